//! A device's resource stack, built from a [`Spec`], with handles kept on the layers that
//! `memres_stats` and `memres_trim` read.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

use mr::adaptor::{ExactCounter, Logging, Statistics};
use mr::device::{DeviceGuard, DeviceId};
use mr::spec::{Built, Target};
use mr::upstream::{CudaAsyncConfig, CudaPhysical, Managed, PinnedHost};
use mr::{
    AnyResource, Arena, Cuda, CudaAsync, CudaVirtual, CudaVirtualConfig, Device, Error,
    ExportHandle, Pool,
};

use crate::ipc::{Exported, Shared};
use crate::recorded::Recorded;
use crate::tags::TagPools;
use mr::spec::Spec;

/// The memory layer under the stack, for its figures and for trimming.
enum PoolLayer {
    Pool(Arc<Pool<Cuda>>),
    Virtual(Arc<Pool<CudaVirtual>>),
    Arena(Arc<Arena<Cuda>>),
    Async(Arc<CudaAsync>),
}

/// One device's stack: the erased top that allocations go through, the outermost
/// statistics layer and the memory layer, if the spec has them.
pub(crate) struct DeviceStack {
    top: AnyResource<Device>,
    statistics: Option<Arc<Statistics<AnyResource<Device>>>>,
    pool: Option<PoolLayer>,
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
    /// Streams recorded for live blocks (`memres_record_stream`).
    recorded: Recorded,
    /// Descriptors exported for live blocks (`memres_ipc_export`).
    exported: Exported,
    /// Whether the spec has a `binning`: its bins keep blocks of the in-place pool and
    /// hand them out again, so that pool cannot sleep (they would serve unmapped memory).
    binned: bool,
    /// The outermost `fallback(..)`, for its tiers' figures (`memres_tier_stats`); with
    /// one, blocks may lie outside the pool's range.
    tiers: Option<Arc<mr::spec::Tiers<Device>>>,
    /// The pools of the tags allocated under on this device (`memres_set_tag`).
    tags: TagPools,
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

/// What the memory layer reports; 0 where it does not know a figure.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PoolFigures {
    pub(crate) size: u64,
    pub(crate) free: u64,
    pub(crate) largest_free_block: u64,
    pub(crate) peak_size: u64,
    /// Host copies of the pool's contents (a sleeping or woken in-place pool's).
    pub(crate) host_copy_bytes: u64,
}

impl DeviceStack {
    /// Builds `spec` for `device` (made current while building).
    pub(crate) fn build(spec: &Spec, device: DeviceId) -> Result<DeviceStack, Error> {
        let _on = DeviceGuard::new(device)?;
        let mut layers = Layers {
            device,
            statistics: None,
            pool: None,
            logs: Vec::new(),
            tiers: None,
        };
        let top = spec.build(&mut layers)?;
        Ok(DeviceStack {
            top,
            statistics: layers.statistics,
            pool: layers.pool,
            logs: layers.logs,
            live: ExactCounter::default(),
            live_blocks: ExactCounter::default(),
            out_of_memory: AtomicI64::new(0),
            recorded: Recorded::default(),
            exported: Exported::default(),
            binned: has_binning(spec),
            tiers: layers.tiers,
            tags: TagPools::default(),
        })
    }
}

/// The device's leaves, and the layers found while building (inside out).
struct Layers {
    device: DeviceId,
    statistics: Option<Arc<Statistics<AnyResource<Device>>>>,
    pool: Option<PoolLayer>,
    logs: Vec<Arc<Logging<AnyResource<Device>>>>,
    tiers: Option<Arc<mr::spec::Tiers<Device>>>,
}

impl Target for Layers {
    type Properties = Device;
    type Memory = Cuda;
    type Backend = CudaPhysical;

    fn memory(&mut self) -> Result<Cuda, Error> {
        Cuda::on(self.device)
    }

    fn virtual_leaf(&mut self, reserve: Option<usize>) -> Result<CudaVirtual, Error> {
        virtual_leaf(self.device, reserve)
    }

    fn arena_size(&mut self) -> Result<usize, Error> {
        Ok(self.device.memory_info()?.free / 2)
    }

    fn driver_pool(
        &mut self,
        initial: Option<usize>,
        release_threshold: Option<u64>,
    ) -> Result<AnyResource<Device>, Error> {
        let config = CudaAsyncConfig {
            initial_size: initial,
            release_threshold,
            ..CudaAsyncConfig::default()
        };
        let pool = Arc::new(CudaAsync::on(self.device, config)?);
        self.pool = Some(PoolLayer::Async(Arc::clone(&pool)));
        Ok(AnyResource::new(pool))
    }

    fn managed(&mut self) -> Result<AnyResource<Device>, Error> {
        Ok(AnyResource::new(Managed::on(self.device)?))
    }

    fn pinned(&mut self) -> Result<AnyResource<Device>, Error> {
        Ok(AnyResource::new(PinnedHost::on(self.device)?))
    }

    fn built(&mut self, layer: Built<'_, Self>) {
        match layer {
            Built::ChunkedPool(pool) => self.pool = Some(PoolLayer::Pool(Arc::clone(pool))),
            Built::InPlacePool(pool) => self.pool = Some(PoolLayer::Virtual(Arc::clone(pool))),
            Built::SuperblockArena(arena) => self.pool = Some(PoolLayer::Arena(Arc::clone(arena))),
            // Built inside out, so the last one kept is the outermost.
            Built::WithStatistics(counted) => self.statistics = Some(Arc::clone(counted)),
            Built::Logged(logged) => self.logs.push(Arc::clone(logged)),
            // Built inside out: the last one kept is the outermost.
            Built::Tiers(tiers) => self.tiers = Some(Arc::clone(tiers)),
            _ => {}
        }
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

    /// The memory the stack's pool holds, as `(address, bytes)` in address order; empty
    /// where the stack has no pool that keeps such a list (an arena, a driver pool, no
    /// pool: every block is then its own allocation).
    pub(crate) fn segments(&self) -> Vec<(usize, usize)> {
        let mut out = match &self.pool {
            Some(PoolLayer::Pool(pool)) => pool.segments(),
            Some(PoolLayer::Virtual(pool)) => pool.segments(),
            Some(PoolLayer::Arena(_) | PoolLayer::Async(_)) | None => Vec::new(),
        };
        for (_, pool) in self.tags.all() {
            out.extend(pool.segments());
        }
        out.sort_unstable();
        out
    }

    /// The pools of the tags allocated under on this device.
    pub(crate) fn tags(&self) -> &TagPools {
        &self.tags
    }

    /// The stack's own pool, if it grows in place (the default stack).
    pub(crate) fn in_place_pool(&self) -> Option<Arc<Pool<CudaVirtual>>> {
        match &self.pool {
            Some(PoolLayer::Virtual(pool)) => Some(Arc::clone(pool)),
            _ => None,
        }
    }

    /// The stack's own pool if it can sleep: it grows in place and no layer above it
    /// keeps its blocks to hand out again (`binning`'s bins would serve them unmapped).
    pub(crate) fn sleepable_pool(&self) -> Result<Option<Arc<Pool<CudaVirtual>>>, Error> {
        if self.binned {
            return Err(Error::unsupported(
                "a stack with `binning` cannot sleep: its bins keep blocks of the pool and \
                 would hand them out while it sleeps; tag what should sleep instead",
            ));
        }
        Ok(self.in_place_pool())
    }

    /// The in-place pool (the stack's own or a tag's) whose reservation holds `address`.
    fn in_place_holding(&self, address: usize) -> Option<Arc<Pool<CudaVirtual>>> {
        self.in_place_pool()
            .filter(|pool| {
                let (base, len) = mr::GrowInPlace::reservation(pool.upstream());
                address.wrapping_sub(base) < len
            })
            .or_else(|| self.tags.holding(address))
    }

    /// The descriptors exported for live blocks.
    pub(crate) fn exported(&self) -> &Exported {
        &self.exported
    }

    /// What another process needs to map the `size` bytes at `address` (a live block of
    /// this stack): the granules' descriptors where the memory is the in-place pool's
    /// virtual memory, else the IPC handle of the `cuMemAlloc` allocation holding it.
    pub(crate) fn share(&self, address: usize, size: usize) -> Result<Shared, Error> {
        if let Some(pool) = self.in_place_holding(address) {
            let leaf = pool.upstream();
            let granule = mr::GrowInPlace::granularity(leaf);
            let (first, fds) = leaf.export_fds(address, size)?;
            return Ok(Shared::Granules {
                granule,
                offset: address - first,
                fds,
            });
        }
        match &self.pool {
            Some(PoolLayer::Async(_)) => Err(Error::unsupported(
                "sharing a block of a driver pool (cuda_async) with another process",
            )),
            _ => {
                let (handle, offset) = mr::upstream::ipc_handle(address)?;
                Ok(Shared::CudaHandle { handle, offset })
            }
        }
    }

    /// How many granules the handle of the `size` bytes at `address` names, where they are
    /// the in-place pool's (`None` for memory shared by a CUDA IPC handle).
    pub(crate) fn granules_of(&self, address: usize, size: usize) -> Option<usize> {
        let pool = self.in_place_holding(address)?;
        let g = mr::GrowInPlace::granularity(pool.upstream());
        let first = address - address % g;
        Some((address + size).next_multiple_of(g).saturating_sub(first) / g)
    }

    /// Whether the stack has a logging layer.
    pub(crate) fn logs(&self) -> bool {
        !self.logs.is_empty()
    }

    /// The resource allocations go through.
    pub(crate) fn top(&self) -> &AnyResource<Device> {
        &self.top
    }

    /// The streams recorded for live blocks.
    pub(crate) fn recorded(&self) -> &Recorded {
        &self.recorded
    }

    pub(crate) fn figures(&self) -> Result<Figures, Error> {
        let pool = match &self.pool {
            None => None,
            Some(PoolLayer::Pool(pool)) => Some(pool_figures(pool.stats())),
            Some(PoolLayer::Virtual(pool)) => Some(pool_figures(pool.stats())),
            Some(PoolLayer::Arena(arena)) => {
                // The arena does not track its largest free block; it holds its whole
                // size from the start.
                Some(PoolFigures {
                    size: arena.size() as u64,
                    free: arena.free_bytes() as u64,
                    largest_free_block: 0,
                    peak_size: arena.size() as u64,
                    host_copy_bytes: 0,
                })
            }
            Some(PoolLayer::Async(pool)) => {
                let (reserved, used) = (pool.reserved_bytes()?, pool.used_bytes()?);
                // The driver does not report its largest free block.
                Some(PoolFigures {
                    size: reserved,
                    free: reserved.saturating_sub(used),
                    largest_free_block: 0,
                    peak_size: pool.reserved_peak_bytes()?,
                    host_copy_bytes: 0,
                })
            }
        };
        // The tags' pools count with the stack's own (PyTorch's `memory_reserved` is
        // everything memres holds on the device).
        let pool = self.tags.all().into_iter().fold(pool, |sum, (_, tagged)| {
            let t = pool_figures(tagged.stats());
            let s = sum.unwrap_or_default();
            Some(PoolFigures {
                size: s.size + t.size,
                free: s.free + t.free,
                largest_free_block: s.largest_free_block.max(t.largest_free_block),
                peak_size: s.peak_size + t.peak_size,
                host_copy_bytes: s.host_copy_bytes + t.host_copy_bytes,
            })
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
        match &self.pool {
            Some(PoolLayer::Pool(pool)) => pool.reset_peak_size(),
            Some(PoolLayer::Virtual(pool)) => pool.reset_peak_size(),
            Some(PoolLayer::Async(pool)) => pool.reset_reserved_peak()?,
            None | Some(PoolLayer::Arena(_)) => {}
        }
        for (_, pool) in self.tags.all() {
            pool.reset_peak_size();
        }
        Ok(())
    }

    /// `Some(false)` when `address` is certainly not memory this stack handed out (outside
    /// the reservation of an in-place pool, the default stack); `None` where the stack
    /// cannot tell cheaply (its other layers keep no range, or a `fallback(..)` may have
    /// served it from another memory).
    pub(crate) fn may_hold(&self, address: usize) -> Option<bool> {
        if self.tags.holding(address).is_some() {
            return Some(true);
        }
        if self.tiers.is_some() {
            // A fallback's next tier hands out memory outside the first tier's range.
            return None;
        }
        match &self.pool {
            Some(PoolLayer::Virtual(pool)) => {
                let (base, len) = mr::GrowInPlace::reservation(pool.upstream());
                Some(address.wrapping_sub(base) < len)
            }
            _ => None,
        }
    }

    /// Gives entirely free memory back to the driver; returns the bytes released where
    /// the layer knows them. An arena's memory is one upstream allocation that it keeps
    /// while it lives, so it gives nothing back (0).
    pub(crate) fn trim(&self) -> Result<u64, Error> {
        let mut tagged = 0;
        for (_, pool) in self.tags.all() {
            tagged += pool.trim()? as u64;
        }
        let own = match &self.pool {
            None => Ok(0),
            // The arena holds its whole size; its trim frees the lists of streams.
            Some(PoolLayer::Arena(arena)) => arena.trim().map(|()| 0),
            Some(PoolLayer::Pool(pool)) => Ok(pool.trim()? as u64),
            Some(PoolLayer::Virtual(pool)) => Ok(pool.trim()? as u64),
            Some(PoolLayer::Async(pool)) => {
                let before = pool.reserved_bytes()?;
                pool.trim_to(0)?;
                Ok(before.saturating_sub(pool.reserved_bytes()?))
            }
        }?;
        Ok(own + tagged)
    }
}

/// The virtual-memory leaf of an in-place pool on `device` (the default stack's and every
/// tag's): reachable from every peer, exportable where the device can.
pub(crate) fn virtual_leaf(device: DeviceId, reserve: Option<usize>) -> Result<CudaVirtual, Error> {
    // Every device that can reach this one's memory may: copies between devices
    // (`tensor.to("cuda:1")`) and peer kernels work as over `cudaMalloc` memory with
    // peer access on, which memory mapped with `cuMemMap` only gets from an access
    // descriptor per device.
    let peers: Vec<DeviceId> = DeviceId::all()?
        .into_iter()
        .filter(|&peer| peer.can_access_peer(device).unwrap_or(false))
        .collect();
    let mut leaf = CudaVirtualConfig::new().peers(peers);
    if let Some(reserve) = reserve {
        leaf = leaf.reserve(reserve);
    }
    // Exportable as POSIX descriptors where the device can (`memres_ipc_export`,
    // PyTorch's CUDA tensors sent to other processes).
    let exportable = leaf.clone().export(ExportHandle::PosixFd);
    match CudaVirtual::with_config(device, exportable) {
        Err(Error::Unsupported(_)) => CudaVirtual::with_config(device, leaf),
        built => built,
    }
}

/// Whether `spec` has a `binning` anywhere.
fn has_binning(spec: &Spec) -> bool {
    match spec {
        Spec::Binning { .. } => true,
        Spec::WithStatistics(inner) | Spec::Logged { inner, .. } | Spec::Limited { inner, .. } => {
            has_binning(inner)
        }
        Spec::Fallback { first, then } => has_binning(first) || has_binning(then),
        _ => false,
    }
}
