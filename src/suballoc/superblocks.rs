//! [`Superblocks`]: where an arena's superblocks start, readable by every stream's list
//! without a lock.
//!
//! An arena carves superblocks only at whole multiples of [`SUPERBLOCK_SIZE`] from its
//! base (every superblock's size is such a multiple, and the global arena only ever gets
//! whole superblocks back), so the table has one slot per MiB of the arena: the size of
//! the superblock that starts there, or 0. Slots change only under the arena's global
//! lock, when a superblock is handed to a stream (set) and when it comes back (cleared).
//!
//! A stream's list reads a slot when a block is freed into it, to learn whether the block
//! starts a superblock (blocks never merge across one), and whether a merged block is a
//! whole superblock. The reads need no lock: a block being freed lies in a superblock
//! that was handed out before the block was allocated (the slot's release store happens
//! before the allocation, which happens before the free), and that superblock cannot go
//! back, nor its slots change, while one of its blocks is handed out or in a list being
//! changed. Before, every list held a copy of the starts, and handing out or taking back
//! a superblock updated every list under its lock: work that grew with the lists (a lane
//! per thread per stream), on a path `random` takes for every request above 1 MiB.

use super::arena::SUPERBLOCK_SIZE;
use crate::sync::atomic::{AtomicUsize, Ordering};

/// The superblocks of one arena, by start (see the module).
pub(crate) struct Superblocks {
    base: usize,
    /// Per MiB of the arena: the size of the superblock starting there, 0 for none.
    sizes: Box<[AtomicUsize]>,
}

impl Superblocks {
    /// The table of an arena of `size` bytes at `base`.
    pub(crate) fn new(base: usize, size: usize) -> Superblocks {
        Superblocks {
            base,
            sizes: (0..size / SUPERBLOCK_SIZE)
                .map(|_| AtomicUsize::new(0))
                .collect(),
        }
    }

    #[inline]
    fn slot(&self, addr: usize) -> Option<&AtomicUsize> {
        let offset = addr.wrapping_sub(self.base);
        if !offset.is_multiple_of(SUPERBLOCK_SIZE) {
            return None;
        }
        self.sizes.get(offset / SUPERBLOCK_SIZE)
    }

    /// The size of the superblock starting at `addr`, if one does.
    #[inline]
    pub(crate) fn size_at(&self, addr: usize) -> Option<usize> {
        self.slot(addr)
            .map(|n| n.load(Ordering::Acquire))
            .filter(|&n| n != 0)
    }

    /// Records the superblock `[addr, addr + size)` (under the arena's global lock).
    pub(crate) fn set(&self, addr: usize, size: usize) {
        debug_assert!(size > 0 && size.is_multiple_of(SUPERBLOCK_SIZE));
        self.slot(addr)
            .expect("superblocks start at whole MiB of the arena")
            .store(size, Ordering::Release);
    }

    /// Forgets the superblock at `addr` (under the arena's global lock).
    pub(crate) fn clear(&self, addr: usize) {
        if let Some(n) = self.slot(addr) {
            n.store(0, Ordering::Release);
        }
    }
}

#[cfg(all(test, not(memres_loom)))]
mod tests {
    use super::*;

    const MIB: usize = SUPERBLOCK_SIZE;

    #[test]
    fn only_whole_mib_inside_the_arena_are_slots() {
        let base = 0x7000_0010_0000;
        let t = Superblocks::new(base, 4 * MIB + 512);
        t.set(base + MIB, 2 * MIB);
        assert_eq!(t.size_at(base + MIB), Some(2 * MIB));
        assert_eq!(t.size_at(base), None);
        assert_eq!(t.size_at(base + MIB + 256), None);
        assert_eq!(t.size_at(base + 4 * MIB), None, "past the last whole MiB");
        assert_eq!(t.size_at(base - MIB), None, "below the base");
        assert_eq!(t.size_at(0), None);
        t.clear(base + MIB);
        assert_eq!(t.size_at(base + MIB), None);
        t.clear(base + 3); // not a slot: nothing to do
    }
}
