//! Devices: which GPU, its memory, making it current, and the resource each device uses by
//! default.
//!
//! memres talks to the CUDA driver API, where "the current device" is the device of the
//! context current on the calling thread. memres uses each device's *primary* context (the
//! one the CUDA runtime, PyTorch and cudarc use too), so memory and streams are shared with
//! them. A thread that has no context current counts device 0 as current, as the runtime
//! does.

mod context;

use std::fmt;

pub use crate::driver::exit::process_is_exiting;
pub use context::DeviceGuard;
pub(crate) use context::{Bound, Context, bind};

use crate::driver::init;
use crate::error::Error;
use crate::platform::{Active, Attribute, DeviceHandle, Platform};

/// The alignment [`layout`](crate::layout) asks for: 256 bytes, as `cudaMalloc`
/// guarantees and RMM uses for every request. Written here, the lowest layer that uses it
/// ([`percent_of_free_device_memory`]); the crate root and `resource` re-export it.
pub const DEFAULT_ALIGNMENT: usize = 256;

/// A GPU device, by ordinal (a CUDA device, or a HIP one in a build with the `hip`
/// feature).
///
/// ```
/// use memres::device::DeviceId;
/// let d = DeviceId::new(0);
/// assert_eq!(d.ordinal(), 0);
/// // "hip:0" in a build with the `hip` feature.
/// assert_eq!(d.to_string(), format!("{}:0", memres::driver::platform().to_lowercase()));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct DeviceId(i32);

/// Free and total memory of a device, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct MemoryInfo {
    /// Bytes the driver could hand out now.
    pub free: usize,
    /// Bytes the device has.
    pub total: usize,
}

impl DeviceId {
    /// The device with this ordinal (not checked until it is used).
    pub const fn new(ordinal: i32) -> Self {
        DeviceId(ordinal)
    }

    /// The ordinal, as CUDA numbers devices.
    pub const fn ordinal(self) -> i32 {
        self.0
    }

    /// The device current on this thread: the device of the current context, or device 0
    /// where no context is current.
    pub fn current() -> Result<DeviceId, Error> {
        init()?;
        if Active::current_context()? == 0 {
            return Ok(DeviceId(0));
        }
        Ok(DeviceId(Active::current_device()?))
    }

    /// Every CUDA device, in ordinal order; [`Error::NoDriver`] without a driver.
    pub fn all() -> Result<Vec<DeviceId>, Error> {
        let n = i32::try_from(DeviceId::count()?).unwrap_or(i32::MAX);
        Ok((0..n).map(DeviceId).collect())
    }

    /// Whether kernels and copies on this device can reach `peer`'s memory directly
    /// (`cuDeviceCanAccessPeer`: NVLink or PCIe peer-to-peer). False for the device itself.
    pub fn can_access_peer(self, peer: DeviceId) -> Result<bool, Error> {
        if peer == self {
            return Ok(false);
        }
        let (dev, peer_dev) = (self.handle()?, peer.handle()?);
        Active::device_can_access_peer(dev, peer_dev)
    }

    /// `Ok` where kernels and copies on this device can reach `owner`'s memory
    /// ([`can_access_peer`](Self::can_access_peer)), else [`Error::Unsupported`] saying
    /// so: what granting this device access to memory of `owner` needs first.
    pub fn require_peer_access(self, owner: DeviceId) -> Result<(), Error> {
        if self.can_access_peer(owner)? {
            return Ok(());
        }
        Err(Error::unsupported(format!(
            "{self} cannot reach the memory of {owner} (no peer access between them)"
        )))
    }

    /// The number of CUDA devices.
    pub fn count() -> Result<usize, Error> {
        init()?;
        Active::device_count()
    }

    /// The driver's handle for this device; fails for an ordinal with no device.
    pub(crate) fn handle(self) -> Result<DeviceHandle, Error> {
        init()?;
        Active::device_get(self.0).map_err(|e| match e {
            Error::Driver(_) => {
                Error::invalid_argument(format!("there is no {} device {self}", Active::NAME))
            }
            e => e,
        })
    }

    /// A device attribute (`cuDeviceGetAttribute`).
    pub(crate) fn attribute(self, attribute: Attribute) -> Result<i32, Error> {
        Active::device_attribute(self.handle()?, attribute)
    }

    /// Free and total memory (`cuMemGetInfo` in the device's primary context).
    pub fn memory_info(self) -> Result<MemoryInfo, Error> {
        let _current = DeviceGuard::new(self)?;
        let (free, total) = Active::memory_info()?;
        Ok(MemoryInfo { free, total })
    }

    /// The device's name, as the driver reports it.
    pub fn name(self) -> Result<String, Error> {
        Active::device_name(self.handle()?)
    }

    /// Waits until the work on every stream of the device (its primary context) is
    /// complete (`cuCtxSynchronize`; the runtime's `cudaDeviceSynchronize`). Memory freed
    /// in stream order to a driver pool ([`CudaAsync`](crate::upstream::CudaAsync)) stays
    /// pending until its stream gets there: a trim after this gives it back. Not while a
    /// stream of the device is being captured into a CUDA graph: the driver refuses the
    /// wait and ends the capture.
    pub fn synchronize(self) -> Result<(), Error> {
        Context::primary(self)?.synchronize()
    }
}

impl fmt::Display for DeviceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", Active::DEVICE_PREFIX, self.0)
    }
}

/// `percent` % of the current device's free memory, aligned down to 256 bytes (RMM's
/// `percent_of_free_device_memory`, handy for sizing a pool).
///
/// `percent` above 100 is [`Error::InvalidArgument`].
pub fn percent_of_free_device_memory(percent: u32) -> Result<usize, Error> {
    if percent > 100 {
        return Err(Error::invalid_argument(format!(
            "percent_of_free_device_memory({percent}): a percentage is at most 100"
        )));
    }
    let free = DeviceId::current()?.memory_info()?.free as u128;
    let share = (free * percent as u128 / 100) as usize;
    Ok(share & !(DEFAULT_ALIGNMENT - 1))
}
