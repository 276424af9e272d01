//! Whether a CUDA driver can be used on this machine.
//!
//! memres loads libcuda at run time (cudarc's `dynamic-loading`), so the crate builds and
//! its host resources work on machines with no GPU. Every CUDA resource asks
//! [`is_present`] before its first driver call and returns [`Error::NoDriver`] instead
//! of panicking when it is false.
//!
//! [`Error::NoDriver`]: crate::Error::NoDriver

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
