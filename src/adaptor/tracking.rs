//! [`Tracking`]: every live allocation, with where it was made.

use std::alloc::Layout;
use std::backtrace::Backtrace;
use std::collections::VecDeque;
use std::fmt::{self, Write as _};
use std::ptr::NonNull;
use std::sync::Arc;

use super::{eq_by_upstream, upstream_access};
use crate::error::Error;
use crate::resource::{Resource, SyncResource};
use crate::stream::StreamRef;
use crate::suballoc::AddrMap;
use crate::sync::{Mutex, MutexGuard};

/// One live allocation, as [`Tracking::outstanding`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outstanding {
    /// Its address.
    pub address: usize,
    /// Its size in bytes.
    pub size: usize,
    /// The call stack that allocated it, where stacks are captured.
    pub stack: Option<String>,
}

struct Entry {
    layout: Layout,
    /// Shared so that reports format it after the lock is released.
    stack: Option<Arc<Backtrace>>,
}

/// Records every live allocation, to find leaks (RMM's `tracking_resource_adaptor`).
///
/// - Every non-empty allocation is recorded with its size and, when made with
///   [`Tracking::with_stacks`], the call stack that made it (`std::backtrace`, costly:
///   for hunting a leak, not for production). Zero-byte allocations are not tracked.
/// - [`outstanding`](Self::outstanding) is an owned snapshot; [`report`](Self::report)
///   is one line per allocation (`0x…: N B`, then the stack if captured).
/// - The record is split in 64 shards by address, each with its own lock, so threads
///   allocating at once rarely wait for each other. A snapshot visits the shards one
///   after another: taken while other threads allocate, it may see some of their changes
///   and not others.
/// - Freeing a pointer it does not know, or with another layout than it was allocated
///   with, is reported through `tracing::error!` — never a panic. A known pointer goes
///   upstream with the layout it was allocated with; an unknown one goes upstream as given,
///   unless this `Tracking` freed it recently (the last 64 frees of each of its 64 shards
///   are remembered) and has not handed it out since: that is a double free, reported
///   and not passed on, so the upstream never sees it. (An upstream shared with other
///   users, an equal `Tracking` among them, may hand that address out again through
///   them; its free through this `Tracking` is then taken for a double free and the
///   block is not freed: for hunting bugs, give each `Tracking` an upstream of its own.)
/// - Equality is the upstream's (as RMM's): memory allocated through one `Tracking` and
///   freed through an equal one is freed correctly, but stays in the first one's record
///   and is reported as unknown by the second.
///
/// ```
/// use memres::adaptor::Tracking;
/// use memres::{HostHeap, SyncResource, layout};
///
/// let tracked = Tracking::new(HostHeap::new());
/// let l = layout(4096)?;
/// let p = tracked.allocate_sync(l)?;
/// assert_eq!(tracked.allocated_bytes(), 4096);
/// assert!(tracked.report().contains(": 4096 B"));
/// // SAFETY: allocated above with `l`.
/// unsafe { tracked.deallocate_sync(p, l) };
/// assert!(tracked.outstanding().is_empty());
/// # Ok::<(), memres::Error>(())
/// ```
pub struct Tracking<U> {
    upstream: U,
    stacks: bool,
    shards: Box<[Shard]>,
}

/// Shards of the record (a power of two: the top bits of a hash pick one).
const SHARDS: usize = 64;
const _: () = assert!(SHARDS.is_power_of_two());

/// One shard: the live blocks whose address hashes to it, on cache lines of its own.
#[repr(align(128))]
#[derive(Default)]
struct Shard(Mutex<Record>);

/// Frees remembered per shard, to tell a double free from a free of unknown memory.
const FREED_PER_SHARD: usize = 64;

/// A shard's blocks: the live ones, and the last ones freed.
#[derive(Default)]
struct Record {
    live: AddrMap<Entry>,
    /// Addresses freed lately and not handed out since.
    freed: AddrMap<()>,
    /// The order they were freed in, oldest first (it may name an address that was
    /// handed out again since: forgetting it then only forgets it early).
    order: VecDeque<usize>,
}

impl Record {
    fn remember_freed(&mut self, address: usize) {
        if self.order.len() == FREED_PER_SHARD
            && let Some(oldest) = self.order.pop_front()
        {
            self.freed.remove(&oldest);
        }
        self.order.push_back(address);
        self.freed.insert(address, ());
    }
}

impl Shard {
    fn lock(&self) -> MutexGuard<'_, Record> {
        // Each update is one insert or remove: a poisoned map is still consistent.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

upstream_access!(Tracking<U>);

impl<U> Tracking<U> {
    /// Tracks sizes, without call stacks.
    pub fn new(upstream: U) -> Self {
        Tracking {
            upstream,
            stacks: false,
            shards: (0..SHARDS).map(|_| Shard::default()).collect(),
        }
    }

    /// Tracks sizes and the call stack of every allocation.
    pub fn with_stacks(upstream: U) -> Self {
        Tracking {
            stacks: true,
            ..Tracking::new(upstream)
        }
    }

    /// The shard that records `address`.
    #[inline]
    fn shard(&self, address: usize) -> MutexGuard<'_, Record> {
        // Addresses are multiples of the alignment: hash them, then take the top bits.
        let h = ((address >> 8) as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        self.shards[(h >> (64 - SHARDS.trailing_zeros())) as usize].lock()
    }

    /// The live allocations now, sorted by address. Each shard is copied under its lock;
    /// the call stacks are turned into text after, so allocating threads do not wait for
    /// that.
    pub fn outstanding(&self) -> Vec<Outstanding> {
        let mut copied: Vec<(usize, usize, Option<Arc<Backtrace>>)> = Vec::new();
        for shard in &self.shards {
            copied.extend(
                shard
                    .lock()
                    .live
                    .iter()
                    .map(|(&address, e)| (address, e.layout.size(), e.stack.clone())),
            );
        }
        copied.sort_by_key(|c| c.0);
        copied
            .into_iter()
            .map(|(address, size, stack)| Outstanding {
                address,
                size,
                stack: stack.map(|s| s.to_string()),
            })
            .collect()
    }

    /// Bytes in live allocations.
    pub fn allocated_bytes(&self) -> usize {
        self.shards
            .iter()
            .map(|s| {
                s.lock()
                    .live
                    .values()
                    .map(|e| e.layout.size())
                    .sum::<usize>()
            })
            .sum()
    }

    /// One line per live allocation (`0x…: N B`), each followed by its call stack where
    /// stacks are captured.
    pub fn report(&self) -> String {
        let mut out = String::new();
        for o in self.outstanding() {
            let _ = writeln!(out, "{:#x}: {} B", o.address, o.size);
            if let Some(stack) = o.stack {
                let _ = writeln!(out, "{stack}");
            }
        }
        out
    }

    fn track(&self, ptr: NonNull<u8>, layout: Layout) {
        if layout.size() == 0 {
            return;
        }
        let stack = self.stacks.then(|| Arc::new(Backtrace::force_capture()));
        let address = ptr.as_ptr() as usize;
        let mut record = self.shard(address);
        record.freed.remove(&address);
        record.live.insert(address, Entry { layout, stack });
    }

    /// Forgets the block; returns the layout to free it with upstream: the one it was
    /// allocated with, where it is known; `None` for a double free, which must not reach
    /// the upstream.
    fn untrack(&self, ptr: NonNull<u8>, layout: Layout) -> Option<Layout> {
        let address = ptr.as_ptr() as usize;
        let mut record = self.shard(address);
        // Looked up whatever the size: a tracked block freed as zero bytes must not leak.
        // (A zero-byte block's dangling address is never a tracked heap address.)
        let removed = record.live.remove(&address);
        if removed.is_some() {
            record.remember_freed(address);
        }
        let freed_before = removed.is_none() && record.freed.contains_key(&address);
        drop(record);
        match removed {
            None if layout.size() == 0 => Some(layout),
            None if freed_before => {
                tracing::error!(
                    address,
                    size = layout.size(),
                    "memres::Tracking: double free (freed before, not handed out since); \
                     not passed on"
                );
                None
            }
            None => {
                tracing::error!(
                    address,
                    size = layout.size(),
                    "memres::Tracking: freeing memory it never handed out"
                );
                Some(layout)
            }
            Some(e) if e.layout != layout => {
                tracing::error!(
                    address,
                    allocated = e.layout.size(),
                    freed = layout.size(),
                    "memres::Tracking: freed with another layout than it was allocated with"
                );
                Some(e.layout)
            }
            Some(e) => Some(e.layout),
        }
    }
}

eq_by_upstream!(Tracking<U>);

impl<U: fmt::Debug> fmt::Debug for Tracking<U> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tracking")
            .field("upstream", &self.upstream)
            .field(
                "outstanding",
                &self
                    .shards
                    .iter()
                    .map(|s| s.lock().live.len())
                    .sum::<usize>(),
            )
            .finish()
    }
}

// SAFETY: every block comes from the upstream unchanged; the record never touches memory.
unsafe impl<U: SyncResource> SyncResource for Tracking<U> {
    type Properties = U::Properties;

    fn allocate_sync(&self, layout: Layout) -> Result<NonNull<u8>, Error> {
        let p = self.upstream.allocate_sync(layout)?;
        self.track(p, layout);
        Ok(p)
    }

    unsafe fn deallocate_sync(&self, ptr: NonNull<u8>, layout: Layout) {
        if let Some(layout) = self.untrack(ptr, layout) {
            // SAFETY: the caller's promise; the layout is the one the block was
            // allocated with where it is known.
            unsafe { self.upstream.deallocate_sync(ptr, layout) }
        }
    }
}

// SAFETY: as for `SyncResource`.
unsafe impl<U: Resource> Resource for Tracking<U> {
    fn allocate(&self, stream: StreamRef<'_>, layout: Layout) -> Result<NonNull<u8>, Error> {
        let p = self.upstream.allocate(stream, layout)?;
        self.track(p, layout);
        Ok(p)
    }

    unsafe fn deallocate(&self, stream: StreamRef<'_>, ptr: NonNull<u8>, layout: Layout) {
        if let Some(layout) = self.untrack(ptr, layout) {
            // SAFETY: as in `deallocate_sync`, in the caller's stream order.
            unsafe { self.upstream.deallocate(stream, ptr, layout) }
        }
    }
}
