//! Which address regions hold free blocks of which sizes: the index behind the
//! address-ordered placement of small requests in a pool that grows in place.
//!
//! Free blocks are grouped by the 16 MiB region their start lies in and by a *band*, the
//! power of two of their size in granules (the last band holds everything of 512 KiB and
//! more). A two-level bitmap per band marks the regions that hold a block of that band;
//! the bands' words of the same 64 regions lie together, so "the lowest region with a
//! block of band `b` or above" ORs a few adjacent words and takes two `trailing_zeros`,
//! and adding or removing a block sets or clears one bit. Each (region, band) has its own list of blocks, linked through the
//! caller's nodes (see [`Links`]), so finding a block in a region is O(1) too.
//!
//! The index answers by region, not by exact address: a small request takes a block of
//! the lowest region that has one, the smallest band there first. On `random` (an
//! virtual pool on the host, 2 MiB granules, seeds 1-12, peak held / peak live) that
//! held 1.089 on average, an exact address-ordered first fit (a `BTreeMap` by address,
//! tried and dropped: twice the time per op) 1.087, size classes alone 1.141: what packs
//! small blocks together is that they go low, not the exact address. Figures in
//! `BENCHMARKS.md`.

use super::granule::{GRANULE, NIL};

/// log2 of a region's size in bytes (16 MiB).
const REGION_SHIFT: u32 = 24;
/// Bands: sizes of 1, 2-3, 4-7, ... granules; the last holds 2,048 granules and more.
const BANDS: usize = 12;

/// The band of a block of `units` granules (`units >= 1`).
#[inline]
fn band_of(units: usize) -> usize {
    ((usize::BITS - 1 - units.leading_zeros()) as usize).min(BANDS - 1)
}

/// Per band, the set of regions that hold a block of that band, as bits (word `w`, band
/// `b`: regions `64 w` to `64 w + 63`) with a one-bit-per-word summary.
#[derive(Default)]
struct Bands {
    words: Vec<[u64; BANDS]>,
    summary: Vec<[u64; BANDS]>,
}

impl Bands {
    #[inline]
    fn set(&mut self, r: usize, band: usize) {
        let w = r / 64;
        if w >= self.words.len() {
            self.words.resize(w + 1, [0; BANDS]);
            self.summary.resize(w / 64 + 1, [0; BANDS]);
        }
        self.words[w][band] |= 1 << (r % 64);
        self.summary[w / 64][band] |= 1 << (w % 64);
    }

    #[inline]
    fn clear(&mut self, r: usize, band: usize) {
        let w = r / 64;
        self.words[w][band] &= !(1 << (r % 64));
        if self.words[w][band] == 0 {
            self.summary[w / 64][band] &= !(1 << (w % 64));
        }
    }

    /// The lowest region with a block of band `band` or above.
    #[inline]
    fn first_from(&self, band: usize) -> Option<usize> {
        let any = |bits: &[u64; BANDS]| bits[band..].iter().fold(0, |a, b| a | b);
        let (s, bits) = self
            .summary
            .iter()
            .enumerate()
            .find_map(|(s, bits)| Some((s, any(bits))).filter(|(_, b)| *b != 0))?;
        let w = s * 64 + bits.trailing_zeros() as usize;
        Some(w * 64 + any(&self.words[w]).trailing_zeros() as usize)
    }
}

/// The (region, band) list links of one node, kept by the caller beside its own.
#[derive(Clone, Copy)]
pub(crate) struct Links {
    prev: u32,
    next: u32,
}

impl Links {
    pub(crate) const NONE: Links = Links {
        prev: NIL,
        next: NIL,
    };
}

/// One region's lists: the head of each band's list, and which bands are non-empty.
#[derive(Clone, Copy)]
struct Region {
    heads: [u32; BANDS],
    /// Bit `b` is set when band `b`'s list is non-empty.
    bands: u16,
}

impl Region {
    const EMPTY: Region = Region {
        heads: [NIL; BANDS],
        bands: 0,
    };
}

/// The index (see the module docs). Node `i`'s links live in `links[i]`, which the
/// caller passes in with every call.
pub(crate) struct Regions {
    /// The first address of region 0.
    base: usize,
    /// Per region (from `base` up to the highest region seen), its lists. An emptied
    /// region keeps its entry: a block often comes back to it at once.
    regions: Vec<Region>,
    /// Which regions hold blocks of which bands.
    bands: Bands,
}

impl Regions {
    /// An empty index for blocks at `base` and above.
    pub(crate) fn new(base: usize) -> Regions {
        Regions {
            base,
            regions: Vec::new(),
            bands: Bands::default(),
        }
    }

    /// The first address of region 0.
    pub(crate) fn base(&self) -> usize {
        self.base
    }

    #[inline]
    fn region(&self, addr: usize) -> usize {
        addr.saturating_sub(self.base) >> REGION_SHIFT
    }

    /// Whether blocks `(a, a_size)` and `(b, b_size)` belong in the same list.
    #[inline]
    pub(crate) fn same_list(&self, a: usize, a_size: usize, b: usize, b_size: usize) -> bool {
        self.region(a) == self.region(b) && band_of(a_size / GRANULE) == band_of(b_size / GRANULE)
    }

    /// Forgets every block.
    pub(crate) fn clear(&mut self) {
        self.regions.clear();
        self.bands = Bands::default();
    }

    /// Adds node `i` (a block at `addr` of `size` bytes).
    #[inline]
    pub(crate) fn link(&mut self, links: &mut [Links], i: u32, addr: usize, size: usize) {
        let (r, band) = (self.region(addr), band_of(size / GRANULE));
        if r >= self.regions.len() {
            self.regions.resize(r + 1, Region::EMPTY);
        }
        let region = &mut self.regions[r];
        let head = region.heads[band];
        region.heads[band] = i;
        region.bands |= 1 << band;
        links[i as usize] = Links {
            prev: NIL,
            next: head,
        };
        if head != NIL {
            links[head as usize].prev = i;
        } else {
            self.bands.set(r, band);
        }
    }

    /// Removes node `i` (a block at `addr` of `size` bytes, linked before).
    #[inline]
    pub(crate) fn unlink(&mut self, links: &mut [Links], i: u32, addr: usize, size: usize) {
        let (r, band) = (self.region(addr), band_of(size / GRANULE));
        let Links { prev, next } = links[i as usize];
        if next != NIL {
            links[next as usize].prev = prev;
        }
        if prev != NIL {
            links[prev as usize].next = next;
            return;
        }
        let region = &mut self.regions[r];
        region.heads[band] = next;
        if next != NIL {
            return;
        }
        region.bands &= !(1 << band);
        self.bands.clear(r, band);
    }

    /// A block for a request of `units` granules below the last band: one of the lowest
    /// region that has a block of the request's band or above, the smallest band there
    /// first; in the request's own band, the first of at most `scan` blocks for which
    /// `fits` holds. `None` when that region has no fit (the caller then searches by
    /// size class).
    #[inline]
    pub(crate) fn find(
        &self,
        links: &[Links],
        units: usize,
        scan: usize,
        fits: impl Fn(u32) -> bool,
    ) -> Option<u32> {
        let band = band_of(units);
        let r = self.bands.first_from(band)?;
        let region = &self.regions[r];
        let mut i = region.heads[band];
        for _ in 0..scan {
            if i == NIL {
                break;
            }
            if fits(i) {
                return Some(i);
            }
            i = links[i as usize].next;
        }
        // Every block of a higher band is larger than any request of this band; the
        // caller still checks alignment with `fits`.
        let above = region.bands & (u16::MAX << band << 1);
        if above == 0 {
            return None;
        }
        let head = region.heads[above.trailing_zeros() as usize];
        fits(head).then_some(head)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bands_cover_sizes() {
        assert_eq!(band_of(1), 0);
        assert_eq!(band_of(2), 1);
        assert_eq!(band_of(3), 1);
        assert_eq!(band_of(1024), 10);
        assert_eq!(band_of(2047), 10);
        assert_eq!(band_of(2048), BANDS - 1);
        assert_eq!(band_of(usize::MAX), BANDS - 1);
    }

    #[test]
    fn bands_give_the_lowest_region_of_a_band_or_above() {
        let mut bands = Bands::default();
        assert_eq!(bands.first_from(0), None);
        // Regions in different words and summary words.
        bands.set(5000, 3);
        bands.set(70, 7);
        bands.set(4100, 1);
        assert_eq!(bands.first_from(0), Some(70));
        assert_eq!(bands.first_from(7), Some(70));
        assert_eq!(bands.first_from(8), None);
        assert_eq!(bands.first_from(2), Some(70));
        bands.clear(70, 7);
        assert_eq!(bands.first_from(2), Some(5000));
        assert_eq!(bands.first_from(0), Some(4100));
        bands.set(4100, 3);
        bands.clear(4100, 1);
        assert_eq!(bands.first_from(2), Some(4100));
        bands.clear(4100, 3);
        bands.clear(5000, 3);
        assert_eq!(bands.first_from(0), None);
    }

    #[test]
    fn finds_the_lowest_region_and_forgets_emptied_ones() {
        const MIB: usize = 1 << 20;
        let base = 1 << 40;
        let mut regions = Regions::new(base);
        let mut links = vec![Links::NONE; 4];
        let size = |units: usize| units * GRANULE;
        // Node 0: 4 granules in region 3; node 1: 64 in region 1; node 2: 1 in region 0.
        let blocks = [
            (base + 48 * MIB, size(4)),
            (base + 16 * MIB, size(64)),
            (base, size(1)),
        ];
        for (i, &(addr, len)) in blocks.iter().enumerate() {
            regions.link(&mut links, i as u32, addr, len);
        }
        let any = |_| true;
        // One granule: region 0 has a block of that band.
        assert_eq!(regions.find(&links, 1, 8, any), Some(2));
        // Three granules: region 1 is the lowest with band 1 or above.
        assert_eq!(regions.find(&links, 3, 8, any), Some(1));
        regions.unlink(&mut links, 1, blocks[1].0, blocks[1].1);
        assert_eq!(regions.find(&links, 3, 8, any), Some(0));
        // A region with no fit in the request's own band and nothing above: none.
        assert_eq!(regions.find(&links, 5, 8, |i| i != 0), None);
        regions.unlink(&mut links, 0, blocks[0].0, blocks[0].1);
        regions.unlink(&mut links, 2, blocks[2].0, blocks[2].1);
        assert_eq!(regions.find(&links, 1, 8, any), None);
        assert!(
            regions
                .regions
                .iter()
                .all(|r| r.bands == 0 && r.heads == [NIL; BANDS])
        );
        assert!(regions.bands.first_from(0).is_none());
    }
}
