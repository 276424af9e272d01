//! A device's resource stack, built from a [`Spec`], with handles kept on the layers that
//! `memres_stats`, `memres_trim`, `memres_segments` and `memres_sleep` reach: every pool
//! it builds, on every tier of a `fallback(..)` and under every `binning`.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

use mr::adaptor::{ExactCounter, Logging, Statistics, StreamUse};
use mr::device::{DeviceGuard, DeviceId};
use mr::spec::{Built, LeafOptions, Target};
use mr::suballoc::{Binning, FixedSize};
use mr::upstream::{CudaAsyncConfig, CudaPhysical, Managed, PinnedHost, Virtual};
use mr::{
    AnyResource, Cuda, CudaVirtual, Device, Error, Pool, VirtualPool, suballoc::Arena,
    upstream::CudaAsync,
};

use crate::exports::{Exported, Shared};
use crate::routed::{self, Routed, TagPool, virtual_leaf};
use mr::spec::Spec;

/// Every layer of a stack that holds memory to hand out again, as [`Spec::build`]
/// showed them to its target (`Target::built`), and the driver pools the target made:
/// `memres_stats` sums their figures, `memres_trim` trims each, `memres_segments` lists
/// the memory of each, and `memres_sleep` puts every in-place pool to sleep. Generic over
/// the target so that the host tests build stacks of host memory into it.
pub(crate) struct Pools<T: Target> {
    chunked: Vec<Arc<Pool<T::Memory>>>,
    in_place: Vec<InPlace<T>>,
    arenas: Vec<Arc<Arena<T::Memory>>>,
    /// `pinned_pool`s (pinned host memory).
    pinned: Vec<Arc<Pool<AnyResource<T::Properties>>>>,
    /// `binning`s' bins (their chunks come from an in-place pool, in `in_place`).
    bins: Vec<Arc<Binning<AnyResource<T::Properties>>>>,
    fixed: Vec<Arc<FixedSize<T::Memory>>>,
    /// `cuda_async` (made by the C ABI's target, not shown by `built`).
    driver: Vec<Arc<CudaAsync>>,
}

/// An in-place pool over a target's virtual memory.
pub(crate) type InPlace<T> = Arc<VirtualPool<Virtual<<T as Target>::Backend>>>;

impl<T: Target> Default for Pools<T> {
    fn default() -> Self {
        Pools {
            chunked: Vec::new(),
            in_place: Vec::new(),
            arenas: Vec::new(),
            pinned: Vec::new(),
            bins: Vec::new(),
            fixed: Vec::new(),
            driver: Vec::new(),
        }
    }
}

impl<T: Target> Pools<T> {
    /// Keeps `layer` if it holds memory (a target's `built` passes every layer here).
    pub(crate) fn keep(&mut self, layer: &Built<'_, T>) {
        match layer {
            Built::ChunkedPool(pool) => self.chunked.push(Arc::clone(pool)),
            Built::VirtualPool(pool) => self.in_place.push(Arc::clone(pool)),
            Built::SuperblockArena(arena) => self.arenas.push(Arc::clone(arena)),
            Built::PinnedPool(pool) => self.pinned.push(Arc::clone(pool)),
            Built::Bins(bins) => self.bins.push(Arc::clone(bins)),
            Built::FixedBlocks(fixed) => self.fixed.push(Arc::clone(fixed)),
            _ => {}
        }
    }

    /// The in-place pools, inner tiers first.
    pub(crate) fn in_place(&self) -> &[InPlace<T>] {
        &self.in_place
    }

    /// The driver pools (`cuda_async`).
    pub(crate) fn driver(&self) -> &[Arc<CudaAsync>] {
        &self.driver
    }

    /// Whether the only memory kept is driver pools' (`cuda_async`).
    fn only_driver_pools(&self) -> bool {
        !self.driver.is_empty()
            && self.chunked.is_empty()
            && self.in_place.is_empty()
            && self.arenas.is_empty()
            && self.pinned.is_empty()
            && self.fixed.is_empty()
    }

    /// The figures of every pool, summed (the largest free block: the largest of any);
    /// `None` for a stack without one.
    pub(crate) fn figures(&self) -> Result<Option<PoolFigures>, Error> {
        let mut all: Vec<PoolFigures> = Vec::new();
        for pool in &self.chunked {
            all.push(pool_figures(pool.stats()));
        }
        for pool in &self.in_place {
            all.push(pool_figures(pool.stats()));
        }
        for pool in &self.pinned {
            // Host memory: not the device's calls.
            all.push(PoolFigures {
                upstream_alloc_calls: 0,
                upstream_free_calls: 0,
                ..pool_figures(pool.stats())
            });
        }
        for arena in &self.arenas {
            // The arena does not track its largest free block; it holds its whole size
            // from the start.
            all.push(PoolFigures {
                size: arena.size() as u64,
                free: arena.free_bytes() as u64,
                largest_free_block: 0,
                peak_size: arena.size() as u64,
                host_copy_bytes: 0,
                ..PoolFigures::default()
            });
        }
        for fixed in &self.fixed {
            // Chunks are kept until the resource drops: what it holds is its peak. Free
            // blocks are those in the lists and this thread's caches.
            let block = fixed.block_size() as u64;
            let size = (fixed.upstream_allocations() * fixed.blocks_per_chunk()) as u64 * block;
            let free = fixed.free_blocks() as u64 * block;
            all.push(PoolFigures {
                size,
                free,
                largest_free_block: if free > 0 { block } else { 0 },
                peak_size: size,
                host_copy_bytes: 0,
                ..PoolFigures::default()
            });
        }
        for pool in &self.driver {
            let (reserved, used) = (pool.reserved_bytes()?, pool.used_bytes()?);
            // The driver does not report its largest free block.
            all.push(PoolFigures {
                size: reserved,
                free: reserved.saturating_sub(used),
                largest_free_block: 0,
                peak_size: pool.reserved_peak_bytes()?,
                host_copy_bytes: 0,
                ..PoolFigures::default()
            });
        }
        Ok(all.into_iter().reduce(PoolFigures::plus))
    }

    /// The memory of every pool that keeps a list of it (chunked, in-place and pinned
    /// pools), as `(address, bytes)` in address order.
    pub(crate) fn segments(&self) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        for pool in &self.chunked {
            out.extend(pool.segments());
        }
        for pool in &self.in_place {
            out.extend(pool.segments());
        }
        for pool in &self.pinned {
            out.extend(pool.segments());
        }
        out.sort_unstable();
        out
    }

    /// Trims every pool, bins first (their free blocks and the lists of their streams;
    /// their chunks stay, as a `FixedSize`'s do), then the pools under them. Returns the
    /// bytes given back where the layers know them; every layer is trimmed even if one
    /// fails, and the first failure is returned.
    /// Bounds what each device-memory pool (chunked and in-place) holds, as
    /// [`Pool::set_limit`] and [`VirtualPool::set_limit`]; `None` lifts the bound. Pinned host pools are not bounded.
    pub(crate) fn set_limit(&self, bytes: Option<usize>) {
        for pool in &self.chunked {
            pool.set_limit(bytes);
        }
        for pool in &self.in_place {
            pool.set_limit(bytes);
        }
    }

    pub(crate) fn trim(&self) -> Result<u64, Error> {
        let mut released = 0u64;
        let mut first_error = None;
        let mut note = |result: Result<u64, Error>| match result {
            Ok(bytes) => released += bytes,
            Err(e) => {
                first_error.get_or_insert(e);
            }
        };
        for bins in &self.bins {
            note(bins.trim().map(|()| 0));
        }
        for fixed in &self.fixed {
            note(fixed.trim().map(|()| 0));
        }
        // An arena holds its whole size; its trim frees the lists of streams.
        for arena in &self.arenas {
            note(arena.trim().map(|()| 0));
        }
        for pool in &self.chunked {
            note(pool.trim().map(|n| n as u64));
        }
        for pool in &self.in_place {
            note(pool.trim().map(|n| n as u64));
        }
        for pool in &self.pinned {
            note(pool.trim().map(|n| n as u64));
        }
        for pool in &self.driver {
            note((|| {
                let before = pool.reserved_bytes()?;
                if before == 0 {
                    return Ok(0);
                }
                // Frees still pending on a stream keep their memory in the pool: wait for
                // the device first, as PyTorch's cudaMallocAsync backend's `empty_cache`
                // does (which is why no capture may be under way on the device).
                pool.device().synchronize()?;
                pool.trim_to(0)?;
                Ok(before.saturating_sub(pool.reserved_bytes()?))
            })());
        }
        match first_error {
            None => Ok(released),
            Some(e) => Err(e),
        }
    }

    /// Starts every pool's peak size afresh from what it holds now.
    pub(crate) fn reset_peaks(&self) -> Result<(), Error> {
        for pool in &self.chunked {
            pool.reset_peak_size();
        }
        for pool in &self.in_place {
            pool.reset_peak_size();
        }
        for pool in &self.pinned {
            pool.reset_peak_size();
        }
        for pool in &self.driver {
            pool.reset_reserved_peak()?;
        }
        Ok(())
    }

    /// The pools that sleep when the stack's own memory (tag `"default"`) does: every
    /// in-place pool, on every tier. `refusal` is [`why_it_cannot_sleep`] of the spec.
    /// Pinned host memory (`pinned`, `pinned_pool` tiers) stays as it is: it holds no
    /// device memory, and its blocks stay usable while the device memory sleeps.
    pub(crate) fn sleepable(&self, refusal: Option<&str>) -> Result<Vec<InPlace<T>>, Error> {
        match refusal {
            Some(why) if !self.in_place.is_empty() => Err(Error::unsupported(why.to_owned())),
            _ => Ok(self.in_place.clone()),
        }
    }
}

/// Why the memory of a stack built from `spec` cannot sleep, if it cannot: only a pool
/// that grows in place can give its device memory back and keep its addresses, so every
/// part that holds device memory must be one. Pinned host memory may sit beside them (a
/// `fallback(virtual_pool, pinned_pool)`): it stays as it is.
pub(crate) fn why_it_cannot_sleep(spec: &Spec) -> Option<String> {
    let part = match spec {
        Spec::VirtualPool { .. } | Spec::Pinned | Spec::PinnedPool => return None,
        Spec::Statistics(inner) | Spec::Logging { inner, .. } | Spec::Limiting { inner, .. } => {
            return why_it_cannot_sleep(inner);
        }
        Spec::Fallback { first, then } => {
            return why_it_cannot_sleep(first).or_else(|| why_it_cannot_sleep(then));
        }
        Spec::Binning { .. } => {
            return Some(
                "a stack with `binning` cannot sleep: its bins keep blocks of the pool and \
                 would hand them out while it sleeps; tag what should sleep instead"
                    .to_owned(),
            );
        }
        Spec::Cuda => "cuda",
        Spec::CudaAsync { .. } => "cuda_async",
        Spec::Managed => "managed",
        Spec::Pool { .. } => "pool",
        Spec::Arena { .. } => "arena",
        Spec::FixedSize { .. } => "fixed_size",
        // A layer newer than this list: refused until it is known to sleep.
        _ => "a layer this C ABI does not know",
    };
    Some(format!(
        "a stack with `{part}` cannot sleep: only a pool that grows in place \
         (`virtual_pool`) gives its device memory back and keeps its addresses, and \
         `{part}` would keep its memory awake; tag what should sleep instead"
    ))
}

/// One device's stack: the erased top that allocations go through, the outermost
/// statistics layer and the layers that hold memory.
pub(crate) struct DeviceStack {
    /// What `memres_malloc` allocates from and `memres_free` frees to: the stack's top
    /// (its wrappers over the router of its base and the tags' pools), under the
    /// library's layer that keeps the live blocks with the streams `memres_record_stream`
    /// names for them.
    memory: StreamUse<AnyResource<Device>>,
    /// The router under the spec's outermost wrappers: the tags' pools.
    routed: Arc<Routed>,
    statistics: Option<Arc<Statistics<AnyResource<Device>>>>,
    /// Every pool of the stack, on every tier.
    pools: Pools<Layers>,
    /// Logging layers: the stack lives in a static, never dropped, so their last rows are
    /// flushed at exit (`flush_logs`).
    logs: Vec<Arc<Logging<AnyResource<Device>>>>,
    /// Bytes live through the C ABI, counted exactly whatever the spec (one atomic add per
    /// call; PyTorch frees on its autograd thread what its main thread allocated, where a
    /// statistics layer's per-thread peak would be approximate).
    live: ExactCounter,
    /// Blocks live through the C ABI, counted as `live` is.
    live_blocks: ExactCounter,
    /// `memres_malloc` calls that ran out of memory.
    out_of_memory: AtomicI64,
    /// Descriptors exported for live blocks (`memres_ipc_export`).
    exported: Exported,
    /// Why the stack's own memory cannot sleep ([`why_it_cannot_sleep`]), if it cannot.
    sleep_refusal: Option<String>,
    /// The outermost `fallback(..)`, for its tiers' figures (`memres_tier_stats`); with
    /// one, blocks may lie outside the pool's range.
    tiers: Option<Arc<mr::spec::Tiers<Device>>>,
    /// The alignment of segment pools' segments taken from this stack
    /// ([`segment_alignment`](Self::segment_alignment)).
    segment_alignment: usize,
}

/// What `memres_stats` reports; zero where the stack lacks the layer.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Figures {
    pub(crate) statistics: Option<mr::adaptor::StatisticsSnapshot>,
    pub(crate) pool: Option<PoolFigures>,
    /// Bytes live through the C ABI.
    pub(crate) live: mr::adaptor::Counter,
    /// Blocks live through the C ABI.
    pub(crate) live_blocks: mr::adaptor::Counter,
    /// `memres_malloc` calls that ran out of memory.
    pub(crate) out_of_memory: i64,
}

/// What the memory layers report; 0 where they do not know a figure.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PoolFigures {
    pub(crate) size: u64,
    pub(crate) free: u64,
    pub(crate) largest_free_block: u64,
    pub(crate) peak_size: u64,
    /// Host copies of the pool's contents (a sleeping or woken in-place pool's).
    pub(crate) host_copy_bytes: u64,
    /// Calls of the device-memory pools that took memory from the driver, and that gave
    /// it back (`PoolStats::upstream_alloc_calls`, `upstream_free_calls`; PyTorch's
    /// `num_device_alloc` and `num_device_free`); 0 for pinned host pools, arenas,
    /// `fixed_size` and driver pools.
    pub(crate) upstream_alloc_calls: u64,
    pub(crate) upstream_free_calls: u64,
}

impl PoolFigures {
    /// The figures of two pools together: sizes add up (peaks too: an upper bound on the
    /// peak of the sum), the largest free block is the larger.
    fn plus(self, other: PoolFigures) -> PoolFigures {
        PoolFigures {
            size: self.size + other.size,
            free: self.free + other.free,
            largest_free_block: self.largest_free_block.max(other.largest_free_block),
            peak_size: self.peak_size + other.peak_size,
            host_copy_bytes: self.host_copy_bytes + other.host_copy_bytes,
            upstream_alloc_calls: self.upstream_alloc_calls + other.upstream_alloc_calls,
            upstream_free_calls: self.upstream_free_calls + other.upstream_free_calls,
        }
    }
}

impl DeviceStack {
    /// Builds `spec` for `device` (made current while building).
    pub(crate) fn build(spec: &Spec, device: DeviceId) -> Result<DeviceStack, Error> {
        let _on = DeviceGuard::new(device)?;
        let mut layers = Layers {
            device,
            statistics: None,
            pools: Pools::default(),
            logs: Vec::new(),
            tiers: None,
            routed: None,
            tag_granule: None,
        };
        let top = spec.build(&mut layers)?;
        // An in-place pool's granule where it is the base (its tags' pools map the same),
        // else the leaves' own guarantee.
        let segment_alignment = match (spec.base(), layers.pools.in_place()) {
            (Spec::VirtualPool { .. }, [pool]) => {
                mr::upstream::GrowInPlace::granularity(pool.upstream())
            }
            _ => mr::device::DEFAULT_ALIGNMENT,
        };
        // Every spec has a base, which the build hands to `Target::base` once.
        let routed = layers
            .routed
            .ok_or_else(|| Error::invalid_argument("the spec built no base to route tags under"))?;
        Ok(DeviceStack {
            memory: StreamUse::new(top),
            routed,
            statistics: layers.statistics,
            pools: layers.pools,
            logs: layers.logs,
            live: ExactCounter::default(),
            live_blocks: ExactCounter::default(),
            out_of_memory: AtomicI64::new(0),
            exported: Exported::default(),
            sleep_refusal: why_it_cannot_sleep(spec),
            tiers: layers.tiers,
            segment_alignment,
        })
    }
}

/// The device's leaves, and the layers found while building (inside out).
pub(crate) struct Layers {
    device: DeviceId,
    statistics: Option<Arc<Statistics<AnyResource<Device>>>>,
    pools: Pools<Layers>,
    logs: Vec<Arc<Logging<AnyResource<Device>>>>,
    tiers: Option<Arc<mr::spec::Tiers<Device>>>,
    /// The router put under the outermost wrappers (`base`).
    routed: Option<Arc<Routed>>,
    /// The granule of the spec's first `virtual_pool` (`granule=`; `Some(None)`: it gives
    /// none), which the tags' pools take too, so that one setting covers every pool that
    /// may sleep.
    tag_granule: Option<Option<usize>>,
}

impl Target for Layers {
    type Properties = Device;
    type Memory = Cuda;
    type Backend = CudaPhysical;

    fn memory(&mut self) -> Result<Cuda, Error> {
        Cuda::on(self.device)
    }

    fn virtual_leaf(&mut self, leaf: &LeafOptions) -> Result<CudaVirtual, Error> {
        self.tag_granule.get_or_insert(leaf.granule);
        virtual_leaf(self.device, leaf)
    }

    fn arena_size(&mut self) -> Result<usize, Error> {
        Ok(self.device.memory_info()?.free / 2)
    }

    fn driver_pool(
        &mut self,
        initial: Option<usize>,
        release_threshold: Option<u64>,
    ) -> Result<AnyResource<Device>, Error> {
        let config = CudaAsyncConfig::new()
            .initial_size(initial)
            .release_threshold(release_threshold);
        let pool = Arc::new(CudaAsync::on(self.device, config)?);
        // A driver pool's memory is not reached through the contexts' peer access: it
        // names its peers as the in-place pools' leaves do (`peers.rs`). Every peer by
        // default, and a peer the driver refuses (a device without pools, say) is left
        // out with a word on stderr: the pool still serves its own device. A peer a
        // caller asked for (on demand) must be granted, else the stack is not built.
        let every = crate::peers::every_peer()?;
        for peer in crate::peers::of_new_leaf(self.device)? {
            match pool.grant_access(peer) {
                Err(e) if every => eprintln!(
                    "memres: the cuda_async pool of {} gives {peer} no access: {e}",
                    self.device
                ),
                granted => granted?,
            }
        }
        self.pools.driver.push(Arc::clone(&pool));
        Ok(AnyResource::new(pool))
    }

    fn managed(&mut self) -> Result<AnyResource<Device>, Error> {
        Ok(AnyResource::new(Managed::on(self.device)?))
    }

    fn pinned(&mut self) -> Result<AnyResource<Device>, Error> {
        Ok(AnyResource::new(PinnedHost::on(self.device)?))
    }

    fn built(&mut self, layer: Built<'_, Self>) {
        self.pools.keep(&layer);
        match layer {
            // Built inside out, so the last one kept is the outermost.
            Built::WithStatistics(counted) => self.statistics = Some(Arc::clone(counted)),
            Built::Logged(logged) => self.logs.push(Arc::clone(logged)),
            // Built inside out: the last one kept is the outermost.
            Built::Tiers(tiers) => self.tiers = Some(Arc::clone(tiers)),
            _ => {}
        }
    }

    /// The router of the base and the tags' pools, so that the spec's statistics,
    /// limit and log see tagged blocks too.
    fn base(&mut self, base: AnyResource<Device>) -> Result<AnyResource<Device>, Error> {
        let tags = routed::device_tags(self.device, self.tag_granule.flatten());
        let (router, erased) = routed::under_wrappers(base, tags);
        self.routed = Some(router);
        Ok(erased)
    }
}

/// The figures of a memres pool. Blocks waiting for other streams
/// (`memres_record_stream`) are held, not free.
fn pool_figures(s: mr::suballoc::PoolStats) -> PoolFigures {
    PoolFigures {
        size: s.pool_size as u64,
        free: s.free_bytes as u64,
        largest_free_block: s.largest_free_block as u64,
        peak_size: s.peak_pool_size as u64,
        host_copy_bytes: s.host_copy_bytes as u64,
        upstream_alloc_calls: s.upstream_alloc_calls,
        upstream_free_calls: s.upstream_free_calls,
    }
}

impl DeviceStack {
    /// Writes out every row its logging layers hold (errors are reported, not returned:
    /// this runs at exit).
    pub(crate) fn flush_logs(&self) {
        for log in &self.logs {
            if let Err(e) = log.flush() {
                eprintln!("memres: cannot write the allocation log: {e}");
            }
        }
    }

    /// The memory the stack's pools (every tier's) and its tags' pools hold, as
    /// `(address, bytes)` in address order; nothing for layers that keep no such list (an
    /// arena, `fixed_size`, a driver pool, no pool: every block is then its own
    /// allocation).
    pub(crate) fn segments(&self) -> Vec<(usize, usize)> {
        let mut out = self.pools.segments();
        for (_, pool) in self.tags() {
            out.extend(pool.segments());
        }
        out.sort_unstable();
        out
    }

    /// The pools of the tags allocated under on this device, with their tag ids.
    pub(crate) fn tags(&self) -> Vec<(usize, TagPool)> {
        routed::tag_pools(&self.routed)
    }

    /// The tag's pool whose reservation holds `address`.
    fn tag_pool_holding(&self, address: usize) -> Option<&TagPool> {
        self.routed.holding(address)
    }

    /// The stack's own pools that sleep when its memory does (tag `"default"`): every
    /// in-place pool on every tier. An error says why the stack cannot sleep: a part of
    /// it holds device memory that cannot (`binning`'s bins would serve the pool's blocks
    /// unmapped; a chunked pool, an arena, ... would keep theirs awake). Empty for a
    /// stack without an in-place pool.
    pub(crate) fn sleepable_pools(&self) -> Result<Vec<Arc<VirtualPool<CudaVirtual>>>, Error> {
        self.pools.sleepable(self.sleep_refusal.as_deref())
    }

    /// The in-place pool (the stack's own, on any tier, or a tag's) whose reservation
    /// holds `address`.
    fn in_place_holding(&self, address: usize) -> Option<Arc<VirtualPool<CudaVirtual>>> {
        self.pools
            .in_place()
            .iter()
            .find(|pool| {
                let (base, len) = mr::upstream::GrowInPlace::reservation(pool.upstream());
                address.wrapping_sub(base) < len
            })
            .cloned()
            .or_else(|| self.tag_pool_holding(address).cloned())
    }

    /// The alignment of the whole-granule segments a segment pool takes from this stack
    /// (`memres_segment_pool_new`): the granule of the in-place pool that is the spec's
    /// base, so that a graph's or `MemPool`'s segment covers whole granules and the
    /// default pool's blocks stay together around it, as torch's private pools'
    /// segments never share memory with its default pool's (a snapshot then draws the
    /// default pool's blocks in one segment where torch's does; PyTorch's
    /// `test_mempool_ctx_multithread`); 256 bytes for every other base.
    pub(crate) fn segment_alignment(&self) -> usize {
        self.segment_alignment
    }

    /// The descriptors exported for live blocks.
    pub(crate) fn exported(&self) -> &Exported {
        &self.exported
    }

    /// What another process needs to map the `size` bytes at `address` (a live block of
    /// this stack): the granules' descriptors where the memory is an in-place pool's
    /// virtual memory, else the IPC handle of the `cuMemAlloc` allocation holding it.
    pub(crate) fn share(&self, address: usize, size: usize) -> Result<Shared, Error> {
        if let Some(pool) = self.in_place_holding(address) {
            let leaf = pool.upstream();
            let granule = mr::upstream::GrowInPlace::granularity(leaf);
            let (first, fds) = leaf.export_fds(address, size)?;
            return Ok(Shared::Granules {
                granule,
                offset: address - first,
                fds,
            });
        }
        if self.pools.only_driver_pools() {
            return Err(Error::unsupported(
                "sharing a block of a driver pool (cuda_async) with another process",
            ));
        }
        let (handle, offset) = mr::upstream::ipc_handle(address)?;
        Ok(Shared::CudaHandle { handle, offset })
    }

    /// How many granules the handle of the `size` bytes at `address` names, where they are
    /// an in-place pool's (`None` for memory shared by a CUDA IPC handle).
    pub(crate) fn granules_of(&self, address: usize, size: usize) -> Option<usize> {
        let pool = self.in_place_holding(address)?;
        let g = mr::upstream::GrowInPlace::granularity(pool.upstream());
        let first = address - address % g;
        Some((address + size).next_multiple_of(g).saturating_sub(first) / g)
    }

    /// Whether the stack has a logging layer.
    pub(crate) fn logs(&self) -> bool {
        !self.logs.is_empty()
    }

    /// The resource allocations go through: the spec's wrappers over the router of its
    /// base and the tags' pools (the device's per-device resource, so a tag set now
    /// routes its allocations too).
    pub(crate) fn top(&self) -> &AnyResource<Device> {
        self.memory.upstream()
    }

    /// What `memres_malloc` allocates from and `memres_free` frees to, with the live
    /// blocks and their recorded streams.
    pub(crate) fn memory(&self) -> &StreamUse<AnyResource<Device>> {
        &self.memory
    }

    /// The figures of the stack: its pools' (every tier's and bin's) and its tags' pools'
    /// summed.
    pub(crate) fn figures(&self) -> Result<Figures, Error> {
        // The tags' pools count with the stack's own (PyTorch's `memory_reserved` is
        // everything memres holds on the device).
        let pool = self
            .tags()
            .into_iter()
            .map(|(_, tagged)| pool_figures(tagged.stats()))
            .fold(self.pools.figures()?, |sum, t| {
                Some(sum.map_or(t, |s| s.plus(t)))
            });
        Ok(Figures {
            statistics: self.statistics.as_ref().map(|s| s.snapshot()),
            pool,
            live: self.live.read(),
            live_blocks: self.live_blocks.read(),
            out_of_memory: self.out_of_memory.load(Ordering::Relaxed),
        })
    }

    /// The figures of each tier of the outermost `fallback(..)`, if the stack has one.
    pub(crate) fn tiers(&self) -> Option<[mr::adaptor::StatisticsSnapshot; 2]> {
        self.tiers.as_ref().map(|t| t.tiers())
    }

    /// Counts a block handed out (`bytes` long) or a request that ran out of memory.
    pub(crate) fn count_allocation(&self, result: Result<usize, &Error>) {
        match result {
            Ok(bytes) => {
                self.live.add(bytes as i64); // a layout's size is at most isize::MAX
                self.live_blocks.add(1);
            }
            Err(Error::OutOfMemory { .. }) => {
                self.out_of_memory.fetch_add(1, Ordering::Relaxed);
            }
            Err(_) => {}
        }
    }

    /// Counts a block freed.
    pub(crate) fn count_free(&self, bytes: usize) {
        self.live.sub(bytes as i64);
        self.live_blocks.sub(1);
    }

    /// Starts every peak afresh from what is live and held now.
    pub(crate) fn reset_peaks(&self) -> Result<(), Error> {
        self.live.reset_peak();
        self.live_blocks.reset_peak();
        self.pools.reset_peaks()?;
        for (_, pool) in self.tags() {
            pool.reset_peak_size();
        }
        Ok(())
    }

    /// `Some(false)` when `address` is certainly not memory this stack handed out (outside
    /// the reservation of an in-place pool, the default stack); `None` where the stack
    /// cannot tell cheaply (its other layers keep no range, or a `fallback(..)` may have
    /// served it from another memory).
    pub(crate) fn may_hold(&self, address: usize) -> Option<bool> {
        if self.tag_pool_holding(address).is_some() {
            return Some(true);
        }
        if self.tiers.is_some() {
            // A fallback's next tier hands out memory outside the first tier's range.
            return None;
        }
        // Without a fallback the stack has at most one in-place pool, which serves every
        // block when it is there (under `binning` too: the bins' chunks are its blocks).
        match self.pools.in_place() {
            [pool] => {
                let (base, len) = mr::upstream::GrowInPlace::reservation(pool.upstream());
                Some(address.wrapping_sub(base) < len)
            }
            _ => None,
        }
    }

    /// Lets `peer` reach the memory of every in-place pool and driver pool (`cuda_async`)
    /// of the stack (every tier) and of every tag's, those made while this runs too:
    /// `memres_enable_peer_access`, which records the grant (`peers::record`) before it
    /// calls this, so that leaves made later give it from the start. Every pool is asked
    /// even if one fails; the first failure is returned.
    pub(crate) fn grant_access(&self, peer: DeviceId) -> Result<(), Error> {
        let mut first_error = None;
        let mut grant = |leaf: &CudaVirtual| {
            if let Err(e) = leaf.grant_access(peer) {
                first_error.get_or_insert(e);
            }
        };
        for pool in self.pools.in_place() {
            grant(pool.upstream());
        }
        routed::each_tag_pool(&self.routed, |pool| grant(pool.upstream()));
        for pool in self.pools.driver() {
            if let Err(e) = pool.grant_access(peer) {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Bounds what each of the device's pools holds (the stack's device-memory pools and
    /// every tag's, those made later too): `memres_set_limit`.
    pub(crate) fn set_limit(&self, bytes: Option<usize>) {
        self.pools.set_limit(bytes);
        routed::set_limit(&self.routed, bytes);
    }

    /// Gives entirely free memory back: every pool of the stack (every tier, every bin)
    /// and every tag's; returns the bytes released where the layers know them. An
    /// arena's memory is one upstream allocation that it keeps while it lives, so it
    /// gives nothing back (0). Every pool is trimmed even if one fails; the first failure
    /// is returned.
    pub(crate) fn trim(&self) -> Result<u64, Error> {
        let mut tagged = 0;
        let mut failed = None;
        for (_, pool) in self.tags() {
            match pool.trim() {
                Ok(n) => tagged += n as u64,
                Err(e) => {
                    failed.get_or_insert(e);
                }
            }
        }
        let own = self.pools.trim();
        match (own, failed) {
            (Ok(own), None) => Ok(own + tagged),
            (Err(e), _) | (Ok(_), Some(e)) => Err(e),
        }
    }
}
