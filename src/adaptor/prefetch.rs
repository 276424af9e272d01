//! [`Prefetch`]: moves new managed memory to the device before its first use.

use std::alloc::Layout;
use std::fmt;
use std::ptr::NonNull;

use cudarc::driver::sys;

use super::{deallocate_used_on_upstream, eq_by_upstream, upstream_access};
use crate::device::{Context, DeviceId, bind};
use crate::driver::{check, require_version};
use crate::error::Error;
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
        require_version(12020, "Prefetch (cuMemPrefetchAsync_v2)")?;
        let attr = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS;
        let enabled = device.attribute(attr)? != 0;
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
        let address = ptr.as_ptr() as u64;
        let mut managed = 0u32;
        let attr = sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_MANAGED;
        // SAFETY: `address` is a live block just allocated; the attribute is a boolean the
        // driver writes into the low byte of the zeroed u32.
        let result =
            unsafe { sys::cuPointerGetAttribute((&mut managed as *mut u32).cast(), attr, address) };
        // Pageable host memory is unknown to the driver: not managed, nothing to do.
        if result == sys::CUresult::CUDA_ERROR_INVALID_VALUE {
            return Ok(());
        }
        check(result)?;
        if managed == 0 {
            return Ok(());
        }
        let location = sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: self.ctx.device().ordinal(),
        };
        let raw = stream.cu().unwrap_or(std::ptr::null_mut());
        // SAFETY: the range is a live managed block of `size` bytes; `raw` is live for the
        // borrow of `stream` (or the legacy default stream); prefetching moves pages and
        // never changes their contents.
        check(unsafe { sys::cuMemPrefetchAsync_v2(address, size, location, 0, raw) })
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
