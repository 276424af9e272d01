//! [`Pool`]: a coalescing sub-allocator with per-stream free lists. What only the pool
//! that grows in place does (its constructor, growth by mapping granules, release by
//! unmapping them) is in [`in_place`].

use std::alloc::Layout;
use std::fmt;
use std::ptr::{self, NonNull};

use super::chunks::{Chunk, release_all, to_ptr};
use super::deferred::{self, Deferred};
use super::free_blocks::{FreeBlock, FreeBlocks, GRANULE};
use super::pool_config::{ChunkSizes, PoolConfig};
use super::shards::{Shard, ShardMap, StreamKey};
use super::stream_list::{PoolShard, block_size};
use crate::error::Error;
use crate::resource::{Resource, dangling};
use crate::stream::{Relaxed, StreamRef};
use crate::sync::atomic::{AtomicBool, Ordering, fence};
use crate::sync::lock;
use crate::sync::{Mutex, MutexGuard};
use crate::upstream::GrowInPlace;
use crate::upstream::virtual_memory::Granules;

mod in_place;
mod sleep;
use in_place::Space;
pub use sleep::SleepMode;

/// A CUDA stream that takes a small block from a host stream's list (where a pool's
/// initial memory is) takes this much, and keeps the rest in its own list.
const HOST_REFILL: usize = 2 << 20;

/// A snapshot of a pool's memory, from [`Pool::stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PoolStats {
    /// Bytes held from the upstream.
    pub pool_size: usize,
    /// The most bytes held at once since the pool was made or
    /// [`Pool::reset_peak_size`] (PyTorch's `max_memory_reserved`).
    pub peak_pool_size: usize,
    /// Bytes held but not handed out.
    pub free_bytes: usize,
    /// The largest free block of any one stream's list.
    pub largest_free_block: usize,
    /// Free blocks, over all lists.
    pub free_blocks: usize,
    /// Allocations held from the upstream (for a pool that grows in place: runs of
    /// mapped granules).
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
    /// While the pool sleeps ([`Pool::sleep`]): the bytes it gave back to the driver and
    /// maps again when woken (`pool_size` and the free figures are then 0). 0 while it is
    /// awake.
    pub asleep_bytes: usize,
    /// Host memory (pinned, for device memory) held for [`Pool::sleep`]: the offloaded
    /// contents while the pool sleeps, and after a wake the copies kept for the next
    /// sleep, until [`Pool::trim`].
    pub host_copy_bytes: usize,
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
struct GrowthState {
    chunks: Vec<Chunk>,
    size: usize,
    /// The highest `size` since the pool was made or [`Pool::reset_peak_size`].
    peak: usize,
    /// For a pool that grows in place: which granules of the reservation it holds
    /// (while it sleeps: which it maps again when woken).
    mapped: Granules,
    /// Set while the pool sleeps: what waking it maps and restores.
    slept: Option<sleep::Slept>,
    /// Host copies a wake kept for the next offloading sleep (freed by `trim`).
    kept: Vec<crate::upstream::HostCopy>,
    /// The bound set with [`Pool::set_limit`], below the configured maximum.
    limit: Option<usize>,
}

impl GrowthState {
    /// The most the pool may hold now: the smaller of `maximum` (the configured one) and
    /// the run-time limit.
    fn maximum(&self, maximum: Option<usize>) -> Option<usize> {
        match (maximum, self.limit) {
            (Some(m), Some(l)) => Some(m.min(l)),
            (m, l) => m.or(l),
        }
    }
}

/// The growth lock of a [`Pool`], held: on unlock it runs a release that a free left
/// pending while the lock was held (see `Pool::release_if_pending`).
struct GrowthGuard<'a, U: Resource> {
    pool: &'a Pool<U>,
    guard: Option<MutexGuard<'a, GrowthState>>,
}

impl<U: Resource> std::ops::Deref for GrowthGuard<'_, U> {
    type Target = GrowthState;

    fn deref(&self) -> &GrowthState {
        self.guard.as_ref().expect("held until dropped")
    }
}

impl<U: Resource> std::ops::DerefMut for GrowthGuard<'_, U> {
    fn deref_mut(&mut self) -> &mut GrowthState {
        self.guard.as_mut().expect("held until dropped")
    }
}

impl<U: Resource> Drop for GrowthGuard<'_, U> {
    fn drop(&mut self) {
        drop(self.guard.take());
        self.pool.release_if_pending();
    }
}

/// A coalescing sub-allocator over any upstream (RMM's `pool_memory_resource`): it takes
/// memory from the upstream and hands out pieces of it.
///
/// # Which upstream for which goal
/// - **Least memory held** (GPU training, anything near the memory limit): a pool that
///   grows in place over [`CudaVirtual`](crate::CudaVirtual) (`CudaVirtual::new()?.pool_in_place(config)`,
///   or [`Pool::in_place`]). It maps exactly the granules a request lacks, right after its
///   free memory, so its memory is one range where every free block can merge with its
///   neighbours, and [`trim`](Pool::trim) gives back every fully free granule. Requests
///   below 512 KiB go to the lowest 16 MiB address region that has a fit, so small
///   blocks pack together and free memory gathers into whole granules (it costs some
///   speed: see `BENCHMARKS.md`). This is the default of the C ABI and the Python
///   shims. [`HostVirtual`](crate::HostVirtual) is the same over host pages.
/// - **Any other upstream** (`Cuda`, `PinnedHost`, `HostHeap`, an adaptor stack):
///   [`Pool::new`]. It takes allocations ("chunks") sized by its
///   [`Growth`](super::Growth) rule: by default what the request needs, at least an
///   eighth of the pool, rounded up to 2 MiB ([`Growth::Eighth`](super::Growth::Eighth):
///   GPT-2 training held 1.13x of its live peak), or RMM's doubling
///   ([`Growth::Rmm`](super::Growth::Rmm): up to 2x, 1.67x there; fewest upstream
///   calls). When the upstream refuses a chunk, the pool asks for less (down to
///   the request itself), then gives its entirely free chunks back and asks again.
///   Blocks of two chunks never merge, so some memory stays stranded between chunks; an
///   `initial_size` that covers the peak avoids that.
///
/// # How it works
/// - **Finding a block** is O(1): free blocks sit in size classes with bitmaps (a
///   two-level segregated fit) and are coalesced with free neighbours on free, in O(1)
///   through maps by address. Small blocks (up to 64 KiB) are first cached per stream and
///   handed out again whole, coalesced when a request finds no fit.
/// - **Streams.** Every stream has its own free list behind its own lock, found without
///   a lock, so threads on different streams never wait for each other. Threads that
///   share one stream use up to 16 lists of it ("lanes", by thread), so that they do not
///   queue for one lock either; a thread whose lane has no fit takes from the stream's
///   other lanes (no wait: one stream's work is ordered whoever enqueued it) before
///   anything below, a fitting block first without taking the pool's growth lock. Memory
///   freed on stream S is reused on S at once. Blocks freed on a host stream (and through the
///   synchronous API) are free for every stream. A stream that cannot be served (1)
///   takes a fitting block from those host lists, else (2) when the other streams' lists
///   hold at least the request in all, merges every list into its own and coalesces it,
///   having first waited for the work of the CUDA streams the blocks came from (one
///   `cuCtxSynchronize` per device: it covers their last uses, also on streams destroyed
///   since and on exited threads' per-thread streams), else (3) grows the pool, else (4)
///   returns free memory to the upstream and grows again. So a pool never grows while
///   its free memory together could serve the request. No event is recorded on the free
///   path. The per-thread default stream has one list per thread; a new thread takes over
///   the list of one that has exited (after waiting for that thread's device work), so
///   threads that come and go neither grow the pool nor its lists. Finding a stream's
///   list is O(1) however many streams a program uses (a table that doubles); the slow
///   path looks at other lists only where memory was freed.
/// - **Alignment**: any power of two (above 256, a fitting block is searched with room
///   for the padding).
/// - [`trim`](Pool::trim) gives free memory back; a
///   [`release_threshold`](PoolConfig::release_threshold) does so after frees;
///   [`stats`](Pool::stats) reports size, free and live bytes, the largest free block and
///   fragmentation.
/// - **Drop** waits for the streams the pool has seen, then returns all its memory, also
///   that under blocks still handed out (as RMM does); the upstream's own drop logic
///   skips driver calls once the process is exiting.
///
/// Equality is identity: a pool equals only itself.
///
/// ```
/// use memres::suballoc::{Pool, PoolConfig};
/// use memres::{HostHeap, Resource, StreamRef, layout};
///
/// let pool = Pool::new(HostHeap::new(), PoolConfig::new().initial_size(1 << 20))?;
/// let l = layout(1000)?;
/// let p = pool.allocate(StreamRef::host(1), l)?;
/// // SAFETY: allocated just above with `l` on the same stream; not used afterwards.
/// unsafe { pool.deallocate(StreamRef::host(1), p, l) };
/// assert_eq!(pool.stats().free_bytes, 1 << 20);
/// # Ok::<(), memres::Error>(())
/// ```
pub struct Pool<U: Resource> {
    upstream: U,
    config: PoolConfig,
    growth: Mutex<GrowthState>,
    shards: ShardMap<PoolShard>,
    /// Set when the pool grows in place.
    space: Option<Space<U>>,
    /// A free crossed the release threshold while another thread held the growth lock:
    /// whoever unlocks it next releases (see [`GrowthGuard`]).
    release_pending: AtomicBool,
    /// Set while the pool sleeps (read first by every allocation; written under the
    /// growth lock, with [`GrowthState::slept`]).
    asleep: AtomicBool,
    /// Blocks freed with [`Resource::deallocate_used_on`] whose other streams' work is
    /// not known to be complete yet.
    held: Deferred,
    /// The key of the host stream's list made with the pool (in the lane of the thread
    /// that made it), which paths holding the growth lock use.
    host_key: StreamKey,
}

impl<U: Resource> Pool<U> {
    /// A pool over `upstream`, taking `config.initial()` bytes from it at once. It grows
    /// by upstream allocations of its own ("chunks"), sized by `config`'s
    /// [`Growth`](super::Growth) rule; over a [`GrowInPlace`] upstream, [`Pool::in_place`]
    /// holds less.
    pub fn new(upstream: U, config: PoolConfig) -> Result<Pool<U>, Error> {
        config.validate()?;
        let pool = Pool {
            upstream,
            config,
            growth: Mutex::new(GrowthState::default()),
            shards: ShardMap::default(),
            space: None,
            release_pending: AtomicBool::new(false),
            asleep: AtomicBool::new(false),
            held: Deferred::default(),
            host_key: StreamKey::of_lane(StreamRef::HOST),
        };
        // The host stream's list exists from the start, so that paths holding the growth
        // lock can look it up without making it (which takes that lock).
        let host = pool.new_shard(pool.host_key);
        if config.initial > 0 {
            let layout = Layout::from_size_align(config.initial, GRANULE)
                .map_err(|_| Error::invalid_argument("the pool's initial size is too large"))?;
            let ptr = pool.upstream.allocate_sync(layout)?;
            pool.add_chunk(&mut pool.lock_growth(), ptr, layout, host);
        }
        Ok(pool)
    }

    /// The upstream resource.
    pub fn upstream(&self) -> &U {
        &self.upstream
    }

    /// The configuration the pool was made with.
    pub fn config(&self) -> PoolConfig {
        self.config
    }

    /// Bounds what the pool holds from now on, under its configured maximum (`None`:
    /// only that maximum). Growth that would pass the bound is refused, after the pool
    /// has given back what it holds free, so a request past it is
    /// [`Error::OutOfMemory`]; what it already holds above a lowered bound stays until
    /// freed and trimmed. PyTorch's `set_per_process_memory_fraction` under memres is
    /// this bound. Costs nothing on the allocation path: only growth reads it.
    ///
    /// ```
    /// use memres::{HostHeap, Pool, PoolConfig, SyncResource, layout};
    ///
    /// let pool = Pool::new(HostHeap::new(), PoolConfig::new())?;
    /// pool.set_limit(Some(4 << 20));
    /// assert_eq!(pool.limit(), Some(4 << 20));
    /// assert!(pool.allocate_sync(layout(8 << 20)?).is_err());
    /// # Ok::<(), memres::Error>(())
    /// ```
    pub fn set_limit(&self, bytes: Option<usize>) {
        self.lock_growth().limit = bytes;
    }

    /// The bound set with [`Pool::set_limit`], if any.
    pub fn limit(&self) -> Option<usize> {
        self.lock_growth().limit
    }

    /// The blocks held for other streams (for the host tests and loom models).
    #[cfg(any(test, memres_loom))]
    pub(crate) fn held(&self) -> &Deferred {
        &self.held
    }

    /// Whether the pool grows in place ([`Pool::in_place`]).
    pub fn grows_in_place(&self) -> bool {
        self.space.is_some()
    }

    /// Bytes held from the upstream (mapped, for a pool that grows in place).
    pub fn pool_size(&self) -> usize {
        let _pin = self.shards.pin(); // (see `ShardMap::retire`)
        self.lock_growth().size
    }

    /// Starts [`PoolStats::peak_pool_size`] afresh from what the pool holds now.
    pub fn reset_peak_size(&self) {
        let _pin = self.shards.pin(); // (see `ShardMap::retire`)
        let mut growth = self.lock_growth();
        growth.peak = growth.size;
    }

    /// The memory the pool holds from its upstream, as `(address, bytes)` in address
    /// order: its chunks, or for a pool that grows in place the mapped runs of its
    /// reservation (what PyTorch's memory snapshots call segments).
    ///
    /// ```
    /// use memres::{HostHeap, Pool, PoolConfig};
    ///
    /// let pool = Pool::new(HostHeap, PoolConfig::new().initial_size(1 << 20))?;
    /// let segments = pool.segments();
    /// assert_eq!(segments.iter().map(|&(_, n)| n).sum::<usize>(), pool.stats().pool_size);
    /// # Ok::<(), memres::Error>(())
    /// ```
    pub fn segments(&self) -> Vec<(usize, usize)> {
        let _pin = self.shards.pin(); // (see `ShardMap::retire`)
        let growth = self.lock_growth();
        if growth.slept.is_some() {
            return Vec::new(); // nothing is mapped while the pool sleeps
        }
        let mut out: Vec<(usize, usize)> = match &self.space {
            Some(space) => growth
                .mapped
                .mapped_runs()
                .into_iter()
                .map(|(first, n)| {
                    (
                        space.base + first * space.granularity,
                        n * space.granularity,
                    )
                })
                .collect(),
            None => growth
                .chunks
                .iter()
                .map(|c| (c.addr, c.layout.size()))
                .collect(),
        };
        out.sort_unstable();
        out
    }

    /// A snapshot of the pool's memory. It locks each stream's list in turn, so under
    /// concurrent use it is exact for each list but not one instant.
    pub fn stats(&self) -> PoolStats {
        let _pin = self.shards.pin(); // (see `ShardMap::retire`)
        let growth = self.lock_growth();
        if let Some(slept) = &growth.slept {
            return PoolStats {
                peak_pool_size: growth.peak,
                stream_lists: self.shards.len(),
                waiting_bytes: self.held.bytes(),
                stream_merges: self.shards.merges(),
                asleep_bytes: slept.size(),
                host_copy_bytes: slept.copy_bytes() + sleep::bytes(&growth.kept),
                ..PoolStats::default()
            };
        }
        let mut stats = PoolStats {
            pool_size: growth.size,
            peak_pool_size: growth.peak,
            upstream_allocations: if self.space.is_some() {
                growth.mapped.mapped_runs().len()
            } else {
                growth.chunks.len()
            },
            stream_lists: self.shards.len(),
            waiting_bytes: self.held.bytes(),
            stream_merges: self.shards.merges(),
            host_copy_bytes: sleep::bytes(&growth.kept),
            ..PoolStats::default()
        };
        for shard in self.shards.all() {
            let s = shard.state.lock();
            stats.free_bytes += s.free_bytes();
            let (quick_blocks, quick_largest) = s.quick_blocks();
            stats.free_blocks += s.free.len() + quick_blocks + s.large.len();
            let large_largest = s.large.iter().map(|&(_, n)| n).max().unwrap_or(0);
            stats.largest_free_block = stats
                .largest_free_block
                .max(s.free.largest())
                .max(quick_largest)
                .max(large_largest);
        }
        stats
    }

    /// Merges every stream's free list into one and coalesces it, first waiting for the
    /// work of the CUDA streams the pool has seen. Afterwards free memory is as few
    /// blocks as the chunks allow (one per chunk once everything is freed; one per run of
    /// mapped granules for a pool that grows in place).
    pub fn coalesce(&self) -> Result<(), Error> {
        let _pin = self.shards.pin(); // (see `ShardMap::retire`)
        let host = self.host_list();
        let _growth = self.lock_growth();
        self.merge_into(host).map(drop)
    }

    /// Gives free memory back to the upstream (after [`coalesce`](Self::coalesce) has
    /// merged the lists): every fully free granule for a pool that grows in place (live
    /// blocks stay where they are), else every entirely free chunk. Returns how many
    /// bytes went back.
    ///
    /// The lists of the pool's streams go too (issue 33, finding 4: 50,000 streams used
    /// once held 515 MiB until the pool dropped): every list emptied by the merge is
    /// freed, on Linux 4.14 and later (`membarrier`), once no other thread can be using it
    /// (a grace period, `crate::sync::grace`: the call waits for the pool's calls under
    /// way on other threads to return); a stream used again gets a new list. Elsewhere,
    /// emptied lists give their heap memory back and keep their inline fields and copy of
    /// the chunk table.
    pub fn trim(&self) -> Result<usize, Error> {
        let released = {
            let _pin = self.shards.pin(); // (see `ShardMap::retire`)
            if self.held.any() {
                // Blocks held for other streams (one freed under a capture needs this wait).
                deferred::free_all(self, &self.held, || self.shards.synchronize_streams())?;
            }
            let host = self.host_list();
            let (released, kept) = {
                let mut growth = self.lock_growth();
                let released = self.release_down_to(&mut growth, host, 0)?;
                (released, std::mem::take(&mut growth.kept))
            };
            // The host copies kept for a sleep (unpinned outside the lock: it takes time).
            drop(kept);
            // Every other list was merged into the host list: what their streams' lists
            // cost on the heap goes too (where they cannot be freed below, a stream used
            // once and never again then costs its inline fields only).
            for shard in self.shards.all() {
                shard.state.lock().release_memory();
            }
            released
        };
        self.retire_empty_lists();
        Ok(released)
    }

    /// Frees every stream's list that holds no free memory, but the host list the pool
    /// was made with (see [`trim`](Self::trim)); returns how many went. The caller is
    /// not pinned and holds no lock.
    fn retire_empty_lists(&self) -> usize {
        // SAFETY: every use of this pool's shards is inside a pin (its entry points pin
        // before they look one up, and hold no shard between calls); this thread is not
        // pinned and holds no lock; `home` pins while it looks up and fills the stream's
        // new list (the retirement's late items go there). Late items move under the
        // growth lock, which every search of other lists holds (the slow path, merges,
        // releases), pinned (the guard's unlock may run a pending release).
        unsafe {
            self.shards.retire(
                |shard| shard.key != self.host_key && shard.state.lock().free_bytes() == 0,
                |s| s.free_bytes() == 0,
                |old| {
                    let _pin = self.shards.pin();
                    match self.shards.find(old.key) {
                        Some(shard) => shard,
                        None => self.new_shard_like(old),
                    }
                },
                PoolShard::drain,
                PoolShard::absorb,
                |_| {},
                || (self.lock_growth(), self.shards.pin()),
            )
        }
    }

    /// Merges every list into `into`'s and releases free memory until at most `keep`
    /// bytes are free (or nothing more can go).
    fn release_down_to(
        &self,
        growth: &mut GrowthState,
        into: &Shard<PoolShard>,
        keep: usize,
    ) -> Result<usize, Error> {
        if growth.slept.is_some() {
            return Ok(0); // nothing is mapped while the pool sleeps
        }
        self.merge_into(into)?;
        let released = match &self.space {
            Some(space) => self.unmap_free_granules(space, growth, into, keep),
            None => self.release_free_chunks(growth, into),
        };
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
    fn release_above(&self, stream: StreamRef<'_>, shard: &Shard<PoolShard>, keep: usize) {
        // A release waits for streams, which a capture forbids: under capture it is left
        // to the next free that crosses the threshold outside one.
        if let Some(ctx) = shard.ctx
            && !matches!(stream.is_capturing_in(ctx), Ok(false))
        {
            return;
        }
        match self.try_lock_growth() {
            Some(mut growth) => self.release_into(&mut growth, shard, keep),
            None => self.release_pending.store(true, Ordering::SeqCst),
        }
        self.release_if_pending();
    }

    /// The growth lock if no other thread holds it (the raw guard: its unlock runs no
    /// pending release, so the callers look for one afterwards).
    fn try_lock_growth(&self) -> Option<MutexGuard<'_, GrowthState>> {
        match self.growth.try_lock() {
            Ok(g) => Some(g),
            Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    fn release_into(&self, growth: &mut GrowthState, shard: &Shard<PoolShard>, keep: usize) {
        if let Err(e) = self.release_down_to(growth, shard, keep) {
            tracing::warn!("a pool could not give memory back at its release threshold: {e}");
        }
    }

    /// Runs a release that a free left pending, unless the growth lock is taken again (its
    /// holder then runs it on unlock). Every unlock of the growth lock calls this, so a
    /// pending release is never left behind: the flag is set before the freer's last try
    /// of the lock, and read after every holder's unlock.
    fn release_if_pending(&self) {
        let Some(keep) = self.config.release_threshold else {
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
    fn lock_growth(&self) -> GrowthGuard<'_, U> {
        GrowthGuard {
            pool: self,
            guard: Some(lock(&self.growth)),
        }
    }

    /// The host stream's list made with the pool: paths that hold the growth lock find
    /// it without taking that lock again. (Not the calling thread's lane of the host
    /// stream, [`Pool::shard`]`(StreamRef::HOST)`: on another thread than the one that
    /// made the pool that list may not exist yet, and making it takes the growth lock,
    /// which the thread holds.)
    fn host_list(&self) -> &Shard<PoolShard> {
        self.shards
            .get(self.host_key)
            .expect("the host list is made with the pool")
    }

    /// The shard of `stream`, made on first use.
    #[inline(always)]
    fn shard(&self, stream: StreamRef<'_>) -> &Shard<PoolShard> {
        let key = StreamKey::of_lane(stream);
        if let Some(shard) = self.shards.get(key) {
            return shard;
        }
        self.new_shard(key)
    }

    #[cold]
    fn new_shard(&self, key: StreamKey) -> &Shard<PoolShard> {
        // Under the growth lock, so no chunk comes or goes while its start is copied. (The
        // raw lock: its unlock runs no pending release, which waits for streams and may
        // come here under stream capture; the next unlock elsewhere runs it.)
        let growth = lock(&self.growth);
        self.shards
            .get_or_insert_with(key, || self.new_list(&growth))
    }

    /// A new list of a retired list's stream, with its context and owner (for the items
    /// freed into the retired one while it went: see [`trim`](Self::trim)).
    #[cold]
    fn new_shard_like(&self, old: &Shard<PoolShard>) -> &Shard<PoolShard> {
        let growth = lock(&self.growth);
        self.shards
            .get_or_insert_like(old, || self.new_list(&growth))
    }

    /// An empty stream list that knows the pool's chunks (the caller holds the growth
    /// lock).
    fn new_list(&self, growth: &GrowthState) -> PoolShard {
        let shard = PoolShard::new(
            growth.chunks.iter().map(|c| (c.addr, c.layout.size())),
            self.space.as_ref().map(|s| s.base),
        );
        // Not for a pool that grows in place: a cached block is handed out again where it
        // was, not low, which costs footprint (host, `random` seed 42: 1.128 of live
        // against 1.114).
        if self.space.is_none() {
            shard.with_large_cache()
        } else {
            shard
        }
    }

    /// Free bytes in the lists of streams other than `own`.
    fn free_elsewhere(&self, own: &Shard<PoolShard>) -> usize {
        self.shards
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
        let _pin = self.shards.pin(); // (see `ShardMap::retire`)
        if layout.size() == 0 {
            return Ok(dangling(layout));
        }
        if self.asleep.load(Ordering::Relaxed) {
            return Err(Error::Asleep);
        }
        let (size, align) = block_size(layout);
        let shard = self.shard(stream);
        if let Some(addr) = shard.state.lock().take(size, align) {
            return Ok(to_ptr(addr));
        }
        self.allocate_missed(stream, shard, size, align, layout.size())
            .map(to_ptr)
    }

    /// The slow path, with a retry after waiting for blocks held for other streams. A
    /// call of its own, so the fast path above saves few registers.
    #[inline(never)]
    fn allocate_missed(
        &self,
        stream: StreamRef<'_>,
        shard: &Shard<PoolShard>,
        size: usize,
        align: usize,
        requested: usize,
    ) -> Result<usize, Error> {
        deferred::retry_after_waiting(self, &self.held, stream, shard.ctx, || {
            self.allocate_slow(stream, shard, size, align, requested)
        })
    }

    /// The slow path: the stream's own list has no fit.
    // long: the slow path's fallbacks in the order tried, top to bottom.
    #[cold]
    fn allocate_slow(
        &self,
        stream: StreamRef<'_>,
        own: &Shard<PoolShard>,
        size: usize,
        align: usize,
        requested: usize,
    ) -> Result<usize, Error> {
        deferred::free_ready(self, &self.held, stream);
        // A fit in a sibling lane, before the own list's cached blocks are coalesced
        // (flushing them at every miss cost more misses: H100 A/B, BENCHMARKS History).
        if let Some(addr) = self.take_lane_fit(own, size, align) {
            return Ok(addr);
        }
        if let Some(ctx) = own.ctx
            && stream.is_capturing_in(ctx)?
        {
            return self.allocate_captured(own, size, align, requested);
        }
        let mut growth = self.lock_growth();
        if growth.slept.is_some() {
            return Err(Error::Asleep);
        }
        if let Some(addr) = self
            .take_listed(own, size, align)
            .or_else(|| self.take_from_lanes(own, size, align))
        {
            return Ok(addr);
        }
        // Memory freed on other streams, once their work is waited for, before growing:
        // when all free memory together could serve the request (blocks of this list
        // and of others may be neighbours that only merge once in one list).
        let mut merged = false;
        let own_free = own.state.lock().free_bytes();
        if own_free + self.free_elsewhere(own) >= size {
            merged = self.merge_into(own)?;
            if let Some(addr) = own.state.lock().free.take(size, align) {
                return Ok(addr);
            }
        }
        if let Some(addr) = self.grow(&mut growth, stream, own, size, align, true)? {
            return Ok(addr);
        }
        if !merged
            && self.merge_into(own)?
            && let Some(addr) = own.state.lock().free.take(size, align)
        {
            return Ok(addr);
        }
        if self.release_down_to(&mut growth, own, 0)? > 0 {
            if let Some(addr) = own.state.lock().free.take(size, align) {
                return Ok(addr);
            }
            if let Some(addr) = self.grow(&mut growth, stream, own, size, align, true)? {
                return Ok(addr);
            }
        }
        Err(Error::OutOfMemory {
            requested,
            limit: growth.maximum(self.config.maximum),
        })
    }

    /// A block from `own`'s list (flushed) or from a host stream's list, whose blocks are
    /// free for all: the list that last received memory first, then the others, from
    /// where the last such search found one ([`ShardMap::search`]). The caller holds the
    /// growth lock.
    fn take_listed(&self, own: &Shard<PoolShard>, size: usize, align: usize) -> Option<usize> {
        let found = {
            let mut s = own.state.lock();
            s.flush();
            s.free.take(size, align)
        };
        let from_host_list = |other: &Shard<PoolShard>| {
            if ptr::eq(other, own)
                || !other.key.is_host()
                || !other.holds_free.load(Ordering::Relaxed)
            {
                return None;
            }
            let mut s = other.state.lock();
            // A CUDA stream's list takes a larger piece when there is one and keeps the
            // rest, so that its next misses do not come back here (threads on one
            // stream then queue less for the growth lock).
            let grab = (!own.key.is_host() && align == GRANULE && size < HOST_REFILL)
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
                self.shards.note_free(own);
            }
            found
        };
        found
            .or_else(|| self.shards.recent().and_then(from_host_list))
            .or_else(|| self.shards.search(usize::MAX, from_host_list))
    }

    /// A block that fits from another lane of `own`'s stream, as that lane's list has it
    /// (its caches not flushed), without the growth lock: no wait is needed (one stream),
    /// and threads sharing a stream whose lanes trade blocks do not queue for the growth
    /// lock (16 threads on one stream on the H100 spent most of their time there).
    fn take_lane_fit(&self, own: &Shard<PoolShard>, size: usize, align: usize) -> Option<usize> {
        self.shards
            .other_lanes(own)
            .filter(|lane| lane.holds_free.load(Ordering::Relaxed))
            .find_map(|lane| lane.state.lock().take(size, align))
    }

    /// Free memory of the other lanes of `own`'s stream (threads that share the stream;
    /// see [`StreamKey::of_lane`]), which needs no wait: one stream's work is ordered
    /// whichever thread enqueued it. A fitting block from one lane, else all their free
    /// memory moved into `own`'s list, where neighbours coalesce. The caller holds the
    /// growth lock.
    fn take_from_lanes(&self, own: &Shard<PoolShard>, size: usize, align: usize) -> Option<usize> {
        let lanes: Vec<_> = self
            .shards
            .other_lanes(own)
            .filter(|s| s.holds_free.load(Ordering::Relaxed))
            .collect();
        for lane in &lanes {
            let mut s = lane.state.lock();
            let found = s.take(size, align).or_else(|| {
                s.flush();
                s.free.take(size, align)
            });
            if found.is_some() {
                return found;
            }
        }
        let mut moved = Vec::new();
        for lane in &lanes {
            let mut s = lane.state.lock();
            moved.extend(s.drain());
            lane.holds_free.store(false, Ordering::Relaxed);
        }
        if moved.is_empty() {
            return None;
        }
        // Highest first, as in `merge_into`, so the lowest blocks head their classes.
        moved.sort_unstable_by_key(|b| std::cmp::Reverse(b.addr));
        let found = {
            let mut s = own.state.lock();
            s.flush();
            for b in moved {
                s.free.insert(b);
            }
            s.free.take(size, align)
        };
        self.shards.note_free(own);
        found
    }

    /// The slow path on a stream under capture, which must not wait: memory of the lists
    /// that need no wait, else growth (in the relaxed capture mode, so that the driver
    /// allows the upstream's calls), else out of memory. Memory freed on other CUDA
    /// streams is not taken (that needs a wait), and no release runs here (the raw growth
    /// lock: a pending release waits for the next unlock outside a capture).
    #[cold]
    #[inline(never)]
    fn allocate_captured(
        &self,
        own: &Shard<PoolShard>,
        size: usize,
        align: usize,
        requested: usize,
    ) -> Result<usize, Error> {
        let mut growth = lock(&self.growth);
        if growth.slept.is_some() {
            return Err(Error::Asleep);
        }
        if let Some(addr) = self
            .take_listed(own, size, align)
            .or_else(|| self.take_from_lanes(own, size, align))
        {
            return Ok(addr);
        }
        let _relaxed = Relaxed::new()?;
        // Grown "on the host stream": memory usable at once, whatever the upstream. (On the
        // captured stream a stream-ordered upstream would make its allocation a node of
        // the graph, memory that exists only while the graph runs.)
        match self.grow(&mut growth, StreamRef::HOST, own, size, align, false)? {
            Some(addr) => Ok(addr),
            None => Err(Error::OutOfMemory {
                requested,
                limit: growth.maximum(self.config.maximum),
            }),
        }
    }

    /// Grows the pool for a block of `size` aligned to `align` and takes the block from
    /// the new memory in the same critical section (no other thread can take it first);
    /// `Ok(None)` when neither the maximum nor the upstream allows it.
    fn grow(
        &self,
        growth: &mut GrowthState,
        stream: StreamRef<'_>,
        own: &Shard<PoolShard>,
        size: usize,
        align: usize,
        may_wait: bool,
    ) -> Result<Option<usize>, Error> {
        let Some(min) = size.checked_add(align - GRANULE) else {
            return Ok(None);
        };
        if let Some(space) = &self.space {
            return self.grow_in_place(space, growth, own, size, align, may_wait);
        }
        let config = PoolConfig {
            maximum: growth.maximum(self.config.maximum),
            ..self.config
        };
        let Some(sizes) = ChunkSizes::new(&config, min, growth.size) else {
            return Ok(None);
        };
        let mut attempt = sizes.first(growth.size);
        loop {
            let Ok(layout) = Layout::from_size_align(attempt, GRANULE) else {
                return Ok(None);
            };
            match self.upstream.allocate(stream, layout) {
                Ok(ptr) => {
                    let mut s = self.add_chunk(growth, ptr, layout, own);
                    let addr = s.free.take(size, align);
                    debug_assert!(addr.is_some(), "a new chunk fits its request");
                    return Ok(addr);
                }
                // Less, when the upstream refuses (see `ChunkSizes::after_refusal`).
                Err(Error::OutOfMemory { .. }) if attempt > sizes.min() => {
                    attempt = sizes.after_refusal(attempt);
                }
                Err(Error::OutOfMemory { .. }) => return Ok(None),
                Err(e) => return Err(e),
            }
        }
    }

    /// Records a new chunk and puts it, free, in `into`'s list, which it returns locked
    /// (so the grower takes its block before any other thread sees the chunk).
    fn add_chunk<'a>(
        &self,
        growth: &mut GrowthState,
        ptr: NonNull<u8>,
        layout: Layout,
        into: &'a Shard<PoolShard>,
    ) -> crate::sync::spin::SpinGuard<'a, PoolShard> {
        let chunk = Chunk::new(ptr, layout);
        let addr = chunk.addr;
        // Every list learns the chunk's start before any block of it can reach one.
        for shard in self.shards.iter() {
            shard.state.lock().chunks.insert(addr, layout.size());
        }
        growth.chunks.push(chunk);
        growth.size += layout.size();
        growth.peak = growth.peak.max(growth.size);
        tracing::debug!(
            target: "memres::pool",
            addr,
            len = layout.size(),
            held = growth.size,
            "memres: pool grew by a chunk"
        );
        let mut s = into.state.lock();
        s.free.insert(FreeBlock {
            addr,
            size: layout.size(),
            starts_chunk: true,
        });
        self.shards.note_free(into);
        s
    }

    /// Moves every other list's free blocks into `into`'s, coalescing them, after waiting
    /// for the CUDA streams they were freed on. Returns whether anything moved.
    fn merge_into(&self, into: &Shard<PoolShard>) -> Result<bool, Error> {
        into.state.lock().flush();
        let moved = self
            .shards
            .merge_into(into, PoolShard::drain, PoolShard::absorb)?;
        if moved {
            tracing::debug!(
                target: "memres::pool",
                into = ?into.key,
                "memres: pool merged other streams' lists into one (after waiting for their streams)"
            );
        }
        Ok(moved)
    }

    /// Returns to the upstream every chunk that is one free block in `from`'s list.
    fn release_free_chunks(&self, growth: &mut GrowthState, from: &Shard<PoolShard>) -> usize {
        let whole = |s: &PoolShard, c: &Chunk| {
            s.free
                .starting_at(c.addr)
                .is_some_and(|b| b.size == c.layout.size())
        };
        let released: Vec<Chunk> = {
            let mut s = from.state.lock();
            s.flush();
            if !growth.chunks.iter().any(|c| whole(&s, c)) {
                return 0;
            }
            // Blocks freed on `from`'s own stream may still be in use by its work (the
            // list stays locked, so nothing freed after the wait joins them).
            if let Some(ctx) = from.ctx
                && let Err(e) = ctx.synchronize()
            {
                drop(s);
                tracing::warn!("a pool could not wait for a stream to return memory: {e}");
                return 0;
            }
            growth
                .chunks
                .extract_if(.., |c| {
                    let whole = whole(&s, c);
                    if whole {
                        s.free.remove_starting_at(c.addr);
                    }
                    whole
                })
                .collect()
        };
        for shard in self.shards.iter() {
            let mut s = shard.state.lock();
            for c in &released {
                s.chunks.remove(&c.addr);
            }
        }
        let bytes = released.iter().map(|c| c.layout.size()).sum();
        for chunk in released {
            // SAFETY: the chunk came from `upstream.allocate` with its layout (see `grow`);
            // no block of it is handed out (it was one free block) and the streams it was
            // freed on were waited for when the lists were merged.
            unsafe { chunk.release(&self.upstream) };
        }
        growth.size -= bytes;
        bytes
    }
}

impl<U: Resource> Drop for Pool<U> {
    fn drop(&mut self) {
        self.held.wait_all();
        let growth = std::mem::take(&mut *lock(&self.growth));
        match &self.space {
            None => release_all(&self.upstream, &self.shards, growth.chunks),
            // Asleep: nothing is mapped (the copies go with `growth`).
            Some(_) if growth.slept.is_some() => {}
            Some(space) => {
                if !crate::device::process_is_exiting()
                    && let Err(e) = self.shards.synchronize_streams()
                {
                    tracing::error!("a pool could not wait for its streams before freeing: {e}");
                }
                let g = space.granularity;
                for (first, n) in growth.mapped.mapped_runs() {
                    // SAFETY: granules this pool mapped; it is going away and its streams'
                    // work is complete (above), so nothing uses them.
                    unsafe { (space.unmap)(&self.upstream, space.base + first * g, n * g) };
                }
            }
        }
    }
}

impl<U: Resource> PartialEq for Pool<U> {
    fn eq(&self, other: &Self) -> bool {
        ptr::eq(self, other)
    }
}

impl<U: Resource + fmt::Debug> fmt::Debug for Pool<U> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pool")
            .field("upstream", &self.upstream)
            .field("config", &self.config)
            .field("stats", &self.stats())
            .finish()
    }
}

/// A place where an in-place pool can grow: `len` bytes of unmapped granules at `addr`,
/// which join the free blocks `joins` (before, after) into one block.
#[derive(Clone, Copy, Debug)]
struct Site {
    addr: usize,
    len: usize,
    joins: [Option<FreeBlock>; 2],
}

/// Where an in-place pool can map memory so that, with the free blocks next to it, one
/// free block holds `need` bytes: the sites that map the fewest bytes first (lowest
/// address among equals), at most one per unmapped run. At the top of what the pool holds
/// (`top`), a site maps at least `step` when the reservation has room, followed by the
/// same site without the step as a fallback.
fn growth_sites(
    space: &Space<impl Resource>,
    mapped: &Granules,
    free: &FreeBlocks,
    need: usize,
    top: usize,
    step: usize,
) -> Vec<Site> {
    let g = space.granularity;
    let mut sites = Vec::new();
    for (first, n) in mapped.unmapped_runs() {
        let (lo, hi) = (space.base + first * g, space.base + (first + n) * g);
        let before = free.ending_at(lo);
        let after = free.starting_at(hi);
        let (b, a) = (before.map_or(0, |b| b.size), after.map_or(0, |b| b.size));
        if b.saturating_add(a).saturating_add(n * g) < need {
            continue;
        }
        // Map next to the block before, next to the one after, or the whole run.
        let from_before = need.saturating_sub(b).next_multiple_of(g);
        let from_after = need.saturating_sub(a).next_multiple_of(g);
        let site = if from_before <= n * g && from_before <= from_after {
            Site {
                addr: lo,
                len: from_before,
                joins: [before, None],
            }
        } else if from_after <= n * g {
            Site {
                addr: hi - from_after,
                len: from_after,
                joins: [None, after],
            }
        } else {
            Site {
                addr: lo,
                len: n * g,
                joins: [before, after],
            }
        };
        if lo == top && site.len < step && step <= n * g {
            sites.push((site.len, Site { len: step, ..site }));
        }
        sites.push((site.len, site));
    }
    // Stable: among equal needs the lower address (and the stepped top site) first.
    sites.sort_by_key(|&(need, _)| need);
    sites.into_iter().map(|(_, site)| site).collect()
}

sync_on_the_host_stream!(Pool);

// SAFETY: blocks are disjoint pieces of chunks from the upstream (free blocks are tracked
// exactly once, in one list), aligned as asked, and carry the upstream's properties; a
// block freed on stream S is handed to another stream only after S's work is complete
// (host streams) or waited for (`merge_into`): memory freed on a stream is reused on that
// stream at once, and on another only after the first's work was waited for. Only the
// pool itself is equal to it.
unsafe impl<U: Resource> Resource for Pool<U> {
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
        let _pin = self.shards.pin(); // (see `ShardMap::retire`)
        let shard = self.shard(stream);
        let mut s = shard.state.lock();
        s.put(addr, size);
        self.shards.note_free(shard);
        if let Some(keep) = self.config.release_threshold
            && s.free_bytes() > keep
        {
            drop(s);
            self.release_above(stream, shard, keep);
        }
    }
    unsafe fn deallocate_used_on(
        &self,
        stream: StreamRef<'_>,
        ptr: NonNull<u8>,
        layout: Layout,
        used_on: &[StreamRef<'_>],
    ) {
        let _pin = self.shards.pin(); // (see `ShardMap::retire`)
        // SAFETY: the caller's promise; `held` is this pool's.
        unsafe { deferred::deallocate_used_on(self, &self.held, stream, ptr, layout, used_on) }
    }
}
