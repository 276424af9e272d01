//! The one error type of the crate.

use std::borrow::Cow;
use std::fmt;

use crate::platform::ErrorCode;

/// Everything that can go wrong when memory is asked for.
///
/// Out-of-memory is an ordinary, recoverable error: a resource that cannot serve a request
/// returns [`Error::OutOfMemory`] and stays usable. No resource in this crate panics or
/// aborts on bad input.
///
/// ```
/// use memres::{Error, HostHeap, SyncResource, layout};
///
/// let heap = HostHeap::new();
/// // One pebibyte: no machine here has it.
/// match heap.allocate_sync(layout(1 << 50)?) {
///     Err(Error::OutOfMemory { requested, .. }) => assert_eq!(requested, 1 << 50),
///     other => panic!("expected OutOfMemory, got {other:?}"),
/// }
/// # Ok::<(), Error>(())
/// ```
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Error {
    /// The resource could not find `requested` bytes.
    #[non_exhaustive]
    OutOfMemory {
        /// Bytes asked for.
        requested: usize,
        /// Set when a byte limit ran out rather than the memory (a `Limiting` adaptor):
        /// the limit in bytes.
        limit: Option<usize>,
    },
    /// A size, alignment or configuration value that the resource cannot accept; the
    /// message names the value and the rule it broke.
    InvalidArgument(Cow<'static, str>),
    /// A resource handed back memory that breaks the contract: the pointer at `address`
    /// is not aligned to `align`. The memory has been returned to where it came from.
    Misaligned {
        /// The alignment that was asked for.
        align: usize,
        /// The address that came back.
        address: usize,
    },
    /// No GPU driver could be loaded on this machine: libcuda, or libamdhip64 in a build
    /// with the `hip` feature.
    NoDriver,
    /// The GPU driver reported an error other than running out of memory.
    Driver(DriverError),
    /// The resource or the device does not support what was asked (the message says what).
    Unsupported(Cow<'static, str>),
    /// The pool is asleep ([`VirtualPool::sleep`](crate::VirtualPool::sleep)): it hands
    /// out no memory until [`VirtualPool::wake`](crate::VirtualPool::wake).
    Asleep,
}

impl Error {
    /// An [`Error::OutOfMemory`] for a request of `requested` bytes.
    ///
    /// For resources written outside this crate (a [`Callback`](crate::upstream::Callback) closure,
    /// a user's own [`SyncResource`](crate::SyncResource)), which cannot name the
    /// variant's fields directly because more may be added.
    pub const fn out_of_memory(requested: usize) -> Self {
        Error::OutOfMemory {
            requested,
            limit: None,
        }
    }

    /// An [`Error::OutOfMemory`] for a request that would take a resource past its byte
    /// `limit`.
    pub const fn over_limit(requested: usize, limit: usize) -> Self {
        Error::OutOfMemory {
            requested,
            limit: Some(limit),
        }
    }

    /// An [`Error::InvalidArgument`] with the given message.
    pub fn invalid_argument(message: impl Into<Cow<'static, str>>) -> Self {
        Error::InvalidArgument(message.into())
    }

    /// An [`Error::Unsupported`] with the given message.
    pub fn unsupported(message: impl Into<Cow<'static, str>>) -> Self {
        Error::Unsupported(message.into())
    }

    /// True for [`Error::OutOfMemory`]: the one error that retrying after freeing memory
    /// can cure.
    pub const fn is_out_of_memory(&self) -> bool {
        matches!(self, Error::OutOfMemory { .. })
    }
}

/// An error the GPU driver reported: its result code (`CUresult`, or `hipError_t` in a
/// build with the `hip` feature), with its name and, where a driver is loaded, the
/// driver's description.
///
/// memres's own type, so that the crate's API does not change with the version of the
/// crate it calls the driver through.
///
/// ```
/// use memres::{Cuda, Error, SyncResource, layout};
///
/// // Without a GPU this is `NoDriver`; with one, a 1 MiB block.
/// match Cuda::new().and_then(|cuda| cuda.allocate_sync(layout(1 << 20)?)) {
///     Err(Error::Driver(e)) => eprintln!("driver error {} ({})", e.code(), e.name()),
///     Err(e) => eprintln!("{e}"),
///     Ok(_) => {}
/// }
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct DriverError(ErrorCode);

impl DriverError {
    /// The error of a driver call that returned `result`.
    pub(crate) fn new(result: ErrorCode) -> DriverError {
        DriverError(result)
    }

    /// The driver's result code (`CUresult`'s numeric value, e.g. 1 for
    /// `CUDA_ERROR_INVALID_VALUE`; `hipError_t`'s in a HIP build).
    pub fn code(&self) -> u32 {
        self.0.number()
    }

    /// The code's name, e.g. `CUDA_ERROR_INVALID_VALUE`.
    pub fn name(&self) -> String {
        self.0.name()
    }

    /// The driver's description of the error where a driver is loaded, else its name.
    pub fn message(&self) -> String {
        self.0.message().unwrap_or_else(|| self.name())
    }
}

#[cfg(feature = "cudarc-interop")]
impl From<cudarc::driver::DriverError> for Error {
    /// Maps `CUDA_ERROR_OUT_OF_MEMORY` to [`Error::OutOfMemory`] with an unknown size
    /// (0); callers that know the size build the variant themselves.
    fn from(e: cudarc::driver::DriverError) -> Self {
        Error::from(DriverError(ErrorCode::Cuda(e.0)))
    }
}

impl From<DriverError> for Error {
    /// Maps `CUDA_ERROR_OUT_OF_MEMORY` to [`Error::OutOfMemory`] with an unknown size
    /// (0); callers that know the size build the variant themselves.
    fn from(e: DriverError) -> Self {
        if e.0.is_out_of_memory() {
            Error::out_of_memory(0)
        } else {
            Error::Driver(e)
        }
    }
}

impl fmt::Display for DriverError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (message, name) = (self.message(), self.name());
        if message == name {
            f.write_str(&name)
        } else {
            write!(f, "{message} ({name})")
        }
    }
}

impl fmt::Debug for DriverError {
    /// The code's name: no driver call, so it works without a driver too.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DriverError({:?})", self.0)
    }
}

impl std::error::Error for DriverError {}

/// Writes a byte count the way people read them: `1.5 GiB (1610612736 bytes)`.
pub(crate) struct Bytes(pub(crate) usize);

impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
        let n = self.0;
        if n < 1024 {
            return write!(f, "{n} bytes");
        }
        let mut value = n as f64 / 1024.0;
        let mut unit = 0;
        while value >= 1024.0 && unit + 1 < UNITS.len() {
            value /= 1024.0;
            unit += 1;
        }
        write!(f, "{value:.1} {} ({n} bytes)", UNITS[unit])
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::OutOfMemory {
                requested,
                limit: Some(limit),
            } => write!(
                f,
                "out of memory: allocating {} would pass the limit of {} \
                 (free memory or raise the limit)",
                Bytes(*requested),
                Bytes(*limit)
            ),
            Error::OutOfMemory { requested: 0, .. } => f.write_str(
                "out of memory: the resource could not serve the request \
                 (free memory, trim a pool, or lower the request)",
            ),
            Error::OutOfMemory { requested, .. } => write!(
                f,
                "out of memory: could not allocate {} \
                 (free memory, trim a pool, or lower the request)",
                Bytes(*requested)
            ),
            Error::InvalidArgument(msg) => write!(f, "invalid argument: {msg}"),
            Error::Misaligned { align, address } => write!(
                f,
                "a resource returned address {address:#x}, which is not aligned to \
                 {align} bytes as asked; the memory was given back (fix the resource or \
                 its allocate callback)"
            ),
            #[cfg(not(feature = "hip"))]
            Error::NoDriver => f.write_str(
                "no CUDA driver: libcuda could not be loaded (install the NVIDIA driver, \
                 or use a host resource such as HostHeap)",
            ),
            #[cfg(feature = "hip")]
            Error::NoDriver => f.write_str(
                "no HIP runtime: libamdhip64 could not be loaded (install ROCm, \
                 or use a host resource such as HostHeap)",
            ),
            Error::Driver(e) => write!(f, "{} driver error: {e}", e.0.platform()),
            Error::Unsupported(msg) => write!(f, "unsupported: {msg}"),
            Error::Asleep => f.write_str(
                "the pool is asleep: it hands out no memory until it is woken (wake it first)",
            ),
        }
    }
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::OutOfMemory { requested, limit } => f
                .debug_struct("OutOfMemory")
                .field("requested", requested)
                .field("limit", limit)
                .finish(),
            Error::InvalidArgument(msg) => f.debug_tuple("InvalidArgument").field(msg).finish(),
            Error::Misaligned { align, address } => f
                .debug_struct("Misaligned")
                .field("align", align)
                .field("address", &format_args!("{address:#x}"))
                .finish(),
            Error::NoDriver => f.write_str("NoDriver"),
            // The code's name, which works whether or not a driver is loaded.
            Error::Driver(e) => f.debug_tuple("Driver").field(&e.0).finish(),
            Error::Unsupported(msg) => f.debug_tuple("Unsupported").field(msg).finish(),
            Error::Asleep => f.write_str("Asleep"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Driver(e) => Some(e),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A driver error names the platform its code is of, whatever the build's platform
    /// (a HIP build still converts cudarc's errors, which are CUDA's).
    #[test]
    fn a_driver_error_names_its_own_platform() {
        let cuda = Error::Driver(DriverError::new(ErrorCode::Cuda(
            cudarc::driver::sys::CUresult::CUDA_ERROR_INVALID_VALUE,
        )))
        .to_string();
        assert!(cuda.starts_with("CUDA driver error: "), "{cuda}");
        #[cfg(feature = "hip")]
        {
            let hip = Error::Driver(DriverError::new(ErrorCode::Hip(1))).to_string();
            assert!(hip.starts_with("HIP driver error: "), "{hip}");
        }
    }

    #[test]
    fn messages_name_the_problem() {
        let oom = Error::out_of_memory(3 << 30).to_string();
        assert!(oom.contains("3.0 GiB"), "{oom}");
        assert!(oom.contains("3221225472 bytes"), "{oom}");
        let bad = Error::invalid_argument("alignment 3 is not a power of two").to_string();
        assert_eq!(bad, "invalid argument: alignment 3 is not a power of two");
        let mis = Error::Misaligned {
            align: 256,
            address: 0x1001,
        }
        .to_string();
        assert!(mis.contains("0x1001") && mis.contains("256"), "{mis}");
        #[cfg(not(feature = "hip"))]
        assert!(Error::NoDriver.to_string().contains("libcuda"));
        #[cfg(feature = "hip")]
        assert!(Error::NoDriver.to_string().contains("libamdhip64"));
    }

    #[test]
    fn driver_out_of_memory_maps_to_out_of_memory() {
        use cudarc::driver::sys::CUresult;
        let e: Error = DriverError(ErrorCode::Cuda(CUresult::CUDA_ERROR_OUT_OF_MEMORY)).into();
        assert!(e.is_out_of_memory());
        let e: Error = DriverError(ErrorCode::Cuda(CUresult::CUDA_ERROR_INVALID_VALUE)).into();
        assert!(matches!(e, Error::Driver(_)));
        // Debug must not need a driver.
        assert!(format!("{e:?}").contains("CUDA_ERROR_INVALID_VALUE"));
        let d = DriverError::new(ErrorCode::Cuda(CUresult::CUDA_ERROR_INVALID_VALUE));
        assert_eq!(
            (d.code(), d.name().as_str()),
            (1, "CUDA_ERROR_INVALID_VALUE")
        );
        assert!(e.to_string().contains("CUDA_ERROR_INVALID_VALUE"), "{e}");
        assert!(std::error::Error::source(&e).is_some());
    }

    #[test]
    fn bytes_are_readable() {
        assert_eq!(Bytes(12).to_string(), "12 bytes");
        assert_eq!(Bytes(1536).to_string(), "1.5 KiB (1536 bytes)");
        assert_eq!(
            Bytes(1 << 50).to_string(),
            "1.0 PiB (1125899906842624 bytes)"
        );
    }
}
