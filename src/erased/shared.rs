//! [`Shared`]: one resource, many owners.

use std::alloc::Layout;
use std::fmt;
use std::ops::Deref;
use std::ptr::NonNull;

use crate::error::Error;
use crate::resource::{Resource, SyncResource};
use crate::stream::StreamRef;
use crate::sync::Arc;

/// A reference-counted handle whose clones share one resource, like CCCL's
/// `cuda::mr::shared_resource` or copying an RMM `shared_ptr` to a resource.
///
/// Not erased: `Shared<Pool<Cuda>>` keeps the static type. Use it where several owners
/// (containers, threads, adaptors) must hold the same stateful resource; the resource is
/// dropped when the last clone is. A plain `Arc<R>` is a resource too; `Shared` adds the
/// RMM semantics that two handles to the same resource are equal without calling `R`'s
/// `==`, and reads as what it is meant for.
///
/// ```
/// use memres::{HostHeap, SyncResource, erased::Shared, layout};
///
/// let a = Shared::new(HostHeap::new());
/// let b = a.clone();
/// let l = layout(100)?;
/// let p = a.allocate_sync(l)?;
/// // SAFETY: `b` shares `a`'s resource, so it may free what `a` allocated.
/// unsafe { b.deallocate_sync(p, l) };
/// assert_eq!(a, b);
/// assert_eq!(Shared::owners(&a), 2);
/// # Ok::<(), memres::Error>(())
/// ```
pub struct Shared<R> {
    inner: Arc<R>,
}

impl<R> Shared<R> {
    /// Puts `resource` behind a shared handle.
    pub fn new(resource: R) -> Self {
        Shared {
            inner: Arc::new(resource),
        }
    }

    /// How many handles share the resource now (a snapshot: other threads may clone or
    /// drop handles at any time).
    pub fn owners(this: &Self) -> usize {
        Arc::strong_count(&this.inner)
    }

    /// True when `a` and `b` share one resource.
    pub fn ptr_eq(a: &Self, b: &Self) -> bool {
        Arc::ptr_eq(&a.inner, &b.inner)
    }
}

impl<R> Clone for Shared<R> {
    fn clone(&self) -> Self {
        Shared {
            inner: self.inner.clone(),
        }
    }
}

impl<R> Deref for Shared<R> {
    type Target = R;

    fn deref(&self) -> &R {
        &self.inner
    }
}

impl<R: PartialEq> PartialEq for Shared<R> {
    /// Equal when both share one resource, or when their resources are equal.
    fn eq(&self, other: &Self) -> bool {
        Shared::ptr_eq(self, other) || *self.inner == *other.inner
    }
}

impl<R: fmt::Debug> fmt::Debug for Shared<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Shared").field(&*self.inner).finish()
    }
}

// SAFETY: every call goes to the one shared resource, which keeps the contract; two
// handles are equal only if they share it or their resources are equal.
unsafe impl<R: SyncResource> SyncResource for Shared<R> {
    type Properties = R::Properties;

    #[inline]
    fn allocate_sync(&self, layout: Layout) -> Result<NonNull<u8>, Error> {
        self.inner.allocate_sync(layout)
    }

    #[inline]
    unsafe fn deallocate_sync(&self, ptr: NonNull<u8>, layout: Layout) {
        // SAFETY: the caller keeps the contract for this handle; every clone shares the
        // one resource, so it is the contract of `R`.
        unsafe { self.inner.deallocate_sync(ptr, layout) }
    }
}

// SAFETY: as for `SyncResource` above.
unsafe impl<R: Resource> Resource for Shared<R> {
    #[inline]
    fn allocate(&self, stream: StreamRef<'_>, layout: Layout) -> Result<NonNull<u8>, Error> {
        self.inner.allocate(stream, layout)
    }

    #[inline]
    unsafe fn deallocate(&self, stream: StreamRef<'_>, ptr: NonNull<u8>, layout: Layout) {
        // SAFETY: as in `deallocate_sync`.
        unsafe { self.inner.deallocate(stream, ptr, layout) }
    }

    #[inline]
    unsafe fn deallocate_used_on(
        &self,
        stream: StreamRef<'_>,
        ptr: NonNull<u8>,
        layout: Layout,
        used_on: &[StreamRef<'_>],
    ) {
        // SAFETY: as in `deallocate_sync`.
        unsafe { self.inner.deallocate_used_on(stream, ptr, layout, used_on) }
    }
}
