//! Whether the driver's library (libcuda, or libamdhip64 in a HIP build) can be loaded.

use crate::platform::{Active, Platform};

/// True when the driver's library can be loaded: libcuda, or libamdhip64 in a build with
/// the `hip` feature. The platform looks it up once and caches the answer (a one-shot
/// `std` `OnceLock`, not a concurrency protocol for loom).
///
/// ```
/// if memres::driver::is_present() {
///     println!("a CUDA driver is installed");
/// } else {
///     println!("host memory only");
/// }
/// ```
pub fn is_present() -> bool {
    Active::is_present()
}
