//! Owning erased handles: [`AnyResource`] and [`AnySyncResource`].

use std::any::Any;
use std::marker::PhantomData;

use super::dyn_resource::{DynResource, DynSyncResource};
use crate::property::{Contains, PropertySet};
use crate::resource::{Resource, SyncResource};
use crate::sync::{Arc, arc_from_std};

/// An owning, type-erased stream-ordered resource whose memory has the properties `P`.
///
/// `Send + Sync`, two words; `clone` is cheap and shares the one resource (an atomic
/// reference count), so memory from one clone may be freed through another. It is the
/// type to store where the concrete stack must not show: a per-device default resource,
/// a container that must not be generic, a plugin boundary. It is itself a resource, so
/// `Pool<AnyResource<Device>>` works.
///
/// ```
/// use memres::{AnyResource, Host, HostHeap, SyncResource, layout};
///
/// let mr: AnyResource<Host> = AnyResource::new(HostHeap::new());
/// let copy = mr.clone();
/// let l = layout(64)?;
/// let p = mr.allocate_sync(l)?;
/// // SAFETY: `copy` shares `mr`'s resource, so it may free `mr`'s memory.
/// unsafe { copy.deallocate_sync(p, l) };
/// assert_eq!(mr, copy);
/// assert!(mr.downcast_ref::<HostHeap>().is_some());
/// # Ok::<(), memres::Error>(())
/// ```
///
/// Only thread-safe resources can be erased this way:
///
/// ```compile_fail,E0277
/// use memres::{AnyResource, Host, HostHeap};
/// use std::rc::Rc;
/// let mr: AnyResource<Host> = AnyResource::new(Rc::new(HostHeap::new()));
/// ```
pub struct AnyResource<P: PropertySet> {
    pub(super) inner: Arc<dyn DynResource + Send>,
    properties: PhantomData<fn() -> P>,
}

/// An owning, type-erased [`SyncResource`] whose memory has the properties `P`.
///
/// As [`AnyResource`], for resources without stream-ordered allocation.
pub struct AnySyncResource<P: PropertySet> {
    pub(super) inner: Arc<dyn DynSyncResource + Send>,
    properties: PhantomData<fn() -> P>,
}

impl<P: PropertySet> AnyResource<P> {
    /// Takes ownership of `resource`, whose property set must contain `P`.
    ///
    /// An `AnyResource<P>` given here is returned as it is rather than wrapped again, so it
    /// keeps comparing equal to its clones (use [`narrow`](Self::narrow) to change `P`).
    pub fn new<R>(resource: R) -> Self
    where
        R: Resource + Send + Sync + 'static,
        R::Properties: Contains<P>,
    {
        let resource = match unwrap_same::<R, Self>(resource) {
            Ok(already) => return already,
            Err(resource) => resource,
        };
        let inner: std::sync::Arc<dyn DynResource + Send> = std::sync::Arc::new(resource);
        AnyResource {
            inner: arc_from_std(inner),
            properties: PhantomData,
        }
    }

    /// The same resource, promising only the subset `Q` of `P`.
    pub fn narrow<Q: PropertySet>(self) -> AnyResource<Q>
    where
        P: Contains<Q>,
    {
        AnyResource {
            inner: self.inner,
            properties: PhantomData,
        }
    }

    /// The concrete resource, if it is an `R`.
    pub fn downcast_ref<R: Any>(&self) -> Option<&R> {
        let inner: &dyn Any = &*self.inner;
        inner.downcast_ref()
    }
}

impl<P: PropertySet> AnySyncResource<P> {
    /// Takes ownership of `resource`, whose property set must contain `P`.
    ///
    /// An `AnySyncResource<P>` given here is returned as it is rather than wrapped again.
    pub fn new<R>(resource: R) -> Self
    where
        R: SyncResource + Send + Sync + 'static,
        R::Properties: Contains<P>,
    {
        let resource = match unwrap_same::<R, Self>(resource) {
            Ok(already) => return already,
            Err(resource) => resource,
        };
        let inner: std::sync::Arc<dyn DynSyncResource + Send> = std::sync::Arc::new(resource);
        AnySyncResource {
            inner: arc_from_std(inner),
            properties: PhantomData,
        }
    }

    /// The same resource, promising only the subset `Q` of `P`.
    pub fn narrow<Q: PropertySet>(self) -> AnySyncResource<Q>
    where
        P: Contains<Q>,
    {
        AnySyncResource {
            inner: self.inner,
            properties: PhantomData,
        }
    }

    /// The concrete resource, if it is an `R`.
    pub fn downcast_ref<R: Any>(&self) -> Option<&R> {
        let inner: &dyn Any = &*self.inner;
        inner.downcast_ref()
    }
}

/// `Ok(value)` when `R` is `T` (so an erased handle is not erased again), else the value
/// back. Runs once per construction, not per call.
fn unwrap_same<R: 'static, T: 'static>(value: R) -> Result<T, R> {
    if std::any::TypeId::of::<R>() != std::any::TypeId::of::<T>() {
        return Err(value);
    }
    let mut slot = Some(value);
    let slot: &mut dyn Any = &mut slot;
    Ok(slot
        .downcast_mut::<Option<T>>()
        .and_then(Option::take)
        .expect("the TypeIds are equal"))
}

// Clone shares; it must not require `P: Clone` (a derive would).
impl<P: PropertySet> Clone for AnyResource<P> {
    fn clone(&self) -> Self {
        AnyResource {
            inner: self.inner.clone(),
            properties: PhantomData,
        }
    }
}
impl<P: PropertySet> Clone for AnySyncResource<P> {
    fn clone(&self) -> Self {
        AnySyncResource {
            inner: self.inner.clone(),
            properties: PhantomData,
        }
    }
}

impl_erased!([P: PropertySet] AnyResource<P>, "AnyResource", stream_ordered);
impl_erased!([P: PropertySet] AnySyncResource<P>, "AnySyncResource");

#[cfg(not(memres_loom))]
static_assertions::assert_eq_size!(AnyResource<()>, [usize; 2]);
static_assertions::assert_impl_all!(AnyResource<()>: Send, Sync, Clone);
static_assertions::assert_impl_all!(AnySyncResource<()>: Send, Sync, Clone);
