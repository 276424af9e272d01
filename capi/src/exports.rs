//! What a device's blocks were shared as: [`Shared`], what the stack gives for a block
//! another process is to map, and [`Exported`], the descriptors exported for live blocks,
//! kept open until each block is freed. The stack keeps an `Exported` per device; the
//! C ABI's IPC calls (`ipc.rs`) fill and read it.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::PoisonError;
use std::sync::atomic::Ordering;

use mr::upstream::IPC_HANDLE_SIZE;

use crate::sync::{AtomicUsize, Mutex};

/// What the device stack gives for a block another process is to map (`share`).
pub(crate) enum Shared {
    /// The allocation's IPC handle; the block starts `offset` bytes into it.
    CudaHandle {
        handle: [u8; IPC_HANDLE_SIZE],
        offset: usize,
    },
    /// One descriptor per granule; the block starts `offset` bytes into the first.
    Granules {
        granule: usize,
        offset: usize,
        fds: Vec<OwnedFd>,
    },
}

/// Per device: block address -> what was exported for it, its descriptors closed when
/// the block is freed.
#[derive(Default)]
pub(crate) struct Exported {
    /// Blocks in `map`: `memres_free` reads this one atomic and skips the lock while it is 0.
    blocks: AtomicUsize,
    map: Mutex<HashMap<usize, Export>>,
}

/// A block's export: its handle and offset (handed out again by later exports of the
/// block, so sending a tensor to many processes costs its descriptors once), and every
/// descriptor exported for it.
struct Export {
    handle: Vec<u8>,
    offset: usize,
    fds: Vec<OwnedFd>,
}

impl Exported {
    /// Keeps `fds` open until the block at `address` is freed; `handle` and `offset` are
    /// what later exports of the block return.
    pub(crate) fn keep(&self, address: usize, handle: Vec<u8>, offset: usize, fds: Vec<OwnedFd>) {
        use std::collections::hash_map::Entry;
        let mut map = self.map.lock().unwrap_or_else(PoisonError::into_inner);
        match map.entry(address) {
            Entry::Occupied(mut e) => {
                let export = e.get_mut();
                (export.handle, export.offset) = (handle, offset);
                export.fds.extend(fds);
            }
            Entry::Vacant(e) => {
                self.blocks.fetch_add(1, Ordering::Relaxed);
                e.insert(Export {
                    handle,
                    offset,
                    fds,
                });
            }
        }
    }

    /// Whether a live block in `base..base + len` has been exported (its descriptors keep
    /// its memory alive in other processes).
    pub(crate) fn any_in(&self, base: usize, len: usize) -> bool {
        if self.blocks.load(Ordering::Acquire) == 0 {
            return false;
        }
        let map = self.map.lock().unwrap_or_else(PoisonError::into_inner);
        map.keys().any(|&a| a.wrapping_sub(base) < len)
    }

    /// The handle and offset exported for the block at `address`, if one of `len` bytes
    /// was (the same range: its descriptors are still open).
    pub(crate) fn handle_of(&self, address: usize, len: usize) -> Option<(Vec<u8>, usize)> {
        if self.blocks.load(Ordering::Relaxed) == 0 {
            return None;
        }
        let map = self.map.lock().unwrap_or_else(PoisonError::into_inner);
        map.get(&address)
            .filter(|e| e.handle.len() == len)
            .map(|e| (e.handle.clone(), e.offset))
    }

    /// Closes the descriptors exported for the block at `address` (being freed).
    #[inline]
    pub(crate) fn release(&self, address: usize) {
        if self.blocks.load(Ordering::Relaxed) != 0 {
            self.release_slow(address);
        }
    }

    #[cold]
    fn release_slow(&self, address: usize) {
        let mut map = self.map.lock().unwrap_or_else(PoisonError::into_inner);
        if map.remove(&address).is_some() {
            self.blocks.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

#[cfg(all(test, not(memres_loom)))]
mod tests {
    use super::*;

    #[test]
    fn exported_descriptors_close_with_their_block() {
        use std::io::Read;
        let e = Exported::default();
        e.release(0x1000); // nothing exported: the fast path
        let (mut r, w) = std::io::pipe().expect("a pipe");
        let w: OwnedFd = w.into();
        let w2 = w.try_clone().expect("a second write end");
        e.keep(0x1000, vec![1], 0, vec![w]);
        assert_eq!(e.handle_of(0x1000, 1), Some((vec![1], 0)));
        e.keep(0x1000, vec![2], 0, vec![w2]);
        assert_eq!(e.handle_of(0x1000, 2), None, "another length");
        assert_eq!(e.blocks.load(Ordering::Relaxed), 1);
        e.release(0x2000);
        assert_eq!(e.blocks.load(Ordering::Relaxed), 1);
        e.release(0x1000);
        assert_eq!(e.blocks.load(Ordering::Relaxed), 0);
        // Every write end is closed: the read end sees the end of the pipe at once.
        assert_eq!(r.read(&mut [0u8; 1]).expect("read"), 0);
    }
}
