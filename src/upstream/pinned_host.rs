//! [`PinnedHost`]: page-locked host memory that the device reaches directly.

use std::ffi::c_void;

use cudarc::driver::sys;

use super::driver_leaf::sync_driver_leaf;
use crate::device::{Context, DeviceId};
use crate::driver::{check_alloc, report};
use crate::error::Error;
use crate::property::HostDevice;

/// Pinned (page-locked) host memory from `cuMemHostAlloc` (RMM's
/// `pinned_host_memory_resource`), mapped into the device's address space and portable
/// across contexts.
///
/// - Host- and device-accessible: with unified addressing the same pointer works in
///   kernels, and copies to and from it are asynchronous and fast.
/// - Not write-combined, so host reads stay fast.
/// - Any power-of-two alignment up to 4096 (a page) is honoured; above that,
///   [`Error::InvalidArgument`].
/// - Streams: usable at once on every stream; the stream-ordered `deallocate` synchronises
///   its stream before `cuMemFreeHost`, since copies enqueued on it may still read the
///   memory.
/// - Equality: equal when they belong to the same device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PinnedHost {
    ctx: Context,
}

impl PinnedHost {
    /// The largest alignment `PinnedHost` honours: one page.
    pub const MAX_ALIGNMENT: usize = 4096;

    /// Pinned memory registered with the current device's context.
    pub fn new() -> Result<PinnedHost, Error> {
        Ok(PinnedHost {
            ctx: Context::current()?,
        })
    }

    /// Pinned memory registered with `device`'s context.
    pub fn on(device: DeviceId) -> Result<PinnedHost, Error> {
        Ok(PinnedHost {
            ctx: Context::primary(device)?,
        })
    }

    /// The device the resource belongs to.
    pub fn device(&self) -> DeviceId {
        self.ctx.device()
    }

    fn alloc(&self, size: usize) -> Result<usize, Error> {
        let mut p: *mut c_void = std::ptr::null_mut();
        let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
        // SAFETY: the context is current (the caller binds it); `p` is a valid place.
        check_alloc(unsafe { sys::cuMemHostAlloc(&mut p, size, flags) }, size)?;
        Ok(p as usize)
    }

    fn free(&self, address: usize) {
        // SAFETY: `address` came from `cuMemHostAlloc` (the caller's promise) and nothing
        // uses it any more.
        report("cuMemFreeHost", unsafe {
            sys::cuMemFreeHost(address as *mut c_void)
        });
    }
}

sync_driver_leaf!(
    PinnedHost,
    HostDevice,
    PinnedHost::MAX_ALIGNMENT,
    "PinnedHost"
);
