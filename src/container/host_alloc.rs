//! Host-accessible resources as `allocator_api2` allocators, for
//! `allocator_api2::vec::Vec`, `hashbrown::HashMap` and any collection of that line.

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::Arc;

use allocator_api2::alloc::{AllocError, Allocator};

use crate::erased::{AnyResource, AnySyncResource, ResourceRef, Shared, SyncResourceRef};
use crate::property::{HostAccessible, PropertySet};
use crate::resource::Has;
use crate::resource::SyncResource;
use crate::upstream::{HostHeap, Managed, PinnedHost};

/// A resource whose memory host code may use, as an [`Allocator`] (the 0.2 line of
/// `allocator-api2`, the one hashbrown uses). Allocation goes through the synchronous
/// path ([`SyncResource::allocate_sync`]).
///
/// Only resources whose properties include [`HostAccessible`] are accepted (`HostHeap`,
/// `PinnedHost`, `Managed`, pools and adaptors over them): a collection writes its
/// elements from the host, so device-only memory does not compile here.
///
/// ```
/// use allocator_api2::vec::Vec;
/// use memres::container::HostAllocator;
/// use memres::{HostHeap, Pool, PoolConfig};
///
/// let pool = Pool::new(HostHeap, PoolConfig::default())?;
/// let mut v = Vec::new_in(HostAllocator::new(&pool));
/// v.extend([1u32, 2, 3]);
/// assert_eq!(v.iter().sum::<u32>(), 6);
/// # Ok::<(), memres::Error>(())
/// ```
#[derive(Debug, Default)]
pub struct HostAllocator<R>(R);

impl<R: SyncResource + Has<HostAccessible>> HostAllocator<R> {
    /// Allocates from `resource`.
    pub fn new(resource: R) -> Self {
        HostAllocator(resource)
    }
}

impl<R> HostAllocator<R> {
    /// The resource.
    pub fn resource(&self) -> &R {
        &self.0
    }

    /// The resource, taken back.
    pub fn into_inner(self) -> R {
        self.0
    }
}

// SAFETY: blocks come from `allocate_sync`, which returns at least `layout.size()` bytes
// aligned to `layout.align()` that stay valid until freed (the `SyncResource` contract)
// and host-accessible (the bound), so they are valid for host reads and writes; moving
// the allocator moves the resource, which does not invalidate its blocks (the contract
// ties validity to the free, not to where the resource lives); clones are the same
// resource (`Clone` exists only for `ShareOnClone` handles).
unsafe impl<R: SyncResource + Has<HostAccessible>> Allocator for HostAllocator<R> {
    #[inline]
    fn allocate(&self, layout: Layout) -> Result<NonNull<[u8]>, AllocError> {
        let ptr = self.0.allocate_sync(layout).map_err(|_| AllocError)?;
        Ok(NonNull::slice_from_raw_parts(ptr, layout.size()))
    }

    #[inline]
    unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) {
        // SAFETY: `Allocator::deallocate`'s contract: `ptr` was allocated by this
        // allocator (or a clone, which is the same resource) with `layout`.
        unsafe { self.0.deallocate_sync(ptr, layout) }
    }
}

/// Resource handles whose clones are the same resource (memory from one may be freed by
/// any other), as an `Allocator`'s clones must be. Only these make [`HostAllocator`]
/// `Clone`: cloning, say, a pool by value would make a second pool.
///
/// Sealed: implemented for references, `Arc`, [`Shared`], the erased handles, and the
/// stateless host-accessible leaves.
pub trait ShareOnClone: Clone + sealed::Sealed {}

mod sealed {
    pub trait Sealed {}
}

macro_rules! share_on_clone {
    ($(impl[$($gen:tt)*] for $ty:ty;)*) => {$(
        impl<$($gen)*> sealed::Sealed for $ty {}
        impl<$($gen)*> ShareOnClone for $ty {}
    )*};
}

share_on_clone! {
    impl['a, R: ?Sized] for &'a R;
    impl[R: ?Sized] for Arc<R>;
    impl[R] for Shared<R>;
    impl[P: PropertySet] for AnyResource<P>;
    impl[P: PropertySet] for AnySyncResource<P>;
    impl['a, P: PropertySet] for ResourceRef<'a, P>;
    impl['a, P: PropertySet] for SyncResourceRef<'a, P>;
    impl[] for HostHeap;
    impl[] for PinnedHost;
    impl[] for Managed;
}

impl<R: ShareOnClone> Clone for HostAllocator<R> {
    fn clone(&self) -> Self {
        HostAllocator(self.0.clone())
    }
}
