//! What `memres_malloc` allocates from on a device: the pool of the tag set now
//! (`memres_set_tag`), else the stack's top; a free goes by its address to the tag's pool
//! whose reservation holds it, else to the top. The C ABI keeps it under the library's
//! [`StreamUse`](mr::adaptor::StreamUse) layer, which keeps the live blocks and the
//! streams `memres_record_stream` names for them. The tags' pools live here too: the
//! table of each device's ([`TagPools`]), the tag set now, and how a pool is made.

use std::alloc::Layout;
use std::ptr::NonNull;

use mr::device::DeviceId;
use mr::{AnyResource, Device, Error, Resource, StreamRef, SyncResource};

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, PoisonError};

use mr::{
    CudaVirtual, VirtualPool, VirtualPoolConfig,
    upstream::{CudaVirtualConfig, ExportHandle, GrowInPlace},
};

use crate::sync;

/// The stack's top and the tags' pools of one device, as one resource.
pub(crate) struct Routed {
    top: AnyResource<Device>,
    tags: TagPools,
    device: DeviceId,
}

impl Routed {
    pub(crate) fn new(top: AnyResource<Device>, device: DeviceId) -> Routed {
        Routed {
            top,
            tags: TagPools::default(),
            device,
        }
    }

    /// The resource the stack's own allocations go through.
    pub(crate) fn top(&self) -> &AnyResource<Device> {
        &self.top
    }

    /// The pools of the tags allocated under on this device.
    pub(crate) fn tags(&self) -> &TagPools {
        &self.tags
    }

    /// The pool allocations go to now (the tag's, made on its first use here, if one is
    /// set), or `None` for the top.
    #[inline]
    pub(crate) fn tagged_pool(&self) -> Result<Option<TagPool>, Error> {
        match current() {
            0 => Ok(None),
            id => self.tags.pool(id, || new_tag_pool(self.device)).map(Some),
        }
    }
}

impl PartialEq for Routed {
    /// One per device, never compared with another.
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self, other)
    }
}

// SAFETY: every block comes from the top or a tag's pool (device memory, both), and goes
// back to the one that served it: a tag's pool serves only addresses of its own
// reservation, and the top none of those (each reservation is the pool's alone).
unsafe impl SyncResource for Routed {
    type Properties = Device;

    fn allocate_sync(&self, layout: Layout) -> Result<NonNull<u8>, Error> {
        match self.tagged_pool()? {
            None => self.top.allocate_sync(layout),
            Some(pool) => pool.allocate_sync(layout),
        }
    }

    unsafe fn deallocate_sync(&self, ptr: NonNull<u8>, layout: Layout) {
        // SAFETY: the caller's promise, for the resource whose memory holds `ptr`.
        unsafe {
            match self.tags.holding(ptr.as_ptr() as usize) {
                Some(pool) => pool.deallocate_sync(ptr, layout),
                None => self.top.deallocate_sync(ptr, layout),
            }
        }
    }
}

// SAFETY: as above.
unsafe impl Resource for Routed {
    #[inline]
    fn allocate(&self, stream: StreamRef<'_>, layout: Layout) -> Result<NonNull<u8>, Error> {
        match self.tagged_pool()? {
            None => self.top.allocate(stream, layout),
            Some(pool) => pool.allocate(stream, layout),
        }
    }

    #[inline]
    unsafe fn deallocate(&self, stream: StreamRef<'_>, ptr: NonNull<u8>, layout: Layout) {
        // SAFETY: the caller's promise, for the resource whose memory holds `ptr`.
        unsafe {
            match self.tags.holding(ptr.as_ptr() as usize) {
                Some(pool) => pool.deallocate(stream, ptr, layout),
                None => self.top.deallocate(stream, ptr, layout),
            }
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
        // SAFETY: as above.
        unsafe {
            match self.tags.holding(ptr.as_ptr() as usize) {
                Some(pool) => pool.deallocate_used_on(stream, ptr, layout, used_on),
                None => self.top.deallocate_used_on(stream, ptr, layout, used_on),
            }
        }
    }
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

/// What the table of tags' pools asks of a pool: the range its blocks lie in, and its
/// bound. A trait so that the loom models fill the table with stand-ins (a tag's pool
/// needs a GPU) and the host tests with pools of host memory.
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

/// A tag's pool on a device, with its tag id and reservation.
struct Tagged<P> {
    id: usize,
    pool: Arc<P>,
    base: usize,
    len: usize,
}

/// One device's tagged pools.
///
/// The protocol (loom models in `sync.rs`): a pool is made under the write lock, after
/// looking again for one made by another thread while this one waited, so a tag has one
/// pool per device; its bound is read under that lock, and `set_limit` stores the bound
/// and bounds every pool under it too, so a pool made beside a `set_limit` is bounded
/// either way. Frees read `any` (acquire; stored after the first pool is in the table)
/// and skip the lock while no pool exists. Pools are never removed: a trim, the figures
/// or a sleep work on a copy of the table's handles (`all`), and allocations hold their
/// pool's handle.
pub(crate) struct TagPools<P = VirtualPool<CudaVirtual>> {
    /// Set once the device has a tagged pool: frees skip the lookup until then.
    any: sync::AtomicBool,
    pools: sync::RwLock<Vec<Tagged<P>>>,
    /// The bound of `memres_set_limit` (0: none), given to pools made later too.
    limit: sync::AtomicUsize,
}

impl<P> Default for TagPools<P> {
    fn default() -> Self {
        TagPools {
            any: sync::AtomicBool::new(false),
            pools: sync::RwLock::new(Vec::new()),
            limit: sync::AtomicUsize::new(0),
        }
    }
}

impl<P: Reserved> TagPools<P> {
    /// The pool of tag `id`, made by `make` on first use (under the table's write lock).
    pub(crate) fn pool(
        &self,
        id: usize,
        make: impl FnOnce() -> Result<P, Error>,
    ) -> Result<Arc<P>, Error> {
        if let Some(pool) = self.find(id) {
            return Ok(pool);
        }
        let mut pools = self.pools.write().unwrap_or_else(PoisonError::into_inner);
        if let Some(t) = pools.iter().find(|t| t.id == id) {
            return Ok(Arc::clone(&t.pool));
        }
        let pool = Arc::new(make()?);
        let limit = self.limit.load(Ordering::Relaxed);
        pool.set_limit((limit != 0).then_some(limit));
        let (base, len) = pool.reservation();
        pools.push(Tagged {
            id,
            pool: Arc::clone(&pool),
            base,
            len,
        });
        self.any.store(true, Ordering::Release);
        Ok(pool)
    }

    /// Bounds what each tag's pool holds, those made later too (`None`: no bound).
    pub(crate) fn set_limit(&self, bytes: Option<usize>) {
        // Under the write lock: a pool made meanwhile reads the new bound.
        let pools = self.pools.write().unwrap_or_else(PoisonError::into_inner);
        self.limit.store(bytes.unwrap_or(0), Ordering::Relaxed);
        for tagged in pools.iter() {
            tagged.pool.set_limit(bytes);
        }
    }

    /// The pool of tag `id`, if the device has one.
    pub(crate) fn find(&self, id: usize) -> Option<Arc<P>> {
        let pools = self.pools.read().unwrap_or_else(PoisonError::into_inner);
        pools
            .iter()
            .find(|t| t.id == id)
            .map(|t| Arc::clone(&t.pool))
    }

    /// The tagged pool whose reservation holds `address`.
    #[inline]
    pub(crate) fn holding(&self, address: usize) -> Option<Arc<P>> {
        if !self.any.load(Ordering::Acquire) {
            return None;
        }
        let pools = self.pools.read().unwrap_or_else(PoisonError::into_inner);
        pools
            .iter()
            .find(|t| address.wrapping_sub(t.base) < t.len)
            .map(|t| Arc::clone(&t.pool))
    }

    /// Every tagged pool, with its tag id.
    pub(crate) fn all(&self) -> Vec<(usize, Arc<P>)> {
        let pools = self.pools.read().unwrap_or_else(PoisonError::into_inner);
        pools.iter().map(|t| (t.id, Arc::clone(&t.pool))).collect()
    }
}

/// A new tag's pool on `device`: in place, over a reservation of its own.
pub(crate) fn new_tag_pool(device: DeviceId) -> Result<VirtualPool<CudaVirtual>, Error> {
    let _on = mr::device::DeviceGuard::new(device)?;
    VirtualPool::new(virtual_leaf(device, None)?, VirtualPoolConfig::new())
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
