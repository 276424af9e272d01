//! [`Limiting`]: a byte limit on what an upstream hands out.

use std::alloc::Layout;
use std::fmt;
use std::ptr::NonNull;

use super::{eq_by_upstream, upstream_access};
use crate::error::Error;
use crate::resource::{DEFAULT_ALIGNMENT, Resource, SyncResource};
use crate::stream::StreamRef;
use crate::sync::atomic::{AtomicUsize, Ordering};

/// Refuses allocations that would take the bytes outstanding past a limit (RMM's
/// `limiting_resource_adaptor`).
///
/// - Each request counts its size rounded up to its alignment, and to at least 256 bytes
///   of alignment, as RMM rounds (what a device allocator really takes).
/// - Over the limit: `Err(OutOfMemory)` with the limit in it ([`Error::over_limit`]), and
///   nothing changes. An upstream failure is returned and its bytes given back.
/// - Equality is the upstream's (RMM's rule): memory allocated through one `Limiting` may
///   be freed through an equal one; the freeing one's count then stops at zero, and the
///   allocating one keeps counting it.
/// - The check is a single atomic add (rolled back when over), so threads never wait on
///   each other; under contention a request may be refused by a moment's worth of bytes
///   that a concurrent one then gives back.
///
/// ```
/// use memres::adaptor::Limiting;
/// use memres::{Error, HostHeap, SyncResource, layout};
///
/// let limited = Limiting::new(HostHeap::new(), 1024);
/// let l = layout(1000)?;
/// let p = limited.allocate_sync(l)?; // 1000 counts as 1024
/// assert_eq!(limited.allocated_bytes(), 1024);
/// assert!(matches!(limited.allocate_sync(layout(1)?), Err(Error::OutOfMemory { .. })));
/// // SAFETY: allocated above with `l`.
/// unsafe { limited.deallocate_sync(p, l) };
/// assert_eq!(limited.allocated_bytes(), 0);
/// # Ok::<(), Error>(())
/// ```
pub struct Limiting<U> {
    upstream: U,
    limit: usize,
    allocated: AtomicUsize,
}

upstream_access!(Limiting<U>);

impl<U> Limiting<U> {
    /// Lets at most `limit` bytes be outstanding from `upstream`.
    pub fn new(upstream: U, limit: usize) -> Self {
        Limiting {
            upstream,
            limit,
            allocated: AtomicUsize::new(0),
        }
    }

    /// The limit in bytes.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Bytes outstanding now, as counted against the limit.
    pub fn allocated_bytes(&self) -> usize {
        self.allocated.load(Ordering::Relaxed)
    }

    /// What a request counts against the limit; `None` if rounding overflows.
    fn charge(layout: Layout) -> Option<usize> {
        let align = layout.align().max(DEFAULT_ALIGNMENT);
        layout.size().checked_next_multiple_of(align)
    }

    /// Takes `layout`'s charge from the limit, or refuses.
    fn take(&self, layout: Layout) -> Result<usize, Error> {
        let over = || Error::over_limit(layout.size(), self.limit);
        let charge = Self::charge(layout).ok_or_else(over)?;
        let before = self.allocated.fetch_add(charge, Ordering::Relaxed);
        if before
            .checked_add(charge)
            .is_none_or(|after| after > self.limit)
        {
            self.allocated.fetch_sub(charge, Ordering::Relaxed);
            return Err(over());
        }
        Ok(charge)
    }

    /// Returns `layout`'s charge. Saturating: memory allocated through an equal `Limiting`
    /// (equal upstreams may free each other's memory) and freed through this one must not
    /// wrap the count around and lock the adaptor out.
    fn give_back(&self, layout: Layout) {
        if let Some(charge) = Self::charge(layout) {
            let _ = self
                .allocated
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                    Some(n.saturating_sub(charge))
                });
        }
    }
}

eq_by_upstream!(Limiting<U>);

impl<U: fmt::Debug> fmt::Debug for Limiting<U> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Limiting")
            .field("upstream", &self.upstream)
            .field("limit", &self.limit)
            .field("allocated", &self.allocated_bytes())
            .finish()
    }
}

// SAFETY: every block comes from the upstream unchanged; the limit only refuses requests.
unsafe impl<U: SyncResource> SyncResource for Limiting<U> {
    type Properties = U::Properties;

    fn allocate_sync(&self, layout: Layout) -> Result<NonNull<u8>, Error> {
        self.take(layout)?;
        self.upstream.allocate_sync(layout).inspect_err(|_| {
            self.give_back(layout);
        })
    }

    unsafe fn deallocate_sync(&self, ptr: NonNull<u8>, layout: Layout) {
        // SAFETY: the caller's promise, for the upstream that allocated the block.
        unsafe { self.upstream.deallocate_sync(ptr, layout) };
        self.give_back(layout);
    }
}

// SAFETY: as for `SyncResource`.
unsafe impl<U: Resource> Resource for Limiting<U> {
    fn allocate(&self, stream: StreamRef<'_>, layout: Layout) -> Result<NonNull<u8>, Error> {
        self.take(layout)?;
        self.upstream.allocate(stream, layout).inspect_err(|_| {
            self.give_back(layout);
        })
    }

    unsafe fn deallocate(&self, stream: StreamRef<'_>, ptr: NonNull<u8>, layout: Layout) {
        // SAFETY: the caller's promise, for the upstream that allocated the block.
        unsafe { self.upstream.deallocate(stream, ptr, layout) };
        self.give_back(layout);
    }
}
