//! Knowing when the process is exiting, so that drops skip the driver.
//!
//! Resources kept for the life of the process (the per-device defaults) are dropped from an
//! `atexit` handler. By then the CUDA driver may be tearing itself down, and calling it
//! (`cuMemFree`, `cuMemPoolDestroy`) can crash, which is what RMM users meet when a static
//! resource outlives the runtime. memres registers its handler once, at the first of
//! `cuInit` or the first use of the per-device map; handlers run in reverse order of
//! registration, so it may run before or after the driver's own. Either way it first sets
//! [`process_is_exiting`] and only then drops the per-device resources, and every memres
//! `Drop` that would call the driver checks the flag and leaves the memory to the
//! process's teardown instead.

use std::ffi::c_int;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

static EXITING: AtomicBool = AtomicBool::new(false);

/// True once the process has begun to exit (`exit` was called or `main` returned). A `Drop`
/// that would call the CUDA driver checks it and skips the call: the process is about to
/// give all its GPU memory back anyway.
pub fn process_is_exiting() -> bool {
    EXITING.load(Ordering::Acquire)
}

unsafe extern "C" {
    fn atexit(callback: extern "C" fn()) -> c_int;
}

/// What the exit handler runs once the flag is set: the per-device map's drop (given by
/// `device`, which sits above this layer).
static AT_EXIT: OnceLock<fn()> = OnceLock::new();

extern "C" fn on_exit() {
    EXITING.store(true, Ordering::Release);
    if let Some(drop_all) = AT_EXIT.get() {
        drop_all();
    }
}

/// Runs `drop_all` at exit, after [`process_is_exiting`] becomes true (the first function
/// given wins), and registers the handler if that has not happened yet.
pub(crate) fn at_exit(drop_all: fn()) {
    let _ = AT_EXIT.set(drop_all);
    register_exit_hook();
}

/// Registers the exit handler, once; called from `driver::init` (right after `cuInit`) and
/// when the per-device map is first used (so resources set there without any CUDA call,
/// as in host-only tests, are dropped at exit too).
pub(crate) fn register_exit_hook() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(register);
}

fn register() {
    // SAFETY: `atexit` is the C library's; `on_exit` is an `extern "C" fn()` that never
    // unwinds (it only stores a flag and drops resources whose drops cannot panic across
    // it: `drop_all_at_exit` catches panics).
    let status = unsafe { atexit(on_exit) };
    if status != 0 {
        tracing::warn!(
            "memres: atexit registration failed; per-device resources will not be dropped at exit"
        );
    }
}
