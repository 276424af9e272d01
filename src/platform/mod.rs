//! The platform seam: every GPU driver operation memres makes, behind one trait.
//!
//! memres calls a GPU vendor's driver for devices and contexts, streams and events, each
//! leaf's allocate and free, driver pools, virtual memory, IPC, copies, memory info and
//! stream capture. [`Platform`] names each of those operations once, in the crate's own
//! terms (addresses as `usize`, handles as opaque integers, errors as [`Error`]); a
//! platform implements them with its vendor's calls:
//!
//! - [`cuda::Cuda`]: NVIDIA's driver API through cudarc (libcuda, loaded at run time).
//! - `hip::Hip` (feature `hip`): AMD's HIP runtime (libamdhip64, loaded at run time).
//!
//! The rest of the crate calls [`Active`], the platform this build was made for, chosen
//! once at compile time: CUDA unless the `hip` feature is on. Every call is a static call
//! to a concrete type, so the CUDA path compiles to the same direct driver calls as
//! before the seam (no `dyn`, no branch on a platform at run time). A build is for one
//! vendor's GPUs, as RMM and its ROCm port hipMM are; see `docs/platforms.md` for the
//! operation table and what HIP lacks.
//!
//! The host simulation (host streams, `HostVirtual`) is not a platform: host streams live
//! beside a GPU's streams in one process (a pool keeps books for both), so they are a kind
//! of [`StreamRef`](crate::StreamRef), not a choice made once for the build.

#[cfg(test)]
mod conformance;
pub(crate) mod cuda;
#[cfg(feature = "hip")]
pub(crate) mod hip;

use std::fmt;

use crate::error::Error;

/// The platform this build calls: CUDA, or HIP with the `hip` feature.
#[cfg(not(feature = "hip"))]
pub(crate) type Active = cuda::Cuda;
/// The platform this build calls: CUDA, or HIP with the `hip` feature.
#[cfg(feature = "hip")]
pub(crate) type Active = hip::Hip;

/// A context handle (`CUcontext`, `hipCtx_t`) as an integer; 0 is "none".
pub(crate) type ContextHandle = usize;
/// A stream handle (`CUstream`, `hipStream_t`) as an integer; 0 is the legacy default
/// stream, 2 the per-thread default stream, on both platforms.
pub(crate) type StreamHandle = usize;
/// An event handle (`CUevent`, `hipEvent_t`) as an integer.
pub(crate) type EventHandle = usize;
/// A driver pool handle (`CUmemoryPool`, `hipMemPool_t`) as an integer.
pub(crate) type PoolHandle = usize;
/// A physical allocation of virtual memory (`CUmemGenericAllocationHandle`,
/// `hipMemGenericAllocationHandle_t`) as an integer.
pub(crate) type MemHandle = u64;
/// A device as the driver names it (`CUdevice`, `hipDevice_t`).
pub(crate) type DeviceHandle = i32;

/// A driver's result code: which platform, and its value. memres's [`DriverError`]
/// holds one.
///
/// [`DriverError`]: crate::error::DriverError
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum ErrorCode {
    /// A `CUresult`.
    Cuda(cudarc::driver::sys::CUresult),
    /// A `hipError_t`.
    #[cfg(feature = "hip")]
    Hip(i32),
}

impl ErrorCode {
    /// The name of the platform the code is of, for messages (a HIP build converts
    /// cudarc's errors too: those are CUDA's).
    pub(crate) fn platform(self) -> &'static str {
        match self {
            ErrorCode::Cuda(_) => cuda::Cuda::NAME,
            #[cfg(feature = "hip")]
            ErrorCode::Hip(_) => hip::Hip::NAME,
        }
    }

    /// The numeric value.
    pub(crate) fn number(self) -> u32 {
        match self {
            ErrorCode::Cuda(r) => r as u32,
            #[cfg(feature = "hip")]
            ErrorCode::Hip(r) => r as u32,
        }
    }

    /// The code's name (`CUDA_ERROR_INVALID_VALUE`, `hipErrorInvalidValue`).
    pub(crate) fn name(self) -> String {
        match self {
            ErrorCode::Cuda(r) => format!("{r:?}"),
            #[cfg(feature = "hip")]
            ErrorCode::Hip(r) => hip::error_name(r),
        }
    }

    /// The driver's description, where its library is loaded.
    pub(crate) fn message(self) -> Option<String> {
        match self {
            ErrorCode::Cuda(r) => cuda::error_message(r),
            #[cfg(feature = "hip")]
            ErrorCode::Hip(r) => hip::error_message(r),
        }
    }

    /// True for the platform's out-of-memory code.
    pub(crate) fn is_out_of_memory(self) -> bool {
        match self {
            ErrorCode::Cuda(r) => r == cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY,
            #[cfg(feature = "hip")]
            ErrorCode::Hip(r) => r == hip::OUT_OF_MEMORY,
        }
    }
}

impl fmt::Debug for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}

/// A device property memres asks about before it uses a feature.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Attribute {
    /// Managed memory may be used by host and device at once (prefetching pays).
    ConcurrentManagedAccess,
    /// The device can access pageable host memory (HMM or ATS).
    PageableMemoryAccess,
    /// Virtual memory management (reserve, create, map).
    VirtualMemoryManagement,
    /// Physical allocations exportable as POSIX file descriptors.
    PosixFdHandles,
    /// Stream-ordered driver pools.
    MemoryPools,
    /// Driver pools exportable as POSIX file descriptors (1 or 0).
    PoolPosixFdHandles,
}

/// An attribute of a driver pool, as a 64-bit value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PoolAttribute {
    /// Bytes the pool keeps reserved at a synchronisation instead of releasing them.
    ReleaseThreshold,
    /// Bytes reserved from the device now.
    ReservedCurrent,
    /// The most bytes reserved at once (settable to 0, to reset it).
    ReservedHigh,
    /// Bytes handed out now.
    UsedCurrent,
}

/// Where memory should live (advice) or move to (prefetch).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Location {
    /// A device, by ordinal.
    Device(i32),
    /// The host.
    Host,
}

/// A thread's stream-capture mode (which calls a capture forbids on the thread).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CaptureMode {
    /// Potentially unsafe calls are forbidden while any thread captures.
    Global,
    /// Forbidden while this thread captures.
    ThreadLocal,
    /// Nothing is forbidden.
    Relaxed,
}

/// Operations a driver may lack; [`Platform::require`] says whether this one has each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Feature {
    /// Advice and prefetches that name a location (`cuMemAdvise_v2`,
    /// `cuMemPrefetchAsync_v2`: CUDA 12.2).
    LocatedAdvice,
    /// A capture's frontier: its id and the nodes new work would depend on
    /// (`cuStreamGetCaptureInfo_v3`: CUDA 12.3).
    CaptureFrontier,
    /// The device's default pool of managed memory (`cuMemGetDefaultMemPool`: CUDA 13.0).
    ManagedPool,
}

/// Where a stream's capture has reached: the capture's id and the nodes the next work
/// captured on it would depend on, as addresses.
pub(crate) type CaptureInfo = (u64, Vec<usize>);

/// Bytes in an IPC memory handle (`CUipcMemHandle`, `hipIpcMemHandle_t`).
pub(crate) const IPC_HANDLE_SIZE: usize = 64;

/// Every driver operation memres makes. Implemented by a unit type per platform; the crate
/// calls [`Active`]'s, so each call is static and inlined.
///
/// Conventions: "current" means the context current on the calling thread, which the
/// caller has made current (`device::bind`) where the operation says so. Allocation
/// operations report running out of memory as [`Error::OutOfMemory`] for the `requested`
/// bytes they are given; every other failure is [`Error::Driver`] with the platform's
/// code, or [`Error::Unsupported`] for an operation the platform lacks.
///
/// # Safety (all `unsafe fn` here)
/// Handles passed in are live handles of this platform (made by it and not destroyed),
/// and addresses are what the operation's own docs ask for; the driver cannot check
/// either, and a stale handle is undefined behaviour in the driver.
pub(crate) trait Platform {
    /// The platform's name as users read it: `"CUDA"`, `"HIP"`.
    const NAME: &'static str;
    /// How devices are named in messages: `cuda:0`, `hip:0`.
    const DEVICE_PREFIX: &'static str;

    // --- the driver -------------------------------------------------------------------

    /// True when the driver library can be loaded (looked up once, cached).
    fn is_present() -> bool;
    /// Initialises the driver; [`Error::NoDriver`] where its library is absent.
    fn init() -> Result<(), Error>;
    /// The driver's version number, in the platform's own encoding.
    fn driver_version() -> Result<i32, Error>;
    /// `Ok` where the driver offers `feature`, else [`Error::Unsupported`] naming `what`.
    fn require(feature: Feature, what: &str) -> Result<(), Error>;

    // --- devices and contexts ------------------------------------------------------------

    /// The number of devices.
    fn device_count() -> Result<usize, Error>;
    /// The driver's handle of device `ordinal`.
    fn device_get(ordinal: i32) -> Result<DeviceHandle, Error>;
    /// A device attribute: 0 for no, otherwise yes (or the count asked for).
    fn device_attribute(dev: DeviceHandle, attribute: Attribute) -> Result<i32, Error>;
    /// The device's name.
    fn device_name(dev: DeviceHandle) -> Result<String, Error>;
    /// Whether `dev` can access `peer`'s memory directly.
    fn device_can_access_peer(dev: DeviceHandle, peer: DeviceHandle) -> Result<bool, Error>;
    /// The device's primary context, retained for the life of the process.
    fn primary_context(dev: DeviceHandle) -> Result<ContextHandle, Error>;
    /// The context current on this thread, 0 for none.
    fn current_context() -> Result<ContextHandle, Error>;
    /// Makes `ctx` current on this thread.
    ///
    /// # Safety
    /// `ctx` is a live context.
    unsafe fn set_current_context(ctx: ContextHandle) -> Result<(), Error>;
    /// The ordinal of the current context's device.
    fn current_device() -> Result<i32, Error>;
    /// The ordinal of the device `stream` belongs to.
    ///
    /// # Safety
    /// `stream` is a live stream that is not a default-stream handle.
    unsafe fn stream_device(stream: StreamHandle) -> Result<i32, Error>;
    /// Waits for all work of the current context's device.
    fn synchronize_context() -> Result<(), Error>;
    /// Free and total bytes of the current device.
    fn memory_info() -> Result<(usize, usize), Error>;

    // --- streams and events ----------------------------------------------------------------

    /// A new stream of the current device (`non_blocking`: independent of the legacy
    /// default stream).
    fn stream_create(non_blocking: bool) -> Result<StreamHandle, Error>;
    /// Destroys a stream.
    ///
    /// # Safety
    /// `stream` is ours, live, and never used again.
    unsafe fn stream_destroy(stream: StreamHandle) -> Result<(), Error>;
    /// Waits until the stream's work so far is complete.
    ///
    /// # Safety
    /// `stream` is live (or a default stream of the current device).
    unsafe fn stream_synchronize(stream: StreamHandle) -> Result<(), Error>;
    /// Makes `stream`'s later work wait for `event`.
    ///
    /// # Safety
    /// Both are live (a default stream counts as live).
    unsafe fn stream_wait_event(stream: StreamHandle, event: EventHandle) -> Result<(), Error>;
    /// True while `stream` is captured into a graph (also for an invalidated capture not
    /// yet ended, and the legacy stream while a blocking stream is captured).
    ///
    /// # Safety
    /// As [`stream_synchronize`](Self::stream_synchronize).
    unsafe fn stream_is_capturing(stream: StreamHandle) -> Result<bool, Error>;
    /// Sets this thread's capture mode, returning the one it replaces.
    fn exchange_capture_mode(mode: CaptureMode) -> Result<CaptureMode, Error>;
    /// The stream's capture id and frontier while a capture is active; `None` when not
    /// capturing or the driver cannot say.
    ///
    /// # Safety
    /// As [`stream_synchronize`](Self::stream_synchronize).
    unsafe fn capture_frontier(stream: StreamHandle) -> Option<CaptureInfo>;
    /// The nodes `node` depends on in the graph being captured; `None` where the driver
    /// cannot say.
    ///
    /// # Safety
    /// `node` is a node of a live graph.
    unsafe fn node_dependencies(node: usize) -> Option<Vec<usize>>;
    /// A new event (timing disabled) of the current device.
    fn event_create() -> Result<EventHandle, Error>;
    /// Captures `stream`'s work so far in `event`.
    ///
    /// # Safety
    /// Both are live.
    unsafe fn event_record(event: EventHandle, stream: StreamHandle) -> Result<(), Error>;
    /// Waits on the host for the event.
    ///
    /// # Safety
    /// `event` is live.
    unsafe fn event_synchronize(event: EventHandle) -> Result<(), Error>;
    /// True when the event's work is complete.
    ///
    /// # Safety
    /// `event` is live.
    unsafe fn event_query(event: EventHandle) -> Result<bool, Error>;
    /// Destroys an event.
    ///
    /// # Safety
    /// `event` is ours and never used again (waits already enqueued stay valid).
    unsafe fn event_destroy(event: EventHandle) -> Result<(), Error>;

    // --- leaves ------------------------------------------------------------------------

    /// Device memory of the current device.
    fn mem_alloc(size: usize) -> Result<usize, Error>;
    /// Managed memory, attached globally.
    fn mem_alloc_managed(size: usize) -> Result<usize, Error>;
    /// Frees memory of [`mem_alloc`](Self::mem_alloc) or
    /// [`mem_alloc_managed`](Self::mem_alloc_managed).
    ///
    /// # Safety
    /// `address` came from one of them and nothing uses it any more.
    unsafe fn mem_free(address: usize) -> Result<(), Error>;
    /// Pinned host memory, portable and mapped into the device's address space, not
    /// write-combined; out of memory is reported for `requested` bytes.
    fn host_alloc(size: usize, requested: usize) -> Result<usize, Error>;
    /// Frees memory of [`host_alloc`](Self::host_alloc).
    ///
    /// # Safety
    /// `address` came from `host_alloc` and nothing uses it any more.
    unsafe fn host_free(address: usize) -> Result<(), Error>;
    /// Page-locks `len` bytes of host memory at `address` in place, portable (for every
    /// context), not mapped into the device's address space; out of memory is reported
    /// for `len` bytes.
    ///
    /// # Safety
    /// `address..address + len` lies in a live host mapping of the caller's, none of it
    /// registered yet, and stays mapped until [`host_unregister`](Self::host_unregister).
    unsafe fn host_register(address: usize, len: usize) -> Result<(), Error>;
    /// Unlocks a range [`host_register`](Self::host_register)ed at `address`.
    ///
    /// # Safety
    /// `address` starts a registered range that no copy uses any more.
    unsafe fn host_unregister(address: usize) -> Result<(), Error>;
    /// Whether `address` is managed memory; `false` for memory the driver does not know.
    fn pointer_is_managed(address: usize) -> Result<bool, Error>;
    /// The ordinal of the device whose memory `address` is.
    fn pointer_device(address: usize) -> Result<i32, Error>;
    /// The base and length of the allocation holding `address`.
    fn address_range(address: usize) -> Result<(usize, usize), Error>;
    /// Prefetches managed memory to `to`, in order on `stream`.
    ///
    /// # Safety
    /// The range is live managed memory; `stream` is live.
    unsafe fn prefetch(
        address: usize,
        len: usize,
        to: Location,
        stream: StreamHandle,
    ) -> Result<(), Error>;
    /// Sets the preferred location of a range of managed or pageable memory.
    ///
    /// # Safety
    /// The range lies in a live allocation.
    unsafe fn advise_preferred(address: usize, len: usize, to: Location) -> Result<(), Error>;

    // --- copies ------------------------------------------------------------------------

    /// Copies `len` bytes in order on `stream` (direction from the addresses).
    ///
    /// # Safety
    /// Both ranges are valid and disjoint until the stream's work is done; the stream's
    /// context is current.
    unsafe fn copy_async(
        dst: usize,
        src: usize,
        len: usize,
        stream: StreamHandle,
    ) -> Result<(), Error>;
    /// Sets `len` bytes of device-accessible memory to `value`, in order on `stream`.
    ///
    /// # Safety
    /// As [`copy_async`](Self::copy_async), for `dst` alone.
    unsafe fn fill_async(
        dst: usize,
        value: u8,
        len: usize,
        stream: StreamHandle,
    ) -> Result<(), Error>;

    // --- driver pools ------------------------------------------------------------------

    /// A new pool of pinned device memory on `device` (`posix_fd`: exportable).
    fn pool_create(device: i32, posix_fd: bool) -> Result<PoolHandle, Error>;
    /// Destroys a pool.
    ///
    /// # Safety
    /// The pool is ours and never used again.
    unsafe fn pool_destroy(pool: PoolHandle) -> Result<(), Error>;
    /// The device's default pool (the one the runtime's async allocations use).
    fn default_pool(dev: DeviceHandle) -> Result<PoolHandle, Error>;
    /// The device's default pool of managed memory; [`Error::Unsupported`] where there is
    /// none.
    fn default_managed_pool(device: i32) -> Result<PoolHandle, Error>;
    /// Allocates from `pool` in order on `stream`.
    ///
    /// # Safety
    /// Both are live; the pool's context is current.
    unsafe fn pool_alloc_async(
        pool: PoolHandle,
        size: usize,
        stream: StreamHandle,
    ) -> Result<usize, Error>;
    /// Frees pool memory in order on `stream`.
    ///
    /// # Safety
    /// `address` came from a pool and its work is ordered before this on `stream`.
    unsafe fn free_async(address: usize, stream: StreamHandle) -> Result<(), Error>;
    /// A pool attribute.
    ///
    /// # Safety
    /// The pool is live.
    unsafe fn pool_get(pool: PoolHandle, attribute: PoolAttribute) -> Result<u64, Error>;
    /// Sets a pool attribute.
    ///
    /// # Safety
    /// The pool is live.
    unsafe fn pool_set(pool: PoolHandle, attribute: PoolAttribute, value: u64)
    -> Result<(), Error>;
    /// Releases the pool's unused memory down to `keep` bytes.
    ///
    /// # Safety
    /// The pool is live.
    unsafe fn pool_trim_to(pool: PoolHandle, keep: usize) -> Result<(), Error>;
    /// A new POSIX file descriptor for the pool (made with `posix_fd`).
    ///
    /// # Safety
    /// The pool is live.
    unsafe fn pool_export_fd(pool: PoolHandle) -> Result<i32, Error>;
    /// Lets each of `devices` (not the pool's own) read and write the pool's memory, what
    /// it holds now and what it allocates later.
    ///
    /// # Safety
    /// The pool is live.
    unsafe fn pool_set_access(pool: PoolHandle, devices: &[i32]) -> Result<(), Error>;
    /// Whether `device` may read and write the pool's memory.
    ///
    /// # Safety
    /// The pool is live.
    unsafe fn pool_get_access(pool: PoolHandle, device: i32) -> Result<bool, Error>;

    // --- virtual memory ------------------------------------------------------------------

    /// The granularity of physical allocations of `device` (`posix_fd`: exportable).
    fn vm_granularity(device: i32, posix_fd: bool) -> Result<usize, Error>;
    /// Reserves `len` bytes of address space aligned to `align`.
    fn vm_reserve(len: usize, align: usize) -> Result<usize, Error>;
    /// Frees a reservation.
    ///
    /// # Safety
    /// The reservation is ours with nothing mapped in it.
    unsafe fn vm_free(base: usize, len: usize) -> Result<(), Error>;
    /// A physical allocation of `size` bytes of pinned memory on `device`; out of memory
    /// is reported for `requested` bytes.
    fn vm_create(
        size: usize,
        device: i32,
        posix_fd: bool,
        requested: usize,
    ) -> Result<MemHandle, Error>;
    /// Drops our reference to a physical allocation (a mapping keeps its own).
    ///
    /// # Safety
    /// `handle` is a reference of ours, never used again.
    unsafe fn vm_release(handle: MemHandle) -> Result<(), Error>;
    /// Maps `handle` at `address` for `size` bytes; out of memory is reported for
    /// `requested` bytes.
    ///
    /// # Safety
    /// `address..address + size` is unmapped space of a reservation of ours.
    unsafe fn vm_map(
        address: usize,
        size: usize,
        handle: MemHandle,
        requested: usize,
    ) -> Result<(), Error>;
    /// Unmaps `address..address + size`.
    ///
    /// # Safety
    /// The range is mapped by us and nothing uses it any more.
    unsafe fn vm_unmap(address: usize, size: usize) -> Result<(), Error>;
    /// Makes a mapped range readable and writable from `devices`; out of memory is
    /// reported for `requested` bytes.
    ///
    /// # Safety
    /// The range is mapped.
    unsafe fn vm_set_access(
        address: usize,
        len: usize,
        devices: &[i32],
        requested: usize,
    ) -> Result<(), Error>;
    /// A new reference to the physical allocation mapped at `address`.
    ///
    /// # Safety
    /// `address` starts a mapped granule.
    unsafe fn vm_retain(address: usize) -> Result<MemHandle, Error>;
    /// A new POSIX file descriptor for a physical allocation made with `posix_fd`.
    ///
    /// # Safety
    /// `handle` is live.
    unsafe fn vm_export_fd(handle: MemHandle) -> Result<i32, Error>;
    /// A reference to the physical allocation another process exported as `fd`.
    fn vm_import_fd(fd: i32) -> Result<MemHandle, Error>;

    // --- IPC ------------------------------------------------------------------------------

    /// The IPC handle of the allocation holding `address`.
    fn ipc_get(address: usize) -> Result<[u8; IPC_HANDLE_SIZE], Error>;
    /// Opens another process's IPC handle in the current context (peer access enabled
    /// lazily); the allocation's base here.
    fn ipc_open(handle: &[u8; IPC_HANDLE_SIZE]) -> Result<usize, Error>;
    /// Closes what [`ipc_open`](Self::ipc_open) opened.
    ///
    /// # Safety
    /// `base` came from `ipc_open` and nothing uses it any more.
    unsafe fn ipc_close(base: usize) -> Result<(), Error>;
}

/// Reports a failed driver call in a `Drop` or a `deallocate`, which cannot return it.
#[inline]
pub(crate) fn report(what: &str, result: Result<(), Error>) {
    if let Err(e) = result {
        report_cold(what, e);
    }
}

#[cold]
fn report_cold(what: &str, e: Error) {
    tracing::error!(%e, "memres: {what} failed");
}
