//! [`StreamAllocator`]: "how to allocate" as one small value to pass around.

use std::alloc::Layout;
use std::ptr::NonNull;

use bytemuck::Pod;

use super::vec::DeviceVec;
use crate::error::Error;
use crate::resource::{DEFAULT_ALIGNMENT, Resource};
use crate::stream::StreamRef;

/// A resource handle paired with a stream, allocating arrays of `T` in order on that
/// stream: RMM's `polymorphic_allocator` and `stream_allocator_adaptor` in one.
///
/// With a `Copy` handle (`&Pool<..>`, [`ResourceRef`](crate::ResourceRef)) it is `Copy`
/// and two or three words, so a library can take "how to allocate" as one argument and
/// hand it down. Arrays are aligned to at least [`DEFAULT_ALIGNMENT`].
///
/// ```
/// use memres::container::StreamAllocator;
/// use memres::{HostHeap, Pool, PoolConfig, StreamRef};
///
/// let pool = Pool::new(HostHeap, PoolConfig::default())?;
/// let alloc = StreamAllocator::new(&pool, StreamRef::HOST);
/// let p = alloc.allocate::<f64>(1000)?;
/// // SAFETY: `p` came from `alloc` for 1000 `f64`s and is not used afterwards.
/// unsafe { alloc.deallocate(p, 1000) };
///
/// let v = alloc.vec::<u32>(16)?; // a DeviceVec on the same resource and stream
/// assert_eq!(v.len(), 16);
/// # Ok::<(), memres::Error>(())
/// ```
#[derive(Debug, Clone, Copy)]
pub struct StreamAllocator<'s, R> {
    resource: R,
    stream: StreamRef<'s>,
}

impl<'s, R: Resource> StreamAllocator<'s, R> {
    /// Allocates from `resource` in order on `stream`.
    pub fn new(resource: R, stream: StreamRef<'s>) -> Self {
        StreamAllocator { resource, stream }
    }

    /// The stream allocations are ordered on.
    pub fn stream(&self) -> StreamRef<'s> {
        self.stream
    }

    /// The same resource on another stream.
    pub fn with_stream<'t>(self, stream: StreamRef<'t>) -> StreamAllocator<'t, R> {
        StreamAllocator {
            resource: self.resource,
            stream,
        }
    }

    /// The resource.
    pub fn resource(&self) -> &R {
        &self.resource
    }

    fn layout<T>(len: usize) -> Result<Layout, Error> {
        Layout::array::<T>(len)
            .and_then(|l| l.align_to(DEFAULT_ALIGNMENT))
            .map_err(|_| {
                Error::invalid_argument(format!(
                    "{len} elements of {} bytes overflow the address space",
                    size_of::<T>()
                ))
            })
    }

    /// Room for `len` values of `T` (uninitialised), usable by work on the stream
    /// enqueued after this call.
    pub fn allocate<T>(&self, len: usize) -> Result<NonNull<T>, Error> {
        let layout = Self::layout::<T>(len)?;
        Ok(self.resource.allocate(self.stream, layout)?.cast())
    }

    /// Frees an array from [`allocate`](Self::allocate) in order on the stream.
    ///
    /// # Safety
    /// `ptr` came from `allocate::<T>(len)` on this allocator or one with an equal
    /// resource, is not freed yet, and every use of it is ordered before this point on
    /// the stream (see [`Resource::deallocate`]).
    pub unsafe fn deallocate<T>(&self, ptr: NonNull<T>, len: usize) {
        // `allocate::<T>(len)` succeeded (the caller's promise), so the layout is valid.
        let Ok(layout) = Self::layout::<T>(len) else {
            return;
        };
        // SAFETY: the caller's promise, with the layout `allocate` used.
        unsafe { self.resource.deallocate(self.stream, ptr.cast(), layout) }
    }
}

impl<'s, R: Resource + Clone> StreamAllocator<'s, R> {
    /// A [`DeviceVec`] of `len` elements from this resource on this stream.
    pub fn vec<T: Pod>(&self, len: usize) -> Result<DeviceVec<'s, T, R>, Error> {
        DeviceVec::new(len, self.stream, self.resource.clone())
    }
}

impl<R: PartialEq> PartialEq for StreamAllocator<'_, R> {
    /// Equal where the resources are: either may free the other's arrays.
    fn eq(&self, other: &Self) -> bool {
        self.resource == other.resource
    }
}
