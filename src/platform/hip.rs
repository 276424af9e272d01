//! The HIP platform (feature `hip`): AMD's HIP runtime, `libamdhip64`, loaded at run time
//! with `libloading` as cudarc loads libcuda, so a machine without ROCm gets
//! [`Error::NoDriver`], never a link error.
//!
//! The declarations below are memres's own, written from AMD's public HIP API reference
//! (`hip_runtime_api.h` of ROCm 6): each function's C signature, and the numeric values of
//! the enumerators memres passes. Every symbol is looked up once, when the library is
//! loaded; one the installed runtime lacks makes only the operations that need it fail,
//! with [`Error::Unsupported`] naming it.
//!
//! **Not yet run on AMD hardware**: this module builds and is clippy-checked in CI, and its
//! loading is tested on machines without ROCm (`Error::NoDriver`); `docs/platforms.md`
//! gives the commands that run the GPU tests on a machine with an AMD GPU.

use std::ffi::{CStr, c_char, c_int, c_uint, c_ulonglong, c_void};
use std::sync::OnceLock;

use super::{
    Attribute, CaptureInfo, CaptureMode, ContextHandle, DeviceHandle, EventHandle, Feature,
    IPC_HANDLE_SIZE, Location, MemHandle, Platform, PoolAttribute, PoolHandle, StreamHandle,
};
use crate::error::{DriverError, Error};

/// `hipError_t`.
type HipError = c_int;
type Ptr = *mut c_void;

const SUCCESS: HipError = 0;
const INVALID_VALUE: HipError = 1;
/// `hipErrorOutOfMemory`.
pub(super) const OUT_OF_MEMORY: HipError = 2;
const NOT_READY: HipError = 600;
const STREAM_CAPTURE_IMPLICIT: HipError = 906;

// Enumerators of hip_runtime_api.h (ROCm 6).
const STREAM_NON_BLOCKING: c_uint = 0x1;
const EVENT_DISABLE_TIMING: c_uint = 0x2;
const MEM_ATTACH_GLOBAL: c_uint = 0x1;
const HOST_MALLOC_PORTABLE: c_uint = 0x1;
const HOST_MALLOC_MAPPED: c_uint = 0x2;
const HOST_REGISTER_PORTABLE: c_uint = 0x1;
const MEMCPY_DEFAULT: c_int = 4;
const POINTER_ATTRIBUTE_IS_MANAGED: c_int = 8;
const POINTER_ATTRIBUTE_DEVICE_ORDINAL: c_int = 9;
const MEM_ADVISE_SET_PREFERRED_LOCATION: c_int = 3;
const CPU_DEVICE_ID: c_int = -1;
const CAPTURE_STATUS_NONE: c_int = 0;
const CAPTURE_STATUS_ACTIVE: c_int = 1;
const MEM_ALLOCATION_TYPE_PINNED: c_int = 1;
const MEM_HANDLE_TYPE_NONE: c_int = 0;
const MEM_HANDLE_TYPE_POSIX_FD: c_int = 1;
const MEM_LOCATION_TYPE_DEVICE: c_int = 1;
const MEM_ACCESS_PROT_READ_WRITE: c_int = 3;
const GRANULARITY_MINIMUM: c_int = 0;
const IPC_LAZY_ENABLE_PEER_ACCESS: c_uint = 0x1;

/// `hipMemAllocationProp` and `hipMemPoolProps` share their first fields (an allocation
/// type, handle types, a `hipMemLocation`, a Windows pointer); the zeroed tail covers the
/// rest of the larger of the two, whose remaining fields memres leaves at their zero
/// defaults.
#[repr(C)]
struct Props {
    allocation_type: c_int,
    handle_types: c_int,
    location_type: c_int,
    location_id: c_int,
    win32: Ptr,
    tail: [u8; 96],
}

impl Props {
    fn new(device: i32, posix_fd: bool) -> Props {
        Props {
            allocation_type: MEM_ALLOCATION_TYPE_PINNED,
            handle_types: if posix_fd {
                MEM_HANDLE_TYPE_POSIX_FD
            } else {
                MEM_HANDLE_TYPE_NONE
            },
            location_type: MEM_LOCATION_TYPE_DEVICE,
            location_id: device,
            win32: std::ptr::null_mut(),
            tail: [0; 96],
        }
    }
}

/// `hipMemAccessDesc`.
#[repr(C)]
struct AccessDesc {
    location_type: c_int,
    location_id: c_int,
    flags: c_int,
}

/// `hipMemLocation`.
#[repr(C)]
struct MemLocation {
    location_type: c_int,
    location_id: c_int,
}

/// Read and write access for each of `devices`.
fn access_descs(devices: &[i32]) -> Vec<AccessDesc> {
    devices
        .iter()
        .map(|&d| AccessDesc {
            location_type: MEM_LOCATION_TYPE_DEVICE,
            location_id: d,
            flags: MEM_ACCESS_PROT_READ_WRITE,
        })
        .collect()
}

/// `hipIpcMemHandle_t`.
#[repr(C)]
#[derive(Clone, Copy)]
struct IpcHandle {
    reserved: [c_char; IPC_HANDLE_SIZE],
}

/// Declares the table of HIP entry points: each an optional function pointer, looked up
/// once when the library loads.
macro_rules! hip_api {
    ($($name:ident: fn($($arg:ty),*) -> $ret:ty;)*) => {
        /// The HIP runtime's entry points that memres calls, and the library they live in.
        #[allow(non_snake_case)]
        struct Api {
            $($name: Option<unsafe extern "C" fn($($arg),*) -> $ret>,)*
            /// Kept loaded as long as the process: the pointers above point into it.
            _library: libloading::Library,
        }

        impl Api {
            // The locals are named as the entry points are (they fill the fields).
            #[allow(non_snake_case)]
            fn load(library: libloading::Library) -> Api {
                $(
                    let symbol = concat!(stringify!($name), "\0").as_bytes();
                    // SAFETY: the symbol's type is HIP's declaration of that function,
                    // written above from AMD's API reference; the pointer is used only
                    // while `library` stays loaded (it is kept in the table).
                    let $name = unsafe {
                        library.get::<unsafe extern "C" fn($($arg),*) -> $ret>(symbol)
                    }
                    .ok()
                    .map(|f| *f);
                )*
                Api { $($name,)* _library: library }
            }
        }
    };
}

hip_api! {
    hipInit: fn(c_uint) -> HipError;
    hipDriverGetVersion: fn(*mut c_int) -> HipError;
    hipGetErrorName: fn(HipError) -> *const c_char;
    hipGetErrorString: fn(HipError) -> *const c_char;
    hipGetDeviceCount: fn(*mut c_int) -> HipError;
    hipDeviceGet: fn(*mut c_int, c_int) -> HipError;
    hipDeviceGetAttribute: fn(*mut c_int, c_int, c_int) -> HipError;
    hipDeviceGetName: fn(*mut c_char, c_int, c_int) -> HipError;
    hipDeviceCanAccessPeer: fn(*mut c_int, c_int, c_int) -> HipError;
    hipDevicePrimaryCtxRetain: fn(*mut Ptr, c_int) -> HipError;
    hipCtxGetCurrent: fn(*mut Ptr) -> HipError;
    hipCtxSetCurrent: fn(Ptr) -> HipError;
    hipCtxGetDevice: fn(*mut c_int) -> HipError;
    hipStreamGetDevice: fn(Ptr, *mut c_int) -> HipError;
    hipDeviceSynchronize: fn() -> HipError;
    hipMemGetInfo: fn(*mut usize, *mut usize) -> HipError;
    hipStreamCreateWithFlags: fn(*mut Ptr, c_uint) -> HipError;
    hipStreamDestroy: fn(Ptr) -> HipError;
    hipStreamSynchronize: fn(Ptr) -> HipError;
    hipStreamWaitEvent: fn(Ptr, Ptr, c_uint) -> HipError;
    hipStreamIsCapturing: fn(Ptr, *mut c_int) -> HipError;
    hipThreadExchangeStreamCaptureMode: fn(*mut c_int) -> HipError;
    hipStreamGetCaptureInfo_v2:
        fn(Ptr, *mut c_int, *mut c_ulonglong, *mut Ptr, *mut *const Ptr, *mut usize) -> HipError;
    hipGraphNodeGetDependencies: fn(Ptr, *mut Ptr, *mut usize) -> HipError;
    hipEventCreateWithFlags: fn(*mut Ptr, c_uint) -> HipError;
    hipEventRecord: fn(Ptr, Ptr) -> HipError;
    hipEventSynchronize: fn(Ptr) -> HipError;
    hipEventQuery: fn(Ptr) -> HipError;
    hipEventDestroy: fn(Ptr) -> HipError;
    hipMalloc: fn(*mut Ptr, usize) -> HipError;
    hipMallocManaged: fn(*mut Ptr, usize, c_uint) -> HipError;
    hipFree: fn(Ptr) -> HipError;
    hipHostMalloc: fn(*mut Ptr, usize, c_uint) -> HipError;
    hipHostFree: fn(Ptr) -> HipError;
    hipHostRegister: fn(Ptr, usize, c_uint) -> HipError;
    hipHostUnregister: fn(Ptr) -> HipError;
    hipPointerGetAttribute: fn(Ptr, c_int, Ptr) -> HipError;
    hipMemGetAddressRange: fn(*mut Ptr, *mut usize, Ptr) -> HipError;
    hipMemPrefetchAsync: fn(Ptr, usize, c_int, Ptr) -> HipError;
    hipMemAdvise: fn(Ptr, usize, c_int, c_int) -> HipError;
    hipMemcpyAsync: fn(Ptr, Ptr, usize, c_int, Ptr) -> HipError;
    hipMemsetD8Async: fn(Ptr, u8, usize, Ptr) -> HipError;
    hipMemPoolCreate: fn(*mut Ptr, *const Props) -> HipError;
    hipMemPoolDestroy: fn(Ptr) -> HipError;
    hipDeviceGetDefaultMemPool: fn(*mut Ptr, c_int) -> HipError;
    hipMallocFromPoolAsync: fn(*mut Ptr, usize, Ptr, Ptr) -> HipError;
    hipFreeAsync: fn(Ptr, Ptr) -> HipError;
    hipMemPoolGetAttribute: fn(Ptr, c_int, Ptr) -> HipError;
    hipMemPoolSetAttribute: fn(Ptr, c_int, Ptr) -> HipError;
    hipMemPoolTrimTo: fn(Ptr, usize) -> HipError;
    hipMemPoolExportToShareableHandle: fn(Ptr, Ptr, c_int, c_uint) -> HipError;
    hipMemPoolSetAccess: fn(Ptr, *const AccessDesc, usize) -> HipError;
    hipMemPoolGetAccess: fn(*mut c_int, Ptr, *mut MemLocation) -> HipError;
    hipMemGetAllocationGranularity: fn(*mut usize, *const Props, c_int) -> HipError;
    hipMemAddressReserve: fn(*mut Ptr, usize, usize, Ptr, c_ulonglong) -> HipError;
    hipMemAddressFree: fn(Ptr, usize) -> HipError;
    hipMemCreate: fn(*mut Ptr, usize, *const Props, c_ulonglong) -> HipError;
    hipMemRelease: fn(Ptr) -> HipError;
    hipMemMap: fn(Ptr, usize, usize, Ptr, c_ulonglong) -> HipError;
    hipMemUnmap: fn(Ptr, usize) -> HipError;
    hipMemSetAccess: fn(Ptr, usize, *const AccessDesc, usize) -> HipError;
    hipMemRetainAllocationHandle: fn(*mut Ptr, Ptr) -> HipError;
    hipMemExportToShareableHandle: fn(Ptr, Ptr, c_int, c_ulonglong) -> HipError;
    hipMemImportFromShareableHandle: fn(*mut Ptr, Ptr, c_int) -> HipError;
    hipIpcGetMemHandle: fn(*mut IpcHandle, Ptr) -> HipError;
    hipIpcOpenMemHandle: fn(*mut Ptr, IpcHandle, c_uint) -> HipError;
    hipIpcCloseMemHandle: fn(Ptr) -> HipError;
}

/// The names libamdhip64 is tried under, in order.
const LIBRARY_NAMES: [&str; 4] = [
    "libamdhip64.so",
    "libamdhip64.so.7",
    "libamdhip64.so.6",
    "amdhip64.dll",
];

/// The loaded runtime, or `None` where no library could be loaded (looked up once).
fn api() -> Option<&'static Api> {
    static API: OnceLock<Option<Api>> = OnceLock::new();
    API.get_or_init(|| {
        LIBRARY_NAMES.iter().find_map(|name| {
            // SAFETY: loading libamdhip64 runs its initialisers, which have no
            // precondition on the loading process (ROCm programs load it the same way).
            unsafe { libloading::Library::new(*name) }
                .ok()
                .map(Api::load)
        })
    })
    .as_ref()
}

/// The entry point `$name`, or the error for its absence.
macro_rules! entry {
    ($name:ident) => {
        api()
            .ok_or(Error::NoDriver)?
            .$name
            .ok_or_else(|| missing(stringify!($name)))?
    };
}

#[cold]
fn missing(name: &str) -> Error {
    Error::unsupported(format!(
        "the installed HIP runtime (libamdhip64) lacks {name}"
    ))
}

/// What HIP lacks for [`Feature::ManagedPool`].
fn no_managed_pool(what: &str) -> Error {
    Error::unsupported(format!(
        "{what}: HIP has no default pool of managed memory \
         (CUDA 13's cuMemGetDefaultMemPool with managed memory)"
    ))
}

fn driver_error(code: HipError) -> Error {
    Error::from(DriverError::new(super::ErrorCode::Hip(code)))
}

#[inline]
fn check(result: HipError) -> Result<(), Error> {
    match result {
        SUCCESS => Ok(()),
        other => Err(driver_error(other)),
    }
}

#[inline]
fn check_alloc(result: HipError, requested: usize) -> Result<(), Error> {
    match result {
        SUCCESS => Ok(()),
        OUT_OF_MEMORY => Err(Error::out_of_memory(requested)),
        other => Err(Error::Driver(DriverError::new(super::ErrorCode::Hip(
            other,
        )))),
    }
}

/// A C string the runtime returned, copied.
fn text(p: *const c_char) -> Option<String> {
    if p.is_null() {
        return None;
    }
    // SAFETY: HIP's name and description functions return NUL-terminated strings with
    // static lifetime.
    Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

/// The code's name (`hipErrorInvalidValue`), from the runtime where loaded.
pub(super) fn error_name(code: HipError) -> String {
    api()
        .and_then(|a| a.hipGetErrorName)
        // SAFETY: `hipGetErrorName` takes any code and returns a static string.
        .and_then(|f| text(unsafe { f(code) }))
        .unwrap_or_else(|| format!("hipError_t({code})"))
}

/// The runtime's description of `code`, where loaded.
pub(super) fn error_message(code: HipError) -> Option<String> {
    let f = api()?.hipGetErrorString?;
    // SAFETY: `hipGetErrorString` takes any code and returns a static string.
    text(unsafe { f(code) })
}

fn ptr(address: usize) -> Ptr {
    std::ptr::with_exposed_provenance_mut(address)
}

fn device_of(to: Location) -> c_int {
    match to {
        Location::Device(id) => id,
        Location::Host => CPU_DEVICE_ID,
    }
}

fn pool_attribute(attribute: PoolAttribute) -> c_int {
    // `hipMemPoolAttr`: the same values as CUDA's `CUmemPool_attribute`.
    match attribute {
        PoolAttribute::ReleaseThreshold => 4,
        PoolAttribute::ReservedCurrent => 5,
        PoolAttribute::ReservedHigh => 6,
        PoolAttribute::UsedCurrent => 7,
    }
}

fn capture_mode(mode: CaptureMode) -> c_int {
    match mode {
        CaptureMode::Global => 0,
        CaptureMode::ThreadLocal => 1,
        CaptureMode::Relaxed => 2,
    }
}

/// AMD's HIP runtime (ROCm).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Hip;

impl Platform for Hip {
    const NAME: &'static str = "HIP";
    const DEVICE_PREFIX: &'static str = "hip";

    fn is_present() -> bool {
        api().is_some()
    }

    fn init() -> Result<(), Error> {
        let f = entry!(hipInit);
        // SAFETY: `hipInit(0)` has no precondition.
        check(unsafe { f(0) })
    }

    fn driver_version() -> Result<i32, Error> {
        let f = entry!(hipDriverGetVersion);
        let mut v = 0;
        // SAFETY: `v` is a valid place.
        check(unsafe { f(&mut v) })?;
        Ok(v)
    }

    fn require(feature: Feature, what: &str) -> Result<(), Error> {
        let api = api().ok_or(Error::NoDriver)?;
        match feature {
            // HIP's advice and prefetches name a device (or the host as -1) directly.
            Feature::LocatedAdvice => Ok(()),
            Feature::CaptureFrontier => api
                .hipStreamGetCaptureInfo_v2
                .map(|_| ())
                .ok_or_else(|| missing("hipStreamGetCaptureInfo_v2")),
            Feature::ManagedPool => Err(no_managed_pool(what)),
        }
    }

    fn device_count() -> Result<usize, Error> {
        let f = entry!(hipGetDeviceCount);
        let mut n = 0;
        // SAFETY: `n` is a valid place.
        check(unsafe { f(&mut n) })?;
        Ok(n.max(0) as usize)
    }

    fn device_get(ordinal: i32) -> Result<DeviceHandle, Error> {
        let f = entry!(hipDeviceGet);
        let mut dev = 0;
        // SAFETY: `dev` is a valid place.
        check(unsafe { f(&mut dev, ordinal) })?;
        Ok(dev)
    }

    fn device_attribute(dev: DeviceHandle, attribute: Attribute) -> Result<i32, Error> {
        // `hipDeviceAttribute_t` values; HIP has no attribute for POSIX descriptors of
        // physical allocations: on Linux every device with virtual memory management
        // exports them.
        let raw = match attribute {
            Attribute::ConcurrentManagedAccess => 9,
            Attribute::PageableMemoryAccess => 65,
            Attribute::MemoryPools => 88,
            Attribute::VirtualMemoryManagement | Attribute::PosixFdHandles => 89,
            Attribute::PoolPosixFdHandles => 91,
        };
        let f = entry!(hipDeviceGetAttribute);
        let mut value = 0;
        // SAFETY: `value` is a valid place; HIP checks the device and the attribute.
        check(unsafe { f(&mut value, raw, dev) })?;
        if attribute == Attribute::PoolPosixFdHandles {
            return Ok(i32::from(value & MEM_HANDLE_TYPE_POSIX_FD != 0));
        }
        Ok(value)
    }

    fn device_name(dev: DeviceHandle) -> Result<String, Error> {
        let f = entry!(hipDeviceGetName);
        let mut buf = [0 as c_char; 256];
        // SAFETY: `buf` holds 256 bytes, the length passed.
        check(unsafe { f(buf.as_mut_ptr(), buf.len() as c_int, dev) })?;
        buf[255] = 0;
        // SAFETY: NUL-terminated (the runtime's string, or the last byte set above).
        Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .into_owned())
    }

    fn device_can_access_peer(dev: DeviceHandle, peer: DeviceHandle) -> Result<bool, Error> {
        let f = entry!(hipDeviceCanAccessPeer);
        let mut can = 0;
        // SAFETY: `can` is a valid place.
        check(unsafe { f(&mut can, dev, peer) })?;
        Ok(can != 0)
    }

    fn primary_context(dev: DeviceHandle) -> Result<ContextHandle, Error> {
        let f = entry!(hipDevicePrimaryCtxRetain);
        let mut ctx = std::ptr::null_mut();
        // SAFETY: `ctx` is a valid place; the retain is never released.
        check(unsafe { f(&mut ctx, dev) })?;
        Ok(ctx as usize)
    }

    #[inline]
    fn current_context() -> Result<ContextHandle, Error> {
        let f = entry!(hipCtxGetCurrent);
        let mut ctx = std::ptr::null_mut();
        // SAFETY: `ctx` is a valid place.
        check(unsafe { f(&mut ctx) })?;
        Ok(ctx as usize)
    }

    #[inline]
    unsafe fn set_current_context(ctx: ContextHandle) -> Result<(), Error> {
        let f = entry!(hipCtxSetCurrent);
        // SAFETY: `ctx` is a live context (the caller's promise).
        check(unsafe { f(ptr(ctx)) })
    }

    fn current_device() -> Result<i32, Error> {
        let f = entry!(hipCtxGetDevice);
        let mut dev = 0;
        // SAFETY: `dev` is a valid place.
        check(unsafe { f(&mut dev) })?;
        Ok(dev)
    }

    unsafe fn stream_device(stream: StreamHandle) -> Result<i32, Error> {
        let f = entry!(hipStreamGetDevice);
        let mut dev = 0;
        // SAFETY: `stream` is live (the caller's promise); `dev` is a valid place.
        check(unsafe { f(ptr(stream), &mut dev) })?;
        Ok(dev)
    }

    fn synchronize_context() -> Result<(), Error> {
        let f = entry!(hipDeviceSynchronize);
        // SAFETY: only waits for the current device.
        check(unsafe { f() })
    }

    fn memory_info() -> Result<(usize, usize), Error> {
        let f = entry!(hipMemGetInfo);
        let (mut free, mut total) = (0, 0);
        // SAFETY: both are valid places.
        check(unsafe { f(&mut free, &mut total) })?;
        Ok((free, total))
    }

    fn stream_create(non_blocking: bool) -> Result<StreamHandle, Error> {
        let f = entry!(hipStreamCreateWithFlags);
        let flags = if non_blocking { STREAM_NON_BLOCKING } else { 0 };
        let mut raw = std::ptr::null_mut();
        // SAFETY: `raw` is a valid place.
        check(unsafe { f(&mut raw, flags) })?;
        Ok(raw as usize)
    }

    unsafe fn stream_destroy(stream: StreamHandle) -> Result<(), Error> {
        let f = entry!(hipStreamDestroy);
        // SAFETY: the caller's promise: ours, live, never used again.
        check(unsafe { f(ptr(stream)) })
    }

    #[inline]
    unsafe fn stream_synchronize(stream: StreamHandle) -> Result<(), Error> {
        let f = entry!(hipStreamSynchronize);
        // SAFETY: `stream` is live or a default stream (the caller's promise).
        check(unsafe { f(ptr(stream)) })
    }

    #[inline]
    unsafe fn stream_wait_event(stream: StreamHandle, event: EventHandle) -> Result<(), Error> {
        let f = entry!(hipStreamWaitEvent);
        // SAFETY: both are live (the caller's promise).
        check(unsafe { f(ptr(stream), ptr(event), 0) })
    }

    unsafe fn stream_is_capturing(stream: StreamHandle) -> Result<bool, Error> {
        let f = entry!(hipStreamIsCapturing);
        let mut status = CAPTURE_STATUS_NONE;
        // SAFETY: `stream` is live (the caller's promise); `status` is a valid place.
        match unsafe { f(ptr(stream), &mut status) } {
            STREAM_CAPTURE_IMPLICIT => Ok(true),
            result => {
                check(result)?;
                Ok(status != CAPTURE_STATUS_NONE)
            }
        }
    }

    fn exchange_capture_mode(mode: CaptureMode) -> Result<CaptureMode, Error> {
        let f = entry!(hipThreadExchangeStreamCaptureMode);
        let mut raw = capture_mode(mode);
        // SAFETY: `raw` is a valid place; the call only swaps the thread's mode.
        check(unsafe { f(&mut raw) })?;
        Ok(match raw {
            0 => CaptureMode::Global,
            1 => CaptureMode::ThreadLocal,
            _ => CaptureMode::Relaxed,
        })
    }

    unsafe fn capture_frontier(stream: StreamHandle) -> Option<CaptureInfo> {
        let f = api()?.hipStreamGetCaptureInfo_v2?;
        let mut status = CAPTURE_STATUS_NONE;
        let mut capture: c_ulonglong = 0;
        let mut graph = std::ptr::null_mut();
        let mut nodes: *const Ptr = std::ptr::null();
        let mut count = 0usize;
        // SAFETY: `stream` is live (the caller's promise); every out-pointer is a valid
        // place; the node array lives while the capture does and is copied below.
        let result = unsafe {
            f(
                ptr(stream),
                &mut status,
                &mut capture,
                &mut graph,
                &mut nodes,
                &mut count,
            )
        };
        if result != SUCCESS || status != CAPTURE_STATUS_ACTIVE {
            return None;
        }
        let nodes = if count == 0 || nodes.is_null() {
            Vec::new()
        } else {
            // SAFETY: the runtime's array of `count` nodes (above).
            unsafe { std::slice::from_raw_parts(nodes, count) }
                .iter()
                .map(|&node| node as usize)
                .collect()
        };
        Some((capture, nodes))
    }

    unsafe fn node_dependencies(node: usize) -> Option<Vec<usize>> {
        let f = api()?.hipGraphNodeGetDependencies?;
        let mut count = 0usize;
        // SAFETY: `node` is a node of a live graph (the caller's promise); a null array
        // asks for the count only.
        if unsafe { f(ptr(node), std::ptr::null_mut(), &mut count) } != SUCCESS {
            return None;
        }
        let mut deps: Vec<Ptr> = vec![std::ptr::null_mut(); count];
        if count > 0 {
            // SAFETY: `deps` has room for `count` entries.
            if unsafe { f(ptr(node), deps.as_mut_ptr(), &mut count) } != SUCCESS {
                return None;
            }
        }
        Some(deps.iter().take(count).map(|&d| d as usize).collect())
    }

    fn event_create() -> Result<EventHandle, Error> {
        let f = entry!(hipEventCreateWithFlags);
        let mut raw = std::ptr::null_mut();
        // SAFETY: `raw` is a valid place.
        check(unsafe { f(&mut raw, EVENT_DISABLE_TIMING) })?;
        Ok(raw as usize)
    }

    #[inline]
    unsafe fn event_record(event: EventHandle, stream: StreamHandle) -> Result<(), Error> {
        let f = entry!(hipEventRecord);
        // SAFETY: both are live (the caller's promise).
        check(unsafe { f(ptr(event), ptr(stream)) })
    }

    unsafe fn event_synchronize(event: EventHandle) -> Result<(), Error> {
        let f = entry!(hipEventSynchronize);
        // SAFETY: the event is live (the caller's promise).
        check(unsafe { f(ptr(event)) })
    }

    #[inline]
    unsafe fn event_query(event: EventHandle) -> Result<bool, Error> {
        let f = entry!(hipEventQuery);
        // SAFETY: the event is live (the caller's promise).
        match unsafe { f(ptr(event)) } {
            SUCCESS => Ok(true),
            NOT_READY => Ok(false),
            other => Err(driver_error(other)),
        }
    }

    unsafe fn event_destroy(event: EventHandle) -> Result<(), Error> {
        let f = entry!(hipEventDestroy);
        // SAFETY: the caller's promise: ours, never used again.
        check(unsafe { f(ptr(event)) })
    }

    #[inline]
    fn mem_alloc(size: usize) -> Result<usize, Error> {
        let f = entry!(hipMalloc);
        let mut p = std::ptr::null_mut();
        // SAFETY: `p` is a valid place.
        check_alloc(unsafe { f(&mut p, size) }, size)?;
        Ok(p as usize)
    }

    fn mem_alloc_managed(size: usize) -> Result<usize, Error> {
        let f = entry!(hipMallocManaged);
        let mut p = std::ptr::null_mut();
        // SAFETY: `p` is a valid place.
        check_alloc(unsafe { f(&mut p, size, MEM_ATTACH_GLOBAL) }, size)?;
        Ok(p as usize)
    }

    #[inline]
    unsafe fn mem_free(address: usize) -> Result<(), Error> {
        let f = entry!(hipFree);
        // SAFETY: the caller's promise: from `hipMalloc`/`hipMallocManaged`, unused.
        check(unsafe { f(ptr(address)) })
    }

    fn host_alloc(size: usize, requested: usize) -> Result<usize, Error> {
        let f = entry!(hipHostMalloc);
        let mut p = std::ptr::null_mut();
        // SAFETY: `p` is a valid place.
        let result = unsafe { f(&mut p, size, HOST_MALLOC_PORTABLE | HOST_MALLOC_MAPPED) };
        check_alloc(result, requested)?;
        Ok(p as usize)
    }

    unsafe fn host_free(address: usize) -> Result<(), Error> {
        let f = entry!(hipHostFree);
        // SAFETY: the caller's promise: from `hipHostMalloc`, unused.
        check(unsafe { f(ptr(address)) })
    }

    unsafe fn host_register(address: usize, len: usize) -> Result<(), Error> {
        let f = entry!(hipHostRegister);
        // SAFETY: the caller's promise: a live host mapping, none of it registered;
        // registering only page-locks it.
        check_alloc(unsafe { f(ptr(address), len, HOST_REGISTER_PORTABLE) }, len)
    }

    unsafe fn host_unregister(address: usize) -> Result<(), Error> {
        let f = entry!(hipHostUnregister);
        // SAFETY: the caller's promise: registered at `address`, unused.
        check(unsafe { f(ptr(address)) })
    }

    fn pointer_is_managed(address: usize) -> Result<bool, Error> {
        let f = entry!(hipPointerGetAttribute);
        let mut managed: c_uint = 0;
        // SAFETY: the attribute is a boolean written into the zeroed `c_uint`; the call
        // only reads the runtime's records of `address`.
        let result = unsafe {
            f(
                (&mut managed as *mut c_uint).cast(),
                POINTER_ATTRIBUTE_IS_MANAGED,
                ptr(address),
            )
        };
        if result == INVALID_VALUE {
            return Ok(false);
        }
        check(result)?;
        Ok(managed != 0)
    }

    fn pointer_device(address: usize) -> Result<i32, Error> {
        let f = entry!(hipPointerGetAttribute);
        let mut ordinal: c_int = 0;
        // SAFETY: `ordinal` is a valid place for an int attribute.
        check(unsafe {
            f(
                (&mut ordinal as *mut c_int).cast(),
                POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                ptr(address),
            )
        })?;
        Ok(ordinal)
    }

    fn address_range(address: usize) -> Result<(usize, usize), Error> {
        let f = entry!(hipMemGetAddressRange);
        let (mut base, mut size) = (std::ptr::null_mut(), 0);
        // SAFETY: the call only reads the runtime's record; the out-places are valid.
        check(unsafe { f(&mut base, &mut size, ptr(address)) })?;
        Ok((base as usize, size))
    }

    unsafe fn prefetch(
        address: usize,
        len: usize,
        to: Location,
        stream: StreamHandle,
    ) -> Result<(), Error> {
        let f = entry!(hipMemPrefetchAsync);
        // SAFETY: the caller's promise: live managed memory, a live stream.
        check(unsafe { f(ptr(address), len, device_of(to), ptr(stream)) })
    }

    unsafe fn advise_preferred(address: usize, len: usize, to: Location) -> Result<(), Error> {
        let f = entry!(hipMemAdvise);
        // SAFETY: the caller's promise: the range lies in a live allocation.
        check(unsafe {
            f(
                ptr(address),
                len,
                MEM_ADVISE_SET_PREFERRED_LOCATION,
                device_of(to),
            )
        })
    }

    #[inline]
    unsafe fn copy_async(
        dst: usize,
        src: usize,
        len: usize,
        stream: StreamHandle,
    ) -> Result<(), Error> {
        let f = entry!(hipMemcpyAsync);
        // SAFETY: the caller's promise (valid, disjoint ranges); the direction comes from
        // the addresses (`hipMemcpyDefault`, unified addressing).
        check(unsafe { f(ptr(dst), ptr(src), len, MEMCPY_DEFAULT, ptr(stream)) })
    }

    #[inline]
    unsafe fn fill_async(
        dst: usize,
        value: u8,
        len: usize,
        stream: StreamHandle,
    ) -> Result<(), Error> {
        let f = entry!(hipMemsetD8Async);
        // SAFETY: the caller's promise: device-accessible memory valid for `len` bytes.
        check(unsafe { f(ptr(dst), value, len, ptr(stream)) })
    }

    fn pool_create(device: i32, posix_fd: bool) -> Result<PoolHandle, Error> {
        let f = entry!(hipMemPoolCreate);
        let props = Props::new(device, posix_fd);
        let mut pool = std::ptr::null_mut();
        // SAFETY: `props` is a `hipMemPoolProps` (see `Props`); `pool` is a valid place.
        check(unsafe { f(&mut pool, &props) })?;
        Ok(pool as usize)
    }

    unsafe fn pool_destroy(pool: PoolHandle) -> Result<(), Error> {
        let f = entry!(hipMemPoolDestroy);
        // SAFETY: the caller's promise: ours, never used again.
        check(unsafe { f(ptr(pool)) })
    }

    fn default_pool(dev: DeviceHandle) -> Result<PoolHandle, Error> {
        let f = entry!(hipDeviceGetDefaultMemPool);
        let mut pool = std::ptr::null_mut();
        // SAFETY: `pool` is a valid place.
        check(unsafe { f(&mut pool, dev) })?;
        Ok(pool as usize)
    }

    fn default_managed_pool(_device: i32) -> Result<PoolHandle, Error> {
        Err(no_managed_pool("a managed memory pool"))
    }

    #[inline]
    unsafe fn pool_alloc_async(
        pool: PoolHandle,
        size: usize,
        stream: StreamHandle,
    ) -> Result<usize, Error> {
        let f = entry!(hipMallocFromPoolAsync);
        let mut p = std::ptr::null_mut();
        // SAFETY: the caller's promise: the pool and the stream are live.
        check_alloc(unsafe { f(&mut p, size, ptr(pool), ptr(stream)) }, size)?;
        Ok(p as usize)
    }

    #[inline]
    unsafe fn free_async(address: usize, stream: StreamHandle) -> Result<(), Error> {
        let f = entry!(hipFreeAsync);
        // SAFETY: the caller's promise: pool memory whose work is ordered before this.
        check(unsafe { f(ptr(address), ptr(stream)) })
    }

    unsafe fn pool_get(pool: PoolHandle, attribute: PoolAttribute) -> Result<u64, Error> {
        let f = entry!(hipMemPoolGetAttribute);
        let mut value = 0u64;
        // SAFETY: the pool is live; these attributes are 64-bit values.
        check(unsafe {
            f(
                ptr(pool),
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
        let f = entry!(hipMemPoolSetAttribute);
        // SAFETY: the pool is live; these attributes are 64-bit values.
        check(unsafe {
            f(
                ptr(pool),
                pool_attribute(attribute),
                (&mut value as *mut u64).cast(),
            )
        })
    }

    unsafe fn pool_trim_to(pool: PoolHandle, keep: usize) -> Result<(), Error> {
        let f = entry!(hipMemPoolTrimTo);
        // SAFETY: the pool is live (the caller's promise).
        check(unsafe { f(ptr(pool), keep) })
    }

    unsafe fn pool_export_fd(pool: PoolHandle) -> Result<i32, Error> {
        let f = entry!(hipMemPoolExportToShareableHandle);
        let mut fd: c_int = -1;
        // SAFETY: the pool is live and exportable (the caller's promise); the runtime
        // writes the descriptor as an `int` into `fd`.
        check(unsafe {
            f(
                (&mut fd as *mut c_int).cast(),
                ptr(pool),
                MEM_HANDLE_TYPE_POSIX_FD,
                0,
            )
        })?;
        Ok(fd)
    }

    unsafe fn pool_set_access(pool: PoolHandle, devices: &[i32]) -> Result<(), Error> {
        let f = entry!(hipMemPoolSetAccess);
        let access = access_descs(devices);
        // SAFETY: the pool is live (the caller's promise); one descriptor a device.
        check(unsafe { f(ptr(pool), access.as_ptr(), access.len()) })
    }

    unsafe fn pool_get_access(pool: PoolHandle, device: i32) -> Result<bool, Error> {
        let f = entry!(hipMemPoolGetAccess);
        let mut at = MemLocation {
            location_type: MEM_LOCATION_TYPE_DEVICE,
            location_id: device,
        };
        let mut flags: c_int = 0;
        // SAFETY: the pool is live (the caller's promise); `at` names a device; the
        // runtime writes the flags into `flags`.
        check(unsafe { f(&mut flags, ptr(pool), &mut at) })?;
        Ok(flags == MEM_ACCESS_PROT_READ_WRITE)
    }

    fn vm_granularity(device: i32, posix_fd: bool) -> Result<usize, Error> {
        let f = entry!(hipMemGetAllocationGranularity);
        let props = Props::new(device, posix_fd);
        let mut granularity = 0;
        // SAFETY: `props` is a `hipMemAllocationProp` (see `Props`); the out-place is valid.
        check(unsafe { f(&mut granularity, &props, GRANULARITY_MINIMUM) })?;
        Ok(granularity)
    }

    fn vm_reserve(len: usize, align: usize) -> Result<usize, Error> {
        let f = entry!(hipMemAddressReserve);
        let mut base = std::ptr::null_mut();
        // SAFETY: reserves address space only; `base` is a valid place.
        let result = unsafe { f(&mut base, len, align, std::ptr::null_mut(), 0) };
        check_alloc(result, len)?;
        Ok(base as usize)
    }

    unsafe fn vm_free(base: usize, len: usize) -> Result<(), Error> {
        let f = entry!(hipMemAddressFree);
        // SAFETY: the caller's promise: our reservation, nothing mapped in it.
        check(unsafe { f(ptr(base), len) })
    }

    fn vm_create(
        size: usize,
        device: i32,
        posix_fd: bool,
        requested: usize,
    ) -> Result<MemHandle, Error> {
        let f = entry!(hipMemCreate);
        let props = Props::new(device, posix_fd);
        let mut handle = std::ptr::null_mut();
        // SAFETY: `props` is a `hipMemAllocationProp`; `handle` is a valid place.
        check_alloc(unsafe { f(&mut handle, size, &props, 0) }, requested)?;
        Ok(handle as usize as MemHandle)
    }

    unsafe fn vm_release(handle: MemHandle) -> Result<(), Error> {
        let f = entry!(hipMemRelease);
        // SAFETY: the caller's promise: a reference of ours, never used again.
        check(unsafe { f(ptr(handle as usize)) })
    }

    unsafe fn vm_map(
        address: usize,
        size: usize,
        handle: MemHandle,
        requested: usize,
    ) -> Result<(), Error> {
        let f = entry!(hipMemMap);
        // SAFETY: the caller's promise: unmapped space of our reservation, a live handle.
        check_alloc(
            unsafe { f(ptr(address), size, 0, ptr(handle as usize), 0) },
            requested,
        )
    }

    unsafe fn vm_unmap(address: usize, size: usize) -> Result<(), Error> {
        let f = entry!(hipMemUnmap);
        // SAFETY: the caller's promise: mapped by us, unused.
        check(unsafe { f(ptr(address), size) })
    }

    unsafe fn vm_set_access(
        address: usize,
        len: usize,
        devices: &[i32],
        requested: usize,
    ) -> Result<(), Error> {
        let f = entry!(hipMemSetAccess);
        let access = access_descs(devices);
        // SAFETY: the range is mapped (the caller's promise); one descriptor a device.
        check_alloc(
            unsafe { f(ptr(address), len, access.as_ptr(), access.len()) },
            requested,
        )
    }

    unsafe fn vm_retain(address: usize) -> Result<MemHandle, Error> {
        let f = entry!(hipMemRetainAllocationHandle);
        let mut handle = std::ptr::null_mut();
        // SAFETY: `address` starts a mapped granule (the caller's promise).
        check(unsafe { f(&mut handle, ptr(address)) })?;
        Ok(handle as usize as MemHandle)
    }

    unsafe fn vm_export_fd(handle: MemHandle) -> Result<i32, Error> {
        let f = entry!(hipMemExportToShareableHandle);
        let mut fd: c_int = -1;
        // SAFETY: `handle` is live and exportable (the caller's promise); `fd` is a
        // valid place for an int.
        check(unsafe {
            f(
                (&mut fd as *mut c_int).cast(),
                ptr(handle as usize),
                MEM_HANDLE_TYPE_POSIX_FD,
                0,
            )
        })?;
        Ok(fd)
    }

    fn vm_import_fd(fd: i32) -> Result<MemHandle, Error> {
        let f = entry!(hipMemImportFromShareableHandle);
        let mut handle = std::ptr::null_mut();
        // SAFETY: for POSIX descriptors the OS handle is the descriptor itself, passed as
        // a pointer-sized integer; `handle` is a valid place.
        check(unsafe {
            f(
                &mut handle,
                std::ptr::without_provenance_mut(fd as usize),
                MEM_HANDLE_TYPE_POSIX_FD,
            )
        })?;
        Ok(handle as usize as MemHandle)
    }

    fn ipc_get(address: usize) -> Result<[u8; IPC_HANDLE_SIZE], Error> {
        let f = entry!(hipIpcGetMemHandle);
        let mut handle = IpcHandle {
            reserved: [0; IPC_HANDLE_SIZE],
        };
        // SAFETY: `handle` is a valid place; the runtime checks `address`.
        check(unsafe { f(&mut handle, ptr(address)) })?;
        Ok(handle.reserved.map(|b| b as u8))
    }

    fn ipc_open(handle: &[u8; IPC_HANDLE_SIZE]) -> Result<usize, Error> {
        let f = entry!(hipIpcOpenMemHandle);
        let raw = IpcHandle {
            reserved: handle.map(|b| b as c_char),
        };
        let mut base = std::ptr::null_mut();
        // SAFETY: `base` is a valid place; the runtime validates the handle.
        check(unsafe { f(&mut base, raw, IPC_LAZY_ENABLE_PEER_ACCESS) })?;
        Ok(base as usize)
    }

    unsafe fn ipc_close(base: usize) -> Result<(), Error> {
        let f = entry!(hipIpcCloseMemHandle);
        // SAFETY: the caller's promise: opened by `ipc_open`, unused.
        check(unsafe { f(ptr(base)) })
    }
}
