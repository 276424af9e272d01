//! memres behind a C ABI: `libmemres.so` / `libmemres.a` with the header
//! `include/memres.h`.
//!
//! Each CUDA device gets one resource stack, built on the first allocation on that device
//! from the spec given to `memres_configure` (or in env `MEMRES_RESOURCE`, or `pool`), and
//! also made memres's per-device resource, so Rust code in the same process shares it.
//! `memres_malloc` and `memres_free` have the signatures PyTorch's
//! `CUDAPluggableAllocator` calls; the Python package in `python/` wraps them for PyTorch
//! and CuPy. Every call of `memres_malloc`/`memres_free` counts towards the open
//! [profiler scopes](mr::profile), which `memres_profile_*` open, close and report.
//!
//! No function unwinds into C: a panic is caught, reported through `memres_last_error`
//! and turned into a failure code (or a null pointer).

mod exports;
mod ipc;
mod peers;
mod profile;
mod routed;
mod segment_pools;
mod stack;
mod sync;
mod tags;

pub use ipc::{memres_ipc_close, memres_ipc_export, memres_ipc_open};
pub use profile::{
    memres_profile_pop, memres_profile_push, memres_profile_report, memres_profile_reset,
};
pub use segment_pools::{
    MEMRES_SEGMENTS_MEDIUM, MEMRES_SEGMENTS_NO_SPLIT, MEMRES_SETTLE_FORGET, MEMRES_SETTLE_POLL,
    MEMRES_SETTLE_WAIT, SegmentPoolHandle, memres_block_t, memres_segment_alloc_fn,
    memres_segment_free_fn, memres_segment_pool_blocks, memres_segment_pool_destroy,
    memres_segment_pool_free, memres_segment_pool_holding, memres_segment_pool_malloc,
    memres_segment_pool_new, memres_segment_pool_record_stream, memres_segment_pool_release_free,
    memres_segment_pool_restore, memres_segment_pool_segment_of, memres_segment_pool_settle,
};
pub use tags::{
    memres_is_asleep, memres_prepare_offload, memres_set_tag, memres_sleep, memres_wake,
};

use std::cell::RefCell;
use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::ptr::NonNull;
use std::sync::{Mutex, OnceLock, PoisonError};

use mr::device::DeviceId;
use mr::{Error, Resource, StreamRef};

use crate::stack::DeviceStack;
use mr::spec::Spec;

/// Success.
pub const MEMRES_OK: c_int = 0;
/// A bad argument: a malformed spec, a negative size, a null pointer where one is needed.
pub const MEMRES_ERROR_INVALID_ARGUMENT: c_int = -1;
/// `memres_configure` after the first allocation.
pub const MEMRES_ERROR_IN_USE: c_int = -2;
/// The CUDA driver is missing or failed.
pub const MEMRES_ERROR_CUDA: c_int = -3;
/// memres panicked; the panic was caught.
pub const MEMRES_ERROR_PANIC: c_int = -4;
/// Out of memory.
pub const MEMRES_ERROR_OUT_OF_MEMORY: c_int = -5;
/// The pool is asleep (`memres_sleep`): wake it first.
pub const MEMRES_ERROR_ASLEEP: c_int = -6;
/// `memres_sleep`: the contents of the memory given back are lost.
pub const MEMRES_SLEEP_DISCARD: c_int = 0;
/// `memres_sleep`: the contents are copied to host memory (through pinned staging
/// buffers) and restored on wake.
pub const MEMRES_SLEEP_OFFLOAD: c_int = 1;

/// Devices memres serves through the C ABI (ordinals 0 to 63).
const MAX_DEVICES: usize = 64;

/// What `memres_stats` fills in (the header's `memres_stats_t`).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub struct memres_stats_t {
    /// 1 when the stack has a statistics layer (the six counts below are its figures).
    pub has_statistics: i32,
    /// 1 when the stack has a pool, arena or driver pool (the three pool figures).
    pub has_pool: i32,
    /// The statistics layer's bytes outstanding now.
    pub current_bytes: i64,
    /// Its highest `current_bytes` (approximate across threads, as the layer's peak is).
    pub peak_bytes: i64,
    /// Its bytes ever allocated.
    pub total_bytes: i64,
    /// Its allocations outstanding now.
    pub current_allocations: i64,
    /// Its highest `current_allocations`.
    pub peak_allocations: i64,
    /// Its allocations ever made.
    pub total_allocations: i64,
    /// Bytes the pool holds from the driver.
    pub pool_size: u64,
    /// Bytes the pool holds but has not handed out.
    pub pool_free_bytes: u64,
    /// The largest free block (0 where the layer does not know it).
    pub pool_largest_free_block: u64,
    /// Bytes live through `memres_malloc`/`memres_free`, counted exactly by the C ABI
    /// whatever the spec (also without a statistics layer).
    pub live_bytes: i64,
    /// The highest `live_bytes` since the stack was built or `memres_reset_peak`.
    pub peak_live_bytes: i64,
    /// Bytes ever allocated through `memres_malloc`.
    pub allocated_bytes: i64,
    /// Blocks live through `memres_malloc`/`memres_free`, counted as `live_bytes` is.
    pub live_allocations: i64,
    /// The highest `live_allocations` since the stack was built or `memres_reset_peak`.
    pub peak_live_allocations: i64,
    /// Blocks ever allocated through `memres_malloc`.
    pub allocations: i64,
    /// `memres_malloc` calls that ran out of memory.
    pub out_of_memory: i64,
    /// The most bytes the pool held at once since the stack was built or
    /// `memres_reset_peak` (its size where it never changes: an arena).
    pub pool_peak_size: u64,
    /// Host memory holding copies of the pools' contents: while a pool sleeps with
    /// `MEMRES_SLEEP_OFFLOAD`, and after its wake until `memres_trim` (kept for the next
    /// sleep). 0 for stacks that cannot sleep.
    pub pool_host_copy_bytes: u64,
    /// Calls of the stack's chunked and in-place pools (and its tags') that took device
    /// memory from the driver since they were made (`PoolStats::upstream_alloc_calls`):
    /// PyTorch's `num_device_alloc`. An arena's one allocation, `fixed_size`'s chunks, a
    /// `cuda` tier's blocks and driver pools are not counted.
    pub pool_alloc_calls: u64,
    /// Their calls that gave it back (`PoolStats::upstream_free_calls`):
    /// `num_device_free`.
    pub pool_free_calls: u64,
}

/// A failure on its way to C: a code and a message for `memres_last_error`.
struct Failure {
    code: c_int,
    message: String,
}

impl Failure {
    fn invalid(message: impl Into<String>) -> Failure {
        Failure {
            code: MEMRES_ERROR_INVALID_ARGUMENT,
            message: message.into(),
        }
    }

    /// The same failure, its message prefixed with `what` (the call and its argument).
    pub(crate) fn within(self, what: &str) -> Failure {
        Failure {
            message: format!("{what}: {}", self.message),
            ..self
        }
    }
}

impl From<Error> for Failure {
    fn from(e: Error) -> Failure {
        let code = match e {
            Error::InvalidArgument(_) => MEMRES_ERROR_INVALID_ARGUMENT,
            Error::OutOfMemory { .. } => MEMRES_ERROR_OUT_OF_MEMORY,
            Error::Asleep => MEMRES_ERROR_ASLEEP,
            _ => MEMRES_ERROR_CUDA,
        };
        Failure {
            code,
            message: describe(&e),
        }
    }
}

/// `e` in words for the C ABI's callers (C programs, the Python package), who have none
/// of the Rust API that the library's own messages may point to.
pub(crate) fn describe(e: &Error) -> String {
    match e {
        // The library's message suggests a Rust host resource (`HostHeap`).
        Error::NoDriver => "no CUDA driver: libcuda could not be loaded (install the NVIDIA \
                            driver; memres allocates GPU memory, so it needs one)"
            .to_owned(),
        other => other.to_string(),
    }
}

/// The most characters of a caller's text (a tag name) that a message quotes.
const QUOTE_CHARS: usize = 200;

/// `text` quoted for a message (as `{:?}` writes it), cut after [`QUOTE_CHARS`]
/// characters with its whole length stated.
pub(crate) fn quoted(text: &str) -> String {
    match text.char_indices().nth(QUOTE_CHARS) {
        None => format!("{text:?}"),
        Some((end, _)) => format!("{:?}... ({} bytes in all)", &text[..end], text.len()),
    }
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last_error(message: &str) {
    // A message with a NUL in it loses the rest rather than being dropped.
    let text = message.split('\0').next().unwrap_or_default();
    let c = CString::new(text).unwrap_or_default();
    let _ = LAST_ERROR.try_with(|last| *last.borrow_mut() = c);
}

/// Runs `f`, catching panics; a failure sets the last error and gives `on_failure(code)`.
fn guarded<T>(on_failure: impl FnOnce(c_int) -> T, f: impl FnOnce() -> Result<T, Failure>) -> T {
    let failure = match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(value)) => return value,
        Ok(Err(failure)) => failure,
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic".into());
            Failure {
                code: MEMRES_ERROR_PANIC,
                message: format!("memres: internal error, caught panic: {what}"),
            }
        }
    };
    set_last_error(&failure.message);
    on_failure(failure.code)
}

/// The spec chosen before the first allocation; `frozen` once a stack is built.
struct Config {
    spec: Option<Spec>,
    frozen: bool,
}

static CONFIG: Mutex<Config> = Mutex::new(Config {
    spec: None,
    frozen: false,
});

static STACKS: [OnceLock<DeviceStack>; MAX_DEVICES] = [const { OnceLock::new() }; MAX_DEVICES];

fn slot(device: c_int) -> Result<&'static OnceLock<DeviceStack>, Failure> {
    usize::try_from(device)
        .ok()
        .and_then(|i| STACKS.get(i))
        .ok_or_else(|| {
            Failure::invalid(format!(
                "device {device} is not a CUDA device ordinal memres serves (0 to {})",
                MAX_DEVICES - 1
            ))
        })
}

/// The stack of `device`, built on first use.
fn stack(device: c_int) -> Result<&'static DeviceStack, Failure> {
    let slot = slot(device)?;
    if let Some(stack) = slot.get() {
        return Ok(stack);
    }
    let mut config = CONFIG.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(stack) = slot.get() {
        return Ok(stack); // built by another thread while this one waited
    }
    let spec = match &config.spec {
        Some(spec) => spec.clone(),
        None => {
            // Read once: every device gets the same stack even if the variable changes.
            let spec = match std::env::var("MEMRES_RESOURCE") {
                Ok(text) => Spec::parse(&text)
                    .map_err(|e| Failure::invalid(format!("MEMRES_RESOURCE: {e}")))?,
                Err(_) => Spec::default_spec(),
            };
            config.spec = Some(spec.clone());
            spec
        }
    };
    let id = DeviceId::new(device);
    let built = DeviceStack::build(&spec, id)?;
    mr::per_device::set_per_device_resource(id, built.top().clone());
    config.frozen = true;
    if built.logs() {
        flush_logs_at_exit();
    }
    Ok(slot.get_or_init(|| built))
}

unsafe extern "C" {
    fn atexit(callback: extern "C" fn()) -> c_int;
}

/// The stacks live in statics, which are never dropped, so a logging layer's writer would
/// never write its last rows: an exit handler flushes them.
fn flush_logs_at_exit() {
    extern "C" fn flush_all() {
        // Unwinding out of an exit handler would abort: catch and drop.
        let _ = catch_unwind(|| {
            for stack in STACKS.iter().filter_map(OnceLock::get) {
                stack.flush_logs();
            }
        });
    }
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: `atexit` is the C library's; `flush_all` is an `extern "C" fn()` that
        // never unwinds (it catches panics) and only reads statics that outlive it.
        if unsafe { atexit(flush_all) } != 0 {
            set_last_error("memres: cannot register the exit handler that flushes the log");
        }
    });
}

/// The stack of `device` if it was built.
fn built_stack(device: c_int) -> Result<Option<&'static DeviceStack>, Failure> {
    Ok(slot(device)?.get())
}

/// The stack of `device`, for a call (`what`, named in the messages) on a block it handed
/// out at `ptr`: a failure for a device memres never allocated on, or an address outside
/// the stack's pool where the stack can tell (the default stack). `tail` ends the
/// messages (what became of the call).
fn stack_of_block(
    what: &str,
    ptr: usize,
    device: c_int,
    tail: &str,
) -> Result<&'static DeviceStack, Failure> {
    let stack = built_stack(device)?.ok_or_else(|| {
        Failure::invalid(format!(
            "{what}: memres never allocated on device {device}{tail}"
        ))
    })?;
    if stack.may_hold(ptr) == Some(false) {
        return Err(Failure::invalid(format!(
            "{what}: {ptr:#x} is not memory of device {device}'s pool (memres never handed \
             it out){tail}"
        )));
    }
    Ok(stack)
}

/// Chooses the resource stack of every device, before the first allocation. See
/// `memres.h` for the spec syntax. A spec that is not UTF-8 or that the parser refuses
/// (longer than 4096 bytes included) is `MEMRES_ERROR_INVALID_ARGUMENT`, its message
/// quoting at most 200 characters of it with its size.
///
/// # Safety
/// `spec` is null or a NUL-terminated string (the spec ends at the first NUL: a caller
/// whose text may hold one, as Python's strings may, refuses it before calling).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memres_configure(spec: *const c_char) -> c_int {
    guarded(
        |code| code,
        || {
            if spec.is_null() {
                return Err(Failure::invalid("memres_configure: the spec is null"));
            }
            // SAFETY: non-null and NUL-terminated (the caller's promise).
            let text = unsafe { CStr::from_ptr(spec) }
                .to_str()
                .map_err(|_| Failure::invalid("memres_configure: the spec is not UTF-8"))?;
            let parsed = Spec::parse(text).map_err(|e| Failure::invalid(e.message().to_owned()))?;
            let mut config = CONFIG.lock().unwrap_or_else(PoisonError::into_inner);
            if config.frozen {
                return Err(Failure {
                    code: MEMRES_ERROR_IN_USE,
                    message: "memres_configure: memres has already allocated; configure it \
                              before the first allocation"
                        .into(),
                });
            }
            config.spec = Some(parsed);
            Ok(MEMRES_OK)
        },
    )
}

/// Builds `device`'s stack now rather than on its first allocation (so a spec the device
/// cannot serve fails here, and the pool's initial size is taken up front).
#[unsafe(no_mangle)]
pub extern "C" fn memres_init_device(device: c_int) -> c_int {
    guarded(
        |code| code,
        || {
            stack(device)?;
            Ok(MEMRES_OK)
        },
    )
}

/// Allocates `size` bytes on `device`, in order on `stream`. Null on failure (see
/// `memres_last_error`).
///
/// A zero-byte request returns null and is not a failure (the last error is cleared), as
/// `cudaMalloc`, RMM and PyTorch's caching allocator do: callers such as PyTorch's
/// pluggable allocator key their records by pointer, so every live block, empty ones
/// included, must have its own address or none. Freeing null is a no-op.
///
/// # Safety
/// `stream` is null (the legacy default stream), `CU_STREAM_LEGACY`,
/// `CU_STREAM_PER_THREAD`, or a live CUDA stream of `device`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memres_malloc(
    size: isize,
    device: c_int,
    stream: *mut c_void,
) -> *mut c_void {
    guarded(
        |_| std::ptr::null_mut(),
        || {
            let size = usize::try_from(size)
                .map_err(|_| Failure::invalid(format!("memres_malloc: negative size {size}")))?;
            if size == 0 {
                set_last_error("");
                return Ok(std::ptr::null_mut());
            }
            let layout = mr::layout(size)?;
            let stack = stack(device)?;
            // SAFETY: the caller's promise about `stream`.
            let stream = unsafe { StreamRef::from_raw(stream.cast()) };
            Ok(allocate_on(stack, stream, layout)?.as_ptr().cast())
        },
    )
}

/// `memres_malloc`'s work on a device's stack: through its wrappers to the tag's pool or
/// the spec's base, the block entering the table of live blocks, counted in the C ABI's figures and the open
/// profiler scopes. Graph and `MemPool` pools take their segments so too.
pub(crate) fn allocate_on(
    stack: &DeviceStack,
    stream: StreamRef<'_>,
    layout: std::alloc::Layout,
) -> Result<NonNull<u8>, Error> {
    let result = stack.memory().allocate(stream, layout);
    stack.count_allocation(result.as_ref().map(|_| layout.size()));
    let ptr = result?;
    mr::profile::count_allocation(layout.size());
    Ok(ptr)
}

/// `memres_free`'s work on a device's stack, as [`allocate_on`]'s counterpart.
///
/// # Safety
/// `ptr` came from [`allocate_on`] on this stack with `layout` and is not freed yet; every
/// use of it is ordered before this point on `stream`, and the streams recorded for it
/// (`memres_record_stream`) are live.
pub(crate) unsafe fn deallocate_on(
    stack: &DeviceStack,
    stream: StreamRef<'_>,
    ptr: NonNull<u8>,
    layout: std::alloc::Layout,
) {
    stack.count_free(layout.size());
    mr::profile::count_free(layout.size());
    stack.exported().release(ptr.as_ptr() as usize);
    // Out of the table of live blocks (with the streams recorded for it, which the free
    // waits for), then through the wrappers back to the tag's pool whose range holds it or
    // to the spec's base.
    // SAFETY: the caller's promise, for the resource `memory()` is.
    unsafe { stack.memory().deallocate(stream, ptr, layout) };
}

/// Frees `ptr` (from `memres_malloc(size, device, ..)`) in order on `stream`. Null is
/// ignored. A pointer that is certainly not memory of the device's pool (outside the
/// reservation of an in-place pool: `virtual_pool`, the default, and `binning`'s) is
/// refused with a message (`memres_last_error`) and not freed; other misuse is not
/// detected.
///
/// # Safety
/// `ptr` is null or came from `memres_malloc` with the same `size` and `device` and is not
/// freed yet; every use of it is ordered before this point on `stream`, which is valid as
/// for `memres_malloc`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memres_free(
    ptr: *mut c_void,
    size: isize,
    device: c_int,
    stream: *mut c_void,
) {
    guarded(
        |_| (),
        || {
            let Some(ptr) = NonNull::new(ptr.cast::<u8>()) else {
                return Ok(());
            };
            if size == 0 {
                return Ok(()); // zero-byte blocks cost nothing to free
            }
            let size = usize::try_from(size).map_err(|_| {
                Failure::invalid(format!("memres_free: negative size {size}; block leaked"))
            })?;
            let layout = mr::layout(size)?;
            let stack = stack_of_block("memres_free", ptr.as_ptr() as usize, device, "; ignored")?;
            // SAFETY: the caller's promise about `stream`.
            let stream = unsafe { StreamRef::from_raw(stream.cast()) };
            // SAFETY: the caller's promise: `ptr` came from `memres_malloc` on this device
            // with this size, and is ordered on `stream`; `memres_record_stream`'s promise
            // keeps the recorded streams live until now.
            unsafe { deallocate_on(stack, stream, ptr, layout) };
            Ok(())
        },
    )
}

/// Records that work on `stream` uses `ptr` (a live block of `memres_malloc` on
/// `device`), as PyTorch's `Tensor.record_stream`: when the block is freed (on any
/// stream), it is not handed out again before the work `stream` has enqueued by then is
/// complete. Recording the stream the block is freed on, or twice, adds nothing.
/// `MEMRES_OK`, or `MEMRES_ERROR_INVALID_ARGUMENT` (nothing recorded) for a null pointer,
/// a device memres never allocated on, or an address that is not the start of a live
/// block `memres_malloc` handed out on `device` (from its stack or a tag's pool): an
/// address inside a block, a block already freed, or memory memres never handed out.
/// The library's `StreamUse` layer over the device's memory keeps the start of every live
/// block for this (an insert per `memres_malloc`, a removal per `memres_free`), whatever
/// the stack; a record is kept with its block and goes with the block's free.
///
/// # Safety
/// `stream` is a live CUDA stream of `device` (or a default-stream handle) and stays live
/// until `ptr` is freed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memres_record_stream(
    ptr: *mut c_void,
    device: c_int,
    stream: *mut c_void,
) -> c_int {
    guarded(
        |code| code,
        || {
            if ptr.is_null() {
                return Err(Failure::invalid(
                    "memres_record_stream: the pointer is null",
                ));
            }
            let stack = stack_of_block("memres_record_stream", ptr as usize, device, "")?;
            // SAFETY: non-null (checked above).
            let block = unsafe { NonNull::new_unchecked(ptr.cast::<u8>()) };
            // SAFETY: the caller's promise: `stream` is live until the block is freed.
            let stream = unsafe { StreamRef::from_raw(stream.cast()) };
            // SAFETY: as above.
            match unsafe { stack.memory().record_stream(block, stream) } {
                Ok(()) => Ok(MEMRES_OK),
                Err(_) => Err(not_a_live_block(ptr as usize, device)),
            }
        },
    )
}

/// `memres_record_stream`'s refusal of `address`, where no live block of `device` starts.
fn not_a_live_block(address: usize, device: c_int) -> Failure {
    Failure::invalid(format!(
        "memres_record_stream: {address:#x} is not the start of a live block memres_malloc \
         handed out on device {device} (an address inside a block, a block already freed, \
         or memory memres never handed out); nothing recorded"
    ))
}

/// Fills `out` with the statistics and pool figures of `device`'s stack (zeros where the
/// stack lacks the layer or is not built yet). The pool figures are every pool's of the
/// stack summed: every tier of a `fallback(..)` (a `pinned_pool`'s host memory too) and
/// every tag's pool.
///
/// # Safety
/// `out` is null or valid for writing one `memres_stats_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memres_stats(device: c_int, out: *mut memres_stats_t) -> c_int {
    guarded(
        |code| code,
        || {
            if out.is_null() {
                return Err(Failure::invalid("memres_stats: `out` is null"));
            }
            let mut stats = memres_stats_t::default();
            if let Some(stack) = built_stack(device)? {
                let figures = stack.figures()?;
                (
                    stats.live_bytes,
                    stats.peak_live_bytes,
                    stats.allocated_bytes,
                ) = (figures.live.current, figures.live.peak, figures.live.total);
                (
                    stats.live_allocations,
                    stats.peak_live_allocations,
                    stats.allocations,
                ) = (
                    figures.live_blocks.current,
                    figures.live_blocks.peak,
                    figures.live_blocks.total,
                );
                stats.out_of_memory = figures.out_of_memory;
                if let Some(s) = figures.statistics {
                    stats.has_statistics = 1;
                    (stats.current_bytes, stats.peak_bytes, stats.total_bytes) =
                        (s.bytes.current, s.bytes.peak, s.bytes.total);
                    (
                        stats.current_allocations,
                        stats.peak_allocations,
                        stats.total_allocations,
                    ) = (
                        s.allocations.current,
                        s.allocations.peak,
                        s.allocations.total,
                    );
                }
                if let Some(pool) = figures.pool {
                    stats.has_pool = 1;
                    (
                        stats.pool_size,
                        stats.pool_free_bytes,
                        stats.pool_largest_free_block,
                        stats.pool_peak_size,
                        stats.pool_host_copy_bytes,
                        stats.pool_alloc_calls,
                        stats.pool_free_calls,
                    ) = (
                        pool.size,
                        pool.free,
                        pool.largest_free_block,
                        pool.peak_size,
                        pool.host_copy_bytes,
                        pool.upstream_alloc_calls,
                        pool.upstream_free_calls,
                    );
                }
            }
            // SAFETY: non-null and valid for one write (the caller's promise).
            unsafe { out.write(stats) };
            Ok(MEMRES_OK)
        },
    )
}

/// Writes the figures of each tier of `device`'s `fallback(first, then)` (the outermost
/// one) into `out` (at most `capacity` entries, the first tier first): the statistics
/// fields of a `memres_stats_t` (`has_statistics` 1), the rest 0. Returns how many tiers
/// there are: 2, or 0 for a stack without a fallback or a device memres never allocated
/// on.
///
/// # Safety
/// `out` is null (with `capacity` 0) or valid for writing `capacity` `memres_stats_t`s.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memres_tier_stats(
    device: c_int,
    out: *mut memres_stats_t,
    capacity: usize,
) -> i64 {
    guarded(i64::from, || {
        if out.is_null() && capacity > 0 {
            return Err(Failure::invalid(
                "memres_tier_stats: a null buffer with room",
            ));
        }
        let Some(tiers) = built_stack(device)?.and_then(DeviceStack::tiers) else {
            return Ok(0);
        };
        for (i, s) in tiers.iter().take(capacity).enumerate() {
            let figures = memres_stats_t {
                has_statistics: 1,
                current_bytes: s.bytes.current,
                peak_bytes: s.bytes.peak,
                total_bytes: s.bytes.total,
                current_allocations: s.allocations.current,
                peak_allocations: s.allocations.peak,
                total_allocations: s.allocations.total,
                ..memres_stats_t::default()
            };
            // SAFETY: the caller's promise: `out` holds `capacity` entries; i < capacity.
            unsafe { out.add(i).write(figures) };
        }
        Ok(tiers.len() as i64)
    })
}

/// Writes the memory `device`'s pools hold as `[address, bytes]` pairs in address order
/// into `out` (at most `capacity` pairs) and returns how many there are (call again with
/// more room if that is larger): the chunks of a chunked pool (`pool`, `pinned_pool`),
/// the mapped runs of an in-place pool (PyTorch's memory snapshots draw them as
/// segments), of every pool of the stack and every tag's. 0 for a device memres never
/// allocated on and for stacks that keep no such list (arena, fixed_size, cuda_async,
/// cuda: each block is its own allocation there, or the library lists no chunks).
///
/// # Safety
/// `out` is null (with `capacity` 0) or valid for `2 * capacity` `uint64_t`s.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memres_segments(device: c_int, out: *mut u64, capacity: usize) -> i64 {
    guarded(i64::from, || {
        let Some(stack) = built_stack(device)? else {
            return Ok(0);
        };
        if out.is_null() && capacity > 0 {
            return Err(Failure::invalid("memres_segments: a null buffer with room"));
        }
        let segments = stack.segments();
        for (i, &(addr, len)) in segments.iter().take(capacity).enumerate() {
            // SAFETY: the caller's promise: `out` holds `2 * capacity` values; i < capacity.
            unsafe {
                out.add(2 * i).write(addr as u64);
                out.add(2 * i + 1).write(len as u64);
            }
        }
        Ok(segments.len() as i64)
    })
}

/// Gives memory the pools of `device` hold but do not use back to the driver (what
/// `torch.cuda.empty_cache()` users expect): every pool of the stack (every tier of a
/// `fallback(..)`, `binning`'s bins and the pool under them) and every tag's. 0 on
/// success, also where there is nothing to trim. An `arena` stack gives nothing back: its
/// memory is one allocation of its whole size, made when it is built and kept while it
/// lives (as RMM's arena); bins and `fixed_size` keep their chunks (they give back their
/// streams' lists); a stack without a pool has nothing to give back either. A
/// `cuda_async` pool that holds memory is trimmed after the device's work is waited for
/// (its blocks freed in stream order are pending until then), as PyTorch's
/// `cudaMallocAsync` backend does: so not while a stream of the device is being captured
/// (the wait would end the capture; the native backend skips such devices).
#[unsafe(no_mangle)]
pub extern "C" fn memres_trim(device: c_int) -> c_int {
    guarded(
        |code| code,
        || {
            if let Some(stack) = built_stack(device)? {
                stack.trim()?;
            }
            Ok(MEMRES_OK)
        },
    )
}

/// Lets `peer` read and write the memory memres's in-place pools map on `device` (the
/// default stack's and every tag's) and its `cuda_async` pools hold (`cuMemPoolSetAccess`,
/// as PyTorch's `cudaMallocAsync` backend does): what they hold now and all they map
/// later, as `cudaDeviceEnablePeerAccess` does for `cudaMalloc` memory (which the call
/// does not do: that is the caller's). Needed only where peers come on demand
/// (`memres_peer_access_on_demand`; by default every peer-capable device has access from
/// the start, in both kinds of pool). PyTorch's `enablePeerAccess`, which a copy or
/// kernel between two devices reaches first, calls it under the native backend. 0 on
/// success, also for a device and itself; `MEMRES_ERROR_CUDA` where `peer` cannot reach
/// `device`'s memory (the message says so) or there is no driver;
/// `MEMRES_ERROR_INVALID_ARGUMENT` for an ordinal with no device or of 64 and above. It
/// waits for the maps and unmaps of those pools under way, and they wait for it (one
/// `cuMemSetAccess` a run of mapped memory).
#[unsafe(no_mangle)]
pub extern "C" fn memres_enable_peer_access(device: c_int, peer: c_int) -> c_int {
    guarded(
        |code| code,
        || {
            let (on, by) = (DeviceId::new(device), DeviceId::new(peer));
            // Ordinals memres keeps no table for first (with or without a driver), then
            // those with no device.
            let not_served = |d: c_int, devices: usize| {
                Failure::invalid(format!(
                    "memres_enable_peer_access: {d} is not a device ordinal memres serves \
                     ({devices} devices, ordinals below {})",
                    peers::MAX_DEVICES
                ))
            };
            for d in [device, peer] {
                if usize::try_from(d).map_or(true, |d| d >= peers::MAX_DEVICES) {
                    return Err(not_served(d, DeviceId::count().unwrap_or(0)));
                }
            }
            let count = DeviceId::count()?;
            for d in [device, peer] {
                if usize::try_from(d).map_or(true, |d| d >= count) {
                    return Err(not_served(d, count));
                }
            }
            if on == by {
                return Ok(MEMRES_OK);
            }
            by.require_peer_access(on)?;
            // Recorded and looked up under the configuration's lock, under which a stack is
            // built and published: one being built reads the grant (its leaves name the
            // peer), one built already is found here and granted it outside the lock (the
            // grant waits for the driver).
            let built = {
                let _config = CONFIG.lock().unwrap_or_else(PoisonError::into_inner);
                peers::record(on, by)?;
                built_stack(device)?
            };
            if let Some(stack) = built {
                stack.grant_access(by)?;
            }
            Ok(MEMRES_OK)
        },
    )
}

/// From now on, the in-place and `cuda_async` pools memres makes give access to their
/// own device alone, and to a peer once `memres_enable_peer_access` names it (as
/// PyTorch's expandable segments and `cudaMallocAsync` pools do): the in-place pools'
/// maps and unmaps are then cheaper (on two H200s a peer tripled a granule's
/// `cuMemSetAccess`; DDP's 24 steps took 5-17% less in all). For
/// a caller that forwards every need of peer access, such as the native PyTorch backend,
/// which calls it when installed; pools made before keep their peers. `MEMRES_PEER_ACCESS=all` or
/// `=on_demand` overrides it for the process. Always 0.
#[unsafe(no_mangle)]
pub extern "C" fn memres_peer_access_on_demand() -> c_int {
    peers::on_demand();
    MEMRES_OK
}

/// Bounds what memres's pools on `device` hold to `bytes` (below 0: no bound), what
/// `torch.cuda.set_per_process_memory_fraction` sets: each device-memory pool of the
/// stack (every tier of a `fallback(..)`, the pool under `binning`) and every tag's pool,
/// those made later too, grows no further than `bytes`, after giving back what it holds
/// free; a request past the bound is out of memory. Pinned host pools, `arena`,
/// `cuda_async` and plain `cuda` stacks are not bounded. Builds the stack if it does not
/// exist yet. 0 on success. A bound of 0 bytes lets no pool grow
/// (`set_per_process_memory_fraction(0)`); the in-place pools grow by whole granules
/// (2 MiB, `routed::DEFAULT_GRANULE`, unless the spec says `granule=`), so a bound below one
/// lets them serve nothing, and one between granules holds whole granules below it.
#[unsafe(no_mangle)]
pub extern "C" fn memres_set_limit(device: c_int, bytes: i64) -> c_int {
    guarded(
        |code| code,
        || {
            let bound = match bytes {
                b if b < 0 => None,
                b => Some(
                    usize::try_from(b)
                        .map_err(|_| Failure::invalid(format!("memres_set_limit: {b} bytes")))?,
                ),
            };
            stack(device)?.set_limit(bound);
            Ok(MEMRES_OK)
        },
    )
}

/// Starts `device`'s peaks (`peak_live_bytes`, `peak_live_allocations`, `pool_peak_size`)
/// afresh from what is live and held now (as `torch.cuda.reset_peak_memory_stats`). 0 on
/// success, also before the first allocation.
#[unsafe(no_mangle)]
pub extern "C" fn memres_reset_peak(device: c_int) -> c_int {
    guarded(
        |code| code,
        || {
            if let Some(stack) = built_stack(device)? {
                stack.reset_peaks()?;
            }
            Ok(MEMRES_OK)
        },
    )
}

/// The message of the last failure on this thread ("" if none); valid until the next
/// memres call on this thread.
#[unsafe(no_mangle)]
pub extern "C" fn memres_last_error() -> *const c_char {
    LAST_ERROR
        .try_with(|last| last.borrow().as_ptr())
        .unwrap_or(c"memres: the error of this thread is gone (thread exiting)".as_ptr())
}

#[cfg(test)]
mod tests;

/// The `capi` fuzz target's corpus, replayed by `cargo test` (the target's code is
/// `fuzz/common/capi.rs`).
#[cfg(test)]
#[path = "../../fuzz/common/capi_replay.rs"]
mod fuzz_corpus;
