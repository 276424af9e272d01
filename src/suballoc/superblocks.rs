//! [`Superblocks`]: where an arena's superblocks start, readable by every stream's list
//! without a lock.
//!
//! Superblocks are at least [`SUPERBLOCK_SIZE`] (1 MiB) long, so at most one starts in any
//! MiB of the arena (counted from its base): the table has one word per MiB, saying where
//! in that MiB a superblock starts and how long it is, or 0. Words change only under the
//! arena's global lock, when a superblock is handed to a stream (set) and when it comes
//! back (cleared); a word is read and written whole, so a reader never sees half of one.
//!
//! A stream's list reads a word when a block is freed into it, to learn whether the block
//! starts a superblock (blocks never merge across one), and whether a merged block is a
//! whole superblock. The reads need no lock. The block lies in a superblock handed out
//! before the block was (the word's release store happens before the allocation, which
//! happens before the free), which cannot go back while one of its blocks is handed out
//! or in a list being changed: if the block starts that superblock, the word says so; if
//! not, the word names no superblock at the block's address, whatever another thread
//! does meanwhile to a superblock starting elsewhere in the same MiB. Before, every list
//! held a copy of the starts, and handing out or taking back a superblock updated every
//! list under its lock: work that grew with the lists (a lane per thread per stream), on
//! a path `random` takes for every request above 1 MiB.

use super::core::free_blocks::GRANULE;
use crate::sync::atomic::{AtomicU64, Ordering};

/// Bits of a word that say where in its MiB the superblock starts, in granules.
/// The size of a superblock, and the largest request served from a stream's arena.
pub const SUPERBLOCK_SIZE: usize = 1 << 20;

const OFFSET_BITS: u32 = (SUPERBLOCK_SIZE / GRANULE).trailing_zeros();
const OFFSET_MASK: u64 = (1 << OFFSET_BITS) - 1;

/// The superblocks of one arena, by start (see the module).
pub(crate) struct Superblocks {
    base: usize,
    /// Per MiB of the arena: 0, or the superblock starting in it, as its size in granules
    /// above [`OFFSET_BITS`] and its offset in the MiB in granules below.
    words: Box<[AtomicU64]>,
}

impl Superblocks {
    /// The table of an arena of `size` bytes at `base` (a superblock needs a whole MiB, so
    /// none starts in a last partial one).
    pub(crate) fn new(base: usize, size: usize) -> Superblocks {
        Superblocks {
            base,
            words: (0..size / SUPERBLOCK_SIZE)
                .map(|_| AtomicU64::new(0))
                .collect(),
        }
    }

    /// The word of the MiB holding `addr`, and `addr`'s offset in it in granules.
    #[inline]
    fn word(&self, addr: usize) -> Option<(&AtomicU64, u64)> {
        let offset = addr.wrapping_sub(self.base);
        let word = self.words.get(offset / SUPERBLOCK_SIZE)?;
        Some((word, ((offset % SUPERBLOCK_SIZE) / GRANULE) as u64))
    }

    /// The size of the superblock starting at `addr`, if one does.
    #[inline]
    pub(crate) fn size_at(&self, addr: usize) -> Option<usize> {
        debug_assert!(addr.wrapping_sub(self.base).is_multiple_of(GRANULE));
        let (word, at) = self.word(addr)?;
        let w = word.load(Ordering::Acquire);
        (w != 0 && w & OFFSET_MASK == at).then(|| (w >> OFFSET_BITS) as usize * GRANULE)
    }

    /// Every superblock, (start, size), in address order (a snapshot, word by word; whole
    /// under the arena's global lock).
    pub(crate) fn iter(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.words.iter().enumerate().filter_map(|(i, word)| {
            let w = word.load(Ordering::Acquire);
            let start = self.base + i * SUPERBLOCK_SIZE + (w & OFFSET_MASK) as usize * GRANULE;
            (w != 0).then(|| (start, (w >> OFFSET_BITS) as usize * GRANULE))
        })
    }

    /// Records the superblock `[addr, addr + size)` (under the arena's global lock).
    pub(crate) fn set(&self, addr: usize, size: usize) {
        debug_assert!(size >= SUPERBLOCK_SIZE && size.is_multiple_of(GRANULE));
        debug_assert!(addr.wrapping_sub(self.base).is_multiple_of(GRANULE));
        let (word, at) = self
            .word(addr)
            .expect("a superblock starts inside its arena");
        let w = ((size / GRANULE) as u64) << OFFSET_BITS | at;
        word.store(w, Ordering::Release);
    }

    /// Forgets the superblock at `addr` (under the arena's global lock).
    pub(crate) fn clear(&self, addr: usize) {
        if let Some((word, _)) = self.word(addr) {
            debug_assert!(self.size_at(addr).is_some(), "no superblock at {addr:#x}");
            word.store(0, Ordering::Release);
        }
    }
}

#[cfg(all(test, not(memres_loom)))]
mod tests {
    use super::*;

    const MIB: usize = SUPERBLOCK_SIZE;

    #[test]
    fn a_superblock_is_found_at_its_start_only() {
        let base = 0x7000_0010_0000;
        let t = Superblocks::new(base, 4 * MIB + 512);
        // Starting 256 bytes into the second MiB, 1.5 MiB long.
        let start = base + MIB + 256;
        t.set(start, 3 * MIB / 2);
        assert_eq!(t.size_at(start), Some(3 * MIB / 2));
        for other in [
            base,
            base + MIB,
            start + 256,
            base + 2 * MIB + 256,
            start + MIB,
        ] {
            assert_eq!(t.size_at(other), None, "{:#x}", other - base);
        }
        // The next one starts right after it, in the third MiB.
        let next = start + 3 * MIB / 2;
        t.set(next, MIB);
        assert_eq!(t.size_at(next), Some(MIB));
        assert_eq!(t.size_at(start), Some(3 * MIB / 2));
        assert_eq!(
            t.iter().collect::<Vec<_>>(),
            [(start, 3 * MIB / 2), (next, MIB)]
        );
        assert_eq!(t.size_at(base + 4 * MIB), None, "past the last whole MiB");
        assert_eq!(t.size_at(base - MIB), None, "below the base");
        assert_eq!(t.size_at(0), None);
        t.clear(start);
        assert_eq!(t.size_at(start), None);
        assert_eq!(t.size_at(next), Some(MIB));
    }

    #[test]
    fn a_superblock_of_half_a_tib_fits_a_word() {
        let t = Superblocks::new(0, 1 << 40);
        t.set(255 * MIB, 1 << 39);
        assert_eq!(t.size_at(255 * MIB), Some(1 << 39));
    }
}
