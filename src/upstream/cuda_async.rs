//! The driver's stream-ordered pools: [`CudaAsync`] (owns a pool), [`CudaAsyncView`]
//! (uses one it does not own) and [`CudaAsyncManaged`] (the device's managed pool).

use std::alloc::Layout;
use std::ptr::NonNull;

use super::driver_leaf::{accept, admit};
use crate::device::{Context, DeviceId, bind, process_is_exiting};
use crate::driver::report;
use crate::error::Error;
use crate::platform::{Active, Attribute, Feature, Platform, PoolAttribute, PoolHandle};
use crate::property::{DeviceAccessible, HostDevice};
use crate::resource::{Resource, SyncResource};
use crate::stream::StreamRef;

/// The alignment of every block from a driver pool, and the largest honoured.
const POOL_ALIGNMENT: usize = 256;

/// A pool handle and the context it is used in: what the three resources share.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct PoolRef {
    pool: usize,
    ctx: Context,
}

impl PoolRef {
    fn handle(self) -> PoolHandle {
        self.pool
    }

    /// `cuMemAllocFromPoolAsync` on `stream`. A host stream (always complete) gets memory
    /// usable at once, as from `allocate_sync`.
    #[inline]
    fn allocate(
        self,
        stream: StreamRef<'_>,
        layout: Layout,
        name: &'static str,
    ) -> Result<NonNull<u8>, Error> {
        if let Some(empty) = admit(layout, POOL_ALIGNMENT, name)? {
            return Ok(empty);
        }
        let Some(raw) = stream.cu() else {
            return self.allocate_sync(layout, name);
        };
        let _current = bind(self.ctx)?;
        // SAFETY: the context is current; the pool is live (owned by the resource, or the
        // promise of `CudaAsyncView::from_raw`); `raw` is live for the borrow of `stream`.
        let address = unsafe { Active::pool_alloc_async(self.handle(), layout.size(), raw) }?;
        accept(address, layout, || {
            // SAFETY: the block was never handed out; it goes back on its own stream.
            report("cuMemFreeAsync", unsafe {
                Active::free_async(address, raw)
            });
        })
    }

    /// Allocates on the legacy default stream and waits for it, so the memory is valid on
    /// every stream at once.
    fn allocate_sync(self, layout: Layout, name: &'static str) -> Result<NonNull<u8>, Error> {
        let ptr = self.allocate(StreamRef::DEFAULT, layout, name)?;
        if layout.size() > 0
            && let Err(e) = StreamRef::DEFAULT.synchronize_in(self.ctx)
        {
            // SAFETY: the block was never handed out; it goes back on its stream.
            unsafe { self.deallocate(StreamRef::DEFAULT, ptr, layout) };
            return Err(e);
        }
        Ok(ptr)
    }

    /// `cuMemFreeAsync` on `stream` (the legacy default stream for a host stream, whose
    /// work is always complete).
    ///
    /// # Safety
    /// `ptr` came from this pool with `layout` and keeps `Resource::deallocate`'s contract.
    #[inline]
    unsafe fn deallocate(self, stream: StreamRef<'_>, ptr: NonNull<u8>, layout: Layout) {
        if layout.size() == 0 || process_is_exiting() {
            return;
        }
        let raw = stream.cu().unwrap_or(0);
        match bind(self.ctx) {
            // SAFETY: the caller's promise: `ptr` came from this pool and the work using it
            // is ordered before this point on `stream`; `raw` is live for its borrow.
            Ok(_current) => report("cuMemFreeAsync", unsafe {
                Active::free_async(ptr.as_ptr() as usize, raw)
            }),
            Err(e) => tracing::error!(%e, "memres: cannot free into a CUDA pool"),
        }
    }

    /// Lets `peer` read and write the pool's memory (`cuMemPoolSetAccess`): see
    /// [`CudaAsync::grant_access`].
    fn grant_access(self, peer: DeviceId) -> Result<(), Error> {
        let own = self.ctx.device();
        if peer == own {
            return Ok(());
        }
        peer.require_peer_access(own)?;
        let _current = bind(self.ctx)?;
        // SAFETY: the pool is live (owned by the resource, or the promise of
        // `CudaAsyncView::from_raw`).
        unsafe { Active::pool_set_access(self.handle(), &[peer.ordinal()]) }
    }

    /// The pool's device, then every other device that may read and write its memory
    /// (`cuMemPoolGetAccess`, asked of the devices that can reach this one at all).
    fn accessible_from(self) -> Result<Vec<DeviceId>, Error> {
        let own = self.ctx.device();
        let _current = bind(self.ctx)?;
        let mut devices = vec![own];
        for device in DeviceId::all()? {
            if device == own || !device.can_access_peer(own)? {
                continue;
            }
            // SAFETY: the pool is live (as above).
            if unsafe { Active::pool_get_access(self.handle(), device.ordinal()) }? {
                devices.push(device);
            }
        }
        Ok(devices)
    }

    fn get_u64(self, attribute: PoolAttribute) -> Result<u64, Error> {
        // SAFETY: the pool is live.
        unsafe { Active::pool_get(self.handle(), attribute) }
    }

    fn set_u64(self, attribute: PoolAttribute, value: u64) -> Result<(), Error> {
        // SAFETY: the pool is live.
        unsafe { Active::pool_set(self.handle(), attribute, value) }
    }
}

/// Implements the resource traits by forwarding to `self.inner: PoolRef`.
macro_rules! pool_resource {
    ($ty:ty, $props:ty, $name:literal) => {
        // SAFETY: blocks come from a driver pool (aligned to 256, checked by `accept`), and
        // are valid until freed; the pool's memory has the properties stated; equal
        // resources share one pool, so they may free each other's memory.
        unsafe impl SyncResource for $ty {
            type Properties = $props;

            fn allocate_sync(&self, layout: Layout) -> Result<NonNull<u8>, Error> {
                self.inner.allocate_sync(layout, $name)
            }

            unsafe fn deallocate_sync(&self, ptr: NonNull<u8>, layout: Layout) {
                // SAFETY: nothing uses the memory any more (the caller's promise), so it may
                // be freed on any stream.
                unsafe { self.inner.deallocate(StreamRef::DEFAULT, ptr, layout) }
            }
        }

        // SAFETY: the driver's pools are stream-ordered with exactly these rules.
        unsafe impl Resource for $ty {
            #[inline]
            fn allocate(
                &self,
                stream: StreamRef<'_>,
                layout: Layout,
            ) -> Result<NonNull<u8>, Error> {
                self.inner.allocate(stream, layout, $name)
            }

            #[inline]
            unsafe fn deallocate(&self, stream: StreamRef<'_>, ptr: NonNull<u8>, layout: Layout) {
                // SAFETY: the caller keeps `deallocate`'s contract.
                unsafe { self.inner.deallocate(stream, ptr, layout) }
            }
        }
    };
}

/// Which kind of handle a [`CudaAsync`] pool can be exported as, for sharing it with
/// another process (RMM's `allocation_handle_type`). RMM also offers fabric handles (for
/// multi-node NVLink systems); memres has no way to export or test one, so it offers
/// none.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ExportHandle {
    /// Not exportable.
    #[default]
    None,
    /// A POSIX file descriptor (`CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`), for processes
    /// on one machine.
    PosixFd,
}

impl ExportHandle {
    /// Whether memory is made exportable as POSIX file descriptors.
    pub(crate) fn is_posix_fd(self) -> bool {
        self == ExportHandle::PosixFd
    }
}

/// A driver memory pool's handle, for `cuMemPool*` calls memres does not wrap: an opaque
/// pointer whatever the features (turning `cudarc-interop` on in one crate of a build
/// never changes another's types). cudarc's `CUmemoryPool` is the same pointer: `.cast()`
/// turns one into the other.
pub type RawMemoryPool = *mut std::ffi::c_void;

/// How to make a [`CudaAsync`] pool: [`CudaAsyncConfig::new`] and its builder methods
/// (the fields are public to read; more may come, so it is built with the methods).
///
/// ```
/// use memres::upstream::{CudaAsyncConfig, ExportHandle};
///
/// let config = CudaAsyncConfig::new().initial_size(1 << 30).release_threshold(None);
/// assert_eq!(config.initial_size, Some(1 << 30));
/// assert_eq!(config.export, ExportHandle::None);
/// ```
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct CudaAsyncConfig {
    /// Bytes to reserve up front: allocated and freed once at construction, so that with
    /// the default release threshold the pool keeps them. `None`: nothing.
    pub initial_size: Option<usize>,
    /// Reserved memory above this many bytes is released back to the device at stream
    /// synchronisation points. `None` means `u64::MAX`: keep everything, as RMM does.
    pub release_threshold: Option<u64>,
    /// Whether, and how, the pool can be shared with other processes.
    pub export: ExportHandle,
}

impl CudaAsyncConfig {
    /// Nothing reserved up front, memory kept (`u64::MAX` release threshold), not shared.
    pub fn new() -> Self {
        CudaAsyncConfig::default()
    }

    /// Bytes to reserve up front (`None`: nothing).
    #[must_use]
    pub fn initial_size(mut self, bytes: impl Into<Option<usize>>) -> Self {
        self.initial_size = bytes.into();
        self
    }

    /// Reserved memory above this many bytes goes back to the device at stream
    /// synchronisation points (`None`: keep everything).
    #[must_use]
    pub fn release_threshold(mut self, bytes: impl Into<Option<u64>>) -> Self {
        self.release_threshold = bytes.into();
        self
    }

    /// Whether, and how, the pool can be shared with other processes.
    #[must_use]
    pub fn export(mut self, handle: ExportHandle) -> Self {
        self.export = handle;
        self
    }
}

/// A stream-ordered pool of device memory owned by this resource: the driver's
/// `cuMemPoolCreate` with `cuMemAllocFromPoolAsync` / `cuMemFreeAsync` (RMM's
/// `cuda_async_memory_resource`).
///
/// - Device-accessible; blocks aligned to 256 bytes (larger alignments are
///   [`Error::InvalidArgument`]).
/// - Stream-ordered as the driver defines it: memory freed on a stream is reused on that
///   stream at once and on others once the driver knows the free is complete.
/// - `allocate_sync` allocates on the legacy default stream and synchronises it.
/// - The release threshold defaults to `u64::MAX` (keep memory, as RMM), so the pool
///   does not give memory back at every synchronisation.
/// - Equality: equal only to itself (and to a [`CudaAsyncView`] of the same pool).
/// - Dropping destroys the pool (the driver waits for outstanding frees), unless the
///   process is exiting.
///
/// ```no_run
/// use memres::{Resource, StreamRef, layout};
/// use memres::upstream::{CudaAsync, CudaAsyncConfig};
///
/// let pool = CudaAsync::with_config(CudaAsyncConfig::new().initial_size(1 << 30))?;
/// let l = layout(4096)?;
/// let p = pool.allocate(StreamRef::PER_THREAD, l)?;
/// // SAFETY: allocated above; no work that uses it is enqueued after this point.
/// unsafe { pool.deallocate(StreamRef::PER_THREAD, p, l) };
/// # Ok::<(), memres::Error>(())
/// ```
#[derive(Debug)]
pub struct CudaAsync {
    inner: PoolRef,
    export: ExportHandle,
}

impl CudaAsync {
    /// A pool on the current device with the default configuration.
    pub fn new() -> Result<CudaAsync, Error> {
        CudaAsync::with_config(CudaAsyncConfig::default())
    }

    /// A pool on the current device.
    pub fn with_config(config: CudaAsyncConfig) -> Result<CudaAsync, Error> {
        CudaAsync::on(DeviceId::current()?, config)
    }

    /// A pool on `device`.
    pub fn on(device: DeviceId, config: CudaAsyncConfig) -> Result<CudaAsync, Error> {
        let ctx = Context::primary(device)?;
        let _current = bind(ctx)?;
        require_pools(device)?;
        check_export_support(device, config.export)?;

        // The device's context is current.
        let pool = Active::pool_create(device.ordinal(), config.export.is_posix_fd())?;
        let resource = CudaAsync {
            inner: PoolRef { pool, ctx },
            export: config.export,
        };
        // From here on, `resource`'s drop destroys the pool if a step fails.
        resource.inner.set_u64(
            PoolAttribute::ReleaseThreshold,
            config.release_threshold.unwrap_or(u64::MAX),
        )?;
        if let Some(size) = config.initial_size.filter(|&s| s > 0) {
            let l = crate::resource::layout(size)?;
            let p = resource.allocate_sync(l)?;
            // SAFETY: allocated just above, never used.
            unsafe { resource.deallocate_sync(p, l) };
            StreamRef::DEFAULT.synchronize_in(ctx)?;
        }
        Ok(resource)
    }

    /// The driver's handle of the pool (for `cuMemPool*` calls memres does not wrap). The
    /// resource keeps owning it: do not destroy it.
    pub fn pool_handle(&self) -> RawMemoryPool {
        self.inner.handle() as RawMemoryPool
    }

    /// The device the pool allocates on.
    pub fn device(&self) -> DeviceId {
        self.inner.ctx.device()
    }

    /// The kind of export handle the pool was made with.
    pub fn export_handle(&self) -> ExportHandle {
        self.export
    }

    /// The release threshold, read back from the driver.
    pub fn release_threshold(&self) -> Result<u64, Error> {
        self.inner.get_u64(PoolAttribute::ReleaseThreshold)
    }

    /// Bytes the pool has reserved from the device now, read from the driver.
    pub fn reserved_bytes(&self) -> Result<u64, Error> {
        self.inner.get_u64(PoolAttribute::ReservedCurrent)
    }

    /// The most bytes the pool has reserved at once since it was made or
    /// [`reset_reserved_peak`](Self::reset_reserved_peak), read from the driver.
    pub fn reserved_peak_bytes(&self) -> Result<u64, Error> {
        self.inner.get_u64(PoolAttribute::ReservedHigh)
    }

    /// Starts [`reserved_peak_bytes`](Self::reserved_peak_bytes) afresh from what the
    /// pool reserves now (the driver resets the high watermark when it is set to 0).
    pub fn reset_reserved_peak(&self) -> Result<(), Error> {
        self.inner.set_u64(PoolAttribute::ReservedHigh, 0)
    }

    /// Bytes handed out and not yet freed, read from the driver.
    pub fn used_bytes(&self) -> Result<u64, Error> {
        self.inner.get_u64(PoolAttribute::UsedCurrent)
    }

    /// Releases reserved memory back to the device until the pool holds at most
    /// `keep` bytes beyond what is in use (`cuMemPoolTrimTo`); memory whose frees are
    /// still pending on a stream is kept.
    pub fn trim_to(&self, keep: usize) -> Result<(), Error> {
        let _current = bind(self.inner.ctx)?;
        // SAFETY: the pool is live; trimming only releases memory nothing holds.
        unsafe { Active::pool_trim_to(self.inner.handle(), keep) }
    }

    /// Lets `peer` read and write the pool's memory, what it holds now and what it
    /// allocates later (`cuMemPoolSetAccess`), as PyTorch's `cudaMallocAsync` backend does
    /// when a program first copies between two devices. A driver pool's memory, unlike
    /// `cudaMalloc`'s, is not reached through the contexts' peer access
    /// (`cuCtxEnablePeerAccess`): a kernel on another device needs this first. The pool's
    /// own device, or a peer granted already, is `Ok`; [`Error::Unsupported`] where `peer`
    /// cannot reach this device's memory.
    ///
    /// ```no_run
    /// use memres::{device::DeviceId, upstream::{CudaAsync, CudaAsyncConfig}};
    ///
    /// let pool = CudaAsync::on(DeviceId::new(0), CudaAsyncConfig::new())?;
    /// pool.grant_access(DeviceId::new(1))?; // kernels on GPU 1 may now use its memory
    /// assert_eq!(pool.accessible_from()?, [DeviceId::new(0), DeviceId::new(1)]);
    /// # Ok::<(), memres::Error>(())
    /// ```
    pub fn grant_access(&self, peer: DeviceId) -> Result<(), Error> {
        self.inner.grant_access(peer)
    }

    /// The pool's device, then the others that may read and write its memory, asked of
    /// the driver (`cuMemPoolGetAccess`).
    pub fn accessible_from(&self) -> Result<Vec<DeviceId>, Error> {
        self.inner.accessible_from()
    }

    /// Exports the pool as a POSIX file descriptor for another process to import
    /// (`cuMemPoolExportToShareableHandle`); the pool must have been made with
    /// [`ExportHandle::PosixFd`], else [`Error::Unsupported`].
    pub fn export_fd(&self) -> Result<std::os::fd::OwnedFd, Error> {
        if self.export != ExportHandle::PosixFd {
            return Err(Error::unsupported(
                "this pool was not made with ExportHandle::PosixFd",
            ));
        }
        let _current = bind(self.inner.ctx)?;
        // SAFETY: the pool is live and exportable as a POSIX fd.
        let fd = unsafe { Active::pool_export_fd(self.inner.handle()) }?;
        use std::os::fd::FromRawFd;
        // SAFETY: the driver returned a new descriptor that nothing else owns.
        Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
    }
}

fn require_pools(device: DeviceId) -> Result<(), Error> {
    if device.attribute(Attribute::MemoryPools)? == 0 {
        return Err(Error::unsupported(format!(
            "{device} does not support stream-ordered memory pools"
        )));
    }
    Ok(())
}

fn check_export_support(device: DeviceId, export: ExportHandle) -> Result<(), Error> {
    if export == ExportHandle::None {
        return Ok(());
    }
    if device.attribute(Attribute::PoolPosixFdHandles)? == 0 {
        return Err(Error::unsupported(format!(
            "{device} cannot export memory pools as {export:?} handles"
        )));
    }
    Ok(())
}

impl Drop for CudaAsync {
    fn drop(&mut self) {
        if process_is_exiting() {
            return;
        }
        let Ok(_current) = bind(self.inner.ctx) else {
            return;
        };
        // SAFETY: the pool is ours; blocks still out keep it alive inside the driver until
        // they are freed (the driver defers the destruction).
        report("cuMemPoolDestroy", unsafe {
            Active::pool_destroy(self.inner.handle())
        });
    }
}

impl PartialEq for CudaAsync {
    fn eq(&self, other: &Self) -> bool {
        self.inner == other.inner
    }
}

impl PartialEq<CudaAsyncView> for CudaAsync {
    fn eq(&self, other: &CudaAsyncView) -> bool {
        self.inner == other.inner
    }
}

pool_resource!(CudaAsync, DeviceAccessible, "CudaAsync");

/// Stream-ordered allocation from a driver pool this resource does not own (RMM's
/// `cuda_async_view_memory_resource`): a pool made elsewhere, or the device's default pool.
///
/// Otherwise as [`CudaAsync`]. Equal to any view of, or [`CudaAsync`] owning, the same pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CudaAsyncView {
    inner: PoolRef,
}

impl CudaAsyncView {
    /// The device's default pool (`cuDeviceGetDefaultMemPool`): the one
    /// `cudaMallocAsync` uses, alive as long as the process.
    pub fn default_pool(device: DeviceId) -> Result<CudaAsyncView, Error> {
        let ctx = Context::primary(device)?;
        require_pools(device)?;
        let dev = device.handle()?;
        let pool = Active::default_pool(dev)?;
        Ok(CudaAsyncView {
            inner: PoolRef { pool, ctx },
        })
    }

    /// A view of `pool`, a pool of device memory on `device`.
    ///
    /// # Safety
    /// `pool` is a live `CUmemoryPool` of pinned device memory on `device`, and stays alive
    /// as long as this view (and every copy of it) is used.
    pub unsafe fn from_raw(pool: RawMemoryPool, device: DeviceId) -> Result<CudaAsyncView, Error> {
        Ok(CudaAsyncView {
            inner: PoolRef {
                pool: pool as usize,
                ctx: Context::primary(device)?,
            },
        })
    }

    /// The pool's handle.
    pub fn pool_handle(&self) -> RawMemoryPool {
        self.inner.handle() as RawMemoryPool
    }

    /// The device the pool allocates on.
    pub fn device(&self) -> DeviceId {
        self.inner.ctx.device()
    }

    /// Lets `peer` read and write the pool's memory: as [`CudaAsync::grant_access`]. For
    /// the device's default pool this is what `cudaMallocAsync`'s memory needs before a
    /// kernel on another device uses it.
    pub fn grant_access(&self, peer: DeviceId) -> Result<(), Error> {
        self.inner.grant_access(peer)
    }

    /// The pool's device, then the others that may read and write its memory: as
    /// [`CudaAsync::accessible_from`].
    pub fn accessible_from(&self) -> Result<Vec<DeviceId>, Error> {
        self.inner.accessible_from()
    }
}

impl PartialEq<CudaAsync> for CudaAsyncView {
    fn eq(&self, other: &CudaAsync) -> bool {
        self.inner == other.inner
    }
}

pool_resource!(CudaAsyncView, DeviceAccessible, "CudaAsyncView");

/// Stream-ordered managed memory from the device's default managed pool (CUDA 13's
/// `cuMemGetDefaultMemPool` with `CU_MEM_ALLOCATION_TYPE_MANAGED`; RMM's
/// `cuda_async_managed_memory_resource`).
///
/// Host- and device-accessible. Where the driver or the device does not offer a managed
/// pool (no concurrent managed access, an older driver), [`CudaAsyncManaged::new`] returns
/// [`Error::Unsupported`]. Otherwise as [`CudaAsync`]; the pool is the device's, so it is
/// never destroyed, and all `CudaAsyncManaged` of one device are equal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CudaAsyncManaged {
    inner: PoolRef,
}

impl CudaAsyncManaged {
    /// The current device's default managed pool.
    pub fn new() -> Result<CudaAsyncManaged, Error> {
        CudaAsyncManaged::on(DeviceId::current()?)
    }

    /// `device`'s default managed pool.
    pub fn on(device: DeviceId) -> Result<CudaAsyncManaged, Error> {
        let ctx = Context::primary(device)?;
        crate::driver::require(Feature::ManagedPool, "a managed memory pool")?;
        let concurrent = device.attribute(Attribute::ConcurrentManagedAccess)?;
        if concurrent == 0 {
            return Err(Error::unsupported(format!(
                "{device} lacks concurrent managed access, which a managed pool needs"
            )));
        }
        let _current = bind(ctx)?;
        // The context is current; the platform checks that its driver has the call.
        let pool = Active::default_managed_pool(device.ordinal())?;
        Ok(CudaAsyncManaged {
            inner: PoolRef { pool, ctx },
        })
    }

    /// The pool's handle.
    pub fn pool_handle(&self) -> RawMemoryPool {
        self.inner.handle() as RawMemoryPool
    }

    /// The device the pool belongs to.
    pub fn device(&self) -> DeviceId {
        self.inner.ctx.device()
    }
}

pool_resource!(CudaAsyncManaged, HostDevice, "CudaAsyncManaged");
