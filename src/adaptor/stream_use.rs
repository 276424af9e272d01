//! [`StreamUse`]: the streams a live block is used on (PyTorch's `Tensor.record_stream`),
//! kept with the block and handed to its free.

use std::alloc::Layout;
use std::collections::HashMap;
use std::fmt;
use std::hash::{BuildHasherDefault, Hasher};
use std::ptr::NonNull;
use std::sync::PoisonError;

use super::upstream_access;
use crate::error::Error;
use crate::resource::{Resource, SyncResource};
use crate::stream::{Recorded, StreamRef};
use crate::sync::{Mutex, MutexGuard};

/// Keeps the start of every live block its upstream handed out, with the streams
/// [`record_stream`](Self::record_stream) named for it; the block's free passes them on
/// ([`Resource::deallocate_used_on`]), so a stream-ordered sub-allocator below holds the
/// block until their work is done. This is PyTorch's `Tensor.record_stream` as a layer:
/// the C ABI's `memres_record_stream` is this layer's `record_stream`.
///
/// - **Refusals**: a record for an address where no live block starts (inside a block, a
///   block already freed, memory this layer never handed out) is
///   [`Error::InvalidArgument`] and records nothing, so a record can never wait to apply
///   to whatever block starts there later.
/// - **A record and a free racing** on two threads: the record lands before the free's
///   removal (the free passes it on) or finds no block (refused); never after. (A record
///   that comes after the block's address was handed out again lands on the new block:
///   a caller that records for a block it has freed breaks `record_stream`'s contract.)
/// - **Equality**: a layer equals only itself (its table knows only its own blocks).
/// - **Cost**: one insert per allocation and one removal per free in a table of 64
///   shards, each under its own lock and on cache lines of its own (chosen by a multiply
///   of the address): about 30 ns the pair on a 2-core VM, one thread, beside 22-37 ns
///   for a virtual pool's own allocate and free there. No cheaper source of "a live
///   block starts here" exists below: pools keep their free blocks, not the live ones.
/// - Frees of [`deallocate_sync`](SyncResource::deallocate_sync) pass recorded streams on
///   too (as a free on the legacy default stream).
///
/// ```
/// use memres::adaptor::StreamUse;
/// use memres::{Error, HostHeap, Resource, StreamRef, layout};
///
/// let blocks = StreamUse::new(HostHeap::new());
/// let l = layout(4096)?;
/// let p = blocks.allocate(StreamRef::host(1), l)?;
/// // Work on host stream 2 reads the block too.
/// // SAFETY: host stream 2 lives as long as the program.
/// unsafe { blocks.record_stream(p, StreamRef::host(2))? };
/// // An address inside the block is refused.
/// // SAFETY: 16 bytes into the 4096-byte block.
/// let inside = unsafe { p.add(16) };
/// // SAFETY: as above.
/// let refused = unsafe { blocks.record_stream(inside, StreamRef::host(2)) };
/// assert!(matches!(refused, Err(Error::InvalidArgument(_))));
/// // SAFETY: allocated above with `l`; the free waits for stream 2's work.
/// unsafe { blocks.deallocate(StreamRef::host(1), p, l) };
/// # Ok::<(), Error>(())
/// ```
pub struct StreamUse<U> {
    upstream: U,
    live: LiveBlocks,
}

upstream_access!(StreamUse<U>);

impl<U> PartialEq for StreamUse<U> {
    /// Equal only to itself: each layer's table knows only its own blocks (a block freed
    /// through another layer over the same upstream would lose its recorded streams).
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self, other)
    }
}

impl<U> StreamUse<U> {
    /// Keeps the live blocks of `upstream`.
    pub fn new(upstream: U) -> Self {
        StreamUse {
            upstream,
            live: LiveBlocks::default(),
        }
    }

    /// Records that work on `stream` uses the live block that starts at `ptr`: its free
    /// (on any stream) passes `stream` on, so the block is not handed out again before
    /// the work `stream` has enqueued by then is complete. Recording the block's freeing
    /// stream, or a stream twice, adds nothing.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`], with nothing recorded, when no live block of this layer
    /// starts at `ptr`.
    ///
    /// # Safety
    /// `stream` stays live (its handle is not destroyed) until the block is freed.
    pub unsafe fn record_stream(
        &self,
        ptr: NonNull<u8>,
        stream: StreamRef<'_>,
    ) -> Result<(), Error> {
        // SAFETY: the caller keeps the stream live until the free that consumes the record.
        let stream = unsafe { stream.detach() };
        if self.live.record(ptr.as_ptr() as usize, stream) {
            return Ok(());
        }
        Err(Error::InvalidArgument(std::borrow::Cow::Owned(format!(
            "record_stream: {:#x} is not the start of a live block (an address inside a block, \
             a block already freed, or memory this resource never handed out); nothing recorded",
            ptr.as_ptr() as usize
        ))))
    }

    /// Whether a live block of this layer starts at `ptr`.
    pub fn is_live(&self, ptr: NonNull<u8>) -> bool {
        self.live.is_live(ptr.as_ptr() as usize)
    }
}

impl<U: fmt::Debug> fmt::Debug for StreamUse<U> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StreamUse")
            .field("upstream", &self.upstream)
            .finish_non_exhaustive()
    }
}

impl<U: Resource> StreamUse<U> {
    /// Frees through the upstream on `stream`, with the recorded streams (`taken`) and the
    /// caller's `used_on` together.
    ///
    /// # Safety
    /// As [`Resource::deallocate_used_on`].
    unsafe fn free_with(
        &self,
        stream: StreamRef<'_>,
        ptr: NonNull<u8>,
        layout: Layout,
        taken: Option<Recorded>,
        used_on: &[StreamRef<'_>],
    ) {
        match taken {
            // SAFETY: the caller's promise, for the upstream that allocated the block.
            None if used_on.is_empty() => unsafe { self.upstream.deallocate(stream, ptr, layout) },
            // SAFETY: as above.
            None => unsafe {
                self.upstream
                    .deallocate_used_on(stream, ptr, layout, used_on)
            },
            Some(mut recorded) => {
                // SAFETY: the caller's streams live during this call; the record ends
                // with it.
                unsafe { recorded.add_used_on(used_on) };
                // SAFETY: the caller's promise; the recorded streams are live until this
                // free (`record_stream`'s promise) and their uses were enqueued before it.
                unsafe {
                    self.upstream
                        .deallocate_used_on(stream, ptr, layout, recorded.streams())
                }
            }
        }
    }
}

// SAFETY: blocks come from the upstream unchanged (so they have its properties), and each
// goes back to it exactly once: the table only adds bookkeeping, and a recorded stream
// only makes the upstream hold the block longer.
unsafe impl<U: Resource> SyncResource for StreamUse<U> {
    type Properties = U::Properties;

    fn allocate_sync(&self, layout: Layout) -> Result<NonNull<u8>, Error> {
        let p = self.upstream.allocate_sync(layout)?;
        self.live.insert(p.as_ptr() as usize);
        Ok(p)
    }

    unsafe fn deallocate_sync(&self, ptr: NonNull<u8>, layout: Layout) {
        match self.live.take(ptr.as_ptr() as usize) {
            // SAFETY: the caller's promise, for the upstream that allocated the block.
            None => unsafe { self.upstream.deallocate_sync(ptr, layout) },
            // Uses on the recorded streams may be pending: the free waits for them as a
            // free on the legacy default stream would.
            // SAFETY: as above; the recorded streams are live until this free.
            Some(recorded) => unsafe {
                self.upstream.deallocate_used_on(
                    StreamRef::DEFAULT,
                    ptr,
                    layout,
                    recorded.streams(),
                )
            },
        }
    }
}

// SAFETY: as for `SyncResource` above.
unsafe impl<U: Resource> Resource for StreamUse<U> {
    #[inline]
    fn allocate(&self, stream: StreamRef<'_>, layout: Layout) -> Result<NonNull<u8>, Error> {
        let p = self.upstream.allocate(stream, layout)?;
        // Entered before the block is handed out; a free of this address on another
        // thread comes after (the program orders its frees after their allocations).
        self.live.insert(p.as_ptr() as usize);
        Ok(p)
    }

    #[inline]
    unsafe fn deallocate(&self, stream: StreamRef<'_>, ptr: NonNull<u8>, layout: Layout) {
        // Removed before the block goes back: another thread may be handed its address at
        // once, and enters it in the table.
        let taken = self.live.take(ptr.as_ptr() as usize);
        // SAFETY: the caller's promise.
        unsafe { self.free_with(stream, ptr, layout, taken, &[]) }
    }

    #[inline]
    unsafe fn deallocate_used_on(
        &self,
        stream: StreamRef<'_>,
        ptr: NonNull<u8>,
        layout: Layout,
        used_on: &[StreamRef<'_>],
    ) {
        let taken = self.live.take(ptr.as_ptr() as usize);
        // SAFETY: the caller's promise.
        unsafe { self.free_with(stream, ptr, layout, taken, used_on) }
    }
}

/// Shards of the table: a power of two (fewer under loom, whose models stay small).
const SHARDS: usize = if cfg!(memres_loom) { 2 } else { 64 };

/// The streams recorded for a live block (the core's [`Recorded`]): `None` for nearly
/// every block, which keeps an entry at 16 bytes.
type Streams = Option<Box<Recorded>>;

type Map = HashMap<usize, Streams, BuildHasherDefault<AddressHasher>>;

/// One shard, alone on its cache lines (two: the adjacent-line prefetcher pairs them).
#[repr(align(128))]
#[derive(Default)]
struct Shard(Mutex<Map>);

/// The start address of every live block, with the streams recorded for it.
pub(crate) struct LiveBlocks {
    shards: Box<[Shard]>,
}

impl Default for LiveBlocks {
    fn default() -> Self {
        LiveBlocks {
            shards: (0..SHARDS).map(|_| Shard::default()).collect(),
        }
    }
}

impl LiveBlocks {
    /// The locked shard that holds `address`, if it is live.
    fn shard(&self, address: usize) -> MutexGuard<'_, Map> {
        // Bits 32.. of the hash: the table indexes by the low bits and tags by the top 7.
        let i = (fold(address as u64) >> 32) as usize % SHARDS;
        self.shards[i]
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// A block handed out at `address`: live, with no stream recorded.
    pub(crate) fn insert(&self, address: usize) {
        // An entry already there (a block at this address freed around this layer) is
        // replaced: its streams are not the new block's.
        self.shard(address).insert(address, None);
    }

    /// Records that work on `stream` uses the live block that starts at `address`. False,
    /// and nothing recorded, when no live block starts there.
    #[must_use]
    pub(crate) fn record(&self, address: usize, stream: StreamRef<'static>) -> bool {
        let mut map = self.shard(address);
        let Some(streams) = map.get_mut(&address) else {
            return false;
        };
        streams.get_or_insert_with(Box::default).add(stream);
        true
    }

    /// The block at `address` is being freed: it is no longer live. Returns the streams
    /// recorded for it, if any (none too for an address this layer did not hand out).
    #[inline]
    pub(crate) fn take(&self, address: usize) -> Option<Recorded> {
        let streams = self.shard(address).remove(&address)?;
        streams.map(|s| *s)
    }

    /// [`take`](Self::take), the streams as a list (the tests' and models' form).
    #[cfg(test)]
    pub(crate) fn remove(&self, address: usize) -> Option<Vec<StreamRef<'static>>> {
        self.take(address).map(Recorded::into_streams)
    }

    /// Whether a live block starts at `address`.
    pub(crate) fn is_live(&self, address: usize) -> bool {
        self.shard(address).contains_key(&address)
    }
}

/// `x` times a 64-bit odd constant, the 128-bit product's halves folded: every bit of
/// `x` reaches both the low and the high bits (blocks are aligned, so an address's low
/// bits alone say nothing).
#[inline]
fn fold(x: u64) -> u64 {
    let m = u128::from(x) * 0x9e37_79b9_7f4a_7c15;
    (m as u64) ^ ((m >> 64) as u64)
}

/// The table's hasher: [`fold`] of the address.
#[derive(Default)]
struct AddressHasher(u64);

impl Hasher for AddressHasher {
    fn write(&mut self, bytes: &[u8]) {
        // Keys are `usize`s (`write_usize`); any other bytes are folded in one by one.
        for &b in bytes {
            self.0 = fold(self.0 ^ u64::from(b));
        }
    }

    #[inline]
    fn write_usize(&mut self, n: usize) {
        self.0 = fold(n as u64);
    }

    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
}

#[cfg(all(test, not(memres_loom)))]
mod tests {
    use super::*;
    use crate::{HostHeap, layout};

    const S7: StreamRef<'static> = StreamRef::host(7);
    const S9: StreamRef<'static> = StreamRef::host(9);

    #[test]
    fn only_a_live_blocks_start_takes_a_record_and_its_free_takes_it_once() {
        let live = LiveBlocks::default();
        assert!(!live.record(0x1000, S7), "never handed out");
        assert_eq!(live.remove(0x1000), None);
        live.insert(0x1000);
        live.insert(0x2000);
        assert!(live.is_live(0x1000));
        assert!(!live.record(0x1100, S7), "inside the block");
        assert!(live.record(0x1000, S7));
        assert!(live.record(0x1000, S7));
        assert!(live.record(0x1000, S9));
        assert_eq!(live.remove(0x2000), None, "live, nothing recorded");
        assert!(!live.record(0x2000, S7), "freed");
        assert_eq!(live.remove(0x1000), Some(vec![S7, S9]));
        assert_eq!(live.remove(0x1000), None);
        assert!(!live.is_live(0x1000));
        // A new block at a freed block's address starts with no stream.
        live.insert(0x1000);
        assert_eq!(live.remove(0x1000), None);
    }

    /// Aligned addresses, the way pools hand them out (256-byte steps, 2 MiB steps), use
    /// every shard.
    #[test]
    fn aligned_addresses_spread_over_the_shards() {
        for step in [256usize, 2 << 20] {
            let mut used = [0usize; SHARDS];
            for i in 0..64 * SHARDS {
                used[(fold((0x7f00_0000_0000 + i * step) as u64) >> 32) as usize % SHARDS] += 1;
            }
            assert!(used.iter().all(|&n| n > 16), "step {step}: {used:?}");
        }
    }

    /// What reaches the upstream's free: the streams of each call.
    #[derive(Default)]
    struct Spy {
        heap: HostHeap,
        frees: std::sync::Mutex<Vec<Vec<StreamRef<'static>>>>,
    }

    impl PartialEq for Spy {
        fn eq(&self, other: &Self) -> bool {
            std::ptr::eq(self, other)
        }
    }

    // SAFETY: the heap's blocks, unchanged; each free goes to the heap once.
    unsafe impl SyncResource for Spy {
        type Properties = <HostHeap as SyncResource>::Properties;
        fn allocate_sync(&self, layout: Layout) -> Result<NonNull<u8>, Error> {
            self.heap.allocate_sync(layout)
        }
        unsafe fn deallocate_sync(&self, ptr: NonNull<u8>, layout: Layout) {
            self.frees.lock().unwrap().push(vec![]);
            // SAFETY: the caller's promise.
            unsafe { self.heap.deallocate_sync(ptr, layout) }
        }
    }

    // SAFETY: as above.
    unsafe impl Resource for Spy {
        fn allocate(&self, _: StreamRef<'_>, layout: Layout) -> Result<NonNull<u8>, Error> {
            self.heap.allocate_sync(layout)
        }
        unsafe fn deallocate(&self, _: StreamRef<'_>, ptr: NonNull<u8>, layout: Layout) {
            self.frees.lock().unwrap().push(vec![]);
            // SAFETY: the caller's promise.
            unsafe { self.heap.deallocate_sync(ptr, layout) }
        }
        unsafe fn deallocate_used_on(
            &self,
            _: StreamRef<'_>,
            ptr: NonNull<u8>,
            layout: Layout,
            used_on: &[StreamRef<'_>],
        ) {
            // SAFETY: kept only as values to compare; never used as streams.
            let kept = used_on.iter().map(|s| unsafe { s.detach() }).collect();
            self.frees.lock().unwrap().push(kept);
            // SAFETY: the caller's promise.
            unsafe { self.heap.deallocate_sync(ptr, layout) }
        }
    }

    #[test]
    fn a_free_passes_the_recorded_streams_on_once() -> Result<(), Error> {
        let blocks = StreamUse::new(Spy::default());
        let l = layout(1024)?;
        let (a, b) = (
            blocks.allocate(StreamRef::host(1), l)?,
            blocks.allocate(StreamRef::host(1), l)?,
        );
        // SAFETY: host streams live for the whole program.
        unsafe {
            blocks.record_stream(a, S7)?;
            blocks.record_stream(a, S7)?;
            blocks.record_stream(a, S9)?;
            assert!(
                blocks.record_stream(a.add(8), S7).is_err(),
                "inside the block"
            );
            blocks.deallocate(StreamRef::host(1), a, l);
            assert!(blocks.record_stream(a, S7).is_err(), "freed");
            // The caller's own streams join the recorded ones (none here for `b`).
            blocks.deallocate_used_on(StreamRef::host(1), b, l, &[S9]);
        }
        let frees = blocks.upstream().frees.lock().unwrap().clone();
        assert_eq!(frees, vec![vec![S7, S9], vec![S9]]);
        Ok(())
    }

    #[test]
    fn a_sync_free_of_a_recorded_block_passes_its_streams_on() -> Result<(), Error> {
        let blocks = StreamUse::new(Spy::default());
        let l = layout(64)?;
        let a = blocks.allocate_sync(l)?;
        assert!(blocks.is_live(a));
        // SAFETY: host streams live for the whole program; `a` allocated above with `l`.
        unsafe {
            blocks.record_stream(a, S7)?;
            blocks.deallocate_sync(a, l);
        }
        assert!(!blocks.is_live(a));
        assert_eq!(*blocks.upstream().frees.lock().unwrap(), vec![vec![S7]]);
        Ok(())
    }
}

#[cfg(all(test, memres_loom))]
mod loom_models {
    use std::sync::atomic::Ordering;

    use loom::sync::Arc;
    use loom::sync::atomic::AtomicBool;
    use loom::thread;

    use super::LiveBlocks;
    use crate::stream::StreamRef;

    const S7: StreamRef<'static> = StreamRef::host(7);
    const S9: StreamRef<'static> = StreamRef::host(9);

    /// A stream recorded on one thread for a live block that another frees after it (the
    /// program orders the two, here with a flag): the free sees the stream, once.
    #[test]
    fn loom_stream_use_a_record_before_the_free_is_taken_by_it() {
        loom::model(|| {
            let live = Arc::new(LiveBlocks::default());
            live.insert(0x1000);
            let done = Arc::new(AtomicBool::new(false));
            let (l, d) = (Arc::clone(&live), Arc::clone(&done));
            let recorder = thread::spawn(move || {
                assert!(l.record(0x1000, S7));
                d.store(true, Ordering::Release);
            });
            if done.load(Ordering::Acquire) {
                assert_eq!(live.remove(0x1000), Some(vec![S7]));
                assert_eq!(live.remove(0x1000), None, "taken once");
            }
            recorder.join().unwrap();
        });
    }

    /// Two threads record streams for one block while a third allocates and frees another
    /// block: that free takes nothing of the first block's, and a free of the first after
    /// both sees both streams.
    #[test]
    fn loom_stream_use_records_of_two_threads_are_both_kept() {
        loom::model(|| {
            let live = Arc::new(LiveBlocks::default());
            live.insert(0x1000);
            let spawn = |stream| {
                let l = Arc::clone(&live);
                thread::spawn(move || assert!(l.record(0x1000, stream)))
            };
            let (a, b) = (spawn(S7), spawn(S9));
            live.insert(0x2000);
            assert_eq!(live.remove(0x2000), None);
            a.join().unwrap();
            b.join().unwrap();
            let mut streams = live.remove(0x1000).expect("both recorded");
            streams.sort_unstable();
            assert_eq!(streams, vec![S7, S9]);
            assert_eq!(live.remove(0x1000), None);
        });
    }

    /// A record racing the block's free (a caller's mistake, but one that must not leak
    /// into the next block at that address): the record lands before the removal, and
    /// the free takes it, or it finds no live block and records nothing. Either way, a
    /// new block handed out at the address afterwards starts with no stream. Fails if
    /// the record looks for the block and records under two holds of the lock.
    #[test]
    fn loom_stream_use_a_record_racing_the_free_never_outlives_the_block() {
        loom::model(|| {
            let live = Arc::new(LiveBlocks::default());
            live.insert(0x1000);
            let recorder = {
                let l = Arc::clone(&live);
                thread::spawn(move || l.record(0x1000, S7))
            };
            let taken = live.remove(0x1000);
            let recorded = recorder.join().unwrap();
            assert_eq!(
                taken,
                recorded.then(|| vec![S7]),
                "the free takes what was recorded"
            );
            live.insert(0x1000); // the upstream hands the address out again
            assert_eq!(live.remove(0x1000), None, "the new block has no stream");
        });
    }
}
