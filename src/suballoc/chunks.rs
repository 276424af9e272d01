//! Allocations a sub-allocator holds from its upstream ("chunks"), and addresses.
//!
//! Sub-allocators keep addresses as integers (they index maps by them); the provenance of
//! the upstream's pointer is exposed when a chunk is taken and picked up again when a
//! piece of it is handed out.

use std::alloc::Layout;
use std::ptr::{self, NonNull};

use super::core::list_table::ListTable;
use crate::device::process_is_exiting;
use crate::resource::SyncResource;

/// One allocation from the upstream.
pub(crate) struct Chunk {
    pub(crate) addr: usize,
    pub(crate) layout: Layout,
}

impl Chunk {
    pub(crate) fn new(ptr: NonNull<u8>, layout: Layout) -> Chunk {
        Chunk {
            addr: ptr.as_ptr().expose_provenance(),
            layout,
        }
    }

    /// Gives the chunk back to `upstream`.
    ///
    /// # Safety
    /// The chunk came from `upstream` (or one equal to it) with its layout, and nothing
    /// uses any of it any more, on the host or on any stream.
    pub(crate) unsafe fn release<U: SyncResource>(self, upstream: &U) {
        // SAFETY: the caller's promise.
        unsafe { upstream.deallocate_sync(to_ptr(self.addr), self.layout) }
    }
}

/// The pointer for an address inside a chunk (which is never zero: a chunk is a
/// non-null allocation).
#[inline]
pub(crate) fn to_ptr(addr: usize) -> NonNull<u8> {
    NonNull::new(ptr::with_exposed_provenance_mut(addr)).expect("chunk addresses are not null")
}

/// What a sub-allocator's drop does: waits for the streams it has seen (blocks freed on
/// them may still be in use by their work), then gives every chunk back, also those
/// under blocks still handed out (as RMM does).
pub(crate) fn release_all<U: SyncResource, S>(
    upstream: &U,
    lists: &ListTable<S>,
    chunks: Vec<Chunk>,
) {
    if !process_is_exiting()
        && let Err(e) = lists.synchronize_streams()
    {
        tracing::error!("a sub-allocator could not wait for its streams before freeing: {e}");
    }
    for chunk in chunks {
        // SAFETY: the owner took each chunk from `upstream` with its layout, and is going
        // away; its streams' work is complete (above).
        unsafe { chunk.release(upstream) };
    }
}
