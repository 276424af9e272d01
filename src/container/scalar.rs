//! [`DeviceScalar`]: one value in a resource's memory.

use std::fmt;

use bytemuck::Pod;

use super::vec::DeviceVec;
use crate::device::DeviceId;
use crate::error::Error;
use crate::resource::Resource;
use crate::stream::StreamRef;

/// One `T` in memory from resource `R` (RMM's `device_scalar`): a result a kernel
/// writes, a counter, a flag. The rules of [`DeviceVec`] apply.
///
/// ```
/// use memres::container::DeviceScalar;
/// use memres::{HostHeap, StreamRef};
///
/// let s = StreamRef::HOST;
/// let mut x = DeviceScalar::with_value(&7u64, s, HostHeap)?;
/// assert_eq!(x.value(s)?, 7);
/// x.set_value_to_zero(s)?;
/// assert_eq!(x.value(s)?, 0);
/// # Ok::<(), memres::Error>(())
/// ```
pub struct DeviceScalar<'s, T: Pod, R: Resource> {
    vec: DeviceVec<'s, T, R>,
}

impl<'s, T: Pod, R: Resource> DeviceScalar<'s, T, R> {
    /// A scalar whose value is uninitialised on device-only memory (zero on
    /// host-accessible memory).
    pub fn new(stream: StreamRef<'s>, resource: R) -> Result<Self, Error> {
        Ok(DeviceScalar {
            vec: DeviceVec::new(1, stream, resource)?,
        })
    }

    /// A scalar holding `value`; returns once the copy is done.
    pub fn with_value(value: &T, stream: StreamRef<'s>, resource: R) -> Result<Self, Error> {
        Ok(DeviceScalar {
            vec: DeviceVec::from_slice(std::slice::from_ref(value), stream, resource)?,
        })
    }

    /// The value, copied on `stream`, which is synchronised.
    pub fn value(&self, stream: StreamRef<'_>) -> Result<T, Error> {
        self.vec.get(0, stream)
    }

    /// Sets the value on `stream` and waits for the copy.
    pub fn set_value(&mut self, value: T, stream: StreamRef<'_>) -> Result<(), Error> {
        self.vec.set(0, value, stream)
    }

    /// Sets the value on `stream` without waiting; `value` must be `'static` (see
    /// [`DeviceVec::set_async`]).
    pub fn set_value_async(
        &mut self,
        value: &'static T,
        stream: StreamRef<'_>,
    ) -> Result<(), Error> {
        self.vec.set_async(0, value, stream)
    }

    /// Sets the value to zero (all bits), in order on `stream`; nothing is read from
    /// the host, so this does not wait.
    pub fn set_value_to_zero(&mut self, stream: StreamRef<'_>) -> Result<(), Error> {
        self.vec.set_to_zero(stream)
    }

    /// The value's address, for kernels.
    pub fn as_ptr(&self) -> *const T {
        self.vec.as_ptr()
    }

    /// The value's address, for kernels that write it.
    pub fn as_mut_ptr(&mut self) -> *mut T {
        self.vec.as_mut_ptr()
    }

    /// The stream the scalar's work is enqueued on and it is freed on.
    pub fn stream(&self) -> StreamRef<'s> {
        self.vec.stream()
    }

    /// Moves the scalar to `stream`, ordered after the old one.
    pub fn set_stream(&mut self, stream: StreamRef<'s>) -> Result<(), Error> {
        self.vec.set_stream(stream)
    }

    /// The device recorded at construction.
    pub fn device(&self) -> Option<DeviceId> {
        self.vec.device()
    }

    /// The resource the memory came from.
    pub fn resource(&self) -> &R {
        self.vec.resource()
    }

    /// The one-element vector holding the value.
    pub fn into_vec(self) -> DeviceVec<'s, T, R> {
        self.vec
    }
}

impl<T: Pod + fmt::Debug, R: Resource> fmt::Debug for DeviceScalar<'_, T, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceScalar")
            .field("vec", &self.vec)
            .finish()
    }
}
