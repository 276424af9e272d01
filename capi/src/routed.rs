//! What the spec's outermost wrappers go over on a device: the pool of the tag set now
//! (`memres_set_tag`), else the spec's base (the layer under those wrappers); a free
//! goes by its address to the tag's pool whose reservation holds it, else to the base.
//! This is the library's address router ([`Router`]) with the base as its default member
//! and the tags' pools as its members, each made on its tag's first use on the device by
//! the route here ([`Tags`]), which also keeps the bound `memres_set_limit` gives pools
//! made later. The spec's build puts it under the wrappers ([`Target::base`]), so a
//! `statistics(..)`, `limiting(..)` or `logging(..)` spec counts, bounds and logs the
//! tags' blocks too (issue 47: the router sat over the whole stack, and they skipped
//! them). The C ABI keeps the stack under the library's
//! [`StreamUse`](mr::adaptor::StreamUse) layer, which keeps the live blocks and the
//! streams `memres_record_stream` names for them.
//!
//! [`Target::base`]: mr::spec::Target::base

use std::alloc::Layout;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use mr::adaptor::{Member, Route, Router};
use mr::device::DeviceId;
use mr::property::{Contains, PropertySet};
use mr::spec::LeafOptions;
use mr::{
    AnyResource, CudaVirtual, Device, Error, Resource, VirtualPool, VirtualPoolConfig,
    upstream::{CudaVirtualConfig, ExportHandle, GrowInPlace},
};

use crate::sync;

/// The spec's base and the tags' pools of one device, as one resource: the router's
/// default member is the base, its members the tags' pools (keyed by tag id).
pub(crate) type Routed = TagRouter<Device, VirtualPool<CudaVirtual>>;

/// A router over an erased base (memory of the properties `P`) and tags' pools of type
/// `T`.
pub(crate) type TagRouter<P, T> = Router<AnyResource<P>, Arc<T>, Tags<T>>;

/// The tags' route on `device`, with no tag's pool yet; their pools map `granule` bytes
/// at a time (the spec's `virtual_pool:granule=`; `None`: [`DEFAULT_GRANULE`]).
pub(crate) fn device_tags(device: DeviceId, granule: Option<usize>) -> Tags {
    Tags::new(move || new_tag_pool(device, granule))
}

/// A router over `base` (its default member) whose members `tags` makes: kept by the
/// target for its handles on the tags' pools, and erased, for the spec's outermost
/// wrappers to go over ([`Target::base`](mr::spec::Target::base)). Generic so that the
/// host tests build it over host memory as the C ABI builds it over a device's.
pub(crate) fn under_wrappers<P, T>(
    base: AnyResource<P>,
    tags: Tags<T>,
) -> (Arc<TagRouter<P, T>>, AnyResource<P>)
where
    P: PropertySet + Contains<P> + Send + Sync + 'static,
    T: Reserved + Resource<Properties = P> + Send + Sync + 'static,
{
    let router = Arc::new(Router::new(base, tags));
    let erased = AnyResource::new(Arc::clone(&router));
    (router, erased)
}

/// How the C ABI's router picks a tag's pool: the tag set now (`memres_set_tag`), and a
/// pool made on the tag's first use on the device, bounded as `memres_set_limit` said.
/// Generic over the pool so that the loom models fill the router with stand-ins (a tag's
/// pool needs a GPU) and the host tests with pools of host memory.
///
/// The protocol (the router makes members under its lock, after looking again for one
/// made by another thread while this one waited, so a tag has one pool per device): a
/// new pool reads the bound in [`Route::make`], under that lock, and [`set_limit`] stores
/// the bound and bounds every pool under it too ([`Router::update`]), so a pool made
/// beside a `set_limit` is bounded either way. Pools are never removed: allocations,
/// trims, the figures and sleeps use the router's references. Model:
/// `loom_a_pool_made_beside_a_new_bound_is_bounded` (`sync.rs`); the router's own, in
/// the library's `adaptor/router.rs`.
pub(crate) struct Tags<P = VirtualPool<CudaVirtual>> {
    /// Makes a tag's pool on the device.
    make: Box<dyn Fn() -> Result<P, Error> + Send + Sync>,
    /// The bound of `memres_set_limit` (0: none), given to pools made later too.
    limit: sync::AtomicUsize,
}

impl<P> Tags<P> {
    /// Tags whose pools `make` makes.
    pub(crate) fn new(make: impl Fn() -> Result<P, Error> + Send + Sync + 'static) -> Tags<P> {
        Tags {
            make: Box::new(make),
            limit: sync::AtomicUsize::new(0),
        }
    }
}

impl<P: Reserved> Route for Tags<P> {
    type Member = Arc<P>;

    #[inline]
    fn choose(&self, _: Layout) -> Option<usize> {
        match current() {
            0 => None,
            id => Some(id),
        }
    }

    fn make(&self, _tag: usize) -> Result<Member<Arc<P>>, Error> {
        let pool = (self.make)()?;
        // Under the router's lock for making members: `set_limit` stores the bound under
        // it too.
        let limit = self.limit.load(Ordering::Relaxed);
        pool.set_limit((limit != 0).then_some(limit));
        let (base, len) = pool.reservation();
        // SAFETY: a tag's pool serves only addresses of its own reservation, and the top
        // and the other tags' pools none of those (each reservation is its pool's alone).
        Ok(unsafe { Member::in_range(Arc::new(pool), base, len) })
    }
}

/// Bounds what each tag's pool of `router` holds, those made later too (`None`: no
/// bound).
pub(crate) fn set_limit<D, P: Reserved>(router: &Router<D, Arc<P>, Tags<P>>, bytes: Option<usize>) {
    router.update(
        |tags| tags.limit.store(bytes.unwrap_or(0), Ordering::Relaxed),
        |pool| pool.set_limit(bytes),
    );
}

/// Runs `each` on every tag's pool of `router` while no pool is made: a pool made beside
/// this call is either made first (and `each` sees it) or after, when it reads what the
/// caller changed before (`memres_enable_peer_access`'s grants).
pub(crate) fn each_tag_pool<D, P: Reserved>(
    router: &Router<D, Arc<P>, Tags<P>>,
    each: impl FnMut(&Arc<P>),
) {
    router.update(|_| {}, each);
}

/// Every tag's pool of `router`, with its tag id.
pub(crate) fn tag_pools<D, P>(router: &Router<D, Arc<P>, Tags<P>>) -> Vec<(usize, Arc<P>)> {
    router
        .members()
        .map(|(id, pool)| (id, Arc::clone(pool)))
        .collect()
}

/// The tag set now (its id, `memres_set_tag`), 0 for none.
static CURRENT: AtomicUsize = AtomicUsize::new(0);

/// The id of the tag set now, 0 for none.
#[inline]
pub(crate) fn current() -> usize {
    CURRENT.load(Ordering::Relaxed)
}

/// Sets the tag allocations go under (its id), 0 for none.
pub(crate) fn set_current(id: usize) {
    CURRENT.store(id, Ordering::Relaxed);
}

/// A tag's pool: it grows in place over its own reservation.
pub(crate) type TagPool = Arc<VirtualPool<CudaVirtual>>;

/// What the tags' route asks of a pool: the range its blocks lie in, and its bound. A
/// trait so that the loom models fill the router with stand-ins (a tag's pool needs a
/// GPU) and the host tests with pools of host memory.
pub(crate) trait Reserved {
    /// The first address and length of the range every block of the pool lies in.
    fn reservation(&self) -> (usize, usize);
    /// Bounds what the pool holds (`None`: no bound), as [`VirtualPool::set_limit`].
    fn set_limit(&self, bytes: Option<usize>);
}

impl<U: GrowInPlace> Reserved for VirtualPool<U> {
    fn reservation(&self) -> (usize, usize) {
        self.upstream().reservation()
    }

    fn set_limit(&self, bytes: Option<usize>) {
        VirtualPool::set_limit(self, bytes);
    }
}

/// A new tag's pool on `device`: in place, over a reservation of its own, mapping
/// `granule` bytes at a time.
pub(crate) fn new_tag_pool(
    device: DeviceId,
    granule: Option<usize>,
) -> Result<VirtualPool<CudaVirtual>, Error> {
    let _on = mr::device::DeviceGuard::new(device)?;
    let leaf = LeafOptions {
        granule,
        ..LeafOptions::default()
    };
    VirtualPool::new(virtual_leaf(device, &leaf)?, VirtualPoolConfig::new())
}

/// The granule of the C ABI's in-place pools where the spec names none (`granule=`):
/// 2 MiB, the driver's minimum on current GPUs (the leaf raises it where a device's is
/// larger), so that a bound on what a device's pools hold
/// ([`memres_set_limit`](crate::memres_set_limit), PyTorch's
/// `set_per_process_memory_fraction`) is honoured to 2 MiB, as under torch's allocator,
/// whose large requests take what they ask rounded to 2 MiB. With 16 MiB (this default
/// for a few hours of 2026-11-28) PyTorch's own `test_max_split_expandable` failed: three
/// blocks of 40 MiB under a bound of 120 MiB took 48 MiB each. What larger granules buy
/// is fewer driver calls, each mapping costing the driver the same whatever its size
/// (about 70 us on one idle H200, 180 with a peer): GPT-2 DDP's steps that reach a new
/// size took 60-180 ms longer than torch's with 2 MiB and went with their round's other
/// steps with 16 MiB, and a 20 GiB pool's sleep unmaps in 0.04-0.07 s rather than
/// 0.3-0.45; the
/// memory held at real models' peaks rose by at most 1% of live (BENCHMARKS.md, "The
/// C ABI's 16 MiB granule"). `virtual_pool:granule=16MiB` chooses that.
pub(crate) const DEFAULT_GRANULE: usize = 2 << 20;

/// The virtual-memory leaf of an in-place pool on `device` (the default stack's and every
/// tag's): reachable from the peers `peers.rs` names (every peer-capable device, or
/// those granted so far where peers come on demand), exportable where the
/// device can, mapping the spec's granule or [`DEFAULT_GRANULE`].
pub(crate) fn virtual_leaf(device: DeviceId, options: &LeafOptions) -> Result<CudaVirtual, Error> {
    let peers = crate::peers::of_new_leaf(device)?;
    let granule = options.granule.unwrap_or(DEFAULT_GRANULE);
    let mut leaf = CudaVirtualConfig::new().peers(peers).granularity(granule);
    if let Some(reserve) = options.reserve {
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
