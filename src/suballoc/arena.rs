//! [`Arena`]: RMM's arena allocator: one global arena of superblocks, per-stream arenas.

use std::alloc::Layout;
use std::fmt::{self, Write as _};
use std::ptr::{self, NonNull};

use super::chunks::{Chunk, release_all, to_ptr};
use super::core::free_blocks::{FreeBlock, FreeBlocks, GRANULE};
use super::core::free_list::{FreeList, QUICK_UNITS, block_size};
use super::core::held::Deferred;
use super::core::lanes;
use super::core::list_table::{List, ListTable, synchronize};
use super::core::ordered::{self, StreamOrdered};
use super::core::stream_key::StreamKey;
use super::superblocks::{SUPERBLOCK_SIZE, Superblocks};
use super::thread_cache::{Cache, Owner, Popped, Pushed, SmallBlocks};
use crate::addr_map::AddrMap;
use crate::device::{Context, DeviceId};
use crate::error::Error;
use crate::resource::{Resource, dangling};
use crate::stream::StreamRef;
use crate::sync::atomic::{AtomicU64, Ordering};
use crate::sync::lock;
use crate::sync::{Arc, Mutex, MutexGuard};

/// The global arena.
#[derive(Default)]
pub(crate) struct Global {
    /// Free memory no stream may still be using (but `whole`).
    free: FreeBlocks,
    /// Free superblocks of [`SUPERBLOCK_SIZE`] taken back from streams, kept apart from
    /// `free` (neither merged nor indexed) for the next stream that needs one: with far
    /// more streams than superblocks, each stream's pair otherwise merged a superblock
    /// into `free` and split one off it again (issue 51 item 4). They join `free` when a
    /// request `free` cannot serve needs them merged, and before a trim ends or a dump
    /// reports.
    whole: Vec<FreeBlock>,
    /// Superblocks given back by CUDA streams' arenas: free at once for their own stream
    /// (any lane), for others once the stream's context is synchronised.
    pending: Vec<Pending>,
    /// The superblocks streams hold, by start, with the list each was given to: an
    /// idle stream's whole superblock is found here, not by a scan of every list
    /// (issue 51: with 16,384 streams over 64 superblocks each new stream's superblock
    /// cost a look at all 16,384 lists, 10 us for its first allocation).
    owners: AddrMap<StreamKey>,
}

/// Superblocks one stream gave back, waiting for its work. (Found by the stream's handle,
/// as its lists are: see the module docs on streams destroyed with work pending.)
struct Pending {
    /// The stream (whatever the lane).
    stream: StreamKey,
    ctx: Option<Context>,
    free: FreeBlocks,
}

impl Global {
    /// Makes `block` free: kept apart when it is one whole superblock of the usual size
    /// (see `whole`), else merged into `free`.
    fn give(&mut self, block: FreeBlock) {
        if block.size == SUPERBLOCK_SIZE {
            self.whole.push(block);
        } else {
            self.free.insert(block);
        }
    }

    /// `size` bytes aligned to `align` of the free memory: a kept superblock for a
    /// superblock's request, else from `free`, merging the kept ones into it first when
    /// `free` alone has no fit.
    fn take_free(&mut self, size: usize, align: usize) -> Option<usize> {
        if size == SUPERBLOCK_SIZE
            && align == GRANULE
            && let Some(sb) = self.whole.pop()
        {
            return Some(sb.addr);
        }
        if let Some(addr) = self.free.take(size, align) {
            return Some(addr);
        }
        if self.whole.is_empty() {
            return None;
        }
        self.merge_whole();
        self.free.take(size, align)
    }

    /// Merges the kept superblocks into `free`.
    fn merge_whole(&mut self) {
        for block in std::mem::take(&mut self.whole) {
            self.free.insert(block);
        }
    }

    /// Free bytes (`free` and the kept superblocks).
    fn free_bytes(&self) -> usize {
        self.free.bytes() + self.whole.len() * SUPERBLOCK_SIZE
    }

    /// Whether a block of `need` bytes is free in one piece (or may be, once the kept
    /// superblocks are merged: then `take_free` merges them).
    fn may_fit(&self, need: usize) -> bool {
        (need <= SUPERBLOCK_SIZE && !self.whole.is_empty()) || self.free.largest() >= need
    }

    fn pending_bytes(&self) -> usize {
        self.pending.iter().map(|p| p.free.bytes()).sum()
    }

    /// The pending entry of `list`'s stream: the same stream (any lane) in the same
    /// context (the legacy default stream has one key on every device).
    fn pending_of(&self, list: &List<FreeList>) -> Option<usize> {
        let stream = list.key.stream();
        self.pending
            .iter()
            .position(|p| p.stream == stream && p.ctx == list.ctx)
    }

    /// Files a superblock `list`'s stream gave back.
    fn add_pending(&mut self, list: &List<FreeList>, block: FreeBlock) {
        match self.pending_of(list) {
            Some(i) => {
                self.pending[i].free.insert(block);
            }
            None => {
                let mut free = FreeBlocks::default();
                free.insert(block);
                self.pending.push(Pending {
                    stream: list.key.stream(),
                    ctx: list.ctx,
                    free,
                });
            }
        }
    }

    /// `size` bytes of what `list`'s own stream gave back, which needs no wait. Not for
    /// the list that threads share in their thread-local destructors (see
    /// [`StreamKey::is_exiting_threads`]): its "own stream" is several.
    #[inline]
    fn take_own_pending(&mut self, list: &List<FreeList>, size: usize) -> Option<usize> {
        // (Nothing pending, the common case, without reading the list's key.)
        if self.pending.is_empty() || list.key.is_exiting_threads() {
            return None;
        }
        let i = self.pending_of(list)?;
        let addr = self.pending[i].free.take(size, GRANULE)?;
        if self.pending[i].free.bytes() == 0 {
            self.pending.swap_remove(i);
        }
        Some(addr)
    }
}

/// RMM's arena allocator (`arena_memory_resource`): one upstream allocation (the global
/// arena), handed to the streams' own arenas a superblock at a time.
///
/// - Each stream has its own arena (the per-thread default stream one per thread; threads
///   sharing another stream one, and up to 16 more "lanes" once they run into each other,
///   as in [`Pool`](super::Pool), so that they do not queue for one lock), found without a lock, with a coalescing free list as in [`Pool`](super::Pool) whose
///   blocks never cross a superblock. A stream whose arena has no fit takes a superblock
///   from the global arena: 1 MiB ([`SUPERBLOCK_SIZE`]), or, for a request above that,
///   one of the request's size. Unlike RMM, which serves those large requests from the
///   global arena on every call, the stream keeps the superblock when the block is freed
///   and serves later requests from it, so large requests do not serialise threads on
///   the global arena's lock.
/// - A superblock that becomes entirely free goes back to the global arena once its
///   stream holds more free memory besides than 1/16 of the arena (at least 1 MiB).
///   A superblock given back by a CUDA stream serves that stream again at once (any of
///   its lanes), and reaches other streams only after that stream's work is waited for
///   (`cuCtxSynchronize`), which the arena does only when the global arena runs short;
///   no event is recorded on the free path.
/// - On out-of-memory it defragments: finds the superblocks whose free pieces, over every
///   stream's list, add up to the whole (a block freed on another stream than the one it
///   was taken on goes to that stream's list, so a superblock's pieces may be in
///   several), takes them out, waits for the streams they were freed on, returns them to
///   the global arena and retries; failing that, it returns
///   [`Error::OutOfMemory`], and with [`dump_on_failure`](Arena::dump_on_failure) it logs
///   [`dump`](Arena::dump) (arena size, superblocks, free bytes, largest free block,
///   fragmentation) through `tracing` first.
/// - **Thread caches**, as in [`Pool`](super::Pool): a small block (up to 64 KiB) a
///   thread frees waits in that thread's cache for its stream (and lane; up to 8 MiB a
///   thread and stream; past that, frees coalesce) and goes to the thread's next request
///   of that size, at the default alignment, on that stream with no lock and no list
///   lookup. On the H100, in one process, a 256 B pair took 8.2 ns against 13.4 without
///   them (0.61; 0.83-0.86 on a slower instance), and `random` 2.6-4.5% more
///   (`BENCHMARKS.md`). Before the slow path searches its list, the thread's cached
///   blocks of the stream go back to it; before a defragmentation scans every list, all
///   of the thread's; other threads' cached blocks come back before out-of-memory (also
///   under stream capture), at [`trim`](Arena::trim), and when their thread exits. On
///   Linux 4.14 and later (`membarrier`) they are taken from busy and idle threads
///   alike; elsewhere a thread gives them back at its next call on the arena, and one
///   that never calls again keeps them. Such a reclaim turns the caches off until a
///   superblock is next handed to a stream, a trim returns, or 65,536 calls have passed.
///   A cached block keeps its superblock split until it comes back, and
///   [`free_bytes`](Arena::free_bytes) counts the calling thread's cached blocks as free,
///   not other threads'. A thread's cache goes back when its thread-locals are destroyed,
///   which for `std::thread::scope`'s threads may be after the scope returns: join their
///   handles (which waits for the whole exit) or [`trim`](Arena::trim) to have them back.
///   [`thread_caches(false)`](Arena::thread_caches) turns them off.
/// - Alignment: any power of two (a superblock is made with room for the padding).
///
/// ```
/// use memres::suballoc::Arena;
/// use memres::{HostHeap, Resource, StreamRef, layout};
///
/// let arena = Arena::with_size(HostHeap::new(), 64 << 20)?;
/// let l = layout(1000)?;
/// let p = arena.allocate(StreamRef::host(1), l)?;
/// // SAFETY: allocated just above with `l` on the same stream; not used afterwards.
/// unsafe { arena.deallocate(StreamRef::host(1), p, l) };
/// # Ok::<(), memres::Error>(())
/// ```
pub struct Arena<U: Resource> {
    upstream: U,
    chunk: Option<Chunk>,
    base: usize,
    size: usize,
    global: Mutex<Global>,
    /// The superblocks streams' arenas hold: where each starts and its size, read by
    /// every stream's list without a lock, changed only under `global`.
    table: Arc<Superblocks>,
    lists: ListTable<FreeList>,
    /// Free bytes a stream's arena keeps besides a superblock before returning it.
    keep: usize,
    dump_on_failure: bool,
    /// Blocks freed with [`Resource::deallocate_used_on`] that wait for other streams.
    held: Deferred,
    /// Defragmentations that took pieces out of streams' lists (each after a wait).
    stream_merges: AtomicU64,
    /// The arena's identity for the per-thread caches of small blocks.
    owner: Owner<SmallBlocks>,
    /// Whether frees of small blocks go to the thread caches ([`Arena::thread_caches`]).
    caches: bool,
}

impl<U: Resource> Arena<U> {
    /// An arena of half the current device's free memory (RMM's default);
    /// [`Error::NoDriver`] without a CUDA driver.
    pub fn new(upstream: U) -> Result<Arena<U>, Error> {
        let free = DeviceId::current()?.memory_info()?.free;
        Arena::with_size(upstream, free / 2)
    }

    /// An arena of `size` bytes (rounded down to a multiple of 256; at least 1 MiB, else
    /// [`Error::InvalidArgument`]), taken from `upstream` at once.
    pub fn with_size(upstream: U, size: usize) -> Result<Arena<U>, Error> {
        let size = size / GRANULE * GRANULE;
        if size < SUPERBLOCK_SIZE {
            return Err(Error::invalid_argument(format!(
                "an arena of {size} bytes is smaller than one superblock ({SUPERBLOCK_SIZE} bytes)"
            )));
        }
        let layout = Layout::from_size_align(size, GRANULE)
            .map_err(|_| Error::invalid_argument("the arena size is too large"))?;
        let chunk = Chunk::new(upstream.allocate_sync(layout)?, layout);
        let base = chunk.addr;
        let mut global = Global::default();
        global.free.insert(FreeBlock {
            addr: base,
            size,
            starts_chunk: true,
        });
        Ok(Arena {
            upstream,
            chunk: Some(chunk),
            base,
            size,
            global: Mutex::new(global),
            table: Arc::new(Superblocks::new(base, size)),
            lists: ListTable::default(),
            keep: (size / 16).max(SUPERBLOCK_SIZE),
            dump_on_failure: false,
            held: Deferred::default(),
            stream_merges: AtomicU64::new(0),
            owner: Owner::new(),
            caches: true,
        })
    }

    /// The blocks held for other streams (for the host tests).
    #[cfg(all(test, not(memres_loom)))]
    pub(crate) fn held(&self) -> &Deferred {
        &self.held
    }

    /// How often the arena took free pieces out of the streams' lists to make superblocks
    /// whole again, each time after waiting for those streams' work (one
    /// `cuCtxSynchronize` per device on a GPU). Lanes of one stream trade without it.
    pub fn stream_merges(&self) -> u64 {
        self.stream_merges.load(Ordering::Relaxed)
    }

    /// Whether an allocation that fails logs [`dump`](Self::dump) first (off by default).
    #[must_use]
    pub fn dump_on_failure(mut self, on: bool) -> Self {
        self.dump_on_failure = on;
        self
    }

    /// Whether a thread's freed small blocks wait in its cache for the stream (on by
    /// default; see the type's docs, "Thread caches"). Off, every free goes to the
    /// stream's list at once, where every thread's requests on that stream and
    /// [`free_bytes`](Self::free_bytes) see it. (Set it before the arena is used: blocks
    /// cached before stay in their caches until a trim, an out-of-memory or their
    /// thread's exit.)
    ///
    /// ```
    /// use memres::suballoc::Arena;
    /// use memres::{HostHeap, Resource, StreamRef, layout};
    ///
    /// let arena = Arena::with_size(HostHeap::new(), 4 << 20)?.thread_caches(false);
    /// let l = layout(4096)?;
    /// let p = arena.allocate(StreamRef::host(1), l)?;
    /// // SAFETY: allocated above with `l` on host stream 1; not used afterwards.
    /// unsafe { arena.deallocate(StreamRef::host(1), p, l) };
    /// // Another thread sees the block free at once (cached, it would be this thread's
    /// // until the thread gave it back).
    /// std::thread::scope(|s| {
    ///     s.spawn(|| assert_eq!(arena.free_bytes(), 4 << 20));
    /// });
    /// # Ok::<(), memres::Error>(())
    /// ```
    #[must_use]
    pub fn thread_caches(mut self, on: bool) -> Self {
        self.caches = on;
        self
    }

    /// The arena's size in bytes.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Bytes not handed out: in the global arena, waiting for a stream, in a stream's
    /// arena, or in the calling thread's caches (a snapshot, list by list). Other
    /// threads' cached blocks count as handed out until they come back (see the type's
    /// docs, "Thread caches").
    pub fn free_bytes(&self) -> usize {
        let _pin = self.lists.pin(); // (see `ListTable::retire`)
        let global = lock(&self.global);
        let pending = global.pending_bytes();
        let streams: usize = self
            .lists
            .all()
            .iter()
            .map(|s| s.state.lock().free_bytes())
            .sum();
        let cached = self.cache().cached_here(SmallBlocks::bytes);
        global.free_bytes() + pending + streams + cached
    }

    /// Superblocks that streams' arenas hold.
    pub fn superblocks(&self) -> usize {
        let _global = lock(&self.global);
        self.table.iter().count()
    }

    /// Moves every stream's free memory to the calling thread's host list (after waiting
    /// for the streams it was freed on), gives every superblock that is then entirely
    /// free back to the global arena, and frees the lists of the streams left with no
    /// free memory (a stream used again gets a new list), so an arena that served many
    /// streams holds lists for its host stream only. Every thread's cached blocks come
    /// back first (on Linux 4.14 and later; elsewhere those of threads that do not call
    /// the arena meanwhile may keep their superblocks split). Linux 4.14
    /// and later free the lists (the call waits for the arena's calls under way on other
    /// threads to return); elsewhere the lists stay, emptied.
    ///
    /// ```
    /// use memres::suballoc::Arena;
    /// use memres::{HostHeap, Resource, StreamRef, layout};
    ///
    /// let arena = Arena::with_size(HostHeap::new(), 64 << 20)?;
    /// let l = layout(1000)?;
    /// for stream in 1..100 {
    ///     let p = arena.allocate(StreamRef::host(stream), l)?;
    ///     // SAFETY: allocated just above with `l` on the same stream; not used afterwards.
    ///     unsafe { arena.deallocate(StreamRef::host(stream), p, l) };
    /// }
    /// arena.trim()?;
    /// assert_eq!(arena.superblocks(), 0, "every superblock back in the global arena");
    /// # Ok::<(), memres::Error>(())
    /// ```
    pub fn trim(&self) -> Result<(), Error> {
        self.cache().resume_after(|| ordered::trim(self))
    }

    /// The upstream resource.
    pub fn upstream(&self) -> &U {
        &self.upstream
    }

    /// The arena's state in words: its size, the superblocks streams hold, free bytes
    /// (global and per stream), the largest free block and the fragmentation.
    pub fn dump(&self) -> String {
        let _pin = self.lists.pin(); // (see `ListTable::retire`)
        let mut global = lock(&self.global);
        global.merge_whole(); // (the largest block as merged)
        let pending = global.pending_bytes();
        let mut free = global.free_bytes() + pending;
        let mut largest = global.free.largest();
        let mut streams = String::new();
        for list in self.lists.all() {
            let s = list.state.lock();
            free += s.free_bytes();
            largest = largest.max(s.largest_coalesced());
            let _ = write!(streams, "\n  {:?}: {} bytes free", list.key, s.free_bytes());
        }
        // This thread's cached blocks, as `free_bytes` counts them.
        let (cached, cached_largest) = self
            .cache()
            .fold_here((0, 0), |(n, l), b| (n + b.bytes(), l.max(b.largest())));
        free += cached;
        largest = largest.max(cached_largest);
        if cached > 0 {
            let _ = write!(streams, "\n  this thread's caches: {cached} bytes free");
        }
        let fragmentation = if free == 0 {
            0.0
        } else {
            100.0 * (1.0 - largest as f64 / free as f64)
        };
        format!(
            "arena of {} bytes: {} superblocks held by streams; {} bytes free ({} in the \
             global arena, {pending} waiting for their streams); largest free block {} \
             bytes; fragmentation {fragmentation:.1}%{streams}",
            self.size,
            self.table.iter().count(),
            free,
            global.free_bytes(),
            largest,
        )
    }

    fn out_of_memory_error(&self, requested: usize) -> Error {
        if self.dump_on_failure {
            tracing::error!("arena out of memory for {requested} bytes: {}", self.dump());
        }
        Error::out_of_memory(requested)
    }

    /// Takes a block from the global arena: from its free memory, else (when it may wait:
    /// not on a stream under capture) after waiting for the streams of pending memory,
    /// else after defragmenting.
    fn take_global(
        &self,
        global: &mut Global,
        size: usize,
        align: usize,
        may_wait: bool,
    ) -> Result<Option<usize>, Error> {
        if let Some(addr) = global.take_free(size, align) {
            return Ok(Some(addr));
        }
        if !may_wait {
            return Ok(None);
        }
        self.settle_pending(global)?;
        if let Some(addr) = global.take_free(size, align) {
            return Ok(Some(addr));
        }
        self.defragment(global, size)?;
        Ok(global.take_free(size, align))
    }

    /// Waits for the streams of pending memory and makes it free.
    fn settle_pending(&self, global: &mut Global) -> Result<(), Error> {
        if global.pending.is_empty() {
            return Ok(());
        }
        synchronize(global.pending.iter().filter_map(|p| p.ctx))?;
        let mut blocks: Vec<_> = std::mem::take(&mut global.pending)
            .iter_mut()
            .flat_map(|p| p.free.drain())
            .collect();
        // Highest first (see `take_from_lanes`).
        blocks.sort_unstable_by_key(|b| std::cmp::Reverse(b.addr));
        for block in blocks {
            global.free.insert(block);
        }
        Ok(())
    }

    /// Returns to the global arena every superblock that the list it was given to holds
    /// entirely free, as one block (an idle stream's: the common case), found through
    /// `Global::owners` (a look at each superblock held, not at every list), once the
    /// streams of those lists are waited for; returns the bytes returned. The lists left
    /// empty are marked idle (`List::idle`). If the wait fails, they go back to their
    /// lists.
    fn take_idle_superblocks(&self, global: &mut Global) -> Result<usize, Error> {
        // (Room for all at once: with many streams, most superblocks are idle.)
        let mut taken: Vec<(&List<FreeList>, FreeBlock)> = Vec::with_capacity(global.owners.len());
        // The contexts of the lists taken from, read only for CUDA streams' lists (a host
        // stream's has none, `List::ctx`): the line it is on is otherwise not read here,
        // a miss for each superblock taken back (issue 51 item 4).
        let mut ctxs: Vec<Context> = Vec::new();
        for (&sb, &key) in &global.owners {
            let (Some(size), Some(list)) = (self.table.size_at(sb), self.lists.find(key)) else {
                continue;
            };
            let mut s = list.state.lock();
            if let Some(block) = take_superblock(&mut s, sb, size) {
                // Left empty (the common case), the list is passed over by its stream's
                // next request (`List::idle`).
                if s.free_bytes() == 0 {
                    list.idle.store(true, Ordering::Relaxed);
                }
                drop(s);
                taken.push((list, block));
                if !key.is_host() {
                    ctxs.extend(list.ctx);
                }
            }
        }
        if taken.is_empty() {
            return Ok(0);
        }
        self.stream_merges.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = synchronize(ctxs.into_iter()) {
            for (list, block) in taken {
                let mut s = list.state.lock();
                s.free.insert(block);
                busy(list);
            }
            return Err(e);
        }
        let superblocks = taken.len();
        let mut bytes = 0;
        for (_, block) in taken {
            self.table.clear(block.addr);
            global.owners.remove(&block.addr);
            bytes += block.size;
            global.give(self.block(block.addr, block.size));
        }
        tracing::debug!(
            target: "memres::arena",
            superblocks,
            bytes,
            "memres: arena defragmented (idle streams' superblocks back to the global arena)"
        );
        Ok(bytes)
    }

    /// Returns every entirely free superblock to the global arena. A superblock's blocks
    /// may have been freed on several streams, so the lists are read (under each one's
    /// lock, nothing moved) to add up each superblock's free bytes; only the superblocks
    /// whose pieces add up to their size are then taken out of the lists holding them,
    /// checked whole again (another thread may have taken a piece in between: then they
    /// go back), and returned once the streams they were freed on are waited for. If a
    /// wait fails, the pieces go back where they were. Nothing is done when all free
    /// memory together is less than `need`.
    // long: four steps (add up, take, wait, give or put back) sharing one index.
    fn defragment(&self, global: &mut Global, need: usize) -> Result<(), Error> {
        // Idle streams' superblocks first; the scan of every list below only when they
        // cannot serve the request (or for a trim, `need` 0, which takes back all).
        if self.take_idle_superblocks(global)? > 0 && need > 0 && global.may_fit(need) {
            return Ok(());
        }
        // Then those that this thread's cached blocks split (other threads' come back
        // only at out-of-memory, a trim, or their exit): not first, as a thread going
        // round many streams keeps up to 64 magazines, most holding a block.
        if !self.cache().put_back_all().is_empty()
            && self.take_idle_superblocks(global)? > 0
            && need > 0
            && global.may_fit(need)
        {
            return Ok(());
        }
        let starts: Vec<(usize, usize)> = self.table.iter().collect();
        let holder = |addr: usize| {
            let i = starts.partition_point(|&(sb, _)| sb <= addr);
            (i > 0 && addr < starts[i - 1].0 + starts[i - 1].1).then(|| i - 1)
        };
        let mut free = vec![0usize; starts.len()];
        let mut listed = 0;
        // Only the lists holding free memory are read again below (after a trim or a
        // defragmentation most lists of many streams hold none).
        let mut lists = self.lists.all();
        lists.retain(|list| {
            let s = list.state.lock();
            if s.free_bytes() == 0 {
                return false;
            }
            for (addr, size) in s.free_extents() {
                listed += size;
                if let Some(i) = holder(addr) {
                    free[i] += size;
                }
            }
            true
        });
        let whole = |i: usize| free[i] == starts[i].1;
        // Nothing to gain when all free memory together is less than the request.
        if listed + global.free_bytes() < need || !(0..starts.len()).any(whole) {
            return Ok(());
        }
        // Take the candidates' pieces out of every list that holds some.
        let mut taken: Vec<(&List<FreeList>, Vec<FreeBlock>)> = Vec::new();
        for list in lists {
            let mut s = list.state.lock();
            if !s.free_extents().any(|(a, _)| holder(a).is_some_and(whole)) {
                continue;
            }
            s.flush();
            let addrs: Vec<usize> = s
                .free
                .blocks()
                .filter(|b| holder(b.addr).is_some_and(whole))
                .map(|b| b.addr)
                .collect();
            let blocks: Vec<FreeBlock> = addrs
                .into_iter()
                .filter_map(|a| s.free.remove_starting_at(a))
                .collect();
            // The flush above made the list an index; one left empty gives it up, as an
            // idle stream's list does (a list of a superblock split between lanes, or
            // freed on several streams, would otherwise keep about 8 KiB for nothing).
            // Should a wait fail, the pieces go back into a new index.
            s.release_memory();
            drop(s);
            taken.push((list, blocks));
        }
        let mut got = vec![0usize; starts.len()];
        for (_, blocks) in &taken {
            for b in blocks {
                if let Some(i) = holder(b.addr) {
                    got[i] += b.size;
                }
            }
        }
        if !taken.is_empty() {
            self.stream_merges.fetch_add(1, Ordering::Relaxed);
        }
        let waited = synchronize(taken.iter().filter_map(|(list, _)| list.ctx));
        let back = |i: usize| waited.is_ok() && got[i] == starts[i].1;
        for (list, blocks) in taken {
            let mut s = list.state.lock();
            for b in blocks {
                if !holder(b.addr).is_some_and(back) {
                    s.free.insert(b);
                }
            }
        }
        let returned: Vec<(usize, usize)> = (0..starts.len())
            .filter(|&i| back(i))
            .map(|i| starts[i])
            .collect();
        tracing::debug!(
            target: "memres::arena",
            superblocks = returned.len(),
            bytes = returned.iter().map(|r| r.1).sum::<usize>(),
            "memres: arena defragmented (entirely free superblocks back to the global arena)"
        );
        for (sb, size) in returned {
            self.table.clear(sb);
            global.owners.remove(&sb);
            global.give(self.block(sb, size));
        }
        waited
    }

    fn block(&self, addr: usize, size: usize) -> FreeBlock {
        FreeBlock {
            addr,
            size,
            starts_chunk: addr == self.base,
        }
    }

    /// Whether the calling thread's lane of `stream` has a list (for the loom models).
    #[cfg(all(test, memres_loom))]
    pub(crate) fn has_list(&self, stream: StreamRef<'_>) -> bool {
        let _pin = self.lists.pin();
        self.lists.find(StreamKey::of_lane(stream)).is_some()
    }

    /// Magazines of the arena on all threads (for the loom models).
    #[cfg(all(test, memres_loom))]
    pub(crate) fn magazines(&self) -> usize {
        self.cache().magazines()
    }

    /// The calling thread's caches of this arena's small blocks.
    #[inline(always)]
    fn cache(&self) -> Cache<'_, SmallBlocks> {
        Cache::small_blocks(&self.owner, self.lists.domain())
    }

    /// Gives the global arena `sb`, a superblock `list`'s stream freed entirely (taken out
    /// of the list): free at once for a host stream's, else pending on its stream.
    fn return_superblock(&self, list: &List<FreeList>, sb: FreeBlock) {
        let mut global = lock(&self.global);
        self.table.clear(sb.addr);
        global.owners.remove(&sb.addr);
        let block = self.block(sb.addr, sb.size);
        if list.key.is_host() {
            global.give(block);
        } else {
            global.add_pending(list, block);
        }
    }

    /// After a reclaim of the thread caches: the own list (flushed), then the stream's
    /// other lanes.
    fn take_reclaimed(&self, own: &List<FreeList>, fit: &Fit) -> Option<usize> {
        let found = {
            let mut s = own.state.lock();
            busy(own);
            s.flush();
            s.free.take(fit.size, fit.align)
        };
        found.or_else(|| lanes::take_all(&self.lists, own, fit.size, fit.align, true))
    }

    /// Makes the superblock at `sb` of `sb_size` bytes `own`'s and takes the request's
    /// block from it; `s` is `own`'s state, locked by the caller, who has cleared its
    /// [`idle`](List::idle) hint.
    fn install(
        &self,
        global: &mut Global,
        own: &List<FreeList>,
        s: &mut FreeList,
        sb: usize,
        sb_size: usize,
        fit: &Fit,
    ) -> usize {
        self.table.set(sb, sb_size);
        global.owners.insert(sb, own.key);
        // A superblock was free: memory is no longer short, and caches that a reclaim
        // turned off come back (a load when they are on).
        self.cache().resume();
        // Kept whole, outside the list's index (see `FreeList::add_superblock`).
        s.take_from_new_superblock(sb, sb_size, fit.size, fit.align)
            .expect("a request fits its new superblock")
    }
}

/// Clears `list`'s [`idle`](List::idle) hint (the caller holds its state's lock): memory
/// comes in, or its stream's slow path looks at it. (A load; a store only when set.)
#[inline]
fn busy(list: &List<FreeList>) {
    if list.idle.load(Ordering::Relaxed) {
        list.idle.store(false, Ordering::Relaxed);
    }
}

/// The superblock `[sb, sb + size)` taken out of list `s` as one block, if the list holds
/// it entirely free (its stream idle, mostly); the list, left with nothing, gives up its
/// index (see `Arena::take_idle_superblocks`).
fn take_superblock(s: &mut FreeList, sb: usize, size: usize) -> Option<FreeBlock> {
    if s.free_bytes() < size {
        return None;
    }
    // The common case, without index work: the list holds the superblock and nothing
    // else, as its fresh extent and small cached blocks.
    let block = if s.take_whole(sb, size) {
        FreeBlock {
            addr: sb,
            size,
            starts_chunk: true,
        }
    } else {
        s.flush();
        if s.free.size_starting_at(sb) != Some(size) {
            return None;
        }
        s.free.remove_starting_at(sb)?
    };
    // An idle stream's list holds nothing now: its index goes to the next list that
    // needs one (`free_blocks::spare_tables`), so many streams' lists cost their inline
    // fields, not an index each.
    s.free.release_memory();
    Some(block)
}

/// A request on the arena's slow path: its stream's list key, its size and alignment
/// (rounded), and the superblock it needs (1 MiB, or the request's size with room for
/// its alignment when larger), if the arena could hold one that large.
pub(crate) struct Fit {
    key: StreamKey,
    /// Whether the thread's magazine for the stream may hold blocks (false when the
    /// fast path found it has none: a thread going round thousands of streams keeps
    /// magazines for a few, and the slow path then skips a second lookup).
    cached: bool,
    size: usize,
    align: usize,
    superblock: Option<usize>,
}

impl Fit {
    fn new(key: StreamKey, cached: bool, size: usize, align: usize, arena_size: usize) -> Fit {
        let superblock = size
            .checked_add(align - GRANULE)
            .map(|n| n.max(SUPERBLOCK_SIZE))
            .filter(|&n| n <= arena_size);
        Fit {
            key,
            cached,
            size,
            align,
            superblock,
        }
    }
}

/// The arena's stages of the core's slow path (`core/ordered.rs`): the stream's arena has
/// no fit; its cache is flushed, else it gets a new superblock.
impl<U: Resource> StreamOrdered for Arena<U> {
    type Free = FreeList;
    type Growth = Global;
    type Locked<'a>
        = MutexGuard<'a, Global>
    where
        Self: 'a;
    type Request = Fit;
    type Trimmed = ();

    fn lists(&self) -> &ListTable<FreeList> {
        &self.lists
    }

    fn held(&self) -> &Deferred {
        &self.held
    }

    #[cold]
    fn new_list(&self, key: StreamKey) -> &List<FreeList> {
        self.lists
            .get_or_insert_with(key, || FreeList::in_arena(Arc::clone(&self.table)))
    }

    #[cold]
    fn new_list_like(&self, old: &List<FreeList>) -> &List<FreeList> {
        self.lists
            .get_or_insert_like(old, || FreeList::in_arena(Arc::clone(&self.table)))
    }

    /// Every list's free memory moves to the host list once the streams it was freed on
    /// are waited for (taken first, then waited for: a block freed on a stream after a
    /// wait could still be in use by the stream's work); then the memory streams gave
    /// back, and every superblock left whole, goes back to the global arena.
    fn trim_locked(&self, global: &mut Global) -> Result<(), Error> {
        // Every thread's cached blocks back in their lists first, so that the
        // superblocks they split are whole again.
        self.cache().reclaim();
        let host = ordered::list_of(self, StreamRef::HOST);
        self.lists
            .merge_into(host, FreeList::drain, FreeList::absorb)?;
        self.settle_pending(global)?;
        let done = self.defragment(global, 0);
        global.merge_whole();
        done
    }

    /// The thread caches take in no retired list: the reclaim takes every magazine's
    /// blocks (a magazine whose blocks were taken never touches its list again).
    fn retired(&self, _lists: &[usize]) {
        let _global = lock(&self.global);
        self.cache().reclaim();
    }

    fn growth_lock(&self, _capturing: bool) -> MutexGuard<'_, Global> {
        lock(&self.global)
    }

    /// The own list flushed; a superblock the stream gave back (first: memory waiting
    /// there would make other streams wait for it), or a free one of the global arena;
    /// then the stream's other lanes (blocks freed by other threads come back, so
    /// superblocks become whole again instead of staying split between lanes; only now,
    /// as lanes that took each other's blocks at every miss would trade them back and
    /// forth).
    fn take_without_wait(
        &self,
        global: &mut Global,
        own: &List<FreeList>,
        fit: &mut Fit,
    ) -> Result<Option<usize>, Error> {
        // This thread's cached blocks of the stream coalesce with the list's first (as
        // the list's own cached blocks do, by its flush).
        if self.caches && fit.cached {
            self.cache().put_back_here(fit.key);
        }
        {
            let mut s = own.state.lock();
            busy(own);
            s.flush();
            // (Not the index's search when it is empty: a list whose superblock went to
            // another stream, issue 51 item 4.)
            if s.free.bytes() != 0
                && let Some(addr) = s.free.take(fit.size, fit.align)
            {
                return Ok(Some(addr));
            }
            // The superblock goes in under the same lock (the growth lock is taken before
            // a list's, as everywhere): one lock a pair fewer with many streams, where
            // every pair installs one (issue 51 item 4: about 6 ns of 114 on the VM).
            // Nothing here may lock a list (a defragmentation, a thread cache's put-back):
            // this one is held.
            if let Some(n) = fit.superblock
                && let Some(sb) = global
                    .take_own_pending(own, n)
                    .or_else(|| global.take_free(n, GRANULE))
            {
                return Ok(Some(self.install(global, own, &mut s, sb, n, fit)));
            }
        }
        // (The lanes emptied give up their index: see `take_idle_superblocks`.)
        Ok(lanes::take_all(&self.lists, own, fit.size, fit.align, true))
    }

    /// A superblock from the global arena, after waiting for the streams of the memory
    /// they gave back and defragmenting (when it may wait).
    fn grow(
        &self,
        global: &mut Global,
        _stream: StreamRef<'_>,
        own: &List<FreeList>,
        fit: &mut Fit,
        may_wait: bool,
    ) -> Result<Option<usize>, Error> {
        if let Some(n) = fit.superblock
            && let Some(sb) = self.take_global(global, n, GRANULE, may_wait)?
        {
            let mut s = own.state.lock();
            busy(own);
            return Ok(Some(self.install(global, own, &mut s, sb, n, fit)));
        }
        if may_wait {
            return Ok(None);
        }
        // Under capture no stage after this one runs: other threads' cached blocks come
        // back, without a wait (lists of CUDA streams are not merged here).
        self.cache().reclaim();
        Ok(self.take_reclaimed(own, fit))
    }

    /// Every thread's cached blocks back in their lists (the caches then stay off until
    /// a superblock is next handed out, a trim returns or enough calls pass,
    /// `thread_cache.rs`), and the search again: the own list, the stream's other lanes,
    /// then a superblock (after a defragmentation, which those blocks may have made
    /// whole).
    fn take_last(
        &self,
        global: &mut Global,
        stream: StreamRef<'_>,
        own: &List<FreeList>,
        fit: &mut Fit,
    ) -> Result<Option<usize>, Error> {
        if fit.superblock.is_none() {
            return Ok(None); // larger than the arena: nothing can serve it
        }
        self.cache().reclaim();
        match self.take_reclaimed(own, fit) {
            Some(addr) => Ok(Some(addr)),
            None => self.grow(global, stream, own, fit, true),
        }
    }

    fn out_of_memory(&self, global: MutexGuard<'_, Global>, requested: usize) -> Error {
        drop(global); // (a dump reads it)
        self.out_of_memory_error(requested)
    }
}

impl<U: Resource> Drop for Arena<U> {
    fn drop(&mut self) {
        // First: no thread's exit touches the lists once the arena has left the registry.
        self.owner.retire();
        self.held.wait_all();
        release_all(
            &self.upstream,
            &self.lists,
            self.chunk.take().into_iter().collect(),
        );
    }
}

impl<U: Resource> PartialEq for Arena<U> {
    fn eq(&self, other: &Self) -> bool {
        ptr::eq(self, other)
    }
}

impl<U: Resource + fmt::Debug> fmt::Debug for Arena<U> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Arena")
            .field("upstream", &self.upstream)
            .field("size", &self.size)
            .finish_non_exhaustive()
    }
}

sync_on_the_host_stream!(Arena);

// SAFETY: blocks are disjoint pieces of the one upstream allocation (each free byte is in
// exactly one list: the global arena's, a pending entry, or one stream's), aligned as
// asked, with the upstream's properties; memory freed on a CUDA stream reaches another
// stream only through the global arena after that stream's context was synchronised.
unsafe impl<U: Resource> Resource for Arena<U> {
    #[inline]
    fn allocate(&self, stream: StreamRef<'_>, layout: Layout) -> Result<NonNull<u8>, Error> {
        if layout.size() == 0 {
            return Ok(dangling(layout));
        }
        let (size, align) = block_size(layout);
        let key = StreamKey::of_lane(stream);
        let units = size / GRANULE;
        // The thread's cache first: it touches no list, so it needs no pin.
        let mut popped = Popped::Missed;
        if self.caches && align == GRANULE && units <= QUICK_UNITS {
            popped = self.cache().pop_small(key, units);
            if let Popped::Block(addr) = popped {
                return Ok(to_ptr(addr));
            }
        }
        let _pin = self.lists.pin(); // (see `ListTable::retire`)
        let list = ordered::list_for(self, key);
        // (Not the list's lock when the list is known empty: `List::idle`.)
        if !list.idle.load(Ordering::Relaxed)
            && let Some(addr) = list.state.lock().take(size, align)
        {
            return Ok(to_ptr(addr));
        }
        let cached = popped != Popped::Nothing;
        let mut fit = Fit::new(key, cached, size, align, self.size);
        ordered::allocate_slow(self, stream, list, &mut fit, layout.size()).map(to_ptr)
    }

    #[inline]
    unsafe fn deallocate(&self, stream: StreamRef<'_>, ptr: NonNull<u8>, layout: Layout) {
        if layout.size() == 0 {
            return;
        }
        let (size, _) = block_size(layout);
        let addr = ptr.as_ptr().expose_provenance();
        let key = StreamKey::of_lane(stream);
        let units = size / GRANULE;
        let mut pushed = Pushed::Elsewhere;
        if self.caches && units <= QUICK_UNITS {
            // SAFETY: the closure returns this arena's list for `key` (the cache pins
            // while it makes a magazine, the only time it calls it).
            pushed = unsafe {
                self.cache()
                    .push_small(key, || ordered::list_for(self, key), addr, units)
            };
            if pushed == Pushed::Kept {
                return;
            }
        }
        let _pin = self.lists.pin(); // (see `ListTable::retire`)
        let list = ordered::list_for(self, key);
        let emptied = {
            let mut s = list.state.lock();
            // A full magazine's block coalesces, as one the list's own full cache turns
            // away does (so that the two hold no more than the list's cache did).
            let merged = if pushed == Pushed::Full {
                Some(s.insert(addr, size))
            } else {
                s.put(addr, size)
            };
            // The hint the lanes' searches read (`lanes::take_all`); a load, and a store
            // only when it was clear. (Not `ListTable::note_free`: the arena's searches
            // never start at the list that last received memory, whose pointer every
            // lane's free would then write.)
            if !list.holds_free.load(Ordering::Relaxed) {
                list.holds_free.store(true, Ordering::Relaxed);
            }
            busy(list);
            match merged {
                // A whole superblock, and the stream keeps enough free memory besides.
                Some(merged)
                    if merged.starts_chunk
                        && s.chunk_at(merged.addr) == Some(merged.size)
                        && s.free_bytes() - merged.size >= self.keep =>
                {
                    s.free.remove_starting_at(merged.addr)
                }
                _ => None,
            }
        };
        if let Some(sb) = emptied {
            self.return_superblock(list, sb);
        }
    }

    unsafe fn deallocate_used_on(
        &self,
        stream: StreamRef<'_>,
        ptr: NonNull<u8>,
        layout: Layout,
        used_on: &[StreamRef<'_>],
    ) {
        // SAFETY: the caller's promise.
        unsafe { ordered::deallocate_used_on(self, stream, ptr, layout, used_on) }
    }
}

#[cfg(all(test, not(memres_loom)))]
mod tests {
    use super::*;
    use crate::upstream::HostHeap;

    const MIB: usize = 1 << 20;

    /// Superblocks a CUDA stream's lanes give back wait in the global arena for that
    /// stream's work before others may use them, but serve the stream itself at once. A
    /// made-up CUDA handle, so only on a machine without a driver.
    /// The superblocks `Global::owners` names are the ones streams hold (the table's),
    /// each with the list it was given to.
    fn owners_match_the_table(arena: &Arena<HostHeap>) {
        let global = lock(&arena.global);
        let mut owned: Vec<usize> = global.owners.iter().map(|(&sb, _)| sb).collect();
        let mut held: Vec<usize> = arena.table.iter().map(|(sb, _)| sb).collect();
        owned.sort_unstable();
        held.sort_unstable();
        assert_eq!(owned, held, "owners name the superblocks streams hold");
    }

    #[test]
    fn idle_streams_superblocks_go_to_new_streams_and_owners_follow() {
        // Two superblocks and twenty streams used in turn: each new stream's superblock
        // comes from an idle stream (each keeps its whole superblock: a sixteenth of the
        // arena is less than one).
        let arena = Arena::with_size(HostHeap::new(), 2 * MIB).unwrap();
        let l = crate::layout(4096).unwrap();
        for round in 0..3 {
            for id in 1..=20 {
                let stream = StreamRef::host(id);
                let p = arena.allocate(stream, l).unwrap();
                // SAFETY: allocated just above with `l` on `stream`.
                unsafe { arena.deallocate(stream, p, l) };
                owners_match_the_table(&arena);
            }
            assert!(arena.superblocks() <= 2, "round {round}");
        }
        arena.trim().unwrap();
        owners_match_the_table(&arena);
        assert_eq!(arena.superblocks(), 0);
        assert_eq!(arena.free_bytes(), 2 * MIB);
    }

    /// A stream whose superblock went to another stream has its list marked idle, so
    /// that its next request goes to the slow path without taking the list's lock (and
    /// gets a superblock there); the hint is only a hint: memory in a list marked idle
    /// (as when a thread cache's blocks are put back into it) is found by that slow path
    /// and used before a new superblock.
    #[test]
    fn an_idle_streams_list_is_passed_over_until_memory_comes_back() {
        // One superblock (an arena of 1 MiB), no thread caches (frees reach the lists).
        let arena = Arena::with_size(HostHeap::new(), MIB)
            .unwrap()
            .thread_caches(false);
        let l = crate::layout(4096).unwrap();
        let (one, two) = (StreamRef::host(1), StreamRef::host(2));
        let pair = |stream| {
            let p = arena.allocate(stream, l).unwrap();
            // SAFETY: allocated just above with `l` on `stream`.
            unsafe { arena.deallocate(stream, p, l) };
        };
        let _pin = arena.lists.pin();
        pair(one);
        let list_one = arena.lists.find(StreamKey::of_lane(one)).unwrap();
        assert!(!list_one.idle.load(Ordering::Relaxed));
        pair(two); // takes stream 1's superblock
        let list_two = arena.lists.find(StreamKey::of_lane(two)).unwrap();
        assert!(
            list_one.idle.load(Ordering::Relaxed),
            "stream 1's list left empty"
        );
        assert!(!list_two.idle.load(Ordering::Relaxed));
        pair(one); // and back
        assert!(
            !list_one.idle.load(Ordering::Relaxed),
            "given a superblock again"
        );
        assert!(list_two.idle.load(Ordering::Relaxed));
        owners_match_the_table(&arena);
        // A stale hint: stream 1's list holds its superblock's memory.
        list_one.idle.store(true, Ordering::Relaxed);
        let p = arena.allocate(one, l).unwrap();
        assert!(
            !list_one.idle.load(Ordering::Relaxed),
            "cleared by the slow path"
        );
        assert_eq!(
            arena.superblocks(),
            1,
            "served from the list's own superblock"
        );
        // SAFETY: allocated just above with `l` on stream 1.
        unsafe { arena.deallocate(one, p, l) };
        assert_eq!(arena.free_bytes(), MIB);
    }

    /// Superblocks taken back whole from idle streams wait apart from the global arena's
    /// index, and are merged into it when a request needs them together: two idle
    /// streams' superblocks serve a request of two.
    #[test]
    fn superblocks_kept_apart_merge_for_a_larger_request() {
        let arena = Arena::with_size(HostHeap::new(), 2 * MIB).unwrap();
        let l = crate::layout(4096).unwrap();
        for id in 1..=3 {
            let stream = StreamRef::host(id);
            let p = arena.allocate(stream, l).unwrap();
            // SAFETY: allocated just above with `l` on `stream`.
            unsafe { arena.deallocate(stream, p, l) };
        }
        assert_eq!(lock(&arena.global).whole.len(), 1, "one kept apart");
        let two = crate::layout(2 * MIB).unwrap();
        let p = arena.allocate(StreamRef::host(4), two).unwrap();
        assert!(lock(&arena.global).whole.is_empty());
        // SAFETY: allocated just above with `two` on this stream.
        unsafe { arena.deallocate(StreamRef::host(4), p, two) };
        arena.trim().unwrap();
        assert!(lock(&arena.global).whole.is_empty(), "merged by the trim");
        assert_eq!(arena.free_bytes(), 2 * MIB);
        assert!(arena.dump().contains("largest free block 2097152 bytes"));
    }

    /// A superblock split between two lanes of a stream (a thread took a block from the
    /// other's lane when the global arena had none) is taken back by the scan of every
    /// list, which puts each list's pieces in its index first: the lists it leaves
    /// empty give that index up, as an idle stream's list does.
    #[test]
    fn lists_a_defragmentation_empties_keep_no_index() {
        let arena = Arena::with_size(HostHeap::new(), MIB).unwrap();
        let l = crate::layout(4096).unwrap();
        let one = StreamRef::host(1);
        // (Joined, not only scoped: a thread's cached blocks go back to their lists as
        // it exits, after the scope would have returned.)
        std::thread::scope(|s| {
            s.spawn(|| {
                crate::suballoc::own_lane();
                let p = arena.allocate(one, l).unwrap();
                // SAFETY: allocated just above with `l` on `one`.
                unsafe { arena.deallocate(one, p, l) };
            })
            .join()
            .unwrap();
        });
        std::thread::scope(|s| {
            s.spawn(|| {
                crate::suballoc::own_lane();
                // The global arena is empty: a block of the first lane's superblock.
                let p = arena.allocate(one, l).unwrap();
                // SAFETY: allocated just above with `l` on `one`.
                unsafe { arena.deallocate(one, p, l) };
            })
            .join()
            .unwrap();
        });
        assert_eq!(
            arena
                .lists
                .all()
                .iter()
                .filter(|s| s.state.lock().free_bytes() > 0)
                .count(),
            2,
            "the superblock split between two lanes"
        );
        let two = StreamRef::host(2);
        let p = arena.allocate(two, l).unwrap();
        assert_eq!(
            arena.stream_merges(),
            1,
            "taken back by the scan of every list"
        );
        for list in arena.lists.all() {
            let s = list.state.lock();
            if s.free_bytes() == 0 {
                assert!(!s.free.keeps_an_index(), "{:?} keeps an index", list.key);
            }
        }
        // SAFETY: allocated above with `l` on `two`.
        unsafe { arena.deallocate(two, p, l) };
        assert_eq!(arena.free_bytes(), MIB);
    }

    /// A lane whose pieces another lane of its stream takes all of (no lane alone has a
    /// fit) gives up the index it held them in.
    #[test]
    fn lanes_drained_by_another_lane_keep_no_index() {
        let arena = Arena::with_size(HostHeap::new(), MIB).unwrap();
        let half = crate::layout(MIB / 2).unwrap();
        let quarter = crate::layout(MIB / 4).unwrap();
        let one = StreamRef::host(1);
        // Two lanes: one holds the superblock's first half, 4 KiB after it and its last
        // quarter less 4 KiB; the other the quarter between (taken from the first lane's
        // superblock: the global arena is empty then). No lane holds 3/4 MiB in one piece.
        std::thread::scope(|s| {
            s.spawn(|| {
                crate::suballoc::own_lane();
                let x = arena.allocate(one, half).unwrap();
                // (A free marks the lane as holding free memory for the other lanes.)
                let small = crate::layout(4096).unwrap();
                let z = arena.allocate(one, small).unwrap();
                // SAFETY: allocated just above with `small` on `one`.
                unsafe { arena.deallocate(one, z, small) };
                std::thread::scope(|s| {
                    s.spawn(|| {
                        crate::suballoc::own_lane();
                        let y = arena.allocate(one, quarter).unwrap();
                        // SAFETY: allocated just above with `quarter` on `one`.
                        unsafe { arena.deallocate(one, y, quarter) };
                    });
                });
                // SAFETY: allocated above with `half` on `one`.
                unsafe { arena.deallocate(one, x, half) };
            });
        });
        let holding = || {
            arena
                .lists
                .all()
                .iter()
                .filter(|s| s.state.lock().free_bytes() > 0)
                .count()
        };
        assert_eq!(holding(), 2, "the superblock split between two lanes");
        let most = crate::layout(3 * MIB / 4).unwrap();
        let p = arena.allocate(one, most).unwrap();
        assert_eq!(
            arena.stream_merges(),
            0,
            "the lanes' pieces, no defragmentation"
        );
        assert_eq!(holding(), 1, "both lanes' pieces moved to this thread's");
        for list in arena.lists.all() {
            let s = list.state.lock();
            if s.free_bytes() == 0 {
                assert!(!s.free.keeps_an_index(), "{:?} keeps an index", list.key);
            }
        }
        // SAFETY: allocated above with `most` on `one`.
        unsafe { arena.deallocate(one, p, most) };
        assert_eq!(arena.free_bytes(), MIB);
    }

    #[test]
    fn a_stream_takes_back_its_own_superblocks_without_a_wait() {
        if crate::driver::is_present() {
            println!(
                "memres-skip: uses a made-up CUDA stream handle (for machines without a driver)"
            );
            return;
        }
        let arena = Arena::with_size(HostHeap::new(), 8 * MIB).unwrap();
        // SAFETY: the handle is never given to a driver (there is none here).
        let stream = unsafe { StreamRef::from_raw(0x5000 as _) };
        let l = crate::layout(MIB).unwrap();
        let blocks: Vec<_> = (0..8).map(|_| arena.allocate(stream, l).unwrap()).collect();
        for p in blocks {
            // SAFETY: allocated above with `l` on `stream`.
            unsafe { arena.deallocate(stream, p, l) };
        }
        // The stream keeps 1 MiB (1/16 of the arena, at least 1 MiB); 7 MiB wait.
        let pending = || lock(&arena.global).pending_bytes();
        assert_eq!(pending(), 7 * MIB);
        let two = crate::layout(2 * MIB).unwrap();
        let p = arena.allocate(stream, two).unwrap();
        assert_eq!(
            pending(),
            5 * MIB,
            "taken from what the stream gave back, no wait"
        );
        // Another stream waits for all of it (here: no driver, nothing to wait for)
        // rather than taking it as its own.
        let q = arena.allocate(StreamRef::host(1), l).unwrap();
        assert_eq!(pending(), 0);
        // SAFETY: allocated above with these layouts and streams.
        unsafe {
            arena.deallocate(stream, p, two);
            arena.deallocate(StreamRef::host(1), q, l);
        }
        assert_eq!(arena.free_bytes(), 8 * MIB);
    }
}
