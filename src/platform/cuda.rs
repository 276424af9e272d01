//! The CUDA platform: NVIDIA's driver API through cudarc's bindings (libcuda is loaded at
//! run time, so a machine without it gets [`Error::NoDriver`], never a link error).
//!
//! Each operation is the driver call the crate made directly before the seam, with the
//! same arguments; `#[inline]` keeps the hot ones (context checks, pool and stream calls)
//! as cheap as they were.

use std::ffi::{c_int, c_void};
use std::sync::OnceLock;

use cudarc::driver::sys::{self, CUresult};

use super::{
    Attribute, CaptureInfo, CaptureMode, ContextHandle, DeviceHandle, EventHandle, Feature,
    IPC_HANDLE_SIZE, Location, MemHandle, Platform, PoolAttribute, PoolHandle, StreamHandle,
};
use crate::error::{DriverError, Error};

/// NVIDIA's CUDA driver API.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Cuda;

/// `Ok(())` for `CUDA_SUCCESS`, else the error (out-of-memory as [`Error::OutOfMemory`] of
/// unknown size; see [`check_alloc`] where the size is known).
#[inline]
fn check(result: CUresult) -> Result<(), Error> {
    match result {
        CUresult::CUDA_SUCCESS => Ok(()),
        other => Err(Error::from(DriverError::new(super::ErrorCode::Cuda(other)))),
    }
}

/// As [`check`], with out-of-memory reported for `requested` bytes.
#[inline]
fn check_alloc(result: CUresult, requested: usize) -> Result<(), Error> {
    match result {
        CUresult::CUDA_SUCCESS => Ok(()),
        CUresult::CUDA_ERROR_OUT_OF_MEMORY => Err(Error::out_of_memory(requested)),
        other => Err(Error::Driver(DriverError::new(super::ErrorCode::Cuda(
            other,
        )))),
    }
}

/// The driver's description of `code`, where libcuda is loaded.
pub(super) fn error_message(code: CUresult) -> Option<String> {
    if !Cuda::is_present() {
        return None;
    }
    let e = cudarc::driver::DriverError(code);
    let s = e.error_string().ok()?;
    Some(s.to_string_lossy().into_owned())
}

/// The driver's version, asked once.
fn version() -> Result<i32, Error> {
    static VERSION: OnceLock<Result<i32, Error>> = OnceLock::new();
    VERSION.get_or_init(Cuda::driver_version).clone()
}

fn location(to: Location) -> sys::CUmemLocation {
    match to {
        Location::Device(id) => sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id,
        },
        Location::Host => sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST,
            id: 0,
        },
    }
}

fn handle_type(posix_fd: bool) -> sys::CUmemAllocationHandleType {
    if posix_fd {
        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    } else {
        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE
    }
}

/// The properties of a physical allocation of pinned memory on `device`.
fn allocation_prop(device: i32, posix_fd: bool) -> sys::CUmemAllocationProp {
    // SAFETY: an all-zero property struct is valid (plain integers and a null pointer);
    // the fields that matter are set below.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location = location(Location::Device(device));
    prop.requestedHandleTypes = handle_type(posix_fd);
    prop
}

fn pool_attribute(attribute: PoolAttribute) -> sys::CUmemPool_attribute {
    use sys::CUmemPool_attribute as A;
    match attribute {
        PoolAttribute::ReleaseThreshold => A::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
        PoolAttribute::ReservedCurrent => A::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
        PoolAttribute::ReservedHigh => A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
        PoolAttribute::UsedCurrent => A::CU_MEMPOOL_ATTR_USED_MEM_CURRENT,
    }
}

fn capture_mode(mode: CaptureMode) -> sys::CUstreamCaptureMode {
    use sys::CUstreamCaptureMode as M;
    match mode {
        CaptureMode::Global => M::CU_STREAM_CAPTURE_MODE_GLOBAL,
        CaptureMode::ThreadLocal => M::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
        CaptureMode::Relaxed => M::CU_STREAM_CAPTURE_MODE_RELAXED,
    }
}

impl Platform for Cuda {
    const NAME: &'static str = "CUDA";
    const DEVICE_PREFIX: &'static str = "cuda";

    fn is_present() -> bool {
        static PRESENT: OnceLock<bool> = OnceLock::new();
        // SAFETY: `is_culib_present` only tries to open the library with `dlopen` and
        // closes it again; it calls no CUDA function, so it has no precondition.
        *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() })
    }

    fn init() -> Result<(), Error> {
        if !Cuda::is_present() {
            return Err(Error::NoDriver);
        }
        // SAFETY: the library is present (checked above), and `cuInit(0)` has no other
        // precondition; it may be called any number of times.
        check(unsafe { sys::cuInit(0) })
    }

    fn driver_version() -> Result<i32, Error> {
        let mut v = 0;
        // SAFETY: the driver is loaded (the caller initialised it); `v` is a valid place.
        check(unsafe { sys::cuDriverGetVersion(&mut v) })?;
        Ok(v)
    }

    fn require(feature: Feature, what: &str) -> Result<(), Error> {
        let required = match feature {
            Feature::LocatedAdvice => 12020,
            Feature::CaptureFrontier => 12030,
            Feature::ManagedPool => 13000,
        };
        let have = version()?;
        if have < required {
            return Err(Error::unsupported(format!(
                "{what} needs a CUDA {}.{} driver; this one is {}.{}",
                required / 1000,
                required % 1000 / 10,
                have / 1000,
                have % 1000 / 10
            )));
        }
        Ok(())
    }

    fn device_count() -> Result<usize, Error> {
        let mut n = 0;
        // SAFETY: the driver is initialised (the caller's); `n` is a valid place.
        check(unsafe { sys::cuDeviceGetCount(&mut n) })?;
        Ok(n.max(0) as usize)
    }

    fn device_get(ordinal: i32) -> Result<DeviceHandle, Error> {
        let mut dev = 0;
        // SAFETY: the driver is initialised; `dev` is a valid place for the result.
        check(unsafe { sys::cuDeviceGet(&mut dev, ordinal) })?;
        Ok(dev)
    }

    fn device_attribute(dev: DeviceHandle, attribute: Attribute) -> Result<i32, Error> {
        use sys::CUdevice_attribute as A;
        let raw = match attribute {
            Attribute::ConcurrentManagedAccess => A::CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS,
            Attribute::PageableMemoryAccess => A::CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS,
            Attribute::VirtualMemoryManagement => {
                A::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
            }
            Attribute::PosixFdHandles => {
                A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED
            }
            Attribute::MemoryPools => A::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED,
            Attribute::PoolPosixFdHandles => A::CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES,
        };
        let mut value = 0;
        // SAFETY: `dev` is a valid device handle; `value` is a valid place for the result.
        check(unsafe { sys::cuDeviceGetAttribute(&mut value, raw, dev) })?;
        if attribute == Attribute::PoolPosixFdHandles {
            let fd = handle_type(true).0 as i32;
            return Ok(i32::from(value & fd != 0));
        }
        Ok(value)
    }

    fn device_name(dev: DeviceHandle) -> Result<String, Error> {
        let mut buf = [0 as std::ffi::c_char; 256];
        // SAFETY: `buf` holds 256 bytes, the length passed; `dev` is a valid handle.
        check(unsafe { sys::cuDeviceGetName(buf.as_mut_ptr(), buf.len() as i32, dev) })?;
        // SAFETY: the driver wrote a NUL-terminated string into `buf`.
        let name = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) };
        Ok(name.to_string_lossy().into_owned())
    }

    fn device_can_access_peer(dev: DeviceHandle, peer: DeviceHandle) -> Result<bool, Error> {
        let mut can = 0;
        // SAFETY: both handles are valid devices; `can` is a valid place for the result.
        check(unsafe { sys::cuDeviceCanAccessPeer(&mut can, dev, peer) })?;
        Ok(can != 0)
    }

    fn primary_context(dev: DeviceHandle) -> Result<ContextHandle, Error> {
        let mut ctx = std::ptr::null_mut();
        // SAFETY: `dev` is a valid device handle; `ctx` is a valid place for the result.
        // The retain is never released: the context lives as long as the process.
        check(unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, dev) })?;
        Ok(ctx as usize)
    }

    #[inline]
    fn current_context() -> Result<ContextHandle, Error> {
        let mut current = std::ptr::null_mut();
        // SAFETY: contexts exist only once the driver is initialised (a caller without
        // one has asked `init` first); `current` is a valid place.
        check(unsafe { sys::cuCtxGetCurrent(&mut current) })?;
        Ok(current as usize)
    }

    #[inline]
    unsafe fn set_current_context(ctx: ContextHandle) -> Result<(), Error> {
        // SAFETY: `ctx` is a live context (the caller's promise).
        check(unsafe { sys::cuCtxSetCurrent(ctx as sys::CUcontext) })
    }

    fn current_device() -> Result<i32, Error> {
        let mut dev = 0;
        // SAFETY: a context is current (the caller's); `dev` is a valid place.
        check(unsafe { sys::cuCtxGetDevice(&mut dev) })?;
        Ok(dev)
    }

    unsafe fn stream_device(stream: StreamHandle) -> Result<i32, Error> {
        let mut ctx = std::ptr::null_mut();
        // SAFETY: the driver is initialised; `stream` names a live stream (the caller's
        // promise); `ctx` is a valid place for the result.
        check(unsafe { sys::cuStreamGetCtx(stream as sys::CUstream, &mut ctx) })?;
        // SAFETY: `ctx` is the live context of a live stream.
        check(unsafe { sys::cuCtxPushCurrent_v2(ctx) })?;
        let got = Cuda::current_device();
        let mut popped = std::ptr::null_mut();
        // SAFETY: pops the context pushed above.
        super::report("restoring the current context", unsafe {
            check(sys::cuCtxPopCurrent_v2(&mut popped))
        });
        got
    }

    fn synchronize_context() -> Result<(), Error> {
        // SAFETY: the call only waits for the current context's work.
        check(unsafe { sys::cuCtxSynchronize() })
    }

    fn memory_info() -> Result<(usize, usize), Error> {
        let (mut free, mut total) = (0, 0);
        // SAFETY: the device's context is current; both are valid places for results.
        check(unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) })?;
        Ok((free, total))
    }

    fn stream_create(non_blocking: bool) -> Result<StreamHandle, Error> {
        let flags = if non_blocking {
            sys::CUstream_flags::CU_STREAM_NON_BLOCKING
        } else {
            sys::CUstream_flags::CU_STREAM_DEFAULT
        };
        let mut raw = std::ptr::null_mut();
        // SAFETY: a context is current; `raw` is a valid place for the new handle.
        check(unsafe { sys::cuStreamCreate(&mut raw, flags as u32) })?;
        Ok(raw as usize)
    }

    unsafe fn stream_destroy(stream: StreamHandle) -> Result<(), Error> {
        // SAFETY: the caller's promise: ours, live, never used again.
        check(unsafe { sys::cuStreamDestroy_v2(stream as sys::CUstream) })
    }

    #[inline]
    unsafe fn stream_synchronize(stream: StreamHandle) -> Result<(), Error> {
        // SAFETY: `stream` is live or a default stream (the caller's promise).
        check(unsafe { sys::cuStreamSynchronize(stream as sys::CUstream) })
    }

    #[inline]
    unsafe fn stream_wait_event(stream: StreamHandle, event: EventHandle) -> Result<(), Error> {
        // SAFETY: both are live (the caller's promise).
        check(unsafe { sys::cuStreamWaitEvent(stream as sys::CUstream, event as sys::CUevent, 0) })
    }

    unsafe fn stream_is_capturing(stream: StreamHandle) -> Result<bool, Error> {
        use sys::CUstreamCaptureStatus as S;
        let mut status = S::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: `stream` is live (the caller's promise); `status` is a valid place.
        match unsafe { sys::cuStreamIsCapturing(stream as sys::CUstream, &mut status) } {
            // Asking about the legacy stream while a blocking stream is captured.
            CUresult::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT => Ok(true),
            result => {
                check(result)?;
                Ok(status != S::CU_STREAM_CAPTURE_STATUS_NONE)
            }
        }
    }

    fn exchange_capture_mode(mode: CaptureMode) -> Result<CaptureMode, Error> {
        use sys::CUstreamCaptureMode as M;
        let mut raw = capture_mode(mode);
        // SAFETY: `raw` is a valid place; the call only swaps the thread's mode.
        check(unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut raw) })?;
        Ok(match raw {
            M::CU_STREAM_CAPTURE_MODE_GLOBAL => CaptureMode::Global,
            M::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL => CaptureMode::ThreadLocal,
            M::CU_STREAM_CAPTURE_MODE_RELAXED => CaptureMode::Relaxed,
        })
    }

    unsafe fn capture_frontier(stream: StreamHandle) -> Option<CaptureInfo> {
        use sys::CUstreamCaptureStatus as S;
        // The 12.3 entry point, which cudarc would panic on where it is missing.
        Cuda::require(Feature::CaptureFrontier, "a capture's frontier").ok()?;
        let mut status = S::CU_STREAM_CAPTURE_STATUS_NONE;
        let mut capture = 0u64;
        let mut graph = std::ptr::null_mut();
        let mut nodes: *const sys::CUgraphNode = std::ptr::null();
        let mut edges: *const sys::CUgraphEdgeData = std::ptr::null();
        let mut count = 0usize;
        // SAFETY: `stream` is live (the caller's promise); every out-pointer is a valid
        // place; the arrays the driver points to live while the capture does, and are
        // copied before this returns.
        let result = unsafe {
            sys::cuStreamGetCaptureInfo_v3(
                stream as sys::CUstream,
                &mut status,
                &mut capture,
                &mut graph,
                &mut nodes,
                &mut edges,
                &mut count,
            )
        };
        if result != CUresult::CUDA_SUCCESS || status != S::CU_STREAM_CAPTURE_STATUS_ACTIVE {
            return None;
        }
        let nodes = if count == 0 || nodes.is_null() {
            Vec::new()
        } else {
            // SAFETY: the driver's array of `count` nodes (above).
            unsafe { std::slice::from_raw_parts(nodes, count) }
                .iter()
                .map(|&node| node as usize)
                .collect()
        };
        Some((capture, nodes))
    }

    unsafe fn node_dependencies(node: usize) -> Option<Vec<usize>> {
        let raw = node as sys::CUgraphNode;
        let mut count = 0usize;
        // SAFETY: `raw` is a node of a live graph (the caller's promise); null arrays ask
        // for the count only.
        let result = unsafe {
            sys::cuGraphNodeGetDependencies_v2(
                raw,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                &mut count,
            )
        };
        if result != CUresult::CUDA_SUCCESS {
            return None;
        }
        if count == 0 {
            return Some(Vec::new());
        }
        let mut deps: Vec<sys::CUgraphNode> = vec![std::ptr::null_mut(); count];
        // SAFETY: zeroed edge data is the default edge's (a plain C struct of integers).
        let mut edges: Vec<sys::CUgraphEdgeData> = vec![unsafe { std::mem::zeroed() }; count];
        // SAFETY: both arrays have room for `count` entries.
        let result = unsafe {
            sys::cuGraphNodeGetDependencies_v2(
                raw,
                deps.as_mut_ptr(),
                edges.as_mut_ptr(),
                &mut count,
            )
        };
        if result != CUresult::CUDA_SUCCESS {
            return None;
        }
        Some(deps.iter().take(count).map(|&d| d as usize).collect())
    }

    fn event_create() -> Result<EventHandle, Error> {
        let mut raw = std::ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: a context is current; `raw` is a valid place for the new handle.
        check(unsafe { sys::cuEventCreate(&mut raw, flags) })?;
        Ok(raw as usize)
    }

    #[inline]
    unsafe fn event_record(event: EventHandle, stream: StreamHandle) -> Result<(), Error> {
        // SAFETY: both are live (the caller's promise).
        check(unsafe { sys::cuEventRecord(event as sys::CUevent, stream as sys::CUstream) })
    }

    unsafe fn event_synchronize(event: EventHandle) -> Result<(), Error> {
        // SAFETY: the event is live (the caller's promise).
        check(unsafe { sys::cuEventSynchronize(event as sys::CUevent) })
    }

    #[inline]
    unsafe fn event_query(event: EventHandle) -> Result<bool, Error> {
        // SAFETY: the event is live (the caller's promise).
        match unsafe { sys::cuEventQuery(event as sys::CUevent) } {
            CUresult::CUDA_SUCCESS => Ok(true),
            CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            other => check(other).map(|()| false),
        }
    }

    unsafe fn event_destroy(event: EventHandle) -> Result<(), Error> {
        // SAFETY: the caller's promise: ours, never used again.
        check(unsafe { sys::cuEventDestroy_v2(event as sys::CUevent) })
    }

    #[inline]
    fn mem_alloc(size: usize) -> Result<usize, Error> {
        let mut address = 0;
        // SAFETY: the context is current (the caller binds it); `address` is a valid place.
        check_alloc(unsafe { sys::cuMemAlloc_v2(&mut address, size) }, size)?;
        Ok(address as usize)
    }

    fn mem_alloc_managed(size: usize) -> Result<usize, Error> {
        let mut address = 0;
        let global = sys::CUmemAttach_flags::CU_MEM_ATTACH_GLOBAL as u32;
        // SAFETY: the context is current (the caller binds it); `address` is a valid place.
        let result = unsafe { sys::cuMemAllocManaged(&mut address, size, global) };
        check_alloc(result, size)?;
        Ok(address as usize)
    }

    #[inline]
    unsafe fn mem_free(address: usize) -> Result<(), Error> {
        // SAFETY: the caller's promise: from `cuMemAlloc`/`cuMemAllocManaged`, unused.
        check(unsafe { sys::cuMemFree_v2(address as sys::CUdeviceptr) })
    }

    fn host_alloc(size: usize, requested: usize) -> Result<usize, Error> {
        let mut p: *mut c_void = std::ptr::null_mut();
        let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
        // SAFETY: the context is current (the caller binds it); `p` is a valid place.
        let result = unsafe { sys::cuMemHostAlloc(&mut p, size, flags) };
        check_alloc(result, requested)?;
        Ok(p as usize)
    }

    unsafe fn host_free(address: usize) -> Result<(), Error> {
        // SAFETY: the caller's promise: from `cuMemHostAlloc`, unused.
        check(unsafe { sys::cuMemFreeHost(address as *mut c_void) })
    }

    unsafe fn host_register(address: usize, len: usize) -> Result<(), Error> {
        // SAFETY: the caller's promise: a live host mapping, none of it registered;
        // registering only page-locks it.
        let result = unsafe {
            sys::cuMemHostRegister_v2(
                std::ptr::with_exposed_provenance_mut(address),
                len,
                sys::CU_MEMHOSTREGISTER_PORTABLE,
            )
        };
        check_alloc(result, len)
    }

    unsafe fn host_unregister(address: usize) -> Result<(), Error> {
        // SAFETY: the caller's promise: registered at `address`, unused.
        check(unsafe { sys::cuMemHostUnregister(std::ptr::with_exposed_provenance_mut(address)) })
    }

    fn pointer_is_managed(address: usize) -> Result<bool, Error> {
        let mut managed = 0u32;
        let attr = sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_MANAGED;
        // SAFETY: the attribute is a boolean the driver writes into the low byte of the
        // zeroed u32; the call only reads the driver's records of `address`.
        let result = unsafe {
            sys::cuPointerGetAttribute(
                (&mut managed as *mut u32).cast(),
                attr,
                address as sys::CUdeviceptr,
            )
        };
        // Pageable host memory is unknown to the driver: not managed.
        if result == CUresult::CUDA_ERROR_INVALID_VALUE {
            return Ok(false);
        }
        check(result)?;
        Ok(managed != 0)
    }

    fn pointer_device(address: usize) -> Result<i32, Error> {
        let mut ordinal: i32 = 0;
        let attr = sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL;
        // SAFETY: the driver is initialised; `ordinal` is a valid place for an int attribute.
        check(unsafe {
            sys::cuPointerGetAttribute(
                (&mut ordinal as *mut i32).cast(),
                attr,
                address as sys::CUdeviceptr,
            )
        })?;
        Ok(ordinal)
    }

    fn address_range(address: usize) -> Result<(usize, usize), Error> {
        let (mut base, mut size) = (0, 0);
        // SAFETY: the call only reads the driver's record of `address`; the out-places
        // are valid.
        check(unsafe {
            sys::cuMemGetAddressRange_v2(&mut base, &mut size, address as sys::CUdeviceptr)
        })?;
        Ok((base as usize, size))
    }

    unsafe fn prefetch(
        address: usize,
        len: usize,
        to: Location,
        stream: StreamHandle,
    ) -> Result<(), Error> {
        // SAFETY: the range is live managed memory and `stream` is live (the caller's
        // promise); prefetching moves pages and never changes their contents.
        check(unsafe {
            sys::cuMemPrefetchAsync_v2(
                address as sys::CUdeviceptr,
                len,
                location(to),
                0,
                stream as sys::CUstream,
            )
        })
    }

    unsafe fn advise_preferred(address: usize, len: usize, to: Location) -> Result<(), Error> {
        let advice = sys::CUmem_advise::CU_MEM_ADVISE_SET_PREFERRED_LOCATION;
        // SAFETY: the range lies in a live allocation (the caller's promise); advice only
        // changes where pages prefer to live, never their contents.
        check(unsafe {
            sys::cuMemAdvise_v2(address as sys::CUdeviceptr, len, advice, location(to))
        })
    }

    #[inline]
    unsafe fn copy_async(
        dst: usize,
        src: usize,
        len: usize,
        stream: StreamHandle,
    ) -> Result<(), Error> {
        // SAFETY: the caller's promise (valid, disjoint ranges; the context current); the
        // driver infers the direction from the addresses (unified addressing).
        check(unsafe {
            sys::cuMemcpyAsync(
                dst as sys::CUdeviceptr,
                src as sys::CUdeviceptr,
                len,
                stream as sys::CUstream,
            )
        })
    }

    #[inline]
    unsafe fn fill_async(
        dst: usize,
        value: u8,
        len: usize,
        stream: StreamHandle,
    ) -> Result<(), Error> {
        // SAFETY: the caller's promise: device-accessible memory valid for `len` bytes.
        check(unsafe {
            sys::cuMemsetD8Async(dst as sys::CUdeviceptr, value, len, stream as sys::CUstream)
        })
    }

    fn pool_create(device: i32, posix_fd: bool) -> Result<PoolHandle, Error> {
        // SAFETY: `CUmemPoolProps` is plain data (integers, a pointer, bytes) for which
        // all-zero is valid: it is the documented way to leave fields at their defaults.
        let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
        props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        props.handleTypes = handle_type(posix_fd);
        props.location = location(Location::Device(device));
        let mut pool = std::ptr::null_mut();
        // SAFETY: the device's context is current; `props` is initialised; `pool` is a
        // valid place for the handle.
        check(unsafe { sys::cuMemPoolCreate(&mut pool, &props) })?;
        Ok(pool as usize)
    }

    unsafe fn pool_destroy(pool: PoolHandle) -> Result<(), Error> {
        // SAFETY: the caller's promise: ours, never used again (blocks still out keep it
        // alive inside the driver until they are freed).
        check(unsafe { sys::cuMemPoolDestroy(pool as sys::CUmemoryPool) })
    }

    fn default_pool(dev: DeviceHandle) -> Result<PoolHandle, Error> {
        let mut pool = std::ptr::null_mut();
        // SAFETY: `dev` is a valid device; `pool` is a valid place for the handle.
        check(unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, dev) })?;
        Ok(pool as usize)
    }

    fn default_managed_pool(device: i32) -> Result<PoolHandle, Error> {
        Cuda::require(Feature::ManagedPool, "a managed memory pool")?;
        let mut at = location(Location::Device(device));
        let mut pool = std::ptr::null_mut();
        // SAFETY: the context is current; `at` names the device; `pool` is a valid place
        // for the handle.
        let result = unsafe {
            sys::cuMemGetDefaultMemPool(
                &mut pool,
                &mut at,
                sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_MANAGED,
            )
        };
        match result {
            CUresult::CUDA_ERROR_NOT_SUPPORTED | CUresult::CUDA_ERROR_INVALID_VALUE => {
                Err(Error::unsupported(format!(
                    "the driver offers no managed memory pool for cuda:{device} ({result:?})"
                )))
            }
            other => {
                check(other)?;
                Ok(pool as usize)
            }
        }
    }

    #[inline]
    unsafe fn pool_alloc_async(
        pool: PoolHandle,
        size: usize,
        stream: StreamHandle,
    ) -> Result<usize, Error> {
        let mut address = 0;
        // SAFETY: the caller's promise: the pool and stream are live, the context current.
        let result = unsafe {
            sys::cuMemAllocFromPoolAsync(
                &mut address,
                size,
                pool as sys::CUmemoryPool,
                stream as sys::CUstream,
            )
        };
        check_alloc(result, size)?;
        Ok(address as usize)
    }

    #[inline]
    unsafe fn free_async(address: usize, stream: StreamHandle) -> Result<(), Error> {
        // SAFETY: the caller's promise: pool memory whose work is ordered before this.
        check(unsafe { sys::cuMemFreeAsync(address as sys::CUdeviceptr, stream as sys::CUstream) })
    }

    unsafe fn pool_get(pool: PoolHandle, attribute: PoolAttribute) -> Result<u64, Error> {
        let mut value = 0u64;
        // SAFETY: the pool is live; the u64 attributes are written as a `cuuint64_t`.
        check(unsafe {
            sys::cuMemPoolGetAttribute(
                pool as sys::CUmemoryPool,
                pool_attribute(attribute),
                (&mut value as *mut u64).cast(),
            )
        })?;
        Ok(value)
    }

    unsafe fn pool_set(
        pool: PoolHandle,
        attribute: PoolAttribute,
        mut value: u64,
    ) -> Result<(), Error> {
        // SAFETY: the pool is live; the u64 attributes are read as a `cuuint64_t`.
        check(unsafe {
            sys::cuMemPoolSetAttribute(
                pool as sys::CUmemoryPool,
                pool_attribute(attribute),
                (&mut value as *mut u64).cast(),
            )
        })
    }

    unsafe fn pool_trim_to(pool: PoolHandle, keep: usize) -> Result<(), Error> {
        // SAFETY: the pool is live (the caller's promise).
        check(unsafe { sys::cuMemPoolTrimTo(pool as sys::CUmemoryPool, keep) })
    }

    unsafe fn pool_export_fd(pool: PoolHandle) -> Result<i32, Error> {
        let mut fd: c_int = -1;
        // SAFETY: the pool is live and exportable as a POSIX fd (the caller's promise),
        // which the driver writes as an `int` into `fd`.
        check(unsafe {
            sys::cuMemPoolExportToShareableHandle(
                (&mut fd as *mut c_int).cast::<c_void>(),
                pool as sys::CUmemoryPool,
                handle_type(true),
                0,
            )
        })?;
        Ok(fd)
    }

    unsafe fn pool_set_access(pool: PoolHandle, devices: &[i32]) -> Result<(), Error> {
        let access = access_descs(devices);
        // SAFETY: the pool is live (the caller's promise); one descriptor a device.
        check(unsafe {
            sys::cuMemPoolSetAccess(pool as sys::CUmemoryPool, access.as_ptr(), access.len())
        })
    }

    unsafe fn pool_get_access(pool: PoolHandle, device: i32) -> Result<bool, Error> {
        let mut at = location(Location::Device(device));
        // Read as an integer, not as the enum: any value the driver writes is one.
        let mut flags: u32 = 0;
        // SAFETY: the pool is live (the caller's promise); `at` names a device; the driver
        // writes the flags, a C enum of 4 bytes, into `flags`.
        check(unsafe {
            sys::cuMemPoolGetAccess(
                (&mut flags as *mut u32).cast(),
                pool as sys::CUmemoryPool,
                &mut at,
            )
        })?;
        Ok(flags == sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE as u32)
    }

    fn vm_granularity(device: i32, posix_fd: bool) -> Result<usize, Error> {
        let prop = allocation_prop(device, posix_fd);
        let mut granularity = 0;
        // SAFETY: `prop` describes device memory of `device`; `granularity` is a valid place.
        check(unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut granularity,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        })?;
        Ok(granularity)
    }

    fn vm_reserve(len: usize, align: usize) -> Result<usize, Error> {
        let mut base = 0;
        // SAFETY: reserves address space only (no memory); `base` is a valid place.
        let result = unsafe { sys::cuMemAddressReserve(&mut base, len, align, 0, 0) };
        check_alloc(result, len)?;
        Ok(base as usize)
    }

    unsafe fn vm_free(base: usize, len: usize) -> Result<(), Error> {
        // SAFETY: the caller's promise: our reservation, nothing mapped in it.
        check(unsafe { sys::cuMemAddressFree(base as sys::CUdeviceptr, len) })
    }

    fn vm_create(
        size: usize,
        device: i32,
        posix_fd: bool,
        requested: usize,
    ) -> Result<MemHandle, Error> {
        let prop = allocation_prop(device, posix_fd);
        let mut handle = 0;
        // SAFETY: `prop` describes pinned device memory of `device`; `handle` is a valid
        // place.
        let result = unsafe { sys::cuMemCreate(&mut handle, size, &prop, 0) };
        check_alloc(result, requested)?;
        Ok(handle)
    }

    unsafe fn vm_release(handle: MemHandle) -> Result<(), Error> {
        // SAFETY: the caller's promise: a reference of ours, never used again.
        check(unsafe { sys::cuMemRelease(handle) })
    }

    unsafe fn vm_map(
        address: usize,
        size: usize,
        handle: MemHandle,
        requested: usize,
    ) -> Result<(), Error> {
        // SAFETY: the caller's promise: unmapped space of our reservation; `handle` live.
        check_alloc(
            unsafe { sys::cuMemMap(address as sys::CUdeviceptr, size, 0, handle, 0) },
            requested,
        )
    }

    unsafe fn vm_unmap(address: usize, size: usize) -> Result<(), Error> {
        // SAFETY: the caller's promise: mapped by us, unused.
        check(unsafe { sys::cuMemUnmap(address as sys::CUdeviceptr, size) })
    }

    unsafe fn vm_set_access(
        address: usize,
        len: usize,
        devices: &[i32],
        requested: usize,
    ) -> Result<(), Error> {
        let access = access_descs(devices);
        // SAFETY: the range is mapped (the caller's promise); one descriptor a device.
        check_alloc(
            unsafe {
                sys::cuMemSetAccess(
                    address as sys::CUdeviceptr,
                    len,
                    access.as_ptr(),
                    access.len(),
                )
            },
            requested,
        )
    }

    unsafe fn vm_retain(address: usize) -> Result<MemHandle, Error> {
        let mut handle = 0;
        // SAFETY: `address` starts a mapped granule (the caller's promise), which has an
        // allocation; retaining it gives the caller a reference to release.
        check(unsafe {
            sys::cuMemRetainAllocationHandle(&mut handle, std::ptr::without_provenance_mut(address))
        })?;
        Ok(handle)
    }

    unsafe fn vm_export_fd(handle: MemHandle) -> Result<i32, Error> {
        let mut fd: c_int = -1;
        // SAFETY: `handle` is live and was created with the POSIX-fd handle type (the
        // caller's promise); `fd` is a valid place for an int.
        check(unsafe {
            sys::cuMemExportToShareableHandle(
                (&mut fd as *mut c_int).cast(),
                handle,
                handle_type(true),
                0,
            )
        })?;
        Ok(fd)
    }

    fn vm_import_fd(fd: i32) -> Result<MemHandle, Error> {
        let mut handle = 0;
        // SAFETY: for POSIX descriptors the OS handle is the descriptor itself, passed as a
        // pointer-sized integer; `handle` is a valid place.
        check(unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut handle,
                fd as usize as *mut c_void,
                handle_type(true),
            )
        })?;
        Ok(handle)
    }

    fn ipc_get(address: usize) -> Result<[u8; IPC_HANDLE_SIZE], Error> {
        let mut handle = sys::CUipcMemHandle_st {
            reserved: [0; IPC_HANDLE_SIZE],
        };
        // SAFETY: `handle` is a valid place; the driver checks `address` (an error for
        // memory it cannot share).
        check(unsafe { sys::cuIpcGetMemHandle(&mut handle, address as sys::CUdeviceptr) })?;
        Ok(handle.reserved.map(|b| b as u8))
    }

    fn ipc_open(handle: &[u8; IPC_HANDLE_SIZE]) -> Result<usize, Error> {
        let raw = sys::CUipcMemHandle_st {
            reserved: handle.map(|b| b as std::ffi::c_char),
        };
        let mut base = 0;
        // SAFETY: `base` is a valid place; the driver validates the handle.
        check(unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut base,
                raw,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        })?;
        Ok(base as usize)
    }

    unsafe fn ipc_close(base: usize) -> Result<(), Error> {
        // SAFETY: the caller's promise: opened by `ipc_open`, unused.
        check(unsafe { sys::cuIpcCloseMemHandle(base as sys::CUdeviceptr) })
    }
}

/// Read and write access for each of `devices`.
fn access_descs(devices: &[i32]) -> Vec<sys::CUmemAccessDesc> {
    devices
        .iter()
        .map(|&d| sys::CUmemAccessDesc {
            location: location(Location::Device(d)),
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        })
        .collect()
}
