//! [`HostCopy`]: the contents of mapped granules kept in host memory while a pool sleeps
//! with [`SleepMode::Offload`](crate::suballoc::SleepMode::Offload).

use std::alloc::Layout;
use std::fmt;
use std::ptr::NonNull;

use crate::error::Error;
use crate::resource::SyncResource;
use crate::upstream::{HostHeap, PinnedHost};

/// A copy in host memory of `len` bytes of a virtual-memory leaf, made by
/// [`GrowInPlace::save_at`](super::GrowInPlace::save_at) and written back by
/// [`GrowInPlace::restore_at`](super::GrowInPlace::restore_at). Its memory is pinned
/// (`cuMemHostAlloc`) for device memory, so that both copies run at the bus's speed, and
/// the heap's for host pages. Dropping it frees that memory.
pub struct HostCopy {
    ptr: NonNull<u8>,
    layout: Layout,
    memory: Staging,
}

/// Where a [`HostCopy`]'s memory came from.
enum Staging {
    Heap(HostHeap),
    Pinned(PinnedHost),
}

/// Host memory is handed out in pieces aligned to a page, which both leaves honour.
const PAGE: usize = 4096;

// SAFETY: the copy owns its memory exclusively (nothing else holds the pointer); the
// leaves it is freed through are `Send + Sync`.
unsafe impl Send for HostCopy {}
// SAFETY: as for `Send`; `&HostCopy` only reads.
unsafe impl Sync for HostCopy {}

impl HostCopy {
    /// `len` bytes of the heap, for a copy of host pages.
    pub(crate) fn heap(len: usize) -> Result<HostCopy, Error> {
        HostCopy::from(Staging::Heap(HostHeap), len)
    }

    /// `len` bytes of pinned memory, for a copy of device memory.
    pub(crate) fn pinned(memory: PinnedHost, len: usize) -> Result<HostCopy, Error> {
        HostCopy::from(Staging::Pinned(memory), len)
    }

    fn from(memory: Staging, len: usize) -> Result<HostCopy, Error> {
        let layout = Layout::from_size_align(len.max(1), PAGE)
            .map_err(|_| Error::invalid_argument(format!("{len} bytes cannot be copied")))?;
        let ptr = match &memory {
            Staging::Heap(heap) => heap.allocate_sync(layout)?,
            Staging::Pinned(pinned) => pinned.allocate_sync(layout)?,
        };
        Ok(HostCopy {
            ptr,
            layout,
            memory,
        })
    }

    /// Bytes held.
    pub fn len(&self) -> usize {
        self.layout.size()
    }

    /// Whether it holds nothing (never: a copy holds at least one byte).
    pub fn is_empty(&self) -> bool {
        self.layout.size() == 0
    }

    /// The first byte, valid for `len()` bytes while `self` lives.
    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for HostCopy {
    fn drop(&mut self) {
        // SAFETY: allocated in `from` by this very leaf with this layout; the copy is its
        // only owner and is going away.
        unsafe {
            match &self.memory {
                Staging::Heap(heap) => heap.deallocate_sync(self.ptr, self.layout),
                Staging::Pinned(pinned) => pinned.deallocate_sync(self.ptr, self.layout),
            }
        }
    }
}

impl fmt::Debug for HostCopy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostCopy")
            .field("len", &self.layout.size())
            .field(
                "memory",
                &match self.memory {
                    Staging::Heap(_) => "heap",
                    Staging::Pinned(_) => "pinned",
                },
            )
            .finish()
    }
}
