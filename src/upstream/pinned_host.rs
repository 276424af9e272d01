//! [`PinnedHost`]: page-locked host memory that the device reaches directly.

use std::alloc::Layout;

use super::driver_leaf::sync_driver_leaf;
use crate::device::Context;
use crate::driver::report;
use crate::error::Error;
use crate::platform::{Active, Platform};
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
/// - Equality: all `PinnedHost` resources are equal (any of them may free the memory).
#[derive(Debug, Clone, Copy)]
pub struct PinnedHost {
    ctx: Context,
}

impl PinnedHost {
    /// The largest alignment `PinnedHost` honours: one page.
    pub const MAX_ALIGNMENT: usize = 4096;

    /// The alignment `cuMemHostAlloc` itself gives.
    const DRIVER_ALIGNMENT: usize = 256;

    /// `cuMemHostAlloc`. It aligns blocks to 256 bytes but no further (seen on an H100 with
    /// driver 580: a 1023-byte request aligned to 1024 came back only 512-aligned), so a
    /// larger alignment is made by over-allocating and aligning up, with the driver's
    /// pointer stored in the word just below the block (RMM's `aligned_host_allocate`
    /// does the same).
    fn alloc(&self, layout: Layout) -> Result<usize, Error> {
        if layout.align() <= Self::DRIVER_ALIGNMENT {
            return self.alloc_raw(layout.size(), layout.size());
        }
        let word = size_of::<usize>();
        let total = layout
            .size()
            .checked_add(layout.align() + word)
            .ok_or(Error::out_of_memory(layout.size()))?;
        let base = self.alloc_raw(total, layout.size())?;
        let aligned = (base + word).next_multiple_of(layout.align());
        // `base..base + total` is a fresh host-accessible block. `aligned - word` lies in
        // it (`aligned >= base + word`) and is word-aligned (both are multiples of 256);
        // the caller's block `aligned..aligned + size` ends inside (`aligned < base + word
        // + align`), so the stored word is outside what the caller gets.
        // SAFETY: as just said, the write stays in our block, aligned, outside the caller's.
        unsafe { ((aligned - word) as *mut usize).write(base) };
        Ok(aligned)
    }

    fn free(&self, address: usize, layout: Layout) {
        let base = if layout.align() <= Self::DRIVER_ALIGNMENT {
            address
        } else {
            // SAFETY: `alloc` stored the driver's pointer in the word below every block
            // aligned beyond `DRIVER_ALIGNMENT`, and this layout says this is one.
            unsafe { ((address - size_of::<usize>()) as *const usize).read() }
        };
        // SAFETY: `base` came from `cuMemHostAlloc` (the caller's promise, through the
        // header above) and nothing uses it any more.
        report("cuMemFreeHost", unsafe { Active::host_free(base) });
    }

    /// `cuMemHostAlloc(size)`; out of memory is reported for `requested` bytes, what the
    /// caller asked for.
    fn alloc_raw(&self, size: usize, requested: usize) -> Result<usize, Error> {
        // The context is current (the caller binds it).
        Active::host_alloc(size, requested)
    }
}

sync_driver_leaf!(
    PinnedHost,
    HostDevice,
    PinnedHost::MAX_ALIGNMENT,
    "PinnedHost"
);
