//! The object-safe mirror of the resource traits that erased handles call through.

use std::alloc::Layout;
use std::any::{Any, type_name};
use std::ptr::NonNull;

use crate::error::Error;
use crate::resource::{Resource, SyncResource};
use crate::stream::StreamRef;

/// [`SyncResource`] without its associated type, so it can be a trait object.
pub(crate) trait DynSyncResource: Any + Sync {
    fn dyn_allocate_sync(&self, layout: Layout) -> Result<NonNull<u8>, Error>;

    /// # Safety
    /// As [`SyncResource::deallocate_sync`].
    unsafe fn dyn_deallocate_sync(&self, ptr: NonNull<u8>, layout: Layout);

    /// The concrete `==` when `other` has the same concrete type, else false.
    fn dyn_eq(&self, other: &dyn DynSyncResource) -> bool;

    /// The concrete type's name, for `Debug`.
    fn type_name(&self) -> &'static str;
}

/// [`Resource`] without its associated type, so it can be a trait object.
pub(crate) trait DynResource: DynSyncResource {
    fn dyn_allocate(&self, stream: StreamRef<'_>, layout: Layout) -> Result<NonNull<u8>, Error>;

    /// # Safety
    /// As [`Resource::deallocate`].
    unsafe fn dyn_deallocate(&self, stream: StreamRef<'_>, ptr: NonNull<u8>, layout: Layout);

    /// # Safety
    /// As [`Resource::deallocate_used_on`].
    unsafe fn dyn_deallocate_used_on(
        &self,
        stream: StreamRef<'_>,
        ptr: NonNull<u8>,
        layout: Layout,
        used_on: &[StreamRef<'_>],
    );
}

impl<R: SyncResource + Sync + 'static> DynSyncResource for R {
    #[inline]
    fn dyn_allocate_sync(&self, layout: Layout) -> Result<NonNull<u8>, Error> {
        self.allocate_sync(layout)
    }

    #[inline]
    unsafe fn dyn_deallocate_sync(&self, ptr: NonNull<u8>, layout: Layout) {
        // SAFETY: the caller keeps `SyncResource::deallocate_sync`'s contract.
        unsafe { self.deallocate_sync(ptr, layout) }
    }

    fn dyn_eq(&self, other: &dyn DynSyncResource) -> bool {
        let other: &dyn Any = other;
        other.downcast_ref::<R>().is_some_and(|other| self == other)
    }

    fn type_name(&self) -> &'static str {
        type_name::<R>()
    }
}

impl<R: Resource + Sync + 'static> DynResource for R {
    #[inline]
    fn dyn_allocate(&self, stream: StreamRef<'_>, layout: Layout) -> Result<NonNull<u8>, Error> {
        self.allocate(stream, layout)
    }

    #[inline]
    unsafe fn dyn_deallocate(&self, stream: StreamRef<'_>, ptr: NonNull<u8>, layout: Layout) {
        // SAFETY: the caller keeps `Resource::deallocate`'s contract.
        unsafe { self.deallocate(stream, ptr, layout) }
    }

    #[inline]
    unsafe fn dyn_deallocate_used_on(
        &self,
        stream: StreamRef<'_>,
        ptr: NonNull<u8>,
        layout: Layout,
        used_on: &[StreamRef<'_>],
    ) {
        // SAFETY: the caller keeps `Resource::deallocate_used_on`'s contract.
        unsafe { self.deallocate_used_on(stream, ptr, layout, used_on) }
    }
}
