//! [`DeviceBuffer`]: untyped, stream-ordered bytes owned together with their resource.

use std::alloc::Layout;
use std::fmt;
use std::mem::ManuallyDrop;
use std::ptr::NonNull;

use crate::copy::{self, Access};
use crate::device::{Bound, Context, DeviceId, bind, process_is_exiting};
use crate::erased::AnyResource;
use crate::error::Error;
use crate::property::Device;
use crate::resource::{DEFAULT_ALIGNMENT, Resource, layout_with_alignment};
use crate::stream::StreamRef;

/// Bytes of memory from a resource, freed on a stream when dropped (RMM's
/// `device_buffer`).
///
/// The buffer owns its memory and a handle `R` to the resource it came from: `&'a Pool<..>`
/// (borrowed; the borrow checker keeps the pool alive as long as the buffer), `Arc<..>`,
/// or [`AnyResource<Device>`] (owned). `'s` is the lifetime of its stream: a buffer cannot
/// outlive the stream it will be freed on.
///
/// # Rules
/// - **Stream order.** The buffer's own work (copies, reallocation, the free at drop) is
///   enqueued on [`stream`](Self::stream). Methods that take another stream order their
///   work against the buffer's stream with an event, so the free can never overtake it;
///   [`set_stream`](Self::set_stream) likewise orders the new stream after the old one
///   (RMM leaves both to the caller).
/// - **Device.** On a CUDA stream the buffer records the device current when it was made,
///   and makes it current for reallocation, copies and its drop, so dropping it with
///   another device current is correct. On a host stream it records none
///   ([`device`](Self::device) is `None`) and never calls the driver.
/// - **Contents.** New bytes are uninitialised on device-only memory, as in RMM; on
///   host-accessible memory they are zeroed, so that host code never reads uninitialised
///   bytes.
/// - **Growth.** [`resize`](Self::resize) within the capacity only changes the size;
///   beyond it, it allocates exactly the new size and copies the old bytes (as RMM).
///
/// ```
/// use memres::container::DeviceBuffer;
/// use memres::{HostHeap, StreamRef};
///
/// let s = StreamRef::HOST;
/// let mut buf = DeviceBuffer::from_host(b"hello", s, HostHeap)?;
/// buf.resize(8)?;
/// assert_eq!(buf.to_host_vec()?, b"hello\0\0\0");
/// assert!(buf.capacity() >= 8);
/// # Ok::<(), memres::Error>(())
/// ```
pub struct DeviceBuffer<'s, R: Resource> {
    ptr: NonNull<u8>,
    size: usize,
    /// The capacity and alignment of the allocation: what it is freed with.
    layout: Layout,
    stream: StreamRef<'s>,
    device: Option<DeviceId>,
    resource: R,
}

// SAFETY: the buffer owns its block (no other handle to it exists in safe code), so moving
// it to another thread moves that ownership; the resource handle goes with it.
unsafe impl<R: Resource + Send> Send for DeviceBuffer<'_, R> {}
// SAFETY: shared access reads the block only through copies enqueued on streams, which any
// thread may do; the resource is shared as `&R`.
unsafe impl<R: Resource + Sync> Sync for DeviceBuffer<'_, R> {}

/// The pieces of a [`DeviceBuffer`], from [`DeviceBuffer::into_raw_parts`] and for
/// [`DeviceBuffer::from_raw_parts`].
#[derive(Debug)]
pub struct RawParts<'s, R> {
    /// The block.
    pub ptr: NonNull<u8>,
    /// Bytes in use.
    pub size: usize,
    /// Bytes allocated: the block's layout is `capacity` bytes at `alignment`.
    pub capacity: usize,
    /// The block's alignment.
    pub alignment: usize,
    /// The stream the block is used and freed on.
    pub stream: StreamRef<'s>,
    /// The device to make current for work on the block (`None` on a host stream).
    pub device: Option<DeviceId>,
    /// The resource that allocated the block.
    pub resource: R,
}

/// The device to record for a container on `stream`: the current one for a CUDA stream.
///
/// The per-thread default stream is refused: it names a different stream on every
/// thread, so a container moved to another thread would free (and order its work) on a
/// stream its earlier work was never on.
pub(super) fn device_for(stream: StreamRef<'_>) -> Result<Option<DeviceId>, Error> {
    if stream.is_per_thread() {
        return Err(Error::invalid_argument(
            "containers cannot use the per-thread default stream (it names another stream \
             on every thread the container may move to); use a `Stream` or the default one",
        ));
    }
    if stream.is_host() {
        Ok(None)
    } else {
        DeviceId::current().map(Some)
    }
}

/// Orders work enqueued on `later` from now on after the work enqueued on `earlier` so
/// far: an event where possible, else (an event cannot join the two) by waiting for
/// `earlier` on the host. Containers use it both ways around a use of their memory on a
/// foreign stream, so the use sees their earlier work and their free cannot overtake it.
pub(super) fn order_after(later: StreamRef<'_>, earlier: StreamRef<'_>) -> Result<(), Error> {
    later
        .wait_for_stream(earlier)
        .or_else(|_| earlier.synchronize())
}

/// Makes current the context that work on `stream` is issued in: for an explicit CUDA
/// stream other than the container's own (`own`), the stream's device (the driver
/// refuses work on a stream of another device's context); otherwise the container's
/// `device`.
pub(super) fn bind_for(
    stream: StreamRef<'_>,
    own: StreamRef<'_>,
    device: Option<DeviceId>,
) -> Result<Option<Bound>, Error> {
    match stream.cu() {
        Some(raw) if stream != own && !stream.is_default() && !stream.is_per_thread() => {
            Ok(Some(bind(Context::of_stream(raw)?)?))
        }
        _ => bind_device(device),
    }
}

/// Makes `device` current until the guard drops (nothing for `None`).
pub(super) fn bind_device(device: Option<DeviceId>) -> Result<Option<Bound>, Error> {
    device.map(|d| bind(Context::primary(d)?)).transpose()
}

impl<'s, R: Resource> DeviceBuffer<'s, R> {
    /// A buffer of `size` bytes from `resource`, usable in order on `stream`, aligned to
    /// [`DEFAULT_ALIGNMENT`].
    ///
    /// # Errors
    /// What the resource returns ([`Error::OutOfMemory`], ...); [`Error::NoDriver`] on a
    /// CUDA stream without a driver.
    pub fn new(size: usize, stream: StreamRef<'s>, resource: R) -> Result<Self, Error> {
        DeviceBuffer::with_alignment(size, DEFAULT_ALIGNMENT, stream, resource)
    }

    /// As [`new`](Self::new), aligned to `alignment` (a power of two).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an alignment that is not a power of two, or one the
    /// resource cannot honour; otherwise as [`new`](Self::new).
    pub fn with_alignment(
        size: usize,
        alignment: usize,
        stream: StreamRef<'s>,
        resource: R,
    ) -> Result<Self, Error> {
        let mut buf = DeviceBuffer::uninit(size, alignment, stream, resource)?;
        buf.zero_if_host(0, size)?;
        Ok(buf)
    }

    /// A buffer holding a copy of `bytes`. The call returns once the copy is done (the
    /// stream is synchronised), so `bytes` may be reused at once.
    pub fn from_host(bytes: &[u8], stream: StreamRef<'s>, resource: R) -> Result<Self, Error> {
        let mut buf = DeviceBuffer::uninit(bytes.len(), DEFAULT_ALIGNMENT, stream, resource)?;
        buf.copy_from_host(bytes)?;
        Ok(buf)
    }

    /// A copy of `other`'s bytes (its size, not its capacity, as RMM) in a new buffer
    /// from `resource` on `stream`, aligned as `other`.
    ///
    /// The copy runs on `stream` after the work already enqueued on `other`'s stream, and
    /// `other`'s stream waits for it, so `other` may be changed or dropped at once.
    pub fn copy_from<Q: Resource>(
        other: &DeviceBuffer<'_, Q>,
        stream: StreamRef<'s>,
        resource: R,
    ) -> Result<Self, Error> {
        let buf = DeviceBuffer::uninit(other.size, other.alignment(), stream, resource)?;
        {
            let _current = bind_device(buf.device)?;
            order_after(stream, other.stream)?;
            // SAFETY: both blocks hold at least `other.size` bytes and are distinct
            // allocations; the copy is ordered after `other`'s work (above) and before
            // `other`'s later work and free (below), and before `buf`'s own free.
            unsafe {
                copy::copy(
                    buf.ptr.as_ptr(),
                    Access::of::<R>(),
                    other.ptr.as_ptr(),
                    Access::of::<Q>(),
                    other.size,
                    stream,
                )?;
            }
            order_after(other.stream, stream)?;
        }
        Ok(buf)
    }

    /// A buffer with uninitialised bytes: the constructors' common part.
    pub(super) fn uninit(
        size: usize,
        alignment: usize,
        stream: StreamRef<'s>,
        resource: R,
    ) -> Result<Self, Error> {
        let layout = layout_with_alignment(size, alignment)?;
        let device = device_for(stream)?;
        let _current = bind_device(device)?;
        let ptr = resource.allocate(stream, layout)?;
        Ok(DeviceBuffer {
            ptr,
            size,
            layout,
            stream,
            device,
            resource,
        })
    }

    /// Bytes in use.
    pub fn size(&self) -> usize {
        self.size
    }

    /// True when the size is zero.
    pub fn is_empty(&self) -> bool {
        self.size == 0
    }

    /// Bytes allocated: the size may grow to this without reallocating.
    pub fn capacity(&self) -> usize {
        self.layout.size()
    }

    /// The alignment the block was allocated with.
    pub fn alignment(&self) -> usize {
        self.layout.align()
    }

    /// The block's address, for kernels and copies (dangling where the capacity is zero).
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// The block's address, for kernels and copies that write it.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The stream the buffer's work is enqueued on and it is freed on.
    pub fn stream(&self) -> StreamRef<'s> {
        self.stream
    }

    /// Moves the buffer to `stream`: later work, and the free, go there. `stream` first
    /// waits for the work already enqueued on the old stream (an event between CUDA
    /// streams, a synchronisation when moving to a host stream).
    pub fn set_stream(&mut self, stream: StreamRef<'s>) -> Result<(), Error> {
        if stream == self.stream {
            return Ok(());
        }
        let device = match device_for(stream)? {
            None => None,
            Some(current) => Some(self.device.unwrap_or(current)),
        };
        let _current = bind_device(device)?;
        order_after(stream, self.stream)?;
        self.stream = stream;
        self.device = device;
        Ok(())
    }

    /// The device recorded when the buffer was made on a CUDA stream (`None` on a host
    /// stream); it is made current for the buffer's work and drop.
    pub fn device(&self) -> Option<DeviceId> {
        self.device
    }

    /// The resource the block came from.
    pub fn resource(&self) -> &R {
        &self.resource
    }

    /// Makes the capacity at least `capacity` bytes: a new block of exactly that size
    /// with the bytes copied over, where it is larger than the current one.
    pub fn reserve(&mut self, capacity: usize) -> Result<(), Error> {
        if capacity > self.capacity() {
            self.reallocate(capacity)?;
        }
        Ok(())
    }

    /// Sets the size to `size` bytes. Within the capacity only the size changes; beyond
    /// it a block of exactly `size` bytes replaces the old one, with the bytes copied.
    /// Bytes added are uninitialised on device-only memory and zero on host-accessible
    /// memory.
    pub fn resize(&mut self, size: usize) -> Result<(), Error> {
        if size > self.capacity() {
            self.reallocate(size)?;
        }
        let old = self.size;
        if size > old {
            self.zero_if_host(old, size - old)?;
        }
        self.size = size;
        Ok(())
    }

    /// Makes the capacity equal to the size, reallocating where it is larger.
    pub fn shrink_to_fit(&mut self) -> Result<(), Error> {
        if self.capacity() > self.size {
            self.reallocate(self.size)?;
        }
        Ok(())
    }

    /// Copies the first `dst.len()` bytes of the buffer to `dst` and waits for the copy.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `dst` is longer than the buffer.
    pub fn copy_to_host(&self, dst: &mut [u8]) -> Result<(), Error> {
        self.check_len(dst.len())?;
        let _current = bind_device(self.device)?;
        // SAFETY: `dst` and the block hold `dst.len()` bytes and are disjoint (the block is
        // not host memory that Rust code borrows); the stream is synchronised below before
        // `dst`'s borrow ends. A failed copy leaves `dst` unread.
        unsafe {
            copy::copy(
                dst.as_mut_ptr(),
                Access::HOST,
                self.ptr.as_ptr(),
                Access::of::<R>(),
                dst.len(),
                self.stream,
            )?;
        }
        self.stream.synchronize()
    }

    /// The buffer's bytes, copied to a new `Vec` (the stream is synchronised).
    pub fn to_host_vec(&self) -> Result<Vec<u8>, Error> {
        let mut out = host_vec(self.size, 0u8)?;
        self.copy_to_host(&mut out)?;
        Ok(out)
    }

    /// Copies `src` to the start of the buffer and waits for the copy.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `src` is longer than the buffer.
    pub fn copy_from_host(&mut self, src: &[u8]) -> Result<(), Error> {
        self.check_len(src.len())?;
        let _current = bind_device(self.device)?;
        // SAFETY: as in `copy_to_host`, with the roles swapped; the synchronisation ends
        // the copy's reads of `src` before its borrow ends.
        unsafe {
            copy::copy(
                self.ptr.as_ptr(),
                Access::of::<R>(),
                src.as_ptr(),
                Access::HOST,
                src.len(),
                self.stream,
            )?;
        }
        self.stream.synchronize()
    }

    /// Takes the buffer apart without freeing the block.
    pub fn into_raw_parts(self) -> RawParts<'s, R> {
        let this = ManuallyDrop::new(self);
        RawParts {
            ptr: this.ptr,
            size: this.size,
            capacity: this.capacity(),
            alignment: this.alignment(),
            stream: this.stream,
            device: this.device,
            // SAFETY: `this` is never dropped or used again, so the resource is moved out
            // exactly once.
            resource: unsafe { std::ptr::read(&this.resource) },
        }
    }

    /// Puts a buffer back together from its parts.
    ///
    /// # Safety
    /// `parts.ptr` came from `parts.resource` (or a resource equal to it) with a layout of
    /// `capacity` bytes at `alignment`, is not freed, and is owned by nobody else; every
    /// use of it so far is ordered before work enqueued on `parts.stream` from now on;
    /// `size <= capacity`; `device` is the block's device (or `None` on a host stream);
    /// and where the memory is host-accessible its first `size` bytes are initialised.
    /// [`into_raw_parts`](Self::into_raw_parts) returns parts that keep these rules.
    pub unsafe fn from_raw_parts(parts: RawParts<'s, R>) -> Self {
        DeviceBuffer {
            ptr: parts.ptr,
            size: parts.size,
            // SAFETY: the caller promises the block was allocated with this layout, which
            // was therefore valid.
            layout: unsafe { Layout::from_size_align_unchecked(parts.capacity, parts.alignment) },
            stream: parts.stream,
            device: parts.device,
            resource: parts.resource,
        }
    }

    fn check_len(&self, len: usize) -> Result<(), Error> {
        if len > self.size {
            return Err(Error::invalid_argument(format!(
                "{len} bytes do not fit a buffer of {} bytes",
                self.size
            )));
        }
        Ok(())
    }

    /// Zeroes `len` bytes at `offset` where the memory is host-accessible.
    fn zero_if_host(&mut self, offset: usize, len: usize) -> Result<(), Error> {
        if !Access::of::<R>().host() || len == 0 {
            return Ok(());
        }
        let _current = bind_device(self.device)?;
        // SAFETY: `offset + len` is within the capacity (the callers' ranges); the block
        // is ours and freed only after the stream's work.
        unsafe {
            copy::zero(
                self.ptr.as_ptr().add(offset),
                Access::of::<R>(),
                len,
                self.stream,
            )
        }
    }

    /// Replaces the block with one of `capacity` bytes, copying `min(size, capacity)`.
    fn reallocate(&mut self, capacity: usize) -> Result<(), Error> {
        let layout = layout_with_alignment(capacity, self.alignment())?;
        let _current = bind_device(self.device)?;
        let ptr = self.resource.allocate(self.stream, layout)?;
        let keep = self.size.min(capacity);
        let access = Access::of::<R>();
        // SAFETY: two distinct blocks of at least `keep` bytes, used on the same stream,
        // which orders the copy before either is freed.
        let copied = unsafe {
            copy::copy(
                ptr.as_ptr(),
                access,
                self.ptr.as_ptr(),
                access,
                keep,
                self.stream,
            )
        };
        if let Err(e) = copied {
            // SAFETY: allocated just above with `layout` on this stream; never used.
            unsafe { self.resource.deallocate(self.stream, ptr, layout) };
            return Err(e);
        }
        let old = std::mem::replace(&mut self.ptr, ptr);
        let old_layout = std::mem::replace(&mut self.layout, layout);
        // SAFETY: `old` came from this resource with `old_layout`; its last use (the copy)
        // is enqueued on the stream it is freed on.
        unsafe { self.resource.deallocate(self.stream, old, old_layout) };
        self.size = keep;
        Ok(())
    }
}

/// `len` copies of `value` in a new `Vec`, or [`Error::OutOfMemory`] where the host has
/// no room (rather than the abort of `vec![..]`).
pub(super) fn host_vec<T: Clone>(len: usize, value: T) -> Result<Vec<T>, Error> {
    let mut out = Vec::new();
    out.try_reserve_exact(len)
        .map_err(|_| Error::out_of_memory(len.saturating_mul(size_of::<T>())))?;
    out.resize(len, value);
    Ok(out)
}

impl<'s> DeviceBuffer<'s, AnyResource<Device>> {
    /// A buffer of `size` bytes from the current device's resource
    /// ([`per_device::current_resource`](crate::per_device::current_resource)); the buffer holds
    /// the resource, so replacing the default later cannot leave it dangling.
    pub fn new_default(size: usize, stream: StreamRef<'s>) -> Result<Self, Error> {
        DeviceBuffer::new(size, stream, crate::per_device::current_resource()?)
    }
}

impl<R: Resource> Drop for DeviceBuffer<'_, R> {
    fn drop(&mut self) {
        // The device may be unreachable at exit; the resource then skips the driver.
        let _current = match self.device {
            Some(_) if process_is_exiting() => None,
            device => bind_device(device).unwrap_or_else(|e| {
                tracing::error!(%e, "memres: DeviceBuffer: cannot make its device current");
                None
            }),
        };
        // SAFETY: the block came from `resource` with `layout` and is freed once; every
        // use the buffer made of it is enqueued on `stream` or ordered before it.
        unsafe { self.resource.deallocate(self.stream, self.ptr, self.layout) };
    }
}

impl<R: Resource> fmt::Debug for DeviceBuffer<'_, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("ptr", &self.ptr)
            .field("size", &self.size)
            .field("capacity", &self.capacity())
            .field("alignment", &self.alignment())
            .field("stream", &self.stream)
            .field("device", &self.device)
            .finish_non_exhaustive()
    }
}
