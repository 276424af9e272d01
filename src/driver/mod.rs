//! Whether a GPU driver can be used on this machine, and which platform this build calls.
//!
//! memres loads the driver at run time (libcuda through cudarc's `dynamic-loading`, or
//! libamdhip64 in a build with the `hip` feature), so the crate builds and its host
//! resources work on machines with no GPU. Every GPU resource asks [`is_present`] before
//! its first driver call and returns [`Error::NoDriver`] instead of panicking when it is
//! false. The driver calls themselves go through the crate's platform seam
//! (`src/platform/`; see `docs/platforms.md`).
//!
//! [`Error::NoDriver`]: crate::Error::NoDriver

use std::sync::OnceLock;

pub(crate) mod exit;
pub(crate) mod presence;

pub use presence::is_present;

use crate::error::Error;
use crate::platform::{Active, Feature, Platform};

/// The GPU platform this build calls: `"CUDA"`, or `"HIP"` with the `hip` feature (see
/// `docs/platforms.md`).
///
/// ```
/// assert!(["CUDA", "HIP"].contains(&memres::driver::platform()));
/// ```
pub fn platform() -> &'static str {
    Active::NAME
}

/// Loads and initialises the driver (`cuInit`, `hipInit`) once; every GPU entry point of
/// memres calls this first. Returns [`Error::NoDriver`] where the driver's library is
/// absent, and the driver's error where initialising fails (no GPU, a driver/kernel
/// mismatch).
pub(crate) fn init() -> Result<(), Error> {
    static INIT: OnceLock<Result<(), Error>> = OnceLock::new();
    INIT.get_or_init(|| {
        Active::init()?;
        // At the latest here, right after `cuInit` (see `device::exit`).
        exit::register_exit_hook();
        Ok(())
    })
    .clone()
}

/// [`Error::Unsupported`] unless the driver offers `feature`; `what` names what needs it.
pub(crate) fn require(feature: Feature, what: &str) -> Result<(), Error> {
    init()?;
    Active::require(feature, what)
}

pub(crate) use crate::platform::report;
