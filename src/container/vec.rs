//! [`DeviceVec`]: a typed, growable array in a resource's memory.

use std::fmt;
use std::marker::PhantomData;
use std::mem::size_of;

use bytemuck::Pod;

use super::buffer::{DeviceBuffer, bind_device, bind_for, host_vec, order_after};
use crate::copy::{self, Access};
use crate::device::DeviceId;
use crate::erased::AnyResource;
use crate::error::Error;
use crate::property::{Device, HostAccessible};
use crate::resource::Has;
use crate::resource::{DEFAULT_ALIGNMENT, Resource};
use crate::stream::StreamRef;

/// A typed array of `T` in memory from resource `R`, freed on a stream when dropped
/// (RMM's `device_uvector`).
///
/// `T` is [`bytemuck::Pod`]: any bit pattern is a valid `T`, which is what reading bytes
/// back from a device needs (cudarc's `DeviceRepr` would also admit `bool`, for which a
/// byte the device wrote could be an invalid value). The buffer rules of
/// [`DeviceBuffer`] apply: stream order, the recorded device, and elements that are
/// uninitialised on device-only memory until written but zero on host-accessible memory.
///
/// Element access (`get`, `set`, `to_vec`) takes the stream to copy on, as RMM's does,
/// and synchronises it; where that is not the vector's own stream, it first waits for
/// the vector's stream. Host slices ([`as_slice`](Self::as_slice)) exist only where `R`'s
/// memory is host-accessible.
///
/// ```
/// use memres::container::DeviceVec;
/// use memres::{HostHeap, Pool, PoolConfig, StreamRef};
///
/// let pool = Pool::new(HostHeap, PoolConfig::default())?;
/// let s = StreamRef::HOST;
/// let mut v = DeviceVec::from_slice(&[1.0f32, 2.0, 3.0], s, &pool)?;
/// v.set(1, -0.0, s)?;
/// assert_eq!(v.get(1, s)?.to_bits(), (-0.0f32).to_bits());
/// v.resize(4)?;
/// assert_eq!(v.to_vec(s)?, [1.0, -0.0, 3.0, 0.0]); // host memory: new elements are 0
/// assert_eq!(v.as_slice()?[2], 3.0);
/// # Ok::<(), memres::Error>(())
/// ```
pub struct DeviceVec<'s, T: Pod, R: Resource> {
    buf: DeviceBuffer<'s, R>,
    len: usize,
    elements: PhantomData<T>,
}

/// `len` elements of `T` in bytes, or an error naming the overflow.
fn bytes_of<T>(len: usize) -> Result<usize, Error> {
    len.checked_mul(size_of::<T>()).ok_or_else(|| {
        Error::invalid_argument(format!(
            "{len} elements of {} bytes overflow the address space",
            size_of::<T>()
        ))
    })
}

fn alignment_of<T>() -> usize {
    DEFAULT_ALIGNMENT.max(align_of::<T>())
}

fn out_of_range(index: usize, len: usize) -> Error {
    Error::invalid_argument(format!(
        "index {index} is out of range for a DeviceVec of length {len}"
    ))
}

impl<'s, T: Pod, R: Resource> DeviceVec<'s, T, R> {
    /// A vector of `len` elements, uninitialised on device-only memory (zero on
    /// host-accessible memory).
    pub fn new(len: usize, stream: StreamRef<'s>, resource: R) -> Result<Self, Error> {
        let buf = DeviceBuffer::with_alignment(
            bytes_of::<T>(len)?,
            alignment_of::<T>(),
            stream,
            resource,
        )?;
        Ok(DeviceVec::from_buf(buf, len))
    }

    /// A vector of `len` zero elements (set in order on `stream`).
    pub fn zeroed(len: usize, stream: StreamRef<'s>, resource: R) -> Result<Self, Error> {
        let mut v = DeviceVec::uninit(len, stream, resource)?;
        v.set_to_zero(stream)?;
        Ok(v)
    }

    /// A vector holding a copy of `values`; returns once the copy is done.
    pub fn from_slice(values: &[T], stream: StreamRef<'s>, resource: R) -> Result<Self, Error> {
        let mut v = DeviceVec::uninit(values.len(), stream, resource)?;
        v.buf.copy_from_host(bytemuck::cast_slice(values))?;
        Ok(v)
    }

    fn uninit(len: usize, stream: StreamRef<'s>, resource: R) -> Result<Self, Error> {
        let buf = DeviceBuffer::uninit(bytes_of::<T>(len)?, alignment_of::<T>(), stream, resource)?;
        Ok(DeviceVec::from_buf(buf, len))
    }

    fn from_buf(buf: DeviceBuffer<'s, R>, len: usize) -> Self {
        DeviceVec {
            buf,
            len,
            elements: PhantomData,
        }
    }

    fn bytes(&self) -> usize {
        self.len * size_of::<T>()
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Elements the vector holds without reallocating.
    pub fn capacity(&self) -> usize {
        match size_of::<T>() {
            0 => usize::MAX,
            n => self.buf.capacity() / n,
        }
    }

    /// The address of the first element, for kernels and copies.
    pub fn as_ptr(&self) -> *const T {
        self.buf.as_ptr().cast()
    }

    /// The address of the first element, for kernels and copies that write.
    pub fn as_mut_ptr(&mut self) -> *mut T {
        self.buf.as_mut_ptr().cast()
    }

    /// The stream the vector's work is enqueued on and it is freed on.
    pub fn stream(&self) -> StreamRef<'s> {
        self.buf.stream()
    }

    /// Moves the vector to `stream`, ordered after the old one; see
    /// [`DeviceBuffer::set_stream`].
    pub fn set_stream(&mut self, stream: StreamRef<'s>) -> Result<(), Error> {
        self.buf.set_stream(stream)
    }

    /// The device recorded at construction; see [`DeviceBuffer::device`].
    pub fn device(&self) -> Option<DeviceId> {
        self.buf.device()
    }

    /// The resource the memory came from.
    pub fn resource(&self) -> &R {
        self.buf.resource()
    }

    /// The element at `index`, copied on `stream`, which is synchronised.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] where `index` is out of range.
    pub fn get(&self, index: usize, stream: StreamRef<'_>) -> Result<T, Error> {
        if index >= self.len {
            return Err(out_of_range(index, self.len));
        }
        let mut value = T::zeroed();
        self.copy_out(index, std::slice::from_mut(&mut value), stream)?;
        Ok(value)
    }

    /// The first element; see [`get`](Self::get).
    pub fn front(&self, stream: StreamRef<'_>) -> Result<T, Error> {
        self.get(0, stream)
    }

    /// The last element; see [`get`](Self::get).
    pub fn back(&self, stream: StreamRef<'_>) -> Result<T, Error> {
        let last = self.len.checked_sub(1).ok_or_else(|| out_of_range(0, 0))?;
        self.get(last, stream)
    }

    /// Sets the element at `index` to `value` on `stream`, and waits for the copy.
    pub fn set(&mut self, index: usize, value: T, stream: StreamRef<'_>) -> Result<(), Error> {
        let queued = self.set_from(index, &value, stream);
        // Even after a failure, nothing may read `value` once this returns.
        let done = stream.synchronize();
        queued.and(done)
    }

    /// Sets the element at `index` to `*value` on `stream` without waiting.
    ///
    /// The copy may read `value` after the call returns, so it must live as long as the
    /// program: a `static`, a promoted constant (`&1.5`), or a leaked box. A temporary or
    /// a local does not compile. The vector's stream is then made to wait for `stream`,
    /// so the vector's later work and its free come after the copy.
    pub fn set_async(
        &mut self,
        index: usize,
        value: &'static T,
        stream: StreamRef<'_>,
    ) -> Result<(), Error> {
        self.set_from(index, value, stream)
    }

    fn set_from(&mut self, index: usize, value: &T, stream: StreamRef<'_>) -> Result<(), Error> {
        if index >= self.len {
            return Err(out_of_range(index, self.len));
        }
        let dst = self.as_mut_ptr().wrapping_add(index).cast();
        self.write_on(stream, || {
            // `write_on` orders the vector's stream after the copy: no free or reuse first.
            // SAFETY: the element is inside the block; `value` lives until the copy is
            // done (synchronised by `set`, `'static` for `set_async`).
            unsafe {
                copy::copy(
                    dst,
                    Access::of::<R>(),
                    (value as *const T).cast(),
                    Access::HOST,
                    size_of::<T>(),
                    stream,
                )
            }
        })
    }

    /// Runs `write`, which enqueues work on the vector's memory on `stream`, between the
    /// two orderings that make a foreign stream safe: `stream` after the vector's stream
    /// (the work sees earlier writes), and the vector's stream after `stream` (its later
    /// work and its free come after), with `stream`'s context current.
    fn write_on(
        &self,
        stream: StreamRef<'_>,
        write: impl FnOnce() -> Result<(), Error>,
    ) -> Result<(), Error> {
        let _current = bind_for(stream, self.stream(), self.buf.device())?;
        order_after(stream, self.stream())?;
        write()?;
        order_after(self.stream(), stream)
    }

    /// Sets every element to zero (all bits) in order on `stream`, without waiting; the
    /// vector's stream then waits for `stream`.
    pub fn set_to_zero(&mut self, stream: StreamRef<'_>) -> Result<(), Error> {
        let (dst, bytes) = (self.buf.as_mut_ptr(), self.bytes());
        // SAFETY: the block holds `len` elements; `write_on` orders the vector's stream
        // after the set, so the block is not freed or reused before it.
        self.write_on(stream, || unsafe {
            copy::zero(dst, Access::of::<R>(), bytes, stream)
        })
    }

    /// Copies `out.len()` elements starting at `first` to `out` on `stream`, after the
    /// vector's stream, and synchronises `stream`.
    fn copy_out(&self, first: usize, out: &mut [T], stream: StreamRef<'_>) -> Result<(), Error> {
        let _current = bind_for(stream, self.stream(), self.buf.device())?;
        order_after(stream, self.stream())?;
        // SAFETY: `first + out.len() <= len` (the callers'); `out` is host memory distinct
        // from the block; the stream is synchronised before `out`'s borrow ends, and after
        // that no use of the block remains on `stream`.
        unsafe {
            copy::copy(
                out.as_mut_ptr().cast(),
                Access::HOST,
                self.as_ptr().add(first).cast(),
                Access::of::<R>(),
                std::mem::size_of_val(out),
                stream,
            )?;
        }
        stream.synchronize()
    }

    /// All elements, copied to a new `Vec` on `stream`, which is synchronised.
    pub fn to_vec(&self, stream: StreamRef<'_>) -> Result<Vec<T>, Error> {
        let mut out = host_vec(self.len, T::zeroed())?;
        self.copy_out(0, &mut out, stream)?;
        Ok(out)
    }

    /// Sets the length to `len`: within the capacity only the length changes; beyond it
    /// the memory is reallocated to exactly `len` elements (see
    /// [`DeviceBuffer::resize`]).
    pub fn resize(&mut self, len: usize) -> Result<(), Error> {
        self.buf.resize(bytes_of::<T>(len)?)?;
        self.len = len;
        Ok(())
    }

    /// Makes the capacity at least `capacity` elements.
    pub fn reserve(&mut self, capacity: usize) -> Result<(), Error> {
        self.buf.reserve(bytes_of::<T>(capacity)?)
    }

    /// Makes the capacity equal to the length.
    pub fn shrink_to_fit(&mut self) -> Result<(), Error> {
        self.buf.shrink_to_fit()
    }

    /// The untyped buffer, with the same memory.
    pub fn into_buffer(self) -> DeviceBuffer<'s, R> {
        self.buf
    }
}

impl<'s, T: Pod, R: Resource> DeviceVec<'s, T, R> {
    /// The elements as a host slice, after waiting for the vector's stream.
    ///
    /// Only for resources whose memory is host-accessible; on device-only memory this
    /// does not compile.
    pub fn as_slice(&self) -> Result<&[T], Error>
    where
        R: Has<HostAccessible>,
    {
        self.sync_own_stream()?;
        // SAFETY: host-accessible memory (the bound) holding `len` initialised elements
        // (zeroed or written when added), with no work in flight on it (synchronised);
        // more work is enqueued only through `&mut self`, which this borrow excludes.
        Ok(unsafe { std::slice::from_raw_parts(self.as_ptr(), self.len) })
    }

    /// The elements as a mutable host slice, after waiting for the vector's stream.
    ///
    /// Only for resources whose memory is host-accessible.
    pub fn as_mut_slice(&mut self) -> Result<&mut [T], Error>
    where
        R: Has<HostAccessible>,
    {
        self.sync_own_stream()?;
        // SAFETY: as in `as_slice`; the borrow of `self` is unique.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.as_mut_ptr(), self.len) })
    }

    fn sync_own_stream(&self) -> Result<(), Error> {
        let _current = bind_device(self.buf.device())?;
        self.stream().synchronize()
    }
}

impl<'s, T: Pod> DeviceVec<'s, T, AnyResource<Device>> {
    /// A vector of `len` elements from the current device's resource; see
    /// [`DeviceBuffer::new_default`].
    pub fn new_default(len: usize, stream: StreamRef<'s>) -> Result<Self, Error> {
        DeviceVec::new(len, stream, crate::per_device::current_resource()?)
    }
}

impl<T: Pod + fmt::Debug, R: Resource> fmt::Debug for DeviceVec<'_, T, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceVec")
            .field("len", &self.len)
            .field("buffer", &self.buf)
            .finish()
    }
}
