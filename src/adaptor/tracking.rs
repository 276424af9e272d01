//! [`Tracking`]: every live allocation, with where it was made.

use std::alloc::Layout;
use std::backtrace::Backtrace;
use std::fmt::{self, Write as _};
use std::ptr::NonNull;
use std::sync::Arc;

use super::{eq_by_upstream, upstream_access};
use crate::addr_map::AddrMap;
use crate::error::Error;
use crate::resource::{Resource, SyncResource};
use crate::stream::StreamRef;
use crate::sync::{SpinGuard, SpinLock};

/// One live allocation, as [`Tracking::outstanding`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
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
/// (A spin lock: held for one map update, it costs one atomic read-modify-write where
/// `std`'s mutex costs two.)
#[repr(align(128))]
#[derive(Default)]
struct Shard(SpinLock<Record>);

/// Frees remembered per shard, to tell a double free from a free of unknown memory.
const FREED_PER_SHARD: usize = 64;

/// A shard's blocks: the live ones, and the addresses of its last frees.
///
/// The last frees need no upkeep when blocks are handed out: an address that is not live
/// but among them was freed lately and not handed out since (handed out again, it is
/// live, or its new free is among them too). So they are a plain ring, looked at only
/// when a free finds no live block, which is already an error.
struct Record {
    live: AddrMap<Entry>,
    /// The addresses of the shard's last [`FREED_PER_SHARD`] frees of live blocks (0: no
    /// free yet; never a block's address).
    last_freed: [usize; FREED_PER_SHARD],
    /// Where the next free goes in `last_freed`.
    next: usize,
}

impl Default for Record {
    fn default() -> Self {
        Record {
            live: AddrMap::default(),
            last_freed: [0; FREED_PER_SHARD],
            next: 0,
        }
    }
}

impl Record {
    /// Records the hand-out of `address`.
    #[inline(always)]
    fn hand_out(&mut self, address: usize, entry: Entry) {
        self.live.insert(address, entry);
    }

    /// Records the free of `address`: its entry if it was live; otherwise whether it was
    /// freed lately and not handed out since (a double free).
    #[inline(always)]
    fn free(&mut self, address: usize) -> Result<Entry, bool> {
        match self.live.remove(&address) {
            Some(entry) => {
                self.last_freed[self.next] = address;
                self.next = (self.next + 1) % FREED_PER_SHARD;
                Ok(entry)
            }
            None => Err(self.last_freed.contains(&address)),
        }
    }

    /// The live blocks.
    fn live(&self) -> impl Iterator<Item = (usize, &Entry)> {
        self.live.iter().map(|(&address, e)| (address, e))
    }
}

impl Shard {
    #[inline]
    fn lock(&self) -> SpinGuard<'_, Record> {
        self.0.lock()
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
    fn shard(&self, address: usize) -> SpinGuard<'_, Record> {
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
                    .live()
                    .map(|(address, e)| (address, e.layout.size(), e.stack.clone())),
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
            .map(|s| s.lock().live().map(|(_, e)| e.layout.size()).sum::<usize>())
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
        self.shard(address)
            .hand_out(address, Entry { layout, stack });
    }

    /// Forgets the block; returns the layout to free it with upstream: the one it was
    /// allocated with, where it is known; `None` for a double free, which must not reach
    /// the upstream.
    fn untrack(&self, ptr: NonNull<u8>, layout: Layout) -> Option<Layout> {
        let address = ptr.as_ptr() as usize;
        // Looked up whatever the size: a tracked block freed as zero bytes must not leak.
        // (A zero-byte block's dangling address is never a tracked heap address.)
        let freed = self.shard(address).free(address);
        match freed {
            Err(_) if layout.size() == 0 => Some(layout),
            Err(true) => {
                tracing::error!(
                    address,
                    size = layout.size(),
                    "memres::Tracking: double free (freed before, not handed out since); \
                     not passed on"
                );
                None
            }
            Err(false) => {
                tracing::error!(
                    address,
                    size = layout.size(),
                    "memres::Tracking: freeing memory it never handed out"
                );
                Some(layout)
            }
            Ok(e) if e.layout != layout => {
                tracing::error!(
                    address,
                    allocated = e.layout.size(),
                    freed = layout.size(),
                    "memres::Tracking: freed with another layout than it was allocated with"
                );
                Some(e.layout)
            }
            Ok(e) => Some(e.layout),
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

    #[inline]
    unsafe fn deallocate_used_on(
        &self,
        stream: StreamRef<'_>,
        ptr: NonNull<u8>,
        layout: Layout,
        used_on: &[StreamRef<'_>],
    ) {
        if let Some(layout) = self.untrack(ptr, layout) {
            // SAFETY: as in `deallocate_sync`, in the caller's stream order and `used_on`'s.
            unsafe {
                self.upstream
                    .deallocate_used_on(stream, ptr, layout, used_on)
            }
        }
    }
}

#[cfg(all(test, not(memres_loom)))]
mod tests {
    use super::*;

    fn entry(size: usize) -> Entry {
        Entry {
            layout: Layout::from_size_align(size, 8).unwrap(),
            stack: None,
        }
    }

    /// A free is remembered (a second free of it is a double free) for exactly the
    /// shard's next `FREED_PER_SHARD - 1` frees.
    #[test]
    fn a_shard_remembers_its_last_frees_and_no_more() {
        let mut r = Record::default();
        let n = FREED_PER_SHARD;
        for a in 1..=3 * n {
            r.hand_out(a * 256, entry(a));
        }
        for a in 1..=n {
            assert_eq!(r.free(a * 256).map(|e| e.layout.size()), Ok(a));
        }
        assert!((1..=n).all(|a| r.free(a * 256).err() == Some(true)));
        // One more free forgets the oldest, and only it.
        assert!(r.free((n + 1) * 256).is_ok());
        assert_eq!(r.free(256).err(), Some(false));
        assert!((2..=n + 1).all(|a| r.free(a * 256).err() == Some(true)));
        for a in n + 2..=3 * n {
            assert!(r.free(a * 256).is_ok());
        }
        assert_eq!(r.live().count(), 0);
    }

    /// An address handed out again and freed again is remembered from its last free,
    /// not forgotten when its first free leaves the window.
    #[test]
    fn a_reused_address_is_remembered_from_its_last_free() {
        let mut r = Record::default();
        r.hand_out(256, entry(1));
        assert!(r.free(256).is_ok());
        r.hand_out(256, entry(2));
        assert_eq!(
            r.live()
                .map(|(a, e)| (a, e.layout.size()))
                .collect::<Vec<_>>(),
            [(256, 2)]
        );
        for a in 2..FREED_PER_SHARD {
            r.hand_out(a * 256, entry(a));
            assert!(r.free(a * 256).is_ok());
        }
        assert!(r.free(256).is_ok(), "live again: freed normally");
        // The first free of 256 has left the window; the second has not.
        r.hand_out(1 << 20, entry(3));
        assert!(r.free(1 << 20).is_ok());
        assert_eq!(r.free(256).err(), Some(true));
    }
}
