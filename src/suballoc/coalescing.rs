//! [`Coalescing`]: the body of the two coalescing pools, [`Pool`](super::Pool) (chunks)
//! and [`VirtualPool`](super::VirtualPool) (grows in place): the per-stream lists, the
//! allocation slow path, merges, the release threshold, `trim`, figures and the blocks
//! held for other streams. How each holds memory from its upstream (how it grows, gives
//! memory back, lists its segments and drops) is its [`Holding`]; the public methods both
//! pools share are written once, by [`coalescing_pool!`].

use std::alloc::Layout;
use std::ptr::{self, NonNull};

use super::chunks::to_ptr;
use super::core::free_blocks::GRANULE;
use super::core::free_list::{FreeList, QUICK_UNITS, block_size};
use super::core::held::{self, Deferred};
use super::core::lanes;
use super::core::list_table::{List, ListTable};
use super::core::ordered::{self, StreamOrdered};
use super::core::stream_key::StreamKey;
use super::thread_cache::{Cache, Owner, Popped, Pushed, SmallBlocks};
use crate::error::Error;
use crate::resource::{Resource, dangling};
use crate::stream::StreamRef;
use crate::sync::atomic::{AtomicBool, AtomicU64, Ordering, fence};
use crate::sync::lock;
use crate::sync::{Mutex, MutexGuard};
use crate::upstream::HostCopy;

/// A CUDA stream that takes a small block from a host stream's list (where a pool's
/// initial memory is) takes this much, and keeps the rest in its own list.
const HOST_REFILL: usize = 2 << 20;

/// A snapshot of a pool's memory, from [`Pool::stats`](super::Pool::stats) or
/// [`VirtualPool::stats`](super::VirtualPool::stats).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PoolStats {
    /// Bytes held from the upstream.
    pub pool_size: usize,
    /// The most bytes held at once since the pool was made or its `reset_peak_size`
    /// (PyTorch's `max_memory_reserved`).
    pub peak_pool_size: usize,
    /// Bytes held but not handed out: in the streams' lists and the calling thread's
    /// caches (a [`Pool`](super::Pool)'s other threads' cached small blocks count as
    /// handed out until they come back; see its "Thread caches").
    pub free_bytes: usize,
    /// The largest free block of any one stream's list or of the calling thread's
    /// caches.
    pub largest_free_block: usize,
    /// Free blocks, over all lists and the calling thread's caches.
    pub free_blocks: usize,
    /// Allocations held from the upstream (for a [`VirtualPool`](super::VirtualPool):
    /// runs of mapped granules).
    pub upstream_allocations: usize,
    /// Free lists: one per stream the pool has seen, the host's included. The
    /// per-thread default stream has one per thread running at once: a new thread takes
    /// over the list of one that has exited.
    pub stream_lists: usize,
    /// Bytes freed with [`Resource::deallocate_used_on`] that wait for other streams'
    /// work: held, neither free nor live.
    pub waiting_bytes: usize,
    /// How often the pool merged other streams' free lists into one, each time after
    /// waiting for their work (one `cuCtxSynchronize` per device on a GPU): a count that
    /// climbs with the calls where streams trade memory. Lanes of one stream trade
    /// without it.
    pub stream_merges: u64,
    /// While the pool sleeps ([`VirtualPool::sleep`](super::VirtualPool::sleep)): the
    /// bytes it gave back to the driver and maps again when woken (`pool_size` and the
    /// free figures are then 0). 0 while it is awake, and always for a [`Pool`](super::Pool).
    pub asleep_bytes: usize,
    /// Host memory (pinned, for device memory) held for
    /// [`VirtualPool::sleep`](super::VirtualPool::sleep): the offloaded contents while
    /// the pool sleeps, and after a wake the copies kept for the next sleep, until its
    /// `trim`.
    pub host_copy_bytes: usize,
    /// Calls that took memory from the upstream since the pool was made: a chunk
    /// allocated ([`Pool`](super::Pool)); granules mapped
    /// ([`VirtualPool`](super::VirtualPool): one a growth, one a piece of up to 256 MiB
    /// of a wake). PyTorch's `num_device_alloc`: a count that climbs in a loop that should
    /// be steady says the pool keeps growing and giving back (on a GPU such a call costs
    /// the driver tens of microseconds a granule).
    pub upstream_alloc_calls: u64,
    /// Calls that gave memory back to the upstream since the pool was made: a chunk
    /// freed; granules unmapped (one a run a trim, the release threshold or a growth's
    /// give-back frees, one a piece of a sleep). PyTorch's `num_device_free`.
    pub upstream_free_calls: u64,
}

impl PoolStats {
    /// Bytes handed out and not yet freed (`pool_size - free_bytes - waiting_bytes`; 0
    /// while the pool sleeps).
    pub fn live_bytes(&self) -> usize {
        self.pool_size
            .saturating_sub(self.free_bytes)
            .saturating_sub(self.waiting_bytes)
    }

    /// `1 - largest_free_block / free_bytes`: 0 when the free memory is one block (or
    /// there is none), near 1 when it is in many small pieces.
    pub fn fragmentation(&self) -> f64 {
        if self.free_bytes == 0 {
            0.0
        } else {
            1.0 - self.largest_free_block as f64 / self.free_bytes as f64
        }
    }
}

/// What changes only when the pool grows or shrinks; its mutex also serialises the
/// allocation slow path.
#[derive(Default)]
pub(super) struct GrowthState<M> {
    pub(super) size: usize,
    /// Calls that took memory from the upstream ([`PoolStats::upstream_alloc_calls`]).
    pub(super) allocs: u64,
    /// Calls that gave memory back ([`PoolStats::upstream_free_calls`]).
    pub(super) frees: u64,
    /// The highest `size` since the pool was made or `reset_peak_size`.
    pub(super) peak: usize,
    /// The bound set with `set_limit`, below the configured maximum.
    limit: Option<usize>,
    /// What the pool holds from its upstream, as its [`Holding`] keeps it.
    pub(super) memory: M,
}

impl<M> GrowthState<M> {
    /// The most the pool may hold now: the smaller of `maximum` (the configured one) and
    /// the run-time limit.
    pub(super) fn maximum(&self, maximum: Option<usize>) -> Option<usize> {
        match (maximum, self.limit) {
            (Some(m), Some(l)) => Some(m.min(l)),
            (m, l) => m.or(l),
        }
    }
}

/// The growth lock of a pool, held: on unlock it runs a release that a free left pending
/// while the lock was held (see `Coalescing::release_if_pending`).
pub(super) struct GrowthGuard<'a, U: Resource, H: Holding<U>> {
    pool: &'a Coalescing<U, H>,
    guard: Option<MutexGuard<'a, GrowthState<H::Memory>>>,
    /// Whether the unlock runs a pending release (not under stream capture: a release
    /// waits for streams; it is then left to the next unlock outside one).
    releases: bool,
}

impl<U: Resource, H: Holding<U>> std::ops::Deref for GrowthGuard<'_, U, H> {
    type Target = GrowthState<H::Memory>;

    fn deref(&self) -> &GrowthState<H::Memory> {
        self.guard.as_ref().expect("held until dropped")
    }
}

impl<U: Resource, H: Holding<U>> std::ops::DerefMut for GrowthGuard<'_, U, H> {
    fn deref_mut(&mut self) -> &mut GrowthState<H::Memory> {
        self.guard.as_mut().expect("held until dropped")
    }
}

impl<U: Resource, H: Holding<U>> Drop for GrowthGuard<'_, U, H> {
    fn drop(&mut self) {
        drop(self.guard.take());
        if self.releases {
            self.pool.release_if_pending();
        }
    }
}

/// How a coalescing pool holds memory from its upstream: the hooks that its body
/// ([`Coalescing`]) calls where the chunked [`Pool`](super::Pool) and the
/// [`VirtualPool`](super::VirtualPool) differ. Monomorphised: no dynamic dispatch.
pub(super) trait Holding<U: Resource>: Sized {
    /// What the pool holds, under the growth lock (the chunks, or which granules of the
    /// reservation are mapped).
    type Memory: Default;

    /// An empty stream list that knows what the pool holds (the caller holds the growth
    /// lock).
    fn new_free_list(&self, memory: &Self::Memory) -> FreeList;

    /// Grows the pool for a block of `size` aligned to `align` (with room for the
    /// alignment, it does not overflow) and takes the block from the new memory into
    /// `own`'s list in the same critical section; `Ok(None)` when neither the maximum nor
    /// the upstream allows it. Without `may_wait` (under capture) it must not wait.
    // (Seven arguments: the growth lock's state and the request, as the slow path has them.)
    fn grow(
        pool: &Coalescing<U, Self>,
        growth: &mut GrowthState<Self::Memory>,
        stream: StreamRef<'_>,
        own: &List<FreeList>,
        size: usize,
        align: usize,
        may_wait: bool,
    ) -> Result<Option<usize>, Error>;

    /// Gives free memory of `from`'s list (which holds all free memory, the lists having
    /// been merged into it) back to the upstream until at most `keep` bytes are free, or
    /// nothing more can go; returns how many bytes went.
    fn release(
        pool: &Coalescing<U, Self>,
        growth: &mut GrowthState<Self::Memory>,
        from: &List<FreeList>,
        keep: usize,
    ) -> usize;

    /// The memory held, as `(address, bytes)` in any order.
    fn segments(&self, memory: &Self::Memory) -> Vec<(usize, usize)>;

    /// How many upstream allocations (or mapped runs) the pool holds.
    fn upstream_allocations(memory: &Self::Memory) -> usize;

    /// Gives everything back when the pool drops (after the held blocks' waits), also
    /// the memory under blocks still handed out.
    fn drop_memory(pool: &Coalescing<U, Self>, memory: Self::Memory);

    /// Whether a host stream that misses merges whole the list of a host stream that has
    /// only freed (see [`List::allocates`]) rather than take one block of it: the virtual
    /// pool's blocks then coalesce across the two lists. Not the chunked pool's: its
    /// blocks never merge across chunks, and on the host `cross-stream` held more with
    /// it (`pool` 1.517 -> 1.603 of live, `pool_rmm` 1.477 -> 2.954).
    const MERGES_FREEING_HOST_LISTS: bool = false;

    /// Whether the pool keeps small blocks freed by a thread in that thread's caches
    /// (`suballoc/thread_cache.rs`), unless it has a release threshold. Not the virtual
    /// pool's: what it holds is what PyTorch's programs see, and its sleep gives back
    /// memory that a cache would hand out.
    const THREAD_CACHES: bool = false;

    /// Whether the pool sleeps: one relaxed load, read first by every allocation.
    #[inline(always)]
    fn is_asleep(&self) -> bool {
        false
    }

    /// While the pool sleeps: the bytes waking it maps again (`None` while it is awake).
    fn asleep_bytes(_memory: &Self::Memory) -> Option<usize> {
        None
    }

    /// Host memory held for sleeping (copies).
    fn host_copy_bytes(_memory: &Self::Memory) -> usize {
        0
    }

    /// The host copies that `trim` frees (outside the growth lock).
    fn take_host_copies(_memory: &mut Self::Memory) -> Vec<HostCopy> {
        Vec::new()
    }
}

/// The body of a coalescing pool over `U` (RMM's `pool_memory_resource`): per-stream
/// free lists, the allocation slow path, merges, release, figures; `H` says how it holds
/// memory from `U`. [`Pool`](super::Pool) and [`VirtualPool`](super::VirtualPool) wrap
/// one (see their docs for how it works).
pub(super) struct Coalescing<U: Resource, H: Holding<U>> {
    pub(super) upstream: U,
    /// How the pool holds memory from `upstream`, with the configuration of that.
    pub(super) holding: H,
    /// The configured maximum.
    maximum: Option<usize>,
    /// The configured release threshold.
    pub(super) release_threshold: Option<usize>,
    growth: Mutex<GrowthState<H::Memory>>,
    pub(super) lists: ListTable<FreeList>,
    /// A free crossed the release threshold while another thread held the growth lock:
    /// whoever unlocks it next releases (see [`GrowthGuard`]).
    release_pending: AtomicBool,
    /// Blocks freed with [`Resource::deallocate_used_on`] whose other streams' work is
    /// not known to be complete yet.
    held: Deferred,
    /// When an allocation last looked at `held` (`held::free_ready_now_and_then`).
    held_look: AtomicU64,
    /// The key of the host stream's list made with the pool (in the lane of the thread
    /// that made it), which paths holding the growth lock use.
    host_key: StreamKey,
    /// The pool's identity for the thread caches.
    owner: Owner<SmallBlocks>,
}

impl<U: Resource, H: Holding<U>> Coalescing<U, H> {
    /// A pool body over `upstream` holding `memory` (nothing yet: the constructors add
    /// the initial memory), bounded by `maximum`, releasing above `release_threshold`.
    pub(super) fn new(
        upstream: U,
        holding: H,
        memory: H::Memory,
        maximum: Option<usize>,
        release_threshold: Option<usize>,
    ) -> Self {
        let pool = Coalescing {
            upstream,
            holding,
            maximum,
            release_threshold,
            growth: Mutex::new(GrowthState {
                memory,
                ..GrowthState::default()
            }),
            lists: ListTable::default(),
            release_pending: AtomicBool::new(false),
            held: Deferred::default(),
            held_look: AtomicU64::new(0),
            host_key: StreamKey::of_lane(StreamRef::HOST),
            owner: Owner::new(),
        };
        // The host stream's list exists from the start, so that paths holding the growth
        // lock can look it up without making it (which takes that lock).
        pool.new_list(pool.host_key);
        pool
    }

    /// Whether this pool keeps small blocks in per-thread caches
    /// ([`Holding::THREAD_CACHES`], and no release threshold: a pool that gives memory
    /// back above a threshold counts every free block at once).
    #[inline(always)]
    fn cached(&self) -> bool {
        H::THREAD_CACHES && self.release_threshold.is_none()
    }

    /// The calling thread's caches of this pool's small blocks.
    #[inline(always)]
    fn cache(&self) -> Cache<'_, SmallBlocks> {
        Cache::small_blocks(&self.owner, self.lists.domain())
    }

    /// Moves this thread's cached blocks (of every stream) into their lists, the caches
    /// kept; whether any moved.
    fn put_back_this_threads_caches(&self) -> bool {
        let lists = self.cache().put_back_all();
        // (Their `holds_free` is set already: a search then starts at the last.)
        for &list in &lists {
            // SAFETY: this pool's lists, given blocks; the caller is pinned (since before
            // the call), so one a `trim` retires meanwhile is not freed before it returns.
            self.lists.set_recent(unsafe { &*list });
        }
        !lists.is_empty()
    }

    /// Takes every thread's cached blocks back to their lists and turns the caches off
    /// (until the pool grows, a trim returns, or enough calls pass; see
    /// `thread_cache.rs`). The caller holds the growth lock.
    fn reclaim_caches(&self) {
        if self.cached() {
            self.cache().reclaim();
        }
    }

    /// The upstream resource.
    pub(super) fn upstream(&self) -> &U {
        &self.upstream
    }

    /// Sets the run-time bound (`set_limit`).
    pub(super) fn set_limit(&self, bytes: Option<usize>) {
        self.lock_growth().limit = bytes;
    }

    /// The run-time bound, if any.
    pub(super) fn limit(&self) -> Option<usize> {
        self.lock_growth().limit
    }

    /// The blocks held for other streams (for the host tests).
    #[cfg(all(test, not(memres_loom)))]
    pub(super) fn held(&self) -> &Deferred {
        &self.held
    }

    /// Bytes held from the upstream.
    pub(super) fn pool_size(&self) -> usize {
        let _pin = self.lists.pin(); // (see `ListTable::retire`)
        self.lock_growth().size
    }

    /// Starts the peak afresh from what the pool holds now.
    pub(super) fn reset_peak_size(&self) {
        let _pin = self.lists.pin(); // (see `ListTable::retire`)
        let mut growth = self.lock_growth();
        growth.peak = growth.size;
    }

    /// The memory held from the upstream, as `(address, bytes)` in address order.
    pub(super) fn segments(&self) -> Vec<(usize, usize)> {
        let _pin = self.lists.pin(); // (see `ListTable::retire`)
        let growth = self.lock_growth();
        let mut out = self.holding.segments(&growth.memory);
        out.sort_unstable();
        out
    }

    /// A snapshot of the pool's memory, each list locked in turn.
    pub(super) fn stats(&self) -> PoolStats {
        let _pin = self.lists.pin(); // (see `ListTable::retire`)
        let growth = self.lock_growth();
        if let Some(asleep_bytes) = H::asleep_bytes(&growth.memory) {
            return PoolStats {
                peak_pool_size: growth.peak,
                upstream_alloc_calls: growth.allocs,
                upstream_free_calls: growth.frees,
                stream_lists: self.lists.len(),
                waiting_bytes: self.held.bytes(),
                stream_merges: self.lists.merges(),
                asleep_bytes,
                host_copy_bytes: H::host_copy_bytes(&growth.memory),
                ..PoolStats::default()
            };
        }
        let mut stats = PoolStats {
            pool_size: growth.size,
            peak_pool_size: growth.peak,
            upstream_allocations: H::upstream_allocations(&growth.memory),
            upstream_alloc_calls: growth.allocs,
            upstream_free_calls: growth.frees,
            stream_lists: self.lists.len(),
            waiting_bytes: self.held.bytes(),
            stream_merges: self.lists.merges(),
            host_copy_bytes: H::host_copy_bytes(&growth.memory),
            ..PoolStats::default()
        };
        for list in self.lists.all() {
            let s = list.state.lock();
            stats.free_bytes += s.free_bytes();
            let (quick_blocks, quick_largest) = s.quick_blocks();
            stats.free_blocks += s.free.len() + quick_blocks + s.large_blocks().len();
            let large_largest = s.large_blocks().iter().map(|&(_, n)| n).max().unwrap_or(0);
            stats.largest_free_block = stats
                .largest_free_block
                .max(s.free.largest())
                .max(quick_largest)
                .max(large_largest);
        }
        if self.cached() {
            let (bytes, blocks, largest) = self.cache().fold_here((0, 0, 0), |(n, k, l), b| {
                (n + b.bytes(), k + b.len(), l.max(b.largest()))
            });
            stats.free_bytes += bytes;
            stats.free_blocks += blocks;
            stats.largest_free_block = stats.largest_free_block.max(largest);
        }
        stats
    }

    /// Merges every stream's free list into the host list, first waiting for the work
    /// of the CUDA streams the pool has seen.
    pub(super) fn coalesce(&self) -> Result<(), Error> {
        let _pin = self.lists.pin(); // (see `ListTable::retire`)
        let host = self.host_list();
        let _growth = self.lock_growth();
        self.caches_back_after(|| {
            self.reclaim_caches();
            self.merge_into(host).map(drop)
        })
    }

    /// Runs `f`, then turns the thread caches back on if they were on before it (see
    /// [`Cache::resume_after`]).
    fn caches_back_after<T>(&self, f: impl FnOnce() -> T) -> T {
        if self.cached() {
            self.cache().resume_after(f)
        } else {
            f()
        }
    }

    /// Gives free memory back to the upstream, then frees the emptied lists (see the
    /// pools' `trim`). Returns how many bytes went back.
    pub(super) fn trim(&self) -> Result<usize, Error> {
        // (Back on after the retirement: every magazine of a retired list was taken by
        // its reclaim, and a magazine made from now on comes from a lookup, which finds
        // no retired list.)
        let (released, kept) = self.caches_back_after(|| ordered::trim(self))?;
        // The host copies kept for a sleep (unpinned outside the lock: it takes time).
        drop(kept);
        Ok(released)
    }

    /// Merges every list into `into`'s and releases free memory until at most `keep`
    /// bytes are free (or nothing more can go).
    pub(super) fn release_down_to(
        &self,
        growth: &mut GrowthState<H::Memory>,
        into: &List<FreeList>,
        keep: usize,
    ) -> Result<usize, Error> {
        if H::asleep_bytes(&growth.memory).is_some() {
            return Ok(0); // nothing is mapped while the pool sleeps
        }
        self.merge_into(into)?;
        let released = H::release(self, growth, into, keep);
        if released > 0 {
            tracing::debug!(
                target: "memres::pool",
                released,
                held = growth.size,
                "memres: pool gave memory back"
            );
        }
        Ok(released)
    }

    /// The release threshold was crossed by a free: release what is above it into the
    /// freeing stream's list (so that its next frees count all free memory). When another
    /// thread holds the growth lock, the release is left to it: it runs once that thread
    /// unlocks ([`GrowthGuard`]), into the host stream's list.
    #[cold]
    #[inline(never)]
    fn release_above(&self, stream: StreamRef<'_>, list: &List<FreeList>, keep: usize) {
        // A release waits for streams, which a capture forbids: under capture it is left
        // to the next free that crosses the threshold outside one.
        if let Some(ctx) = list.ctx
            && !matches!(stream.is_capturing_in(ctx), Ok(false))
        {
            return;
        }
        match self.try_lock_growth() {
            Some(mut growth) => self.release_into(&mut growth, list, keep),
            None => self.release_pending.store(true, Ordering::SeqCst),
        }
        self.release_if_pending();
    }

    /// The growth lock if no other thread holds it (the raw guard: its unlock runs no
    /// pending release, so the callers look for one afterwards).
    fn try_lock_growth(&self) -> Option<MutexGuard<'_, GrowthState<H::Memory>>> {
        match self.growth.try_lock() {
            Ok(g) => Some(g),
            Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    fn release_into(
        &self,
        growth: &mut GrowthState<H::Memory>,
        list: &List<FreeList>,
        keep: usize,
    ) {
        if let Err(e) = self.release_down_to(growth, list, keep) {
            tracing::warn!("a pool could not give memory back at its release threshold: {e}");
        }
    }

    /// Runs a release that a free left pending, unless the growth lock is taken again (its
    /// holder then runs it on unlock). Every unlock of the growth lock calls this, so a
    /// pending release is never left behind: the flag is set before the freer's last try
    /// of the lock, and read after every holder's unlock.
    fn release_if_pending(&self) {
        let Some(keep) = self.release_threshold else {
            return;
        };
        // A freer sets the flag, then tries the lock; a holder unlocks, then reads the
        // flag. Without a full fence on each side both could see the other's old state
        // (the flag unset, the lock still held) and the release would be lost.
        fence(Ordering::SeqCst);
        while self.release_pending.load(Ordering::SeqCst) {
            let Some(mut growth) = self.try_lock_growth() else {
                return;
            };
            if !self.release_pending.swap(false, Ordering::AcqRel) {
                continue; // another thread ran it; unlock, then look again
            }
            self.release_into(&mut growth, self.host_list(), keep);
        }
    }

    /// The growth lock, as a guard that runs a pending release once it unlocks.
    pub(super) fn lock_growth(&self) -> GrowthGuard<'_, U, H> {
        GrowthGuard {
            pool: self,
            guard: Some(lock(&self.growth)),
            releases: true,
        }
    }

    /// The host stream's list made with the pool: paths that hold the growth lock find
    /// it without taking that lock again. (Not the calling thread's lane of the host
    /// stream, `list(StreamRef::HOST)`: on another thread than the one that
    /// made the pool that list may not exist yet, and making it takes the growth lock,
    /// which the thread holds.)
    pub(super) fn host_list(&self) -> &List<FreeList> {
        self.lists
            .get(self.host_key)
            .expect("the host list is made with the pool")
    }

    /// An empty stream list that knows what the pool holds (the caller holds the growth
    /// lock).
    fn new_free_list(&self, growth: &GrowthState<H::Memory>) -> FreeList {
        self.holding.new_free_list(&growth.memory)
    }

    /// Free bytes in the lists of streams other than `own`.
    fn free_elsewhere(&self, own: &List<FreeList>) -> usize {
        self.lists
            .iter()
            .filter(|s| !ptr::eq(*s, own) && s.holds_free.load(Ordering::Relaxed))
            .map(|s| {
                let st = s.state.lock();
                let free = st.free_bytes();
                if free == 0 {
                    s.holds_free.store(false, Ordering::Relaxed);
                }
                free
            })
            .sum()
    }

    /// [`Resource::allocate`] without its trace event.
    #[inline(always)]
    fn allocate_untraced(
        &self,
        stream: StreamRef<'_>,
        layout: Layout,
    ) -> Result<NonNull<u8>, Error> {
        if layout.size() == 0 {
            return Ok(dangling(layout));
        }
        if self.holding.is_asleep() {
            return Err(Error::Asleep);
        }
        // Blocks held for other streams whose work is done come back now and then, to
        // their own stream (PyTorch's `record_stream`; one load when none is held).
        held::free_ready_now_and_then(self, &self.held, &self.held_look, stream);
        let (size, align) = block_size(layout);
        let key = StreamKey::of_lane(stream);
        let units = size / GRANULE;
        // The thread's cache first: it touches no list, so it needs no pin.
        let mut popped = Popped::Missed;
        if self.cached() && align == GRANULE && units <= QUICK_UNITS {
            popped = self.cache().pop_small(key, units);
            if let Popped::Block(addr) = popped {
                return Ok(to_ptr(addr));
            }
        }
        let _pin = self.lists.pin(); // (see `ListTable::retire`)
        let list = ordered::list_for(self, key);
        if let Some(addr) = list.state.lock().take(size, align) {
            return Ok(to_ptr(addr));
        }
        // (Only where it is read: a virtual pool's host lists. Else the slow path does not
        // read the list's first line, which other threads' searches read; issue 49.)
        if H::MERGES_FREEING_HOST_LISTS
            && stream.is_host()
            && !list.allocates.load(Ordering::Relaxed)
        {
            list.allocates.store(true, Ordering::Relaxed);
        }
        let mut fit = Fit {
            key,
            cached: popped != Popped::Nothing,
            size,
            align,
            host: stream.is_host(),
            merged: false,
        };
        ordered::allocate_slow(self, stream, list, &mut fit, layout.size()).map(to_ptr)
    }

    /// A block from `own`'s list (flushed) or from a host stream's list, whose blocks are
    /// free for all: the list that last received memory first, then the others, from
    /// where the last such search found one ([`ListTable::search`]). The caller holds the
    /// growth lock.
    fn take_listed(&self, own: &List<FreeList>, fit: &Fit) -> Option<usize> {
        let (size, align) = (fit.size, fit.align);
        let found = {
            let mut s = own.state.lock();
            s.flush();
            s.free.take(size, align)
        };
        let from_host_list = |other: &List<FreeList>| {
            if ptr::eq(other, own)
                || !other.key.is_host()
                || !other.holds_free.load(Ordering::Relaxed)
            {
                return None;
            }
            if H::MERGES_FREEING_HOST_LISTS && fit.host && !other.allocates.load(Ordering::Relaxed)
            {
                // A host list only freed into (its stream never missed in it) is merged
                // whole, as a CUDA stream's list is after a wait, so that its blocks
                // coalesce with this list's. Taking one block of it at each miss left
                // the two lists' blocks apart and `cross-stream` at 1.136 of live on the
                // host (1.100 merged; BENCHMARKS.md, issue 51 item 5). A stream that
                // allocates keeps its list: no thread drains another's at each miss.
                return lanes::move_all(&self.lists, own, &[other], fit.size, fit.align, false);
            }
            let mut s = other.state.lock();
            // A CUDA stream's list takes a larger piece when there is one and keeps the
            // rest, so that its next misses do not come back here (threads on one
            // stream then queue less for the growth lock).
            let grab = (!fit.host && align == GRANULE && size < HOST_REFILL)
                .then(|| s.free.take(HOST_REFILL, GRANULE))
                .flatten();
            let found = grab.or_else(|| {
                s.take(size, align).or_else(|| {
                    s.flush();
                    s.free.take(size, align)
                })
            });
            if s.free_bytes() == 0 {
                other.holds_free.store(false, Ordering::Relaxed);
            }
            drop(s);
            if let Some(addr) = grab {
                own.state.lock().insert(addr + size, HOST_REFILL - size);
                self.lists.note_free(own);
            }
            found
        };
        found
            .or_else(|| self.lists.recent().and_then(from_host_list))
            .or_else(|| self.lists.search(usize::MAX, from_host_list))
    }

    /// Grows the pool for a block of `size` aligned to `align` and takes the block from
    /// the new memory in the same critical section (no other thread can take it first);
    /// `Ok(None)` when neither the maximum nor the upstream allows it.
    fn grow_for(
        &self,
        growth: &mut GrowthState<H::Memory>,
        stream: StreamRef<'_>,
        own: &List<FreeList>,
        size: usize,
        align: usize,
        may_wait: bool,
    ) -> Result<Option<usize>, Error> {
        if size.checked_add(align - GRANULE).is_none() {
            return Ok(None);
        }
        let grown = H::grow(self, growth, stream, own, size, align, may_wait);
        if self.cached() && matches!(grown, Ok(Some(_))) {
            // Memory is no longer short: caches that a reclaim turned off come back.
            self.cache().resume();
        }
        grown
    }

    /// The configured maximum, under the run-time bound.
    pub(super) fn maximum(&self, growth: &GrowthState<H::Memory>) -> Option<usize> {
        growth.maximum(self.maximum)
    }
    /// Moves every other list's free blocks into `into`'s, coalescing them, after waiting
    /// for the CUDA streams they were freed on. Returns whether anything moved.
    fn merge_into(&self, into: &List<FreeList>) -> Result<bool, Error> {
        into.state.lock().flush();
        let moved = self
            .lists
            .merge_into(into, FreeList::drain, FreeList::absorb)?;
        if moved {
            tracing::debug!(
                target: "memres::pool",
                into = ?into.key,
                "memres: pool merged other streams' lists into one (after waiting for their streams)"
            );
        }
        Ok(moved)
    }
}

/// A request on the pool's slow path: its size and alignment (rounded), its stream's kind, and whether the
/// lists were merged for it before the pool grew.
pub(crate) struct Fit {
    /// The key of the request's stream's list (in the calling thread's lane).
    key: StreamKey,
    /// Whether the thread's magazine for the stream may hold blocks (false when the
    /// fast path found it has none: the slow path then skips a second lookup).
    cached: bool,
    size: usize,
    align: usize,
    /// Whether the request's stream is a host stream (known from the stream, so that the
    /// slow path need not read its list's key: on the line other threads' searches read,
    /// cold when the list is; issue 49).
    host: bool,
    merged: bool,
}

/// The pool's stages of the core's slow path (`core/ordered.rs`).
impl<U: Resource, H: Holding<U>> StreamOrdered for Coalescing<U, H> {
    type Free = FreeList;
    type Growth = GrowthState<H::Memory>;
    type Locked<'a>
        = GrowthGuard<'a, U, H>
    where
        Self: 'a;
    type Request = Fit;
    /// The bytes given back, and the host copies kept for a sleep (freed outside the
    /// growth lock).
    type Trimmed = (usize, Vec<HostCopy>);

    fn lists(&self) -> &ListTable<FreeList> {
        &self.lists
    }

    fn held(&self) -> &Deferred {
        &self.held
    }

    /// The thread caches take in no retired list: the reclaim takes every magazine's
    /// blocks (a magazine whose blocks were taken never touches its list again).
    fn retired(&self, _lists: &[usize]) {
        if self.cached() {
            let _growth = lock(&self.growth);
            self.cache().reclaim();
        }
    }

    /// Only the host list the pool was made with.
    fn keeps_list(&self, list: &List<FreeList>) -> bool {
        list.key == self.host_key
    }

    /// Every list merged into the host list, then all free memory given back that can go.
    fn trim_locked(&self, growth: &mut GrowthState<H::Memory>) -> Result<Self::Trimmed, Error> {
        self.reclaim_caches();
        let released = self.release_down_to(growth, self.host_list(), 0)?;
        Ok((released, H::take_host_copies(&mut growth.memory)))
    }

    #[cold]
    fn new_list_like(&self, old: &List<FreeList>) -> &List<FreeList> {
        let growth = lock(&self.growth);
        self.lists
            .get_or_insert_like(old, || self.new_free_list(&growth))
    }

    #[cold]
    fn new_list(&self, key: StreamKey) -> &List<FreeList> {
        // Under the growth lock, so no chunk comes or goes while its start is copied. (The
        // raw lock: its unlock runs no pending release, which waits for streams and may
        // come here under stream capture; the next unlock elsewhere runs it.)
        let growth = lock(&self.growth);
        self.lists
            .get_or_insert_with(key, || self.new_free_list(&growth))
    }

    fn growth_lock(&self, capturing: bool) -> GrowthGuard<'_, U, H> {
        GrowthGuard {
            pool: self,
            guard: Some(lock(&self.growth)),
            releases: !capturing,
        }
    }

    /// A fit in a sibling lane, before the own list's cached blocks are coalesced
    /// (flushing them at every miss cost more misses: H100 A/B, BENCHMARKS History).
    fn take_before_lock(&self, own: &List<FreeList>, fit: &mut Fit) -> Option<usize> {
        lanes::take_fit(&self.lists, own, fit.size, fit.align)
    }

    /// The own list flushed, host streams' lists, then the other lanes' memory.
    fn take_without_wait(
        &self,
        growth: &mut GrowthState<H::Memory>,
        own: &List<FreeList>,
        fit: &mut Fit,
    ) -> Result<Option<usize>, Error> {
        if H::asleep_bytes(&growth.memory).is_some() {
            return Err(Error::Asleep);
        }
        if self.cached() && fit.cached {
            // This thread's cached blocks of the stream coalesce with the list's before
            // it is searched (as the list's own cached blocks are by `take_listed`).
            self.cache().put_back_here(fit.key);
        }
        let found = self
            .take_listed(own, fit)
            .or_else(|| lanes::take_all(&self.lists, own, fit.size, fit.align, false));
        if found.is_some() || !self.cached() {
            return Ok(found);
        }
        // Then its cached blocks of other streams, before anything waits or grows (not
        // first: a thread on many streams, whose lists run dry in turn, would move them
        // at every miss).
        if self.put_back_this_threads_caches() {
            return Ok(self.take_listed(own, fit));
        }
        Ok(None)
    }

    /// Memory freed on other streams, once their work is waited for, before growing:
    /// when all free memory together could serve the request (blocks of this list and of
    /// others may be neighbours that only merge once in one list).
    fn take_after_wait(
        &self,
        _growth: &mut GrowthState<H::Memory>,
        own: &List<FreeList>,
        fit: &mut Fit,
    ) -> Result<Option<usize>, Error> {
        let own_free = own.state.lock().free_bytes();
        if own_free + self.free_elsewhere(own) < fit.size {
            return Ok(None);
        }
        fit.merged = self.merge_into(own)?;
        Ok(own.state.lock().free.take(fit.size, fit.align))
    }

    fn grow(
        &self,
        growth: &mut GrowthState<H::Memory>,
        stream: StreamRef<'_>,
        own: &List<FreeList>,
        fit: &mut Fit,
        may_wait: bool,
    ) -> Result<Option<usize>, Error> {
        let grown = self.grow_for(growth, stream, own, fit.size, fit.align, may_wait)?;
        if grown.is_some() || may_wait || !self.cached() {
            return Ok(grown);
        }
        // Under capture no stage after this one runs: other threads' cached blocks (which
        // their lanes' lists held before thread caches) come back here, without a wait.
        self.cache().reclaim();
        Ok(self
            .take_listed(own, fit)
            .or_else(|| lanes::take_all(&self.lists, own, fit.size, fit.align, false)))
    }

    /// Other streams' memory if it was not merged before growing; then free memory goes
    /// back to the upstream and the pool grows again (fewer, larger pieces).
    fn take_last(
        &self,
        growth: &mut GrowthState<H::Memory>,
        stream: StreamRef<'_>,
        own: &List<FreeList>,
        fit: &mut Fit,
    ) -> Result<Option<usize>, Error> {
        if self.cached() {
            // Other threads' cached blocks, back in their lists, for the merge.
            self.cache().reclaim();
            fit.merged = false;
        }
        if !fit.merged
            && self.merge_into(own)?
            && let Some(addr) = own.state.lock().free.take(fit.size, fit.align)
        {
            return Ok(Some(addr));
        }
        if self.release_down_to(growth, own, 0)? == 0 {
            return Ok(None);
        }
        if let Some(addr) = own.state.lock().free.take(fit.size, fit.align) {
            return Ok(Some(addr));
        }
        self.grow_for(growth, stream, own, fit.size, fit.align, true)
    }

    fn out_of_memory(&self, growth: GrowthGuard<'_, U, H>, requested: usize) -> Error {
        Error::OutOfMemory {
            requested,
            limit: growth.maximum(self.maximum),
        }
    }
}

impl<U: Resource, H: Holding<U>> Drop for Coalescing<U, H> {
    fn drop(&mut self) {
        // First: no thread's exit touches the lists once the pool has left the registry.
        self.owner.retire();
        self.held.wait_all();
        let growth = std::mem::take(&mut *lock(&self.growth));
        H::drop_memory(self, growth.memory);
    }
}

impl<U: Resource, H: Holding<U>> PartialEq for Coalescing<U, H> {
    fn eq(&self, other: &Self) -> bool {
        ptr::eq(self, other)
    }
}

sync_on_the_host_stream!(Coalescing<U, H>, U: Resource, H: Holding<U>);

// SAFETY: blocks are disjoint pieces of the memory held from the upstream (chunks, or mapped
// granules of a reservation; free blocks are tracked
// exactly once, in one list), aligned as asked, and carry the upstream's properties; a
// block freed on stream S is handed to another stream only after S's work is complete
// (host streams) or waited for (`merge_into`): memory freed on a stream is reused on that
// stream at once, and on another only after the first's work was waited for. Only the
// pool itself is equal to it.
unsafe impl<U: Resource, H: Holding<U>> Resource for Coalescing<U, H> {
    #[inline]
    fn allocate(&self, stream: StreamRef<'_>, layout: Layout) -> Result<NonNull<u8>, Error> {
        let result = self.allocate_untraced(stream, layout);
        #[cfg(feature = "trace-allocations")]
        tracing::trace!(
            target: "memres::pool",
            size = layout.size(),
            stream = ?stream,
            result = ?result,
            "memres: pool allocate"
        );
        result
    }

    #[inline]
    unsafe fn deallocate(&self, stream: StreamRef<'_>, ptr: NonNull<u8>, layout: Layout) {
        #[cfg(feature = "trace-allocations")]
        tracing::trace!(
            target: "memres::pool",
            size = layout.size(),
            stream = ?stream,
            address = ptr.as_ptr() as usize,
            "memres: pool free"
        );
        if layout.size() == 0 {
            return;
        }
        let (size, _) = block_size(layout);
        let addr = ptr.as_ptr().expose_provenance();
        let key = StreamKey::of_lane(stream);
        let units = size / GRANULE;
        let mut pushed = Pushed::Elsewhere;
        if self.cached() && units <= QUICK_UNITS {
            // SAFETY: the closure returns this pool's list for `key` (the cache pins while
            // it makes a magazine, the only time it calls it).
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
        let mut s = list.state.lock();
        if pushed == Pushed::Full {
            // Coalesced, as when the list's own cache is full: with the thread's cache in
            // front, the list's stays empty and the two hold no more than one did.
            s.insert(addr, size);
        } else {
            s.put(addr, size);
        }
        self.lists.note_free(list);
        if let Some(keep) = self.release_threshold
            && s.free_bytes() > keep
        {
            drop(s);
            self.release_above(stream, list, keep);
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

/// The public face both coalescing pools share, written once over their body (a field
/// `core: Coalescing<U, _>`): the methods on their memory, `Resource` and `SyncResource`
/// (the body's calls), identity equality and `Debug`. `$names` and `$new` write the
/// examples: the names they import, and the call that makes the pool, up to its
/// configuration's closing parenthesis.
macro_rules! coalescing_pool {
    ($ty:ident, $names:literal, $new:literal) => {
        impl<U: crate::resource::Resource> $ty<U> {
            /// The upstream resource.
            pub fn upstream(&self) -> &U {
                self.core.upstream()
            }

            /// Bounds what the pool holds from now on, under its configured maximum
            /// (`None`: only that maximum). Growth that would pass the bound is refused,
            /// after the pool has given back what it holds free, so a request past it is
            /// [`Error::OutOfMemory`](crate::Error::OutOfMemory); what it already holds
            /// above a lowered bound stays until freed and trimmed. PyTorch's
            /// `set_per_process_memory_fraction` under memres is this bound. Costs
            /// nothing on the allocation path: only growth reads it.
            ///
            /// ```
            #[doc = concat!("use memres::{", $names, ", SyncResource, layout};")]
            ///
            #[doc = concat!("let pool = ", $new, ")?;")]
            /// pool.set_limit(Some(4 << 20));
            /// assert_eq!(pool.limit(), Some(4 << 20));
            /// assert!(pool.allocate_sync(layout(8 << 20)?).is_err());
            /// # Ok::<(), memres::Error>(())
            /// ```
            pub fn set_limit(&self, bytes: Option<usize>) {
                self.core.set_limit(bytes);
            }

            #[doc = concat!("The bound set with [`", stringify!($ty), "::set_limit`], if any.")]
            pub fn limit(&self) -> Option<usize> {
                self.core.limit()
            }

            /// The blocks held for other streams (for the host tests).
            #[cfg(all(test, not(memres_loom)))]
            #[allow(dead_code)] // (not every pool's tests look)
            pub(crate) fn held(&self) -> &crate::suballoc::core::held::Deferred {
                self.core.held()
            }

            /// Bytes held from the upstream (mapped, for a pool that grows in place).
            pub fn pool_size(&self) -> usize {
                self.core.pool_size()
            }

            /// Starts [`PoolStats::peak_pool_size`](crate::suballoc::PoolStats::peak_pool_size)
            /// afresh from what the pool holds now.
            pub fn reset_peak_size(&self) {
                self.core.reset_peak_size();
            }

            /// The memory the pool holds from its upstream, as `(address, bytes)` in
            /// address order: its chunks, or for a pool that grows in place the mapped
            /// runs of its reservation (what PyTorch's memory snapshots call segments).
            ///
            /// ```
            #[doc = concat!("use memres::{", $names, "};")]
            ///
            #[doc = concat!("let pool = ", $new, ".initial_size(1 << 20))?;")]
            /// let segments = pool.segments();
            /// assert_eq!(segments.iter().map(|&(_, n)| n).sum::<usize>(), pool.stats().pool_size);
            /// # Ok::<(), memres::Error>(())
            /// ```
            pub fn segments(&self) -> Vec<(usize, usize)> {
                self.core.segments()
            }

            /// A snapshot of the pool's memory. It locks each stream's list in turn, so
            /// under concurrent use it is exact for each list but not one instant.
            pub fn stats(&self) -> crate::suballoc::PoolStats {
                self.core.stats()
            }

            /// Merges every stream's free list into one and coalesces it, first waiting
            /// for the work of the CUDA streams the pool has seen. Afterwards free memory
            /// is as few blocks as the chunks allow (one per chunk once everything is
            /// freed; one per run of mapped granules for a pool that grows in place).
            pub fn coalesce(&self) -> Result<(), crate::Error> {
                self.core.coalesce()
            }

            /// Gives free memory back to the upstream (after
            /// [`coalesce`](Self::coalesce) has merged the lists): every fully free
            /// granule for a pool that grows in place (live blocks stay where they are),
            /// else every entirely free chunk. Returns how many bytes went back.
            ///
            /// The lists of the pool's streams go too (issue 33, finding 4: 50,000
            /// streams used once held 515 MiB until the pool dropped): every list emptied
            /// by the merge is freed, on Linux 4.14 and later (`membarrier`), once no
            /// other thread can be using it (a grace period, `crate::sync::grace`: the
            /// call waits for the pool's calls under way on other threads to return); a
            /// stream used again gets a new list. Elsewhere, emptied lists give their
            /// heap memory back and keep their inline fields and copy of the chunk table.
            pub fn trim(&self) -> Result<usize, crate::Error> {
                self.core.trim()
            }
        }

        impl<U: crate::resource::Resource> PartialEq for $ty<U> {
            fn eq(&self, other: &Self) -> bool {
                std::ptr::eq(self, other)
            }
        }

        impl<U: crate::resource::Resource + std::fmt::Debug> std::fmt::Debug for $ty<U> {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_struct(stringify!($ty))
                    .field("upstream", self.upstream())
                    .field("config", &self.config())
                    .field("stats", &self.stats())
                    .finish()
            }
        }

        sync_on_the_host_stream!($ty);

        // SAFETY: the calls of the pool's body (`Coalescing`), which keeps the contract
        // (its impl says how); only the pool itself is equal to it.
        unsafe impl<U: crate::resource::Resource> crate::resource::Resource for $ty<U> {
            #[inline]
            fn allocate(
                &self,
                stream: crate::stream::StreamRef<'_>,
                layout: std::alloc::Layout,
            ) -> Result<std::ptr::NonNull<u8>, crate::Error> {
                self.core.allocate(stream, layout)
            }

            #[inline]
            unsafe fn deallocate(
                &self,
                stream: crate::stream::StreamRef<'_>,
                ptr: std::ptr::NonNull<u8>,
                layout: std::alloc::Layout,
            ) {
                // SAFETY: the caller's promise, for the body that handed the block out.
                unsafe { self.core.deallocate(stream, ptr, layout) }
            }

            unsafe fn deallocate_used_on(
                &self,
                stream: crate::stream::StreamRef<'_>,
                ptr: std::ptr::NonNull<u8>,
                layout: std::alloc::Layout,
                used_on: &[crate::stream::StreamRef<'_>],
            ) {
                // SAFETY: the caller's promise, for the body that handed the block out.
                unsafe { self.core.deallocate_used_on(stream, ptr, layout, used_on) }
            }
        }
    };
}

pub(super) use coalescing_pool;
