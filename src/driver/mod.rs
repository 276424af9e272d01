//! Whether a CUDA driver can be used on this machine.
//!
//! memres loads libcuda at run time (cudarc's `dynamic-loading`), so the crate builds and
//! its host resources work on machines with no GPU. Every CUDA resource asks
//! [`is_present`] before its first driver call and returns [`Error::NoDriver`] instead
//! of panicking when it is false.
//!
//! [`Error::NoDriver`]: crate::Error::NoDriver

use std::sync::OnceLock;

pub(crate) mod exit;
pub(crate) mod presence;

pub use presence::is_present;

use cudarc::driver::sys::{self, CUresult};

use crate::error::{DriverError, Error};

/// Loads and initialises the driver (`cuInit`) once; every CUDA entry point of memres calls
/// this first. Returns [`Error::NoDriver`] where libcuda is absent, and the driver's error
/// where `cuInit` fails (no GPU, a driver/kernel mismatch).
pub(crate) fn init() -> Result<(), Error> {
    static INIT: OnceLock<Result<(), Error>> = OnceLock::new();
    INIT.get_or_init(|| {
        if !is_present() {
            return Err(Error::NoDriver);
        }
        // SAFETY: the library is present (checked above), and `cuInit(0)` has no other
        // precondition; it may be called any number of times.
        check(unsafe { sys::cuInit(0) })?;
        // At the latest here, right after `cuInit` (see `device::exit`).
        exit::register_exit_hook();
        Ok(())
    })
    .clone()
}

/// The driver's CUDA version (`cuDriverGetVersion`: 13000 for CUDA 13.0), once it is
/// initialised. Entry points newer than the oldest driver memres supports check it first:
/// cudarc would panic on a symbol the driver lacks.
pub(crate) fn version() -> Result<i32, Error> {
    static VERSION: OnceLock<Result<i32, Error>> = OnceLock::new();
    init()?;
    VERSION
        .get_or_init(|| {
            let mut v = 0;
            // SAFETY: the driver is loaded and initialised; `v` is a valid place.
            check(unsafe { sys::cuDriverGetVersion(&mut v) })?;
            Ok(v)
        })
        .clone()
}

/// [`Error::Unsupported`] unless the driver is at least `required` (e.g. 13000).
pub(crate) fn require_version(required: i32, what: &str) -> Result<(), Error> {
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

/// `Ok(())` for `CUDA_SUCCESS`, else the error (out-of-memory as [`Error::OutOfMemory`] of
/// unknown size; see [`check_alloc`] where the size is known).
#[inline]
pub(crate) fn check(result: CUresult) -> Result<(), Error> {
    match result {
        CUresult::CUDA_SUCCESS => Ok(()),
        other => Err(Error::from(DriverError::new(other))),
    }
}

/// As [`check`], with out-of-memory reported for `requested` bytes.
#[inline]
pub(crate) fn check_alloc(result: CUresult, requested: usize) -> Result<(), Error> {
    match result {
        CUresult::CUDA_SUCCESS => Ok(()),
        CUresult::CUDA_ERROR_OUT_OF_MEMORY => Err(Error::out_of_memory(requested)),
        other => Err(Error::Driver(DriverError::new(other))),
    }
}

/// Reports a failed driver call in a `Drop` or a `deallocate`, which cannot return it.
#[cold]
pub(crate) fn report(what: &str, result: CUresult) {
    if result != CUresult::CUDA_SUCCESS {
        tracing::error!(?result, "memres: {what} failed");
    }
}
