//! [`FixedSize`]: blocks of one size, in O(1).

use std::alloc::Layout;
use std::fmt;
use std::ptr::{self, NonNull};

use super::chunks::{Chunk, release_all, to_ptr};
use super::core::free_blocks::GRANULE;
use super::core::held::Deferred;
use super::core::list_table::{List, ListTable};
use super::core::ordered::{self, Contents, StreamOrdered};
use super::core::stream_key::StreamKey;
use super::thread_cache::{Cache, Owner};
use crate::error::Error;
use crate::resource::{Resource, dangling};
use crate::stream::StreamRef;
use crate::sync::atomic::Ordering;
use crate::sync::lock;
use crate::sync::spin::SpinLock;
use crate::sync::{Mutex, MutexGuard};

/// A stream's list takes at most this many bytes of blocks at a time from a host
/// stream's list (as a pool's does).
const HOST_BATCH_BYTES: usize = 2 << 20;

/// ... and at most this many blocks: a batch is a few slow-path visits' worth for the
/// taker, and leaves the giver blocks for the next stream (taking half of a list each
/// time drained the lists a new stream's search finds first, so that over thousands of
/// streams each new one searched further).
const HOST_BATCH_BLOCKS: usize = 32;
/// Lists a slow path looks at for blocks to spare that the marks missed (see
/// `take_from_donors`), past the donors.
const MARKS_MISSED_LOOK: usize = 64;
/// A thread's cache for one stream holds at most this many bytes of blocks...
const CACHE_BYTES: usize = 4 << 20;
/// ... and this many blocks...
const CACHE_BLOCKS: usize = 64;
/// ... but at least this many, so that blocks of 2 and 4 MiB (a `Binning`'s largest bins)
/// are cached too, in 8 and 16 MiB; larger blocks have no thread caches.
const CACHE_MIN_BLOCKS: usize = 4;
/// The largest block a thread cache keeps (a `Binning`'s largest default bin).
const CACHE_LARGEST_BLOCK: usize = 4 << 20;

/// Hands out blocks of one size (RMM's `fixed_size_memory_resource`): every request up
/// to the block size gets a whole block, in O(1) (a pop from the stream's free list).
///
/// It takes chunks of `blocks_per_chunk` blocks from its upstream, one when it is made
/// and another each time a stream finds no free block (after taking free blocks of host
/// streams, which are free for all, up to 2 MiB of them at a time, and of the stream's
/// other lanes: threads sharing one stream that run into each other get up to 16 more
/// lists of it, as in
/// [`Pool`](super::Pool), so that they do not all wait for one lock; a lane that runs
/// dry takes half of another's blocks). Before it grows it merges every other stream's
/// blocks into the asking stream's list, having waited for the CUDA streams they were
/// freed on (one context synchronisation per batch moved), as [`Pool`](super::Pool)
/// does: blocks allocated on one stream and freed on another are reused, not grown
/// for. It never returns chunks before it drops.
///
/// - **Thread caches.** Blocks up to 4 MiB are also cached per thread and stream (at
///   most 64 blocks and 4 MiB each, but 4 blocks however large: 8 MiB of 2 MiB blocks,
///   16 MiB of 4 MiB ones): a free pushes onto the calling thread's cache and an
///   allocation pops from it, with no atomic read-modify-write; a cache trades half
///   its blocks with the stream's list when it overflows or runs dry, gives them all
///   back before the resource grows, and when its thread exits. Before it reports
///   [`Error::OutOfMemory`], a thread that finds no free block takes every other
///   thread's cached blocks back to the lists, also from threads that never call the
///   resource again (on Linux 4.14 and later, with `membarrier`; elsewhere each thread
///   gives them back at its next call, and the asker waits up to 2 ms), and the caches
///   stay off until the resource next grows (or for 65,536 calls, at a hard limit).
/// - Defaults: 1 MiB blocks, 128 per chunk (RMM's).
/// - A request above the block size is [`Error::InvalidArgument`] naming both sizes (no
///   amount of freeing would make it fit); alignments above 256 bytes likewise.
///
/// ```
/// use memres::suballoc::FixedSize;
/// use memres::{HostHeap, SyncResource, layout};
///
/// let blocks = FixedSize::with_block_size(HostHeap::new(), 4096, 16)?;
/// let l = layout(3000)?;
/// let p = blocks.allocate_sync(l)?;
/// // SAFETY: allocated above with `l`; not used afterwards.
/// unsafe { blocks.deallocate_sync(p, l) };
/// assert!(blocks.allocate_sync(layout(5000)?).is_err());
/// # Ok::<(), memres::Error>(())
/// ```
pub struct FixedSize<U: Resource> {
    owner: Owner<Vec<usize>>,
    /// Blocks per thread cache; 0: no thread caches.
    cache_capacity: usize,
    upstream: U,
    block_size: usize,
    blocks_per_chunk: usize,
    chunks: Mutex<Vec<Chunk>>,
    lists: ListTable<Vec<usize>>,
    /// Host streams' lists that had blocks to spare when they were last marked (their
    /// addresses; each listed once, by [`List::in_donors`]; possibly stale): where a
    /// stream that finds no block looks first. Searching every list instead cost each new
    /// stream's first allocation 4.5 us at 16,384 streams (issue 33, finding 3).
    donors: SpinLock<Vec<usize>>,
    /// Blocks freed with [`Resource::deallocate_used_on`] that wait for other streams.
    held: Deferred,
}

impl<U: Resource> FixedSize<U> {
    /// 1 MiB blocks, 128 of them taken from `upstream` at once.
    pub fn new(upstream: U) -> Result<FixedSize<U>, Error> {
        FixedSize::with_block_size(upstream, 1 << 20, 128)
    }

    /// Blocks of `block_size` bytes (rounded up to a multiple of 256), taken from
    /// `upstream` `blocks_per_chunk` at a time; the first chunk is taken at once.
    pub fn with_block_size(
        upstream: U,
        block_size: usize,
        blocks_per_chunk: usize,
    ) -> Result<FixedSize<U>, Error> {
        let rounded = block_size.max(1).checked_next_multiple_of(GRANULE);
        let chunk_size = rounded.and_then(|b| b.checked_mul(blocks_per_chunk));
        let (Some(block_size), Some(chunk_size)) = (rounded, chunk_size) else {
            return Err(Error::invalid_argument(format!(
                "a chunk of {blocks_per_chunk} blocks of {block_size} bytes (rounded up to a \
                 multiple of {GRANULE}) overflows the address space"
            )));
        };
        if blocks_per_chunk == 0 || chunk_size > isize::MAX as usize {
            return Err(Error::invalid_argument(format!(
                "a chunk of {blocks_per_chunk} blocks of {block_size} bytes is not a size a \
                 resource can allocate"
            )));
        }
        let fixed = FixedSize {
            owner: Owner::new(),
            cache_capacity: if block_size <= CACHE_LARGEST_BLOCK {
                (CACHE_BYTES / block_size).clamp(CACHE_MIN_BLOCKS, CACHE_BLOCKS)
            } else {
                0
            },
            upstream,
            block_size,
            blocks_per_chunk,
            chunks: Mutex::new(Vec::new()),
            lists: ListTable::default(),
            donors: SpinLock::new(Vec::new()),
            held: Deferred::default(),
        };
        let host = ordered::list_of(&fixed, StreamRef::HOST);
        let first = fixed.grow_chunk(&mut lock(&fixed.chunks), StreamRef::HOST, host)?;
        host.state.lock().push(first);
        Ok(fixed)
    }

    /// The blocks held for other streams (for the host tests).
    #[cfg(all(test, not(memres_loom)))]
    pub(crate) fn held(&self) -> &Deferred {
        &self.held
    }

    /// The size of every block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// How many blocks each upstream allocation holds.
    pub fn blocks_per_chunk(&self) -> usize {
        self.blocks_per_chunk
    }

    /// Allocations held from the upstream.
    pub fn upstream_allocations(&self) -> usize {
        lock(&self.chunks).len()
    }

    /// Blocks not handed out: in the streams' lists and the calling thread's caches
    /// (other threads' caches, per thread and stream at most 64 blocks and 4 MiB or 4
    /// blocks, are not counted; blocks above 4 MiB are never cached; see the type's docs
    /// for how an out-of-memory takes them back).
    pub fn free_blocks(&self) -> usize {
        let _pin = self.lists.pin(); // (see `ListTable::retire`)
        let lists: usize = self.lists.all().iter().map(|s| s.state.lock().len()).sum();
        lists + self.cache().cached_here(Vec::len)
    }

    /// Magazines of this resource on all threads (for the loom models).
    #[cfg(all(test, memres_loom))]
    pub(crate) fn magazines(&self) -> usize {
        self.cache().magazines()
    }

    /// Whether the calling thread's lane of `stream` has a list (for the loom models).
    #[cfg(all(test, memres_loom))]
    pub(crate) fn has_list(&self, stream: StreamRef<'_>) -> bool {
        let _pin = self.lists.pin();
        self.lists.find(StreamKey::of_lane(stream)).is_some()
    }

    /// Whether this resource keeps blocks in per-thread caches.
    #[inline]
    fn cached(&self) -> bool {
        self.cache_capacity > 0
    }

    /// The calling thread's cache of this resource's blocks.
    #[inline]
    fn cache(&self) -> Cache<'_, Vec<usize>> {
        Cache {
            owner: &self.owner,
            domain: self.lists.domain(),
            capacity: self.cache_capacity,
        }
    }

    /// Waits for the work of every stream the resource has served, takes every
    /// thread's cached blocks back (the caches come back as it returns), moves
    /// every stream's free blocks to the calling thread's host list, and frees the lists
    /// of streams then left without free blocks (a stream used again gets a new list),
    /// so a resource that served many streams holds lists for its host stream's lanes
    /// only. Chunks are kept (a `FixedSize` returns them when it drops). Linux 4.14 and
    /// later free the lists (the call waits for the resource's calls under way on other
    /// threads to return); elsewhere the lists stay, emptied.
    ///
    /// ```
    /// use memres::suballoc::FixedSize;
    /// use memres::{HostHeap, Resource, StreamRef, layout};
    ///
    /// let blocks = FixedSize::with_block_size(HostHeap::new(), 4096, 64)?;
    /// let l = layout(4096)?;
    /// for stream in 1..100 {
    ///     let p = blocks.allocate(StreamRef::host(stream), l)?;
    ///     // SAFETY: allocated just above with `l` on the same stream; not used afterwards.
    ///     unsafe { blocks.deallocate(StreamRef::host(stream), p, l) };
    /// }
    /// blocks.trim()?;
    /// // Every block free, in the host list (each stream's list had kept its last one).
    /// assert_eq!(blocks.free_blocks(), 64 * blocks.upstream_allocations());
    /// # Ok::<(), memres::Error>(())
    /// ```
    pub fn trim(&self) -> Result<(), Error> {
        // The caches the trim's reclaims turn off come back as it returns (after the
        // retirement: every magazine of a retired list was taken by its reclaim, and a
        // magazine made from now on comes from a lookup, which finds no retired list).
        if self.cached() {
            self.cache().resume_after(|| ordered::trim(self))
        } else {
            ordered::trim(self)
        }
    }

    /// The upstream resource.
    pub fn upstream(&self) -> &U {
        &self.upstream
    }

    /// Takes a chunk from the upstream on `stream`, puts all its blocks but the lowest in
    /// `into`'s list and returns the lowest: the grower's block is never in a list, so no
    /// other thread can take it between the growth and the grower's pop.
    fn grow_chunk(
        &self,
        chunks: &mut Vec<Chunk>,
        stream: StreamRef<'_>,
        into: &List<Vec<usize>>,
    ) -> Result<usize, Error> {
        let size = self.block_size * self.blocks_per_chunk;
        let layout = Layout::from_size_align(size, GRANULE)
            .map_err(|_| Error::invalid_argument("the chunk size overflows"))?;
        let chunk = Chunk::new(self.upstream.allocate(stream, layout)?, layout);
        let base = chunk.addr;
        chunks.push(chunk);
        // Memory is no longer short: caches that a reclaim turned off come back.
        self.cache().resume();
        let mut list = into.state.lock();
        // Highest first, so blocks are handed out in address order.
        list.extend(
            (1..self.blocks_per_chunk)
                .rev()
                .map(|i| base + i * self.block_size),
        );
        self.note_spare(into, list.len());
        Ok(base)
    }

    /// The error for a request larger than a block or aligned to more than 256 bytes (out
    /// of line: the formatting would otherwise weigh on every allocation's frame).
    #[cold]
    #[inline(never)]
    fn does_not_fit(&self, layout: Layout) -> Error {
        Error::invalid_argument(format!(
            "a request of {} bytes aligned to {} does not fit this FixedSize resource's \
             blocks of {} bytes aligned to {GRANULE}",
            layout.size(),
            layout.align(),
            self.block_size
        ))
    }

    /// Marks a list that holds `len` blocks (its lock held) as one with blocks to spare,
    /// if it has some ([`List::spares`]): as the first that searches of other lists look
    /// at if it was not marked yet, and, for a host stream's list, on the stack of
    /// donors. The marks may be stale (a search then finds nothing there, or misses a
    /// list the merge before growing still reaches), never unsafe.
    fn note_spare(&self, list: &List<Vec<usize>>, len: usize) {
        if list.spares(len) {
            self.lists.note_free(list);
            self.list_donor(list);
        }
    }

    /// Puts a host stream's list on the stack of donors, unless it is there already.
    fn list_donor(&self, list: &List<Vec<usize>>) {
        // A load first: a list freed into again and again is listed already, and the
        // swap (a read-modify-write) is then not paid on every such free. A retired list
        // (`trim`) is never listed again: the stack outlives the call.
        if list.key.is_host()
            && !list.in_donors.load(Ordering::Relaxed)
            && !list.is_retired()
            && !list.in_donors.swap(true, Ordering::Relaxed)
        {
            self.donors
                .lock()
                .push(ptr::from_ref(list).expose_provenance());
        }
    }

    /// Takes the list at `addr` off the stack of donors.
    fn unlist_donor(&self, addr: usize, list: &List<Vec<usize>>) {
        let mut donors = self.donors.lock();
        if let Some(at) = donors.iter().rposition(|&a| a == addr) {
            donors.remove(at);
            list.in_donors.store(false, Ordering::Relaxed);
        }
    }

    /// Half the blocks of the first other host stream's list that has any (at most 2 MiB
    /// of them), taken into `own`'s. With `leave_last`, a list's last block stays, but the
    /// shared host stream's: its stream would come here for one at once, and over many
    /// streams each holding one block every allocation would take another's (issue 33,
    /// finding 3). `look`: how many lists to look at past the marked ones (see
    /// [`take_from_donors`](Self::take_from_donors)).
    fn take_from_host_lists(
        &self,
        own: &List<Vec<usize>>,
        leave_last: bool,
        look: usize,
    ) -> Option<usize> {
        let host_batch = (HOST_BATCH_BYTES / self.block_size).clamp(1, HOST_BATCH_BLOCKS);
        let take = |other: &List<Vec<usize>>| {
            let leave = if leave_last {
                other.key.kept_for_itself()
            } else {
                0
            };
            take_half(other, own, host_batch, leave)
        };
        // Lists with spare blocks (the hint; a list with one block has none to spare,
        // and over thousands of streams a search through every list made each new
        // stream's first allocation cost 39 us at 16,384 streams): the one that got
        // some last first, then any other.
        let spare = |other: &List<Vec<usize>>| {
            other.key.is_host()
                && !ptr::eq(other, own)
                && (!leave_last || other.holds_free.load(Ordering::Relaxed))
        };
        let taken = self.take_from_donors(&spare, &take, look);
        if taken.is_some() && own.holds_free.load(Ordering::Relaxed) {
            // The taker has blocks to spare now, most likely: the next stream's donor.
            self.list_donor(own);
        }
        taken
    }

    /// [`take_from_host_lists`](Self::take_from_host_lists)'s search: the list that last
    /// got blocks to spare, then the donors, latest first (a list with nothing left to
    /// spare leaves the stack), then (lists the marks missed) up to `look` other lists,
    /// from where the last look stopped.
    fn take_from_donors(
        &self,
        spare: &dyn Fn(&List<Vec<usize>>) -> bool,
        take: &dyn Fn(&List<Vec<usize>>) -> Option<usize>,
        look: usize,
    ) -> Option<usize> {
        if let Some(recent) = self.lists.recent()
            && spare(recent)
            && let Some(addr) = take(recent)
        {
            if recent.holds_free.load(Ordering::Relaxed) {
                // Still a donor once `recent` moves on.
                self.list_donor(recent);
            }
            return Some(addr);
        }
        loop {
            let Some(addr) = self.donors.lock().last().copied() else {
                break;
            };
            // SAFETY: the stack holds addresses of this resource's lists; one that `trim`
            // retires leaves the stack a grace period before it is freed, and this call
            // is pinned.
            let donor = unsafe { &*ptr::with_exposed_provenance::<List<Vec<usize>>>(addr) };
            let taken = if spare(donor) { take(donor) } else { None };
            if !donor.holds_free.load(Ordering::Relaxed) || taken.is_none() {
                self.unlist_donor(addr, donor);
            }
            if taken.is_some() {
                return taken;
            }
        }
        if look == 0 {
            return None;
        }
        let (addr, donor) = self.lists.search(look, |other| {
            spare(other)
                .then(|| take(other).map(|addr| (addr, other)))
                .flatten()
        })?;
        if donor.holds_free.load(Ordering::Relaxed) {
            // The next stream's search starts where this one found blocks to spare.
            self.lists.set_recent(donor);
            self.list_donor(donor);
        }
        Some(addr)
    }

    /// Gives this thread's cached blocks (of every stream) back to their lists, lists
    /// with blocks to spare then on the donors' stack; whether any went back.
    fn give_back_this_threads_caches(&self) -> bool {
        let lists = self.cache().flush();
        for &list in &lists {
            // SAFETY: the cache returns this resource's lists it gave blocks to; the
            // caller is pinned (since before the flush), so a list `trim` retires
            // meanwhile is not freed before the call returns.
            let list = unsafe { &*list };
            if list.holds_free.load(Ordering::Relaxed) {
                self.list_donor(list);
            }
        }
        !lists.is_empty()
    }

    /// Moves other streams' blocks into `own`'s list, each list keeping `leave`, after
    /// waiting for their streams' work, and pops one. The caller holds the growth lock,
    /// so no other thread grows (or pops after growing) while they come over; a thread on
    /// `own`'s stream may still take some of them, as it could any free block.
    fn merge_leaving(&self, own: &List<Vec<usize>>, leave: usize) -> Result<Option<usize>, Error> {
        self.lists
            .merge_into(
                own,
                |list: &mut Vec<usize>| list.split_off(leave.min(list.len())),
                |list, mut items| list.append(&mut items),
            )
            .map(|_| own.state.lock().pop())
    }
}

/// `FixedSize`'s stages of the core's slow path (`core/ordered.rs`).
impl<U: Resource> StreamOrdered for FixedSize<U> {
    type Free = Vec<usize>;
    type Growth = Vec<Chunk>;
    type Locked<'a>
        = MutexGuard<'a, Vec<Chunk>>
    where
        Self: 'a;
    type Request = ();
    type Trimmed = ();

    fn lists(&self) -> &ListTable<Vec<usize>> {
        &self.lists
    }

    fn held(&self) -> &Deferred {
        &self.held
    }

    #[cold]
    fn new_list(&self, key: StreamKey) -> &List<Vec<usize>> {
        self.lists.get_or_insert_with(key, Vec::new)
    }

    #[cold]
    fn new_list_like(&self, old: &List<Vec<usize>>) -> &List<Vec<usize>> {
        self.lists.get_or_insert_like(old, Vec::new)
    }

    /// The thread caches' blocks taken back first (a reclaim), then every list's blocks
    /// moved to the host list after a wait for their streams.
    fn trim_locked(&self, _chunks: &mut Vec<Chunk>) -> Result<(), Error> {
        if self.cached() {
            self.cache().reclaim();
        }
        let host = ordered::list_of(self, StreamRef::HOST);
        self.lists
            .merge_into(host, Contents::drain, Contents::absorb)?;
        let len = host.state.lock().len();
        self.note_spare(host, len);
        Ok(())
    }

    /// Kept across calls are the donors' stack and the thread caches' magazines, which
    /// take in no retired list: the donors leave the stack, and the reclaim takes every
    /// magazine's blocks (a magazine whose blocks were taken never touches its list
    /// again).
    fn retired(&self, lists: &[usize]) {
        let retired: std::collections::HashSet<usize> = lists.iter().copied().collect();
        self.donors.lock().retain(|addr| !retired.contains(addr));
        if self.cached() {
            let _chunks = lock(&self.chunks);
            self.cache().reclaim();
        }
    }

    fn growth_lock(&self, _capturing: bool) -> MutexGuard<'_, Vec<Chunk>> {
        lock(&self.chunks)
    }

    /// The own list; host streams' blocks on the donors' stack (free for all; at most
    /// 2 MiB of them, so that a stream does not keep what others would then grow for);
    /// the stream's other lanes (one stream to the device): half of the first list found
    /// with any, host lists keeping their last block (see `take_from_host_lists`); host
    /// lists with blocks to spare that the marks missed; then this thread's cached blocks.
    fn take_without_wait(
        &self,
        _chunks: &mut Vec<Chunk>,
        own: &List<Vec<usize>>,
        _: &mut (),
    ) -> Result<Option<usize>, Error> {
        if let Some(addr) = own.state.lock().pop() {
            return Ok(Some(addr));
        }
        if let Some(addr) = self.take_from_host_lists(own, true, 0) {
            return Ok(Some(addr));
        }
        for lane in self.lists.other_lanes(own) {
            if let Some(addr) = take_half(lane, own, usize::MAX, 0) {
                return Ok(Some(addr));
            }
        }
        // A few lists only, from where the last such look stopped. The merge before
        // growing reaches every list, and a look through all of them made each miss cost
        // what the streams seen do (issue 49: 14.2 us a pair round-robin over 16,384
        // streams, where every list keeps its last block and none has any to spare).
        if let Some(addr) = self.take_from_host_lists(own, true, MARKS_MISSED_LOOK) {
            return Ok(Some(addr));
        }
        // This thread's cached blocks (of every stream) go back to their lists, and the
        // lists that then have blocks to spare are donors, before anything waits or grows.
        // (Not first: a thread on more streams than it keeps caches for, whose streams'
        // lists run dry in turn, gave its caches back and made them anew at every miss,
        // most of a miss's cost over 16,384 streams.)
        if self.give_back_this_threads_caches() {
            // (The list's lock is released before the donors' look, which locks it.)
            let popped = own.state.lock().pop();
            return Ok(popped.or_else(|| self.take_from_host_lists(own, true, 0)));
        }
        Ok(None)
    }

    /// Blocks freed on other streams, once their work is waited for, before growing (as
    /// the pools do): else a producer on one stream whose blocks are freed on another
    /// grows by a chunk per chunk of blocks it hands out. The wait is one context
    /// synchronisation per batch of blocks moved (all of them), not per block. Each list
    /// keeps one block here (its stream's next allocation then needs no merge of its
    /// own); all of them move before out-of-memory ([`take_last`](Self::take_last)).
    fn take_after_wait(
        &self,
        _chunks: &mut Vec<Chunk>,
        own: &List<Vec<usize>>,
        _: &mut (),
    ) -> Result<Option<usize>, Error> {
        self.merge_leaving(own, 1)
    }

    /// A new chunk; under capture, when the upstream has none, the host lists' last
    /// blocks (which need no wait either).
    fn grow(
        &self,
        chunks: &mut Vec<Chunk>,
        stream: StreamRef<'_>,
        own: &List<Vec<usize>>,
        _: &mut (),
        may_wait: bool,
    ) -> Result<Option<usize>, Error> {
        match self.grow_chunk(chunks, stream, own) {
            Ok(addr) => Ok(Some(addr)),
            Err(Error::OutOfMemory { .. }) if !may_wait => {
                Ok(self.take_from_host_lists(own, false, usize::MAX))
            }
            Err(Error::OutOfMemory { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Every block of the other lists, and those other threads hold in their caches:
    /// they give them back at their next call, which the reclaim waits a little for.
    fn take_last(
        &self,
        _chunks: &mut Vec<Chunk>,
        _stream: StreamRef<'_>,
        own: &List<Vec<usize>>,
        _: &mut (),
    ) -> Result<Option<usize>, Error> {
        if let Some(addr) = self.merge_leaving(own, 0)? {
            return Ok(Some(addr));
        }
        if !self.cached() {
            return Ok(None);
        }
        self.cache().reclaim();
        self.merge_leaving(own, 0)
    }

    fn out_of_memory(&self, _chunks: MutexGuard<'_, Vec<Chunk>>, requested: usize) -> Error {
        Error::OutOfMemory {
            requested,
            limit: None,
        }
    }
}

/// Moves half the blocks of `from`'s list (the most recently freed; at least one, at
/// most `most`, leaving at least `leave`) to `into`'s and takes one: a thread whose list
/// runs dry comes to the slow path once per batch, not per block (a thread that only
/// allocates, its blocks freed by another thread on the stream; a new thread on a stream
/// whose blocks are in an old one's list).
fn take_half(
    from: &List<Vec<usize>>,
    into: &List<Vec<usize>>,
    most: usize,
    leave: usize,
) -> Option<usize> {
    let moved = {
        let mut blocks = from.state.lock();
        let len = blocks.len();
        let keep = (len - len.div_ceil(2).min(most)).max(leave).min(len);
        from.mark_spare(keep);
        blocks.split_off(keep)
    };
    if moved.is_empty() {
        return None;
    }
    let mut list = into.state.lock();
    list.extend(moved);
    let taken = list.pop();
    // A mark, not the first place searches look: that stays with the giver, which has
    // more to give (making each taker the first made every search look at a list with
    // half as much as the last one's).
    into.mark_spare(list.len());
    taken
}

impl<U: Resource> Drop for FixedSize<U> {
    fn drop(&mut self) {
        self.held.wait_all();
        // First, so no exiting thread gives blocks back to it from now on.
        self.owner.retire();
        let chunks = std::mem::take(&mut *lock(&self.chunks));
        release_all(&self.upstream, &self.lists, chunks);
    }
}

impl<U: Resource> PartialEq for FixedSize<U> {
    fn eq(&self, other: &Self) -> bool {
        ptr::eq(self, other)
    }
}

impl<U: Resource + fmt::Debug> fmt::Debug for FixedSize<U> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FixedSize")
            .field("upstream", &self.upstream)
            .field("block_size", &self.block_size)
            .field("blocks_per_chunk", &self.blocks_per_chunk)
            .field("upstream_allocations", &self.upstream_allocations())
            .finish()
    }
}

sync_on_the_host_stream!(FixedSize);

// SAFETY: blocks are disjoint slices of chunks from the upstream, each free one in
// exactly one free list or one thread's cache (a magazine), 256-byte aligned (chunks
// are, and the block size is a multiple of 256), with the upstream's properties; a block
// freed on a stream goes to another stream only once that stream's work is complete
// (host streams) or waited for (`merge_into`).
unsafe impl<U: Resource> Resource for FixedSize<U> {
    #[inline]
    fn allocate(&self, stream: StreamRef<'_>, layout: Layout) -> Result<NonNull<u8>, Error> {
        if layout.size() == 0 {
            return Ok(dangling(layout));
        }
        if layout.size() > self.block_size || layout.align() > GRANULE {
            return Err(self.does_not_fit(layout));
        }
        let key = StreamKey::of_lane(stream);
        // The thread's magazine first: it touches no list, so it needs no pin.
        if self.cached()
            && let Some(addr) = self.cache().pop(key)
        {
            return Ok(to_ptr(addr));
        }
        let _pin = self.lists.pin(); // (see `ListTable::retire`)
        let list = if self.cached() {
            let list = ordered::list_for(self, key);
            // SAFETY: `list` is this resource's list for `key`.
            if let Some(addr) = unsafe { self.cache().refill(key, list) } {
                return Ok(to_ptr(addr));
            }
            list
        } else {
            let list = ordered::list_for(self, key);
            if let Some(addr) = list.state.lock().pop() {
                return Ok(to_ptr(addr));
            }
            list
        };
        ordered::allocate_slow(self, stream, list, &mut (), layout.size()).map(to_ptr)
    }

    #[inline]
    unsafe fn deallocate(&self, stream: StreamRef<'_>, ptr: NonNull<u8>, layout: Layout) {
        if layout.size() == 0 {
            return;
        }
        let addr = ptr.as_ptr().expose_provenance();
        let key = StreamKey::of_lane(stream);
        if self.cached() {
            // SAFETY: the closure returns this resource's list for `key` (the cache pins
            // while it makes a magazine, the only time it calls it).
            let left = unsafe {
                self.cache()
                    .push(key, || ordered::list_for(self, key), addr)
            };
            if left.is_none() {
                return;
            }
        }
        let _pin = self.lists.pin(); // (see `ListTable::retire`)
        let list = ordered::list_for(self, key);
        let mut blocks = list.state.lock();
        blocks.push(addr);
        self.note_spare(list, blocks.len());
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
    use std::sync::mpsc;

    use crate::resource::SyncResource;

    use super::*;
    use crate::adaptor::Limiting;
    use crate::upstream::HostHeap;

    /// One chunk of 16 blocks of 4 KiB, and no room for another.
    fn one_chunk() -> FixedSize<Limiting<HostHeap>> {
        FixedSize::with_block_size(Limiting::new(HostHeap::new(), 16 * 4096), 4096, 16).unwrap()
    }

    fn layout_4k() -> Layout {
        Layout::from_size_align(4096, 256).unwrap()
    }

    /// Takes every block, checks that one more fails, and frees them all.
    fn run_out(fixed: &FixedSize<Limiting<HostHeap>>) {
        let l = layout_4k();
        let all: Vec<_> = (0..16).map(|_| fixed.allocate_sync(l).unwrap()).collect();
        assert!(matches!(
            fixed.allocate_sync(l),
            Err(Error::OutOfMemory { .. })
        ));
        for p in all {
            // SAFETY: allocated above with `l`.
            unsafe { fixed.deallocate_sync(p, l) };
        }
    }

    /// A thread's cache holds up to 64 blocks and 4 MiB, but at least 4 blocks up to
    /// 4 MiB (a `Binning`'s 2 and 4 MiB bins); none for larger blocks.
    #[test]
    fn thread_caches_are_bounded_by_bytes_and_blocks() {
        for (size, blocks) in [
            (256, 64),
            (64 << 10, 64),
            (128 << 10, 32),
            (1 << 20, 4),
            (2 << 20, 4),
            (4 << 20, 4),
            ((4 << 20) + 256, 0),
            (8 << 20, 0),
        ] {
            let fixed = FixedSize::with_block_size(HostHeap::new(), size, 1).unwrap();
            assert_eq!(fixed.cache_capacity, blocks, "blocks of {size} bytes");
        }
    }

    /// A failure with no other thread holding a magazine turns nothing off.
    #[test]
    fn running_out_alone_keeps_the_caches() {
        let fixed = one_chunk();
        run_out(&fixed);
        assert!(
            fixed.cache().cached_here(Vec::len) > 0,
            "frees went to the cache"
        );
    }

    /// Another thread caches half the blocks and then sits idle (never calls again):
    /// the blocks are taken from its cache, so this thread gets all of them (issue 33,
    /// finding 8: it got 8 of 16 and 8 out-of-memory); the caches are off afterwards and,
    /// at a hard limit (no growth ever again), come back after `CALLS_OFF` calls. Where
    /// the kernel has no `membarrier`, the idle thread cannot answer: out of memory.
    #[test]
    fn an_idle_threads_cache_is_taken_and_caches_come_back_at_a_hard_limit() {
        let fixed = one_chunk();
        let l = layout_4k();
        let (made, main_waits) = mpsc::channel::<()>();
        let (done, worker_waits) = mpsc::channel::<()>();
        let fixed = &fixed;
        // This thread holds half the blocks; the worker takes the other half and frees
        // them into its magazine.
        let mut mine: Vec<_> = (0..8).map(|_| fixed.allocate_sync(l).unwrap()).collect();
        // Nothing in this thread's cache: a free later shows whether caches are on.
        fixed.cache().flush();
        std::thread::scope(|scope| {
            scope.spawn(move || {
                let theirs: Vec<_> = (0..8).map(|_| fixed.allocate_sync(l).unwrap()).collect();
                for p in theirs {
                    // SAFETY: allocated just above with `l`.
                    unsafe { fixed.deallocate_sync(p, l) };
                }
                made.send(()).unwrap();
                // Idle until this test is done (or has failed: `done` is dropped then).
                let _ = worker_waits.recv();
            });
            let done = done;
            main_waits.recv().unwrap();
            if crate::sync::barrier::heavy_available() {
                for _ in 0..8 {
                    mine.push(fixed.allocate_sync(l).expect("the idle thread's blocks"));
                }
                assert_eq!(fixed.upstream_allocations(), 1, "taken, not grown");
            } else {
                assert!(matches!(
                    fixed.allocate_sync(l),
                    Err(Error::OutOfMemory { .. })
                ));
            }
            for p in mine {
                // SAFETY: allocated above with `l`.
                unsafe { fixed.deallocate_sync(p, l) };
            }
            assert_eq!(
                fixed.cache().cached_here(Vec::len),
                0,
                "caches off: frees to the lists"
            );
            for _ in 0..CALLS_OFF_FOR_TESTS {
                let p = fixed.allocate_sync(l).unwrap();
                // SAFETY: allocated just above with `l`.
                unsafe { fixed.deallocate_sync(p, l) };
            }
            assert!(fixed.cache().cached_here(Vec::len) > 0, "caches back on");
            done.send(()).unwrap();
        });
    }

    /// A trim takes every thread's cached blocks back, which turns the caches off, and
    /// turns them back on as it returns: the next free is cached again (issue 49: they
    /// stayed off for up to 65,536 calls, each pair costing twice what it did).
    #[test]
    fn thread_caches_are_back_on_after_a_trim() {
        let fixed = FixedSize::with_block_size(HostHeap::new(), 4096, 64).unwrap();
        let l = layout_4k();
        let (cached, trim) = mpsc::channel::<()>();
        let (trimmed, exit) = mpsc::channel::<()>();
        let fixed = &fixed;
        std::thread::scope(|scope| {
            // Another thread with a magazine, as the trim runs: its blocks are taken back.
            scope.spawn(move || {
                let p = fixed.allocate_sync(l).unwrap();
                // SAFETY: allocated just above with `l`.
                unsafe { fixed.deallocate_sync(p, l) };
                assert!(
                    fixed.cache().cached_here(Vec::len) > 0,
                    "a magazine on this thread"
                );
                cached.send(()).unwrap();
                let _ = exit.recv();
            });
            // (Dropped if this thread panics, so that the other one ends.)
            let trimmed = trimmed;
            trim.recv().unwrap();
            fixed.trim().unwrap();
            let mut calls = 0;
            while fixed.cache().cached_here(Vec::len) == 0 {
                assert!(calls < 1_000, "caches still off after {calls} pairs");
                let p = fixed.allocate_sync(l).unwrap();
                // SAFETY: allocated just above with `l`.
                unsafe { fixed.deallocate_sync(p, l) };
                calls += 1;
            }
            assert_eq!(
                calls, 1,
                "on at once: the first free after the trim is cached"
            );
            trimmed.send(()).unwrap();
        });
    }

    /// Pairs enough to turn the caches back on (each pair counts at least once).
    const CALLS_OFF_FOR_TESTS: u64 = crate::suballoc::thread_cache::CALLS_OFF;
}
