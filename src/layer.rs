//! Composing stacks that read top-down: [`ResourceExt`] and [`Layer`].
//!
//! A stack is a nest of types, `Limiting<Statistics<Pool<Cuda>>>`; written as nested
//! constructors it reads inside-out. [`ResourceExt`] turns that into a chain that reads in
//! the order memory flows, from the leaf up:
//!
//! ```
//! use memres::{AnyResource, Host, HostHeap, ResourceExt};
//!
//! let mr: AnyResource<Host> = HostHeap::new()
//!     .with_limiting(1 << 30) // Limiting<HostHeap>: at most 1 GiB outstanding
//!     .with_statistics() // Statistics<Limiting<HostHeap>>
//!     .shared()          // Shared<..>: clones share one stack
//!     .into_any();       // AnyResource<Host>: erased at the API boundary
//! ```
//!
//! Adaptors plug in through [`Layer`], as in tower: a layer is a small value that knows how
//! to wrap an upstream, and [`ResourceExt::with`] applies it. Nothing happens at run time
//! that writing the nested constructor by hand would not do; the chain is the same types.
//!
//! Every adaptor whose constructor cannot fail ships a layer ([`StatisticsLayer`],
//! [`LimitingLayer`], [`TrackingLayer`], [`ProfilingLayer`], [`GuardLayer`],
//! [`ThreadSafeLayer`], [`StreamUseLayer`], [`SharedLayer`]), and a pair or triple of layers is a layer that
//! applies them in order, innermost first. A stack recipe is then a value, made once and
//! applied to each device's leaf or pool:
//!
//! ```
//! use memres::layer::{LimitingLayer, StatisticsLayer};
//! use memres::{HostHeap, PoolConfig, ResourceExt};
//!
//! let recipe = (LimitingLayer::new(1 << 30), StatisticsLayer);
//! let stacks = (0..2)
//!     .map(|_| Ok(HostHeap::new().pool(PoolConfig::new())?.with(recipe)))
//!     .collect::<Result<Vec<_>, memres::Error>>()?;
//! // Statistics<Limiting<Pool<HostHeap>>>, one per "device".
//! assert_eq!(stacks[1].upstream().limit(), 1 << 30);
//! # Ok::<(), memres::Error>(())
//! ```
//!
//! Adaptors whose constructors check their arguments ([`Aligned`](crate::adaptor::Aligned),
//! [`Prefetch`](crate::adaptor::Prefetch)) or take a closure
//! ([`FailureRetry`](crate::adaptor::FailureRetry)), and the sub-allocators, are made
//! with their builder methods of [`ResourceExt`] (`with_aligned`, `with_prefetch`,
//! `with_failure_retry`, `pool`, `arena`, ...), which return what they return.
//!
//! **Names.** A builder is named as the type it builds, in snake case: for an adaptor,
//! `with_` and its type's name (`with_statistics`, `with_tracking`, `with_profiling`,
//! `with_guard`, `with_limiting`, `with_aligned`, `with_failure_retry`, `with_fallback`,
//! `with_thread_safe`, `with_prefetch`, `with_stream_use`); its layer is the adaptor's
//! type name and `Layer` (`StatisticsLayer`); a sub-allocator's builder is its type's name
//! (`pool`, `arena`, `binning`, `fixed_size`; a virtual-memory leaf's `virtual_pool`,
//! which builds a [`VirtualPool`](crate::VirtualPool)).
//! [`Logging`](crate::adaptor::Logging) has no builder: it needs a destination, made
//! with its own constructors.

use crate::erased::{AnyResource, AnySyncResource, ResourceRef, Shared};
use crate::property::{Contains, PropertySet};
use crate::resource::{Resource, SyncResource};

/// Something that wraps an upstream resource `U` in an adaptor.
///
/// ```
/// use memres::{HostHeap, ResourceExt, erased::Shared, layer::Layer};
///
/// /// Puts any resource behind a `Shared` handle (as memres's own `SharedLayer` does).
/// struct BehindShared;
/// impl<U> Layer<U> for BehindShared {
///     type Resource = Shared<U>;
///     fn layer(self, upstream: U) -> Shared<U> { Shared::new(upstream) }
/// }
///
/// let mr: Shared<HostHeap> = HostHeap::new().with(BehindShared);
/// ```
pub trait Layer<U> {
    /// The adaptor over `U`.
    type Resource;

    /// Wraps `upstream`.
    fn layer(self, upstream: U) -> Self::Resource;
}

/// Two layers applied in order: `self.0` over the upstream, then `self.1` over that.
impl<U, A: Layer<U>, B: Layer<A::Resource>> Layer<U> for (A, B) {
    type Resource = B::Resource;

    #[inline]
    fn layer(self, upstream: U) -> B::Resource {
        self.1.layer(self.0.layer(upstream))
    }
}

/// Three layers applied in order, the first innermost.
impl<U, A, B, C> Layer<U> for (A, B, C)
where
    A: Layer<U>,
    B: Layer<A::Resource>,
    C: Layer<B::Resource>,
{
    type Resource = C::Resource;

    #[inline]
    fn layer(self, upstream: U) -> C::Resource {
        self.2.layer(self.1.layer(self.0.layer(upstream)))
    }
}

/// Layers that wrap an upstream in an adaptor, one per adaptor, each `Copy` so that one
/// recipe serves many stacks.
macro_rules! unit_layer {
    ($(#[$doc:meta])* $layer:ident => $adaptor:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
        pub struct $layer;

        impl<U> Layer<U> for $layer {
            type Resource = crate::adaptor::$adaptor<U>;

            #[inline]
            fn layer(self, upstream: U) -> Self::Resource {
                crate::adaptor::$adaptor::new(upstream)
            }
        }
    };
}

unit_layer!(
    /// Wraps in [`Statistics`](crate::adaptor::Statistics) (as
    /// [`ResourceExt::with_statistics`]).
    StatisticsLayer => Statistics
);
unit_layer!(
    /// Wraps in [`Profiling`](crate::adaptor::Profiling) (as
    /// [`ResourceExt::with_profiling`]).
    ProfilingLayer => Profiling
);
unit_layer!(
    /// Wraps in [`Guard`](crate::adaptor::Guard) (as [`ResourceExt::with_guard`]).
    GuardLayer => Guard
);
unit_layer!(
    /// Wraps in [`ThreadSafe`](crate::adaptor::ThreadSafe) (as
    /// [`ResourceExt::with_thread_safe`]).
    ThreadSafeLayer => ThreadSafe
);
unit_layer!(
    /// Wraps in [`StreamUse`](crate::adaptor::StreamUse) (as
    /// [`ResourceExt::with_stream_use`]).
    StreamUseLayer => StreamUse
);

/// Wraps in [`Limiting`](crate::adaptor::Limiting) with a cap of `limit` bytes (as
/// [`ResourceExt::with_limiting`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitingLayer {
    limit: usize,
}

impl LimitingLayer {
    /// At most `limit` bytes outstanding.
    pub fn new(limit: usize) -> LimitingLayer {
        LimitingLayer { limit }
    }
}

impl<U> Layer<U> for LimitingLayer {
    type Resource = crate::adaptor::Limiting<U>;

    #[inline]
    fn layer(self, upstream: U) -> Self::Resource {
        crate::adaptor::Limiting::new(upstream, self.limit)
    }
}

/// Wraps in [`Tracking`](crate::adaptor::Tracking), with call stacks or without (as
/// [`ResourceExt::with_tracking`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TrackingLayer {
    stacks: bool,
}

impl TrackingLayer {
    /// Records live allocations, without call stacks.
    pub fn new() -> TrackingLayer {
        TrackingLayer { stacks: false }
    }

    /// Records live allocations with the call stack of each.
    pub fn with_stacks() -> TrackingLayer {
        TrackingLayer { stacks: true }
    }
}

impl<U> Layer<U> for TrackingLayer {
    type Resource = crate::adaptor::Tracking<U>;

    #[inline]
    fn layer(self, upstream: U) -> Self::Resource {
        if self.stacks {
            crate::adaptor::Tracking::with_stacks(upstream)
        } else {
            crate::adaptor::Tracking::new(upstream)
        }
    }
}

/// Puts the upstream behind a [`Shared`] handle (as [`ResourceExt::shared`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SharedLayer;

impl<U> Layer<U> for SharedLayer {
    type Resource = Shared<U>;

    #[inline]
    fn layer(self, upstream: U) -> Shared<U> {
        Shared::new(upstream)
    }
}

/// Methods to build stacks top-down; implemented for every resource.
pub trait ResourceExt: SyncResource + Sized {
    /// Wraps `self` in the adaptor that `layer` makes.
    #[inline]
    fn with<L: Layer<Self>>(self, layer: L) -> L::Resource {
        layer.layer(self)
    }

    /// Counts bytes and allocations: [`Statistics`](crate::adaptor::Statistics).
    #[inline]
    fn with_statistics(self) -> crate::adaptor::Statistics<Self> {
        crate::adaptor::Statistics::new(self)
    }

    /// Records live allocations: [`Tracking`](crate::adaptor::Tracking) (call stacks too
    /// when `stacks`).
    #[inline]
    fn with_tracking(self, stacks: bool) -> crate::adaptor::Tracking<Self> {
        if stacks {
            crate::adaptor::Tracking::with_stacks(self)
        } else {
            crate::adaptor::Tracking::new(self)
        }
    }

    /// Counts allocations towards the open [`profile`](crate::profile) scopes:
    /// [`Profiling`](crate::adaptor::Profiling).
    #[inline]
    fn with_profiling(self) -> crate::adaptor::Profiling<Self> {
        crate::adaptor::Profiling::new(self)
    }

    /// Pads every block with canaries checked when it is freed, to catch writes out of
    /// bounds: [`Guard`](crate::adaptor::Guard).
    #[inline]
    fn with_guard(self) -> crate::adaptor::Guard<Self> {
        crate::adaptor::Guard::new(self)
    }

    /// Caps the bytes outstanding: [`Limiting`](crate::adaptor::Limiting).
    #[inline]
    fn with_limiting(self, limit: usize) -> crate::adaptor::Limiting<Self> {
        crate::adaptor::Limiting::new(self, limit)
    }

    /// Aligns requests of at least `threshold` bytes to `alignment`:
    /// [`Aligned`](crate::adaptor::Aligned).
    #[inline]
    fn with_aligned(
        self,
        alignment: usize,
        threshold: usize,
    ) -> Result<crate::adaptor::Aligned<Self>, crate::Error> {
        crate::adaptor::Aligned::new(self, alignment, threshold)
    }

    /// Retries out-of-memory failures while `on_failure` says so:
    /// [`FailureRetry`](crate::adaptor::FailureRetry).
    #[inline]
    fn with_failure_retry<F: Fn(usize) -> bool>(
        self,
        on_failure: F,
    ) -> crate::adaptor::FailureRetry<Self, F> {
        crate::adaptor::FailureRetry::new(self, on_failure)
    }

    /// Sends what `self` has no memory for to `then`, with `self`'s properties (which
    /// `then` must give too; for a set both give, name it:
    /// `Fallback::<_, _, Device>::new(first, then)`):
    /// [`Fallback`](crate::adaptor::Fallback).
    #[inline]
    fn with_fallback<B>(self, then: B) -> crate::adaptor::Fallback<Self, B, Self::Properties> {
        crate::adaptor::Fallback::new(self, then)
    }

    /// Puts `self` behind a lock so it can be shared between threads:
    /// [`ThreadSafe`](crate::adaptor::ThreadSafe).
    #[inline]
    fn with_thread_safe(self) -> crate::adaptor::ThreadSafe<Self> {
        crate::adaptor::ThreadSafe::new(self)
    }

    /// Keeps the live blocks and the streams `record_stream` names for each, handed to
    /// the free: [`StreamUse`](crate::adaptor::StreamUse).
    #[inline]
    fn with_stream_use(self) -> crate::adaptor::StreamUse<Self> {
        crate::adaptor::StreamUse::new(self)
    }

    /// A coalescing [`Pool`](crate::suballoc::Pool) over `self`.
    ///
    /// ```
    /// use memres::{HostHeap, PoolConfig, ResourceExt};
    ///
    /// let pool = HostHeap::new().pool(PoolConfig::new().initial_size(1 << 20))?.with_statistics();
    /// # Ok::<(), memres::Error>(())
    /// ```
    #[inline]
    fn pool(
        self,
        config: crate::suballoc::PoolConfig,
    ) -> Result<crate::suballoc::Pool<Self>, crate::Error>
    where
        Self: crate::resource::Resource,
    {
        crate::suballoc::Pool::new(self, config)
    }

    /// Prefetches new managed memory to the device: [`Prefetch`](crate::adaptor::Prefetch).
    #[inline]
    fn with_prefetch(self) -> Result<crate::adaptor::Prefetch<Self>, crate::Error> {
        crate::adaptor::Prefetch::new(self)
    }

    /// An [`Arena`](crate::suballoc::Arena) of `size` bytes over `self`.
    #[inline]
    fn arena(self, size: usize) -> Result<crate::suballoc::Arena<Self>, crate::Error>
    where
        Self: crate::resource::Resource,
    {
        crate::suballoc::Arena::with_size(self, size)
    }

    /// A [`Binning`](crate::suballoc::Binning) over `self`: bins of 2^`min_exponent` ..
    /// 2^`max_exponent` bytes; larger requests go to `self`.
    #[inline]
    fn binning(
        self,
        min_exponent: u32,
        max_exponent: u32,
    ) -> Result<crate::suballoc::Binning<Self>, crate::Error>
    where
        Self: crate::resource::Resource + Send + Sync + 'static,
    {
        crate::suballoc::Binning::new(self, min_exponent, max_exponent)
    }

    /// A [`FixedSize`](crate::suballoc::FixedSize) over `self`: blocks of `block_size`
    /// bytes, taken `blocks_per_chunk` at a time.
    #[inline]
    fn fixed_size(
        self,
        block_size: usize,
        blocks_per_chunk: usize,
    ) -> Result<crate::suballoc::FixedSize<Self>, crate::Error>
    where
        Self: crate::resource::Resource,
    {
        crate::suballoc::FixedSize::with_block_size(self, block_size, blocks_per_chunk)
    }

    /// Puts `self` behind a [`Shared`] handle whose clones share it.
    #[inline]
    fn shared(self) -> Shared<Self> {
        Shared::new(self)
    }

    /// Erases `self` into an owning [`AnyResource`] promising the properties `P`.
    #[inline]
    fn into_any<P>(self) -> AnyResource<P>
    where
        Self: Resource + Send + Sync + 'static,
        P: PropertySet,
        Self::Properties: Contains<P>,
    {
        AnyResource::new(self)
    }

    /// Erases `self` into an owning [`AnySyncResource`] promising the properties `P`.
    #[inline]
    fn into_any_sync<P>(self) -> AnySyncResource<P>
    where
        Self: Send + Sync + 'static,
        P: PropertySet,
        Self::Properties: Contains<P>,
    {
        AnySyncResource::new(self)
    }

    /// A borrowed, erased [`ResourceRef`] to `self` promising the properties `P` (for an
    /// erased resource, to the resource inside it).
    #[inline]
    fn as_resource_ref<P>(&self) -> ResourceRef<'_, P>
    where
        Self: Resource + Sync + 'static,
        P: PropertySet,
        Self::Properties: Contains<P>,
    {
        ResourceRef::new(self)
    }
}

impl<R: SyncResource> ResourceExt for R {}
