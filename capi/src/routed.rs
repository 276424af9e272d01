//! What `memres_malloc` allocates from on a device: the pool of the tag set now
//! (`memres_set_tag`), else the stack's top; a free goes by its address to the tag's pool
//! whose reservation holds it, else to the top. The C ABI keeps it under the library's
//! [`StreamUse`](mr::adaptor::StreamUse) layer, which keeps the live blocks and the
//! streams `memres_record_stream` names for them.

use std::alloc::Layout;
use std::ptr::NonNull;

use mr::device::DeviceId;
use mr::{AnyResource, Device, Error, Resource, StreamRef, SyncResource};

use crate::tags::{TagPool, TagPools, current, new_tag_pool};

/// The stack's top and the tags' pools of one device, as one resource.
pub(crate) struct Routed {
    top: AnyResource<Device>,
    tags: TagPools,
    device: DeviceId,
}

impl Routed {
    pub(crate) fn new(top: AnyResource<Device>, device: DeviceId) -> Routed {
        Routed {
            top,
            tags: TagPools::default(),
            device,
        }
    }

    /// The resource the stack's own allocations go through.
    pub(crate) fn top(&self) -> &AnyResource<Device> {
        &self.top
    }

    /// The pools of the tags allocated under on this device.
    pub(crate) fn tags(&self) -> &TagPools {
        &self.tags
    }

    /// The pool allocations go to now (the tag's, made on its first use here, if one is
    /// set), or `None` for the top.
    #[inline]
    pub(crate) fn tagged_pool(&self) -> Result<Option<TagPool>, Error> {
        match current() {
            0 => Ok(None),
            id => self.tags.pool(id, || new_tag_pool(self.device)).map(Some),
        }
    }
}

impl PartialEq for Routed {
    /// One per device, never compared with another.
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self, other)
    }
}

// SAFETY: every block comes from the top or a tag's pool (device memory, both), and goes
// back to the one that served it: a tag's pool serves only addresses of its own
// reservation, and the top none of those (each reservation is the pool's alone).
unsafe impl SyncResource for Routed {
    type Properties = Device;

    fn allocate_sync(&self, layout: Layout) -> Result<NonNull<u8>, Error> {
        match self.tagged_pool()? {
            None => self.top.allocate_sync(layout),
            Some(pool) => pool.allocate_sync(layout),
        }
    }

    unsafe fn deallocate_sync(&self, ptr: NonNull<u8>, layout: Layout) {
        // SAFETY: the caller's promise, for the resource whose memory holds `ptr`.
        unsafe {
            match self.tags.holding(ptr.as_ptr() as usize) {
                Some(pool) => pool.deallocate_sync(ptr, layout),
                None => self.top.deallocate_sync(ptr, layout),
            }
        }
    }
}

// SAFETY: as above.
unsafe impl Resource for Routed {
    #[inline]
    fn allocate(&self, stream: StreamRef<'_>, layout: Layout) -> Result<NonNull<u8>, Error> {
        match self.tagged_pool()? {
            None => self.top.allocate(stream, layout),
            Some(pool) => pool.allocate(stream, layout),
        }
    }

    #[inline]
    unsafe fn deallocate(&self, stream: StreamRef<'_>, ptr: NonNull<u8>, layout: Layout) {
        // SAFETY: the caller's promise, for the resource whose memory holds `ptr`.
        unsafe {
            match self.tags.holding(ptr.as_ptr() as usize) {
                Some(pool) => pool.deallocate(stream, ptr, layout),
                None => self.top.deallocate(stream, ptr, layout),
            }
        }
    }

    #[inline]
    unsafe fn deallocate_used_on(
        &self,
        stream: StreamRef<'_>,
        ptr: NonNull<u8>,
        layout: Layout,
        used_on: &[StreamRef<'_>],
    ) {
        // SAFETY: as above.
        unsafe {
            match self.tags.holding(ptr.as_ptr() as usize) {
                Some(pool) => pool.deallocate_used_on(stream, ptr, layout, used_on),
                None => self.top.deallocate_used_on(stream, ptr, layout, used_on),
            }
        }
    }
}
