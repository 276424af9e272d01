//! [`Cuda`]: device memory straight from the driver.

use super::driver_leaf::sync_driver_leaf;
use crate::device::Context;
use crate::driver::report;
use crate::error::Error;
use crate::platform::{Active, Platform};
use crate::property::DeviceAccessible;

/// Device memory from `cuMemAlloc` / `cuMemFree` (RMM's `cuda_memory_resource`).
///
/// - Device-accessible only. Every block is aligned to 256 bytes; larger alignments are
///   [`Error::InvalidArgument`].
/// - The resource belongs to the device current when it was made ([`Cuda::new`]) or the
///   one named ([`Cuda::on`]); it allocates there whatever device is current at the call.
/// - Streams: `cuMemAlloc` memory is usable at once on every stream, so the stream of
///   `allocate` is ignored. The stream-ordered `deallocate` synchronises its stream before
///   `cuMemFree`, so work enqueued before the free is done with the memory.
/// - Each call goes to the driver (microseconds); put a `Pool` over it for hot loops.
/// - Equality: all `Cuda` resources are equal (as RMM's): with unified addressing the
///   driver finds a block's device from its address, so any of them may free it.
/// - Without a CUDA driver, [`Cuda::new`] returns [`Error::NoDriver`].
///
/// ```no_run
/// use memres::{SyncResource, layout, upstream::Cuda};
///
/// let cuda = Cuda::new()?;
/// let l = layout(1 << 20)?;
/// let p = cuda.allocate_sync(l)?;
/// // SAFETY: allocated above with `l`; no kernel uses it any more.
/// unsafe { cuda.deallocate_sync(p, l) };
/// # Ok::<(), memres::Error>(())
/// ```
#[derive(Debug, Clone, Copy)]
pub struct Cuda {
    ctx: Context,
}

impl Cuda {
    /// The alignment of every block, and the largest alignment `Cuda` honours.
    pub const ALIGNMENT: usize = 256;

    /// `cuMemAlloc`, with the resource's context current.
    fn alloc(&self, layout: std::alloc::Layout) -> Result<usize, Error> {
        // The context is current (the caller binds it).
        Active::mem_alloc(layout.size())
    }

    /// `cuMemFree`, with the resource's context current.
    fn free(&self, address: usize, _layout: std::alloc::Layout) {
        // SAFETY: `address` came from `cuMemAlloc` of this device (the caller's promise)
        // and nothing uses it any more.
        report("cuMemFree", unsafe { Active::mem_free(address) });
    }
}

sync_driver_leaf!(Cuda, DeviceAccessible, Cuda::ALIGNMENT, "Cuda");
