//! [`Limiting`]: a byte limit on what an upstream hands out.

use std::alloc::Layout;
use std::fmt;
use std::ptr::NonNull;

use super::{eq_by_upstream, upstream_access};
use crate::error::Error;
use crate::resource::{DEFAULT_ALIGNMENT, Resource, SyncResource};
use crate::stream::StreamRef;
use crate::sync::atomic::{AtomicUsize, Ordering};
use crate::sync::per_thread::{PerThread, ThreadSlot};

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
///
/// # Cost and exactness under concurrency
/// Each thread keeps a small reserve of the limit (at most two *grabs*; a grab is
/// 1/1024 of the limit, at most 64 MiB): a request that fits in the calling thread's
/// reserve takes it with a plain load and store, a free puts the bytes back there, and
/// only a thread whose reserve runs out or overflows touches the shared count (one atomic
/// add, which also tops the reserve up to one grab when the limit allows). So:
/// - One thread at a time (threads one after another included): exact. A refused thread
///   first falls back to asking for exactly what it lacks.
/// - Several threads at once: a request may be refused while up to two grabs per other
///   thread sit unused in those threads' reserves (at most 1/512 of the limit per
///   thread); the limit itself is never exceeded. A thread's reserve goes back when the
///   thread exits.
/// - [`allocated_bytes`](Self::allocated_bytes) is the shared count less every thread's
///   reserve.
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
    /// What a thread takes from the shared count when its reserve runs out.
    grab: usize,
    quota: PerThread<Reserve>,
}

/// One thread's unused share of the limit (written only by that thread).
#[derive(Default)]
struct Reserve(AtomicUsize);

/// Bytes taken from the limit: outstanding, plus every thread's reserve.
#[derive(Default)]
struct Charged(AtomicUsize);

impl Charged {
    /// Adds `n` if the total stays within `limit`. A compare-and-swap loop, not an add
    /// rolled back when over: a refused request (a huge one, say) must never make the
    /// count look higher to other threads, even for a moment.
    #[inline]
    fn take(&self, n: usize, limit: usize) -> bool {
        self.0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |c| {
                c.checked_add(n).filter(|&after| after <= limit)
            })
            .is_ok()
    }

    /// Subtracts `n`, stopping at zero (memory allocated through an equal `Limiting` and
    /// freed through this one must not wrap the count around and lock it out); returns
    /// whether all of `n` was there.
    fn give_back(&self, n: usize) -> bool {
        let before = self
            .0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |c| {
                Some(c.saturating_sub(n))
            })
            .unwrap_or_else(|c| c);
        before >= n
    }
}

impl ThreadSlot for Reserve {
    type Shared = Charged;

    fn retire(&self, charged: &Charged) {
        charged.give_back(self.0.swap(0, Ordering::Relaxed));
    }
}

/// The largest grab.
const MAX_GRAB: usize = 64 << 20;

upstream_access!(Limiting<U>);

impl<U> Limiting<U> {
    /// Lets at most `limit` bytes be outstanding from `upstream`.
    pub fn new(upstream: U, limit: usize) -> Self {
        Limiting {
            upstream,
            limit,
            grab: (limit / 1024).min(MAX_GRAB),
            quota: PerThread::new(Charged::default()),
        }
    }

    /// The limit in bytes.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Bytes outstanding now, as counted against the limit.
    pub fn allocated_bytes(&self) -> usize {
        // Reserves and the shared charge under one lock: a thread exiting meanwhile gives
        // its reserve back either wholly before or wholly after the read.
        let mut reserved = 0usize;
        let charged = self.quota.read(
            |r| reserved = reserved.saturating_add(r.0.load(Ordering::Relaxed)),
            |charged| charged.0.load(Ordering::Relaxed),
        );
        charged.saturating_sub(reserved)
    }

    /// What a request counts against the limit: its size rounded up to its alignment,
    /// and to at least [`DEFAULT_ALIGNMENT`].
    #[inline]
    fn charge(layout: Layout) -> usize {
        // Alignments are powers of two: a mask rather than a division. No overflow: a
        // `Layout`'s size rounded up to its alignment is at most `isize::MAX`, so adding
        // less than `max(align, 256)` stays below `usize::MAX`.
        let mask = layout.align().max(DEFAULT_ALIGNMENT) - 1;
        (layout.size() + mask) & !mask
    }

    /// Takes `layout`'s charge from the limit, or refuses.
    #[inline]
    fn take(&self, layout: Layout) -> Result<(), Error> {
        let over = || Error::over_limit(layout.size(), self.limit);
        let charge = Self::charge(layout);
        let charged = self.quota.shared();
        let Some(reserve) = self.quota.get() else {
            // The thread is exiting: straight from the shared count.
            return if charged.take(charge, self.limit) {
                Ok(())
            } else {
                Err(over())
            };
        };
        let have = reserve.0.load(Ordering::Relaxed);
        if let Some(left) = have.checked_sub(charge) {
            reserve.0.store(left, Ordering::Relaxed);
            return Ok(());
        }
        let missing = charge - have;
        let left = if charged.take(missing.saturating_add(self.grab), self.limit) {
            self.grab
        } else if charged.take(missing, self.limit) {
            0
        } else {
            return Err(over());
        };
        reserve.0.store(left, Ordering::Relaxed);
        Ok(())
    }

    /// Gives back the charge of a request the upstream refused, and passes its error on.
    #[cold]
    fn refused(&self, layout: Layout, e: Error) -> Error {
        self.give_back(layout);
        e
    }

    /// Returns `layout`'s charge: to the thread's reserve, and what it holds beyond one
    /// grab to the shared count once it holds more than two.
    #[inline]
    fn give_back(&self, layout: Layout) {
        let charge = Self::charge(layout);
        let charged = self.quota.shared();
        let Some(reserve) = self.quota.get() else {
            charged.give_back(charge);
            return;
        };
        let have = reserve.0.load(Ordering::Relaxed).saturating_add(charge);
        // A reserve the shared count does not cover holds bytes allocated through an
        // equal adaptor: those go to the shared count (and stop at zero there).
        if have <= 2 * self.grab && have <= charged.0.load(Ordering::Relaxed) {
            reserve.0.store(have, Ordering::Relaxed);
        } else if have > 2 * self.grab && charged.give_back(have - self.grab) {
            reserve.0.store(self.grab, Ordering::Relaxed);
        } else {
            // Not backed by the shared count: the bytes were not all ours (freed through
            // an equal adaptor). All of it goes back, stopping at zero; no reserve.
            charged.give_back(have);
            reserve.0.store(0, Ordering::Relaxed);
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

    #[inline(always)]
    fn allocate_sync(&self, layout: Layout) -> Result<NonNull<u8>, Error> {
        self.take(layout)?;
        match self.upstream.allocate_sync(layout) {
            Ok(p) => Ok(p),
            Err(e) => Err(self.refused(layout, e)),
        }
    }

    #[inline(always)]
    unsafe fn deallocate_sync(&self, ptr: NonNull<u8>, layout: Layout) {
        // SAFETY: the caller's promise, for the upstream that allocated the block.
        unsafe { self.upstream.deallocate_sync(ptr, layout) };
        self.give_back(layout);
    }
}

// SAFETY: as for `SyncResource`.
unsafe impl<U: Resource> Resource for Limiting<U> {
    #[inline(always)]
    fn allocate(&self, stream: StreamRef<'_>, layout: Layout) -> Result<NonNull<u8>, Error> {
        self.take(layout)?;
        // `Ok(p)` rebuilt rather than the upstream's result passed on whole: moving the
        // whole result (an error is 32 bytes) reads it back with wide loads that the
        // upstream's narrow stores cannot forward, a stall longer than the rest of the
        // adaptor's work.
        match self.upstream.allocate(stream, layout) {
            Ok(p) => Ok(p),
            Err(e) => Err(self.refused(layout, e)),
        }
    }

    #[inline(always)]
    unsafe fn deallocate(&self, stream: StreamRef<'_>, ptr: NonNull<u8>, layout: Layout) {
        // SAFETY: the caller's promise, for the upstream that allocated the block.
        unsafe { self.upstream.deallocate(stream, ptr, layout) };
        self.give_back(layout);
    }

    #[inline]
    unsafe fn deallocate_used_on(
        &self,
        stream: StreamRef<'_>,
        ptr: NonNull<u8>,
        layout: Layout,
        used_on: &[StreamRef<'_>],
    ) {
        // SAFETY: the caller's promise, for the upstream that allocated the block.
        unsafe {
            self.upstream
                .deallocate_used_on(stream, ptr, layout, used_on)
        };
        self.give_back(layout);
    }
}
