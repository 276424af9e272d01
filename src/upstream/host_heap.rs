//! [`HostHeap`]: host memory from the Rust global allocator.

use std::alloc::{self, Layout};
use std::ptr::NonNull;

use crate::error::Error;
use crate::property::HostAccessible;
use crate::resource::{Resource, SyncResource, dangling};
use crate::stream::StreamRef;

/// Host memory from the Rust global allocator (`std::alloc`), the host counterpart of
/// `Cuda`.
///
/// Host-accessible only: the GPU cannot reach it (use `PinnedHost` for that). It honours
/// any power-of-two alignment. It is stateless: every `HostHeap` equals every other.
/// Streams are ignored: the memory is usable at once, which satisfies any stream order.
///
/// ```
/// use memres::{HostHeap, SyncResource, resource::layout_with_alignment};
///
/// let heap = HostHeap::new();
/// let l = layout_with_alignment(3000, 4096)?;
/// let p = heap.allocate_sync(l)?;
/// assert_eq!(p.as_ptr() as usize % 4096, 0);
/// // SAFETY: allocated above with `l`; not used afterwards.
/// unsafe { heap.deallocate_sync(p, l) };
/// # Ok::<(), memres::Error>(())
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct HostHeap;

impl HostHeap {
    /// The global allocator as a memory resource.
    pub const fn new() -> Self {
        HostHeap
    }
}

// SAFETY: blocks come from the global allocator with the caller's layout (zero-size ones
// are dangling and never dereferenced); heap memory is host-accessible; all `HostHeap`s
// free through the same global allocator, so all are equal.
unsafe impl SyncResource for HostHeap {
    type Properties = HostAccessible;

    #[inline]
    fn allocate_sync(&self, layout: Layout) -> Result<NonNull<u8>, Error> {
        if layout.size() == 0 {
            return Ok(dangling(layout));
        }
        // SAFETY: `layout` has a non-zero size, as `alloc` requires.
        let ptr = unsafe { alloc::alloc(layout) };
        NonNull::new(ptr).ok_or(Error::out_of_memory(layout.size()))
    }

    #[inline]
    unsafe fn deallocate_sync(&self, ptr: NonNull<u8>, layout: Layout) {
        if layout.size() == 0 {
            return;
        }
        // SAFETY: the caller promises `ptr` came from `allocate_sync(layout)` on a
        // `HostHeap` (all are equal), i.e. from `alloc(layout)` with this non-zero-size
        // layout, and is freed once.
        unsafe { alloc::dealloc(ptr.as_ptr(), layout) }
    }
}

// SAFETY: as for `SyncResource`; the memory is usable at once, which is usable in any
// stream order.
unsafe impl Resource for HostHeap {
    #[inline]
    fn allocate(&self, _stream: StreamRef<'_>, layout: Layout) -> Result<NonNull<u8>, Error> {
        self.allocate_sync(layout)
    }

    #[inline]
    unsafe fn deallocate(&self, _stream: StreamRef<'_>, ptr: NonNull<u8>, layout: Layout) {
        // Nothing can still be using it on a stream: heap memory is not device-accessible,
        // so no kernel touches it, and CUDA copies to or from pageable memory finish with
        // the host's part before the enqueueing call returns.
        // SAFETY: from this resource with `layout` (the caller's promise), and unused (above).
        unsafe { self.deallocate_sync(ptr, layout) }
    }
}
