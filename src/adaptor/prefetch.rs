//! [`Prefetch`]: moves new managed memory to the device before its first use.

use std::alloc::Layout;
use std::fmt;
use std::ptr::NonNull;

use super::{deallocate_used_on_upstream, eq_by_upstream, upstream_access};
use crate::device::{Context, DeviceId, bind};
use crate::error::Error;
use crate::platform::{Active, Attribute, Feature, Location, Platform};
use crate::resource::{Resource, SyncResource};
use crate::stream::StreamRef;

/// After each allocation, prefetches managed memory to the device on the allocation's
/// stream (RMM's `prefetch_resource_adaptor`), so a kernel's first touch does not fault
/// pages over one by one.
///
/// - Where the device lacks concurrent managed access, prefetching is off and the adaptor
///   only forwards (a no-op, not an error).
/// - Memory that is not managed (checked per block with `cuPointerGetAttribute`) is left
///   alone: not an error either.
/// - The target is the device given at construction ([`Prefetch::new`]: the device current
///   then), not the one current at each allocation: a stack belongs to one device.
/// - The prefetch is enqueued on the allocation's stream (the legacy default stream for
///   the sync calls and host streams); a failed prefetch is logged with `tracing` and the
///   allocation still succeeds — prefetching is an optimisation.
pub struct Prefetch<U> {
    upstream: U,
    ctx: Context,
    enabled: bool,
}

upstream_access!(Prefetch<U>);

impl<U> Prefetch<U> {
    /// Prefetches to the current device.
    pub fn new(upstream: U) -> Result<Self, Error> {
        Prefetch::to(upstream, DeviceId::current()?)
    }

    /// Prefetches to `device`.
    pub fn to(upstream: U, device: DeviceId) -> Result<Self, Error> {
        let ctx = Context::primary(device)?;
        crate::driver::require(Feature::LocatedAdvice, "Prefetch (cuMemPrefetchAsync_v2)")?;
        let enabled = device.attribute(Attribute::ConcurrentManagedAccess)? != 0;
        Ok(Prefetch {
            upstream,
            ctx,
            enabled,
        })
    }

    /// Whether prefetches are issued (the device has concurrent managed access).
    pub fn is_enabled(&self) -> bool {
        self.enabled
    }

    /// The device memory is prefetched to.
    pub fn device(&self) -> DeviceId {
        self.ctx.device()
    }

    fn prefetch(&self, ptr: NonNull<u8>, size: usize, stream: StreamRef<'_>) {
        if !self.enabled || size == 0 {
            return;
        }
        if let Err(e) = self.try_prefetch(ptr, size, stream) {
            tracing::warn!(%e, "memres::Prefetch: prefetch failed; the memory is still valid");
        }
    }

    fn try_prefetch(
        &self,
        ptr: NonNull<u8>,
        size: usize,
        stream: StreamRef<'_>,
    ) -> Result<(), Error> {
        let _current = bind(self.ctx)?;
        let address = ptr.as_ptr() as usize;
        // Pageable host memory is unknown to the driver: not managed, nothing to do.
        if !Active::pointer_is_managed(address)? {
            return Ok(());
        }
        let to = Location::Device(self.ctx.device().ordinal());
        let raw = stream.cu().unwrap_or(0);
        // SAFETY: the range is a live managed block of `size` bytes; `raw` is live for the
        // borrow of `stream` (or the legacy default stream); prefetching moves pages and
        // never changes their contents.
        unsafe { Active::prefetch(address, size, to, raw) }
    }
}

eq_by_upstream!(Prefetch<U>);

impl<U: fmt::Debug> fmt::Debug for Prefetch<U> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Prefetch")
            .field("upstream", &self.upstream)
            .field("device", &self.device())
            .field("enabled", &self.enabled)
            .finish()
    }
}

// SAFETY: every block comes from the upstream unchanged; a prefetch moves pages only.
unsafe impl<U: SyncResource> SyncResource for Prefetch<U> {
    type Properties = U::Properties;

    fn allocate_sync(&self, layout: Layout) -> Result<NonNull<u8>, Error> {
        let p = self.upstream.allocate_sync(layout)?;
        self.prefetch(p, layout.size(), StreamRef::DEFAULT);
        Ok(p)
    }

    unsafe fn deallocate_sync(&self, ptr: NonNull<u8>, layout: Layout) {
        // SAFETY: the caller's promise, for the upstream that allocated the block.
        unsafe { self.upstream.deallocate_sync(ptr, layout) }
    }
}

// SAFETY: as for `SyncResource`.
unsafe impl<U: Resource> Resource for Prefetch<U> {
    fn allocate(&self, stream: StreamRef<'_>, layout: Layout) -> Result<NonNull<u8>, Error> {
        let p = self.upstream.allocate(stream, layout)?;
        self.prefetch(p, layout.size(), stream);
        Ok(p)
    }

    unsafe fn deallocate(&self, stream: StreamRef<'_>, ptr: NonNull<u8>, layout: Layout) {
        // SAFETY: the caller's promise, for the upstream that allocated the block.
        unsafe { self.upstream.deallocate(stream, ptr, layout) }
    }

    deallocate_used_on_upstream!(|self, stream, ptr, layout| {});
}
