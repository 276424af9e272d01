//! Whether libcuda can be loaded: the one thing about the driver that the error type
//! needs to know (to describe a driver error), so it depends on nothing in the crate.

use std::sync::OnceLock;

/// True when libcuda can be loaded. The answer is looked up once and cached.
///
/// This is a one-shot cache, not a concurrency protocol, so it uses `std`'s `OnceLock`
/// directly rather than the `crate::sync` shims (loom has no `OnceLock`).
///
/// ```
/// if memres::driver::is_present() {
///     println!("a CUDA driver is installed");
/// } else {
///     println!("host memory only");
/// }
/// ```
pub fn is_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: `is_culib_present` only tries to open the library with `dlopen` and closes
    // it again; it calls no CUDA function, so it has no precondition.
    *PRESENT.get_or_init(|| unsafe { cudarc::driver::sys::is_culib_present() })
}
