//! [`Pool`]: the coalescing pool that takes its memory from the upstream in chunks (its
//! body, shared with [`VirtualPool`](super::VirtualPool), is [`Coalescing`]).

use std::alloc::Layout;
use std::ptr::NonNull;

use super::chunks::{Chunk, release_all};
use super::coalescing::{Coalescing, GrowthState, Holding, coalescing_pool};
use super::core::free_blocks::{FreeBlock, GRANULE};
use super::core::free_list::FreeList;
use super::core::list_table::List;
use super::pool_config::{ChunkSizes, PoolConfig};
use crate::error::Error;
use crate::resource::Resource;
use crate::stream::StreamRef;

/// A coalescing sub-allocator over any upstream (RMM's `pool_memory_resource`): it takes
/// memory from the upstream in chunks and hands out pieces of it.
///
/// # Which pool for which goal
/// - **Least memory held** (GPU training, anything near the memory limit): not this pool
///   but a [`VirtualPool`](super::VirtualPool), which grows in place over
///   [`CudaVirtual`](crate::CudaVirtual) (`CudaVirtual::new()?.virtual_pool(config)`, or
///   [`VirtualPool::new`](super::VirtualPool::new)). It maps exactly the granules a
///   request lacks, right after its free memory, so its memory is one range where every
///   free block can merge with its neighbours, and its `trim` gives back every fully free
///   granule; it can also sleep (give its memory back while its addresses stay). It is
///   the default of the C ABI and the Python shims; its docs say more.
/// - **Any upstream** (`Cuda`, `PinnedHost`, `HostHeap`, an adaptor stack): this pool,
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
/// - **Thread caches.** A small block a thread frees waits in that thread's cache for
///   its stream (up to 8 MiB a thread and stream, the bytes a stream's list caches; past
///   that, frees coalesce) and goes to the thread's next request of that size on that
///   stream with no lock, no atomic read-modify-write and no list lookup: on the H100 a
///   256 B pair took 16.3-17.8 ns against 23.9-25.4 (the fastest rounds), 16 threads on
///   one stream 16.4 ns against 107.8, and the `random` workload 0-3% more in one
///   process (3-7% between builds, within what a build's code layout moves it;
///   `BENCHMARKS.md`). A request the cache
///   cannot serve goes to the list as before; before the slow path searches, the
///   thread's cached blocks go back to their lists and coalesce. Other threads' cached
///   blocks are taken back (from threads busy or idle) before the pool reports
///   out-of-memory, by [`trim`](Pool::trim) and [`coalesce`](Pool::coalesce), and when
///   their thread exits; [`stats`](Pool::stats) counts the calling thread's cached
///   blocks as free, not other threads' (they count as live until then). A pool with a
///   [`release_threshold`](PoolConfig::release_threshold) keeps no thread caches (it
///   counts every free at once). A thread's cache goes back when its thread-locals are
///   destroyed, which for `std::thread::scope`'s threads may be after the scope returns:
///   [`coalesce`](Pool::coalesce) or [`trim`](Pool::trim) takes it back at once. (The virtual pool has none: what it holds is what
///   PyTorch's programs see.)
/// - **Streams.** Every stream has its own free list behind its own lock, found without
///   a lock, so threads on different streams never wait for each other. Threads that
///   share one stream use one list of it until they run into each other, then up to 16
///   more ("lanes", see the module `suballoc`), so that they do not queue for one lock; a thread whose lane has no fit takes from the stream's
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
    core: Coalescing<U, Chunks>,
}

/// How a [`Pool`] holds memory: chunks of its upstream, sized by its configuration.
pub(super) struct Chunks {
    config: PoolConfig,
}

impl<U: Resource> Pool<U> {
    /// A pool over `upstream`, taking `config.initial()` bytes from it at once. It grows
    /// by upstream allocations of its own ("chunks"), sized by `config`'s [`Growth`](super::Growth)
    /// rule; over a [`GrowInPlace`](crate::upstream::GrowInPlace) upstream, a
    /// [`VirtualPool`](super::VirtualPool) holds less.
    pub fn new(upstream: U, config: PoolConfig) -> Result<Pool<U>, Error> {
        config.validate()?;
        let pool = Pool {
            core: Coalescing::new(
                upstream,
                Chunks { config },
                Vec::new(),
                config.maximum(),
                config.threshold(),
            ),
        };
        if config.initial() > 0 {
            let core = &pool.core;
            let layout = Layout::from_size_align(config.initial(), GRANULE)
                .map_err(|_| Error::invalid_argument("the pool's initial size is too large"))?;
            let ptr = core.upstream.allocate_sync(layout)?;
            add_chunk(core, &mut core.lock_growth(), ptr, layout, core.host_list());
        }
        Ok(pool)
    }

    /// The configuration the pool was made with.
    pub fn config(&self) -> PoolConfig {
        self.core.holding.config
    }

    /// Whether the calling thread's lane of `stream` has a list (for the loom models).
    #[cfg(all(test, memres_loom))]
    pub(crate) fn has_list(&self, stream: StreamRef<'_>) -> bool {
        let _pin = self.core.lists.pin();
        self.core
            .lists
            .find(super::core::stream_key::StreamKey::of_lane(stream))
            .is_some()
    }
}

coalescing_pool!(
    Pool,
    "HostHeap, Pool, PoolConfig",
    "Pool::new(HostHeap::new(), PoolConfig::new()"
);

impl<U: Resource> Holding<U> for Chunks {
    type Memory = Vec<Chunk>;

    const THREAD_CACHES: bool = true;

    fn new_free_list(&self, chunks: &Vec<Chunk>) -> FreeList {
        FreeList::new(chunks.iter().map(|c| (c.addr, c.layout.size())), None).with_large_cache()
    }

    /// A chunk sized by the growth rule ([`ChunkSizes`]), less when the upstream
    /// refuses it, put in `own`'s list, the block taken from it.
    fn grow(
        pool: &Coalescing<U, Chunks>,
        growth: &mut GrowthState<Vec<Chunk>>,
        stream: StreamRef<'_>,
        own: &List<FreeList>,
        size: usize,
        align: usize,
        _may_wait: bool,
    ) -> Result<Option<usize>, Error> {
        let Some(min) = size.checked_add(align - GRANULE) else {
            return Ok(None);
        };
        let config = PoolConfig {
            maximum: pool.maximum(growth),
            ..pool.holding.config
        };
        let Some(sizes) = ChunkSizes::new(&config, min, growth.size) else {
            return Ok(None);
        };
        let mut attempt = sizes.first(growth.size);
        loop {
            let Ok(layout) = Layout::from_size_align(attempt, GRANULE) else {
                return Ok(None);
            };
            match pool.upstream.allocate(stream, layout) {
                Ok(ptr) => {
                    let mut s = add_chunk(pool, growth, ptr, layout, own);
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

    /// Returns to the upstream every chunk that is one free block in `from`'s list (a
    /// chunk goes whole or not at all: `keep` is not looked at).
    fn release(
        pool: &Coalescing<U, Chunks>,
        growth: &mut GrowthState<Vec<Chunk>>,
        from: &List<FreeList>,
        _keep: usize,
    ) -> usize {
        let whole = |s: &FreeList, c: &Chunk| {
            s.free
                .starting_at(c.addr)
                .is_some_and(|b| b.size == c.layout.size())
        };
        let released: Vec<Chunk> = {
            let mut s = from.state.lock();
            s.flush();
            if !growth.memory.iter().any(|c| whole(&s, c)) {
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
                .memory
                .extract_if(.., |c| {
                    let whole = whole(&s, c);
                    if whole {
                        s.free.remove_starting_at(c.addr);
                    }
                    whole
                })
                .collect()
        };
        for list in pool.lists.iter() {
            let mut s = list.state.lock();
            for c in &released {
                s.remove_chunk(c.addr);
            }
        }
        let bytes = released.iter().map(|c| c.layout.size()).sum();
        let count = released.len();
        for chunk in released {
            // SAFETY: the chunk came from `upstream.allocate` with its layout (see `grow`);
            // no block of it is handed out (it was one free block) and the streams it was
            // freed on were waited for when the lists were merged.
            unsafe { chunk.release(&pool.upstream) };
        }
        growth.size -= bytes;
        growth.frees += count as u64;
        bytes
    }

    fn segments(&self, chunks: &Vec<Chunk>) -> Vec<(usize, usize)> {
        chunks.iter().map(|c| (c.addr, c.layout.size())).collect()
    }

    fn upstream_allocations(chunks: &Vec<Chunk>) -> usize {
        chunks.len()
    }

    fn drop_memory(pool: &Coalescing<U, Chunks>, chunks: Vec<Chunk>) {
        release_all(&pool.upstream, &pool.lists, chunks);
    }
}

/// Records a new chunk and puts it, free, in `into`'s list, which it returns locked
/// (so the grower takes its block before any other thread sees the chunk).
fn add_chunk<'a, U: Resource>(
    pool: &Coalescing<U, Chunks>,
    growth: &mut GrowthState<Vec<Chunk>>,
    ptr: NonNull<u8>,
    layout: Layout,
    into: &'a List<FreeList>,
) -> crate::sync::spin::SpinGuard<'a, FreeList> {
    let chunk = Chunk::new(ptr, layout);
    let addr = chunk.addr;
    // Every list learns the chunk's start before any block of it can reach one.
    for list in pool.lists.iter() {
        list.state.lock().add_chunk(addr, layout.size());
    }
    growth.memory.push(chunk);
    growth.size += layout.size();
    growth.allocs += 1;
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
    pool.lists.note_free(into);
    s
}
