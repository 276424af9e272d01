//! Borrowed erased handles: [`ResourceRef`] and [`SyncResourceRef`].

use std::any::Any;
use std::marker::PhantomData;

use super::any::{AnyResource, AnySyncResource};
use super::dyn_resource::{DynResource, DynSyncResource};
use crate::property::{Contains, PropertySet};
use crate::resource::{Resource, SyncResource};

/// A borrowed, type-erased stream-ordered resource whose memory has the properties `P`.
///
/// Two words (a data pointer and a vtable pointer), `Copy`, `Send + Sync`; each call is one
/// indirect call. This is the type for "a memory resource" parameters of functions that
/// must not be generic.
///
/// ```
/// use memres::{Host, HostHeap, Resource, ResourceRef, StreamRef, layout};
///
/// fn scratch(mr: ResourceRef<'_, Host>) -> Result<(), memres::Error> {
///     let l = layout(1024)?;
///     let p = mr.allocate(StreamRef::HOST, l)?;
///     // SAFETY: allocated just above with `l`, not used after this.
///     unsafe { mr.deallocate(StreamRef::HOST, p, l) };
///     Ok(())
/// }
///
/// let heap = HostHeap::new();
/// scratch(ResourceRef::new(&heap))?;
/// # Ok::<(), memres::Error>(())
/// ```
///
/// A reference promising more than the resource has does not compile:
///
/// ```compile_fail,E0277
/// use memres::{Device, HostHeap, ResourceRef};
/// let heap = HostHeap::new();
/// let r = ResourceRef::<Device>::new(&heap); // HostHeap memory is not device-accessible
/// ```
pub struct ResourceRef<'a, P: PropertySet> {
    inner: &'a dyn DynResource,
    properties: PhantomData<fn() -> P>,
}

/// A borrowed, type-erased [`SyncResource`] whose memory has the properties `P`.
///
/// As [`ResourceRef`], for resources (or callers) without stream-ordered allocation.
/// A `ResourceRef` becomes one with [`ResourceRef::as_sync`].
pub struct SyncResourceRef<'a, P: PropertySet> {
    inner: &'a dyn DynSyncResource,
    properties: PhantomData<fn() -> P>,
}

impl<'a, P: PropertySet> ResourceRef<'a, P> {
    /// Erases `resource`, whose property set must contain `P`.
    ///
    /// A reference to an [`AnyResource<P>`](crate::AnyResource) yields a handle to the
    /// resource inside, not a second layer of erasure, so it compares equal to other
    /// handles to that resource. (To change `P` of an existing `ResourceRef`, use
    /// [`narrow`](Self::narrow).)
    pub fn new<R>(resource: &'a R) -> Self
    where
        R: Resource + Sync + 'static,
        R::Properties: Contains<P>,
    {
        let any: &dyn Any = resource;
        if let Some(erased) = any.downcast_ref::<AnyResource<P>>() {
            return erased.as_resource_ref();
        }
        Self::from_dyn(resource)
    }

    pub(super) fn from_dyn(inner: &'a dyn DynResource) -> Self {
        ResourceRef {
            inner,
            properties: PhantomData,
        }
    }

    /// The same resource, promising only the subset `Q` of `P`.
    ///
    /// ```
    /// use memres::{Device, HostDevice, ResourceRef};
    /// fn launch(_: ResourceRef<'_, Device>) {}
    /// fn staging(mr: ResourceRef<'_, HostDevice>) { launch(mr.narrow()) }
    /// ```
    pub fn narrow<Q: PropertySet>(self) -> ResourceRef<'a, Q>
    where
        P: Contains<Q>,
    {
        ResourceRef::from_dyn(self.inner)
    }

    /// The same resource, without its stream-ordered calls.
    pub fn as_sync(self) -> SyncResourceRef<'a, P> {
        SyncResourceRef::from_dyn(self.inner)
    }
}

impl<'a, P: PropertySet> SyncResourceRef<'a, P> {
    /// Erases `resource`, whose property set must contain `P`.
    ///
    /// A reference to an [`AnySyncResource<P>`](crate::erased::AnySyncResource) or an
    /// [`AnyResource<P>`](crate::AnyResource) yields a handle to the resource inside.
    pub fn new<R>(resource: &'a R) -> Self
    where
        R: SyncResource + Sync + 'static,
        R::Properties: Contains<P>,
    {
        let any: &dyn Any = resource;
        if let Some(erased) = any.downcast_ref::<AnySyncResource<P>>() {
            return erased.as_sync_resource_ref();
        }
        if let Some(erased) = any.downcast_ref::<AnyResource<P>>() {
            return erased.as_sync_resource_ref();
        }
        Self::from_dyn(resource)
    }

    pub(super) fn from_dyn(inner: &'a dyn DynSyncResource) -> Self {
        SyncResourceRef {
            inner,
            properties: PhantomData,
        }
    }

    /// The same resource, promising only the subset `Q` of `P`.
    pub fn narrow<Q: PropertySet>(self) -> SyncResourceRef<'a, Q>
    where
        P: Contains<Q>,
    {
        SyncResourceRef::from_dyn(self.inner)
    }
}

// Copy without requiring `P: Copy` (a derive would).
impl<P: PropertySet> Clone for ResourceRef<'_, P> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<P: PropertySet> Copy for ResourceRef<'_, P> {}
impl<P: PropertySet> Clone for SyncResourceRef<'_, P> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<P: PropertySet> Copy for SyncResourceRef<'_, P> {}

impl<'a, R, P> From<&'a R> for ResourceRef<'a, P>
where
    R: Resource + Sync + 'static,
    P: PropertySet,
    R::Properties: Contains<P>,
{
    fn from(resource: &'a R) -> Self {
        ResourceRef::new(resource)
    }
}

impl<'a, P: PropertySet> From<ResourceRef<'a, P>> for SyncResourceRef<'a, P> {
    fn from(r: ResourceRef<'a, P>) -> Self {
        r.as_sync()
    }
}

impl_erased!(['a, P: PropertySet] ResourceRef<'a, P>, "ResourceRef", stream_ordered);
impl_erased!(['a, P: PropertySet] SyncResourceRef<'a, P>, "SyncResourceRef");

static_assertions::assert_eq_size!(ResourceRef<'static, ()>, [usize; 2]);
static_assertions::assert_eq_size!(SyncResourceRef<'static, ()>, [usize; 2]);
static_assertions::assert_impl_all!(ResourceRef<'static, ()>: Send, Sync, Copy);
static_assertions::assert_impl_all!(SyncResourceRef<'static, ()>: Send, Sync, Copy);

// The borrowed handles of the owning ones are made here, beside the borrowed types, so
// that `any` needs nothing from this module.
impl<P: PropertySet> AnyResource<P> {
    /// A borrowed handle to the same resource, without a second indirection.
    pub fn as_resource_ref(&self) -> ResourceRef<'_, P> {
        ResourceRef::from_dyn(&*self.inner)
    }

    /// A borrowed sync handle to the same resource.
    pub fn as_sync_resource_ref(&self) -> SyncResourceRef<'_, P> {
        SyncResourceRef::from_dyn(&*self.inner)
    }
}

impl<P: PropertySet> AnySyncResource<P> {
    /// A borrowed handle to the same resource, without a second indirection.
    pub fn as_sync_resource_ref(&self) -> SyncResourceRef<'_, P> {
        SyncResourceRef::from_dyn(&*self.inner)
    }
}
