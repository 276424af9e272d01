//! [`Managed`]: unified memory that the host and the device both reach.

use super::driver_leaf::sync_driver_leaf;
use crate::device::Context;
use crate::driver::report;
use crate::error::Error;
use crate::platform::{Active, Platform};
use crate::property::HostDevice;

/// Managed (unified) memory from `cuMemAllocManaged` with global attachment (RMM's
/// `managed_memory_resource`): pages migrate between host and device on demand.
///
/// - Host- and device-accessible. Aligned to 256 bytes; larger alignments are
///   [`Error::InvalidArgument`].
/// - Streams: usable at once on every stream, so `allocate`'s stream is ignored; the
///   stream-ordered `deallocate` synchronises its stream before `cuMemFree`.
/// - Equality: all `Managed` resources are equal (any of them may free the memory).
#[derive(Debug, Clone, Copy)]
pub struct Managed {
    ctx: Context,
}

impl Managed {
    /// The largest alignment `Managed` honours.
    pub const ALIGNMENT: usize = 256;

    fn alloc(&self, layout: std::alloc::Layout) -> Result<usize, Error> {
        // The context is current (the caller binds it).
        Active::mem_alloc_managed(layout.size())
    }

    fn free(&self, address: usize, _layout: std::alloc::Layout) {
        // SAFETY: `address` came from `cuMemAllocManaged` (the caller's promise) and
        // nothing uses it any more.
        report("cuMemFree", unsafe { Active::mem_free(address) });
    }
}

sync_driver_leaf!(Managed, HostDevice, Managed::ALIGNMENT, "Managed");
