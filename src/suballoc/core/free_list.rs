//! One stream's free memory in a pool or an arena (its "list"): coalescing free blocks,
//! caches of recently freed small and large blocks, and the chunk table the free path
//! checks. Used by `Pool` and by `Arena` (whose "chunks" are superblocks).

use std::alloc::Layout;

use super::free_blocks::{FreeBlock, FreeBlocks, GRANULE};
use crate::addr_map::AddrMap;
use crate::suballoc::superblocks::Superblocks;
use crate::sync::Arc;

/// Blocks up to this many granules (64 KiB) are cached on free without coalescing.
pub(crate) const QUICK_UNITS: usize = 256;
/// At most this many bytes are cached per stream; beyond it frees coalesce at once.
///
/// Pools that grow in place keep the same limit, although a cached block is handed out
/// again where it was rather than low (see [`FreeBlocks::address_ordered`]): on the H100
/// (2026-11-23, three alternating runs), 1 MiB instead made the virtual pool's `random`
/// 97-164 ns against 84-120 and `random-mt` 20-28 ns against 17-19, for a footprint of
/// 1.085 of live against 1.091 (`random`, seeds 1-6, mean).
pub(crate) const QUICK_BYTES: usize = 8 << 20;

/// A pool's stream list (of a pool over chunks; not one that grows in place, whose
/// footprint it would raise) also keeps this many recently freed large blocks (1 to 8 MiB),
/// handed out again whole to a request of the same size: a loop that allocates and frees
/// one large buffer then costs what a small one does. Few, so that little memory waits
/// uncoalesced (random sizes almost never match).
const LARGE_BLOCKS: usize = 2;
/// The smallest block kept that way (smaller ones coalesce at once, or are cached as
/// small blocks)...
const LARGE_MIN: usize = 1 << 20;
/// ... and the largest.
const LARGE_BYTES: usize = 8 << 20;

/// One stream's free memory (of a pool, or of an arena, whose "chunks" are superblocks).
/// The small blocks' cache comes first (`repr(C)`): with the list's lock before it, its
/// fields fill the state's first cache line, so a cached block of the smallest size
/// cached is found on that line and one line of its bin's buffer, and one of another
/// size on those and one line of the table of bins.
#[repr(C)]
pub(crate) struct FreeList {
    /// Recently freed small blocks of `quick_base` granules (the smallest size cached),
    /// handed out again whole, newest first: the first bin of the small blocks' cache,
    /// whose vector is on the state's first line (issue 49: through the table of bins,
    /// every cached allocation and free on a cold list read one line more, the table's,
    /// a miss per call at 16,384 streams; a program freeing small blocks of one size
    /// uses this bin alone).
    first: Vec<usize>,
    /// The size in granules of `first`'s blocks; 0 while the cache has no bins (no
    /// small block freed since the list was made or its memory released).
    quick_base: u32,
    /// Bytes of the cached small blocks (at most [`QUICK_BYTES`]).
    quick_bytes: u32,
    /// The other bins: entry `i` for blocks of `quick_base + 1 + i` granules, the table
    /// only as long as the sizes freed so far need (issue 49: a table of every size,
    /// `QUICK_UNITS + 1` entries or 6 KiB, made a list cost 7 KiB, and a stream used by
    /// 16 threads' lanes 112.8 KiB, for one 4 KiB block). Empty (no heap) until a block
    /// larger than the first bin's is freed, and again after `release_memory`. A boxed
    /// slice, not a vector (it grows at most once per size, by a copy): 8 bytes less, so
    /// that with `first` inline a stream's `List` still fits 512 bytes.
    quick: Box<[Vec<usize>]>,
    /// Recently freed larger blocks, (address, size), oldest first: at most
    /// `large_cap` (0 for an arena, whose frees must coalesce to return superblocks).
    /// Boxed (made with the first such block, dropped by `release_memory`): 8 bytes
    /// inline instead of a vector's 24, so that with `first` inline a stream's `List`
    /// still fits 512 bytes; a request for a block of 1 MiB or more, the only one that
    /// reads it (and only while `large_bytes` is not 0), costs far more than the
    /// pointer's line. It fills the state's first line, the small blocks' cache's,
    /// which the other fields leave 8 bytes of.
    // (The box is the point: a thin pointer inline, the vector's three words on the heap.)
    #[allow(clippy::box_collection)]
    large: Option<Box<Vec<(usize, usize)>>>,
    /// Bytes of `large`'s blocks. From here to the first fields of `free` (its bytes and
    /// class summary) is the state's second cache line: what a request that the small
    /// blocks' cache cannot serve reads first (one to an empty list, half the
    /// allocations on random streams, reads nothing further of the list; issue 49: with
    /// these fields apart it read two more lines). 32-bit, and `large_cap` 8-bit, so
    /// that a stream's `List` fits 512 bytes.
    large_bytes: u32,
    large_cap: u8,
    /// Whether the fresh extent (an arena's list's, in `chunks`) holds any bytes: here,
    /// on the state's second line, so that a request to an empty list and a search's
    /// flush of a cold list read `chunks`' line only when it does (with the extent's
    /// bounds alone there, a pool's pair on random streams of 16,384 read 1.5 lines
    /// more).
    fresh_held: bool,
    pub(crate) free: FreeBlocks,
    /// The starts of the blocks' chunks (blocks never merge across a chunk's start).
    chunks: Chunks,
}

/// Where a list learns the chunks its blocks never merge across: a pool's own copy of
/// its chunk table, or an arena's table of superblocks. One field for either (32 bytes:
/// the arena's pointer lies beside the vector's capacity, whose values past `isize::MAX`
/// tell the two apart), not two, so that a stream's `List` fits 512 bytes.
enum Chunks {
    /// A pool's chunks, start to size (a copy per stream, so the free path needs no
    /// shared lock).
    Pool(AddrMap<usize>),
    /// An arena's superblocks, shared by all its lists.
    /// An arena's superblocks, shared by all its lists, and the list's fresh extent: the
    /// superblock the arena last gave the list, less what requests took from its front,
    /// `[start, end)`, free, kept as one extent outside the list's index (empty when
    /// `start == end`). Requests that the index cannot serve take from its front;
    /// [`flush`](FreeList::flush), and a free that reaches its start, put it in the
    /// index. With far more streams than superblocks, a stream's superblock is mostly
    /// taken back (whole again) before the stream uses it for more than one block: kept
    /// out of the index, handing it over costs no index work at either end (issue 51
    /// item 4: that work was about half the time of a pair on a stream whose superblock
    /// had gone to another stream). (In this variant, beside the superblocks' pointer,
    /// so that a stream's `List` stays 512 bytes: a pool's list has no fresh extent.)
    Arena {
        superblocks: Arc<Superblocks>,
        fresh: (usize, usize),
    },
}

impl FreeList {
    /// `low_first`: for a pool that grows in place, the start of its reservation; small
    /// requests then go to the lowest address region with a fit
    /// ([`FreeBlocks::address_ordered`]).
    pub(crate) fn new(
        chunks: impl Iterator<Item = (usize, usize)>,
        low_first: Option<usize>,
    ) -> FreeList {
        FreeList {
            free: match low_first {
                Some(base) => FreeBlocks::address_ordered(base),
                None => FreeBlocks::default(),
            },
            first: Vec::new(),
            quick_base: 0,
            quick_bytes: 0,
            quick: Box::default(),
            large_bytes: 0,
            large: None,
            large_cap: 0,
            fresh_held: false,
            chunks: Chunks::Pool(chunks.collect()),
        }
    }

    /// The list of an arena with these superblocks (which are its chunks).
    pub(crate) fn in_arena(superblocks: Arc<Superblocks>) -> FreeList {
        FreeList {
            chunks: Chunks::Arena {
                superblocks,
                fresh: (0, 0),
            },
            ..FreeList::new(std::iter::empty(), None)
        }
    }

    /// The size of the chunk starting at `addr`, if one does.
    #[inline]
    pub(crate) fn chunk_at(&self, addr: usize) -> Option<usize> {
        match &self.chunks {
            Chunks::Arena {
                superblocks: table, ..
            } => table.size_at(addr),
            Chunks::Pool(chunks) => chunks.get(&addr).copied(),
        }
    }

    /// Tells a pool's list of its pool's chunk `[addr, addr + size)` (an arena's list
    /// reads its superblocks' table: nothing to do).
    pub(crate) fn add_chunk(&mut self, addr: usize, size: usize) {
        if let Chunks::Pool(chunks) = &mut self.chunks {
            chunks.insert(addr, size);
        }
    }

    /// Tells a pool's list that its pool gave back the chunk at `addr` (see
    /// [`add_chunk`](Self::add_chunk)).
    pub(crate) fn remove_chunk(&mut self, addr: usize) {
        if let Chunks::Pool(chunks) = &mut self.chunks {
            chunks.remove(&addr);
        }
    }

    /// Also keeps the last [`LARGE_BLOCKS`] larger blocks freed (see there): a pool's
    /// lists do, an arena's do not.
    pub(crate) fn with_large_cache(mut self) -> FreeList {
        self.large_cap = LARGE_BLOCKS as u8;
        self
    }

    /// Takes a block of `size` bytes aligned to `align`: a cached one of that size, else
    /// one cut from the coalesced free blocks.
    ///
    /// The cache's pop is inlined into the callers and the rest is a call of its own
    /// ([`take_uncached`](Self::take_uncached)), as in [`put`](Self::put): the fast path
    /// then saves and restores few registers (`BENCHMARKS.md`, "Speed against RMM").
    #[inline(always)]
    pub(crate) fn take(&mut self, size: usize, align: usize) -> Option<usize> {
        let units = size / GRANULE;
        if align == GRANULE
            && units <= QUICK_UNITS
            && let Some(addr) = self.quick_bin(units).and_then(Vec::pop)
        {
            // (At most `QUICK_BYTES`, as the cache's bytes are.)
            self.quick_bytes -= size as u32;
            return Some(addr);
        }
        self.take_uncached(size, align)
    }

    /// The small blocks' cache's bin for blocks of `units` granules, if it has one
    /// (`first`, or an entry of the table: an index below `quick_base` wraps far past
    /// its end).
    #[inline(always)]
    fn quick_bin(&mut self, units: usize) -> Option<&mut Vec<usize>> {
        let base = self.quick_base as usize;
        if units == base {
            Some(&mut self.first)
        } else {
            self.quick.get_mut(units.wrapping_sub(base + 1))
        }
    }

    /// The small blocks' bins with their blocks' sizes in bytes, smallest first.
    fn quick_bins(&self) -> impl Iterator<Item = (usize, &Vec<usize>)> {
        let base = self.quick_base as usize;
        std::iter::once(&self.first)
            .chain(self.quick.iter())
            .enumerate()
            .map(move |(at, bin)| ((base + at) * GRANULE, bin))
    }

    /// How many small blocks the cache holds, and the largest one's size.
    pub(crate) fn quick_blocks(&self) -> (usize, usize) {
        let count = self.quick_bins().map(|(_, bin)| bin.len()).sum();
        let largest = self
            .quick_bins()
            .filter(|(_, bin)| !bin.is_empty())
            .last()
            .map_or(0, |(size, _)| size);
        (count, largest)
    }

    /// Whether the small blocks' cache takes `size` more bytes.
    #[inline(always)]
    fn quick_room(&self, size: usize) -> bool {
        self.quick_bytes as usize + size <= QUICK_BYTES
    }

    /// [`take`](Self::take) past the small blocks' cache: a cached large block of that
    /// size, else a block of the index, else the front of the fresh superblock.
    #[inline(never)]
    pub(crate) fn take_uncached(&mut self, size: usize, align: usize) -> Option<usize> {
        if align == GRANULE
            && size >= LARGE_MIN
            && self.large_bytes != 0
            && let Some(large) = self.large.as_mut()
            && let Some(i) = large.iter().rposition(|&(_, n)| n == size)
        {
            self.large_bytes -= size as u32;
            return Some(large.remove(i).0);
        }
        // (The fresh extent's flag first: a pool's list has none, its bounds lie on a
        // line of their own, and without one the index's search is the last call.)
        if self.fresh_held {
            return self.take_indexed_or_fresh(size, align);
        }
        // (Not the index's search when it is empty: a list whose superblock went to
        // another stream, or a pool's stream that only frees, issue 51 item 4.)
        if self.free.bytes() == 0 {
            return None;
        }
        self.free.take_inlined(size, align)
    }

    /// [`take_uncached`](Self::take_uncached) past the large blocks' cache, with a fresh
    /// extent: a block of the index, else the extent's front.
    #[inline(never)]
    fn take_indexed_or_fresh(&mut self, size: usize, align: usize) -> Option<usize> {
        // (The index's search only when it holds bytes: a list given a superblock has
        // mostly none, issue 51 item 4.)
        if self.free.bytes() != 0
            && let Some(addr) = self.free.take(size, align)
        {
            return Some(addr);
        }
        self.take_fresh(size, align)
    }

    /// `size` bytes aligned to `align` from the front of the fresh superblock; the
    /// padding before them, if any, goes to the index.
    fn take_fresh(&mut self, size: usize, align: usize) -> Option<usize> {
        let Chunks::Arena { fresh, .. } = &mut self.chunks else {
            return None;
        };
        let (start, end) = *fresh;
        let addr = start.checked_add(align - 1)? & !(align - 1);
        let top = addr.checked_add(size).filter(|&top| top <= end)?;
        fresh.0 = top;
        self.fresh_held = top < end;
        if addr > start {
            // (Ends below the fresh extent's new start: no spill.)
            self.insert(start, addr - start);
        }
        Some(addr)
    }

    /// Gives the list an arena's superblock `[addr, addr + size)`, kept whole as the
    /// fresh extent (a previous one goes to the index first; a pool's list, which has no
    /// fresh extent, puts it in its index).
    #[inline]
    pub(crate) fn add_superblock(&mut self, addr: usize, size: usize) {
        self.spill_fresh();
        match &mut self.chunks {
            Chunks::Arena { fresh, .. } => {
                *fresh = (addr, addr + size);
                self.fresh_held = size > 0;
            }
            Chunks::Pool(_) => {
                self.insert(addr, size);
            }
        }
    }

    /// Gives the list an arena's superblock `[addr, addr + sb_size)` as
    /// [`add_superblock`](Self::add_superblock) does, and takes `size` bytes aligned to
    /// `align`: as [`take_uncached`](Self::take_uncached) would (an arena's list caches no
    /// large blocks), without its steps (issue 51 item 4: one call less on every pair at
    /// 16,384 streams).
    pub(crate) fn take_from_new_superblock(
        &mut self,
        addr: usize,
        sb_size: usize,
        size: usize,
        align: usize,
    ) -> Option<usize> {
        debug_assert!(self.large_bytes == 0 && sb_size > 0);
        self.add_superblock(addr, sb_size);
        // (`take_indexed_or_fresh`'s steps, without its call.)
        if self.free.bytes() != 0
            && let Some(addr) = self.free.take(size, align)
        {
            return Some(addr);
        }
        self.take_fresh(size, align)
    }

    /// The fresh extent, `(start, end)` (see [`Chunks::Arena`]); empty in a pool's list.
    #[inline]
    fn fresh(&self) -> (usize, usize) {
        match &self.chunks {
            Chunks::Arena { fresh, .. } => *fresh,
            Chunks::Pool(_) => (0, 0),
        }
    }

    /// Puts the fresh extent in the index, merged with its neighbours; returns the merged
    /// block, if the extent held any bytes.
    fn spill_fresh(&mut self) -> Option<FreeBlock> {
        if !self.fresh_held {
            return None;
        }
        self.fresh_held = false;
        let (start, end) = match &mut self.chunks {
            Chunks::Arena { fresh, .. } => std::mem::take(fresh),
            Chunks::Pool(_) => return None,
        };
        (start < end).then(|| {
            let starts_chunk = self.chunk_at(start).is_some();
            self.free.insert(FreeBlock {
                addr: start,
                size: end - start,
                starts_chunk,
            })
        })
    }

    /// Empties the list if what it holds is exactly `[addr, addr + size)` in its fresh
    /// extent and caches (an idle stream's superblock, whole again), with nothing in the
    /// index; returns whether it did. Free extents never overlap, so extents inside the
    /// range that add up to its size cover it. Otherwise nothing changes.
    ///
    /// Read field by field, not through [`free_extents`](Self::free_extents): the bins
    /// past the first are read (and cleared) only when the cache's bytes say they hold
    /// blocks, the large blocks' only when theirs do (issue 51 item 4: the walk of every
    /// extent and the clearing of every bin were about 260 instructions for each idle
    /// superblock an arena took back, one per pair at 16,384 streams over 64).
    pub(crate) fn take_whole(&mut self, addr: usize, size: usize) -> bool {
        if self.free.bytes() != 0 || self.free_bytes() != size {
            return false;
        }
        let end = addr + size;
        let inside = |a: usize, n: usize| a >= addr && a + n <= end;
        let first_size = self.quick_base as usize * GRANULE;
        // Whether the bins past the first, or the large blocks' cache, hold blocks.
        let others =
            self.quick_bytes as usize != self.first.len() * first_size || self.large_bytes != 0;
        let (start, stop) = self.fresh();
        if (self.fresh_held && !inside(start, stop - start))
            || !self.first.iter().all(|&a| inside(a, first_size))
            || (others && !self.others_inside(addr, end))
        {
            return false;
        }
        self.first.clear();
        if others {
            self.clear_others();
        }
        self.quick_bytes = 0;
        if let Chunks::Arena { fresh, .. } = &mut self.chunks {
            *fresh = (0, 0);
        }
        self.fresh_held = false;
        true
    }

    /// Whether the blocks of the bins past the first and of the large blocks' cache all
    /// lie in `[addr, end)` (see [`take_whole`](Self::take_whole)).
    #[cold]
    fn others_inside(&self, addr: usize, end: usize) -> bool {
        let inside = |a: usize, n: usize| a >= addr && a + n <= end;
        self.quick_bins()
            .skip(1)
            .all(|(n, bin)| bin.iter().all(|&a| inside(a, n)))
            && self.large_blocks().iter().all(|&(a, n)| inside(a, n))
    }

    /// Empties the bins past the first and the large blocks' cache, with its bytes (the
    /// small blocks' bytes are the caller's to zero).
    #[cold]
    fn clear_others(&mut self) {
        for bin in &mut self.quick {
            bin.clear();
        }
        if let Some(large) = &mut self.large {
            large.clear();
        }
        self.large_bytes = 0;
    }

    /// The largest free extent outside the small blocks' cache (a scan: for statistics).
    pub(crate) fn largest_coalesced(&self) -> usize {
        let (start, end) = self.fresh();
        self.free.largest().max(end - start)
    }

    /// Frees a block into the list: cached if small, else coalesced (and then returned,
    /// merged with its neighbours).
    #[inline(always)]
    pub(crate) fn put(&mut self, addr: usize, size: usize) -> Option<FreeBlock> {
        let units = size / GRANULE;
        if units <= QUICK_UNITS
            && self.quick_room(size)
            && let Some(cached) = self.quick_bin(units)
        {
            cached.push(addr);
            // (At most `QUICK_BYTES` after.)
            self.quick_bytes += size as u32;
            return None;
        }
        self.put_uncached(addr, size)
    }

    /// [`put`](Self::put) where the small blocks' cache does not take the block (or has
    /// no bin for its size yet).
    #[inline(never)]
    fn put_uncached(&mut self, addr: usize, size: usize) -> Option<FreeBlock> {
        let units = size / GRANULE;
        if units <= QUICK_UNITS && self.quick_room(size) {
            // The first block of a size outside the sizes cached so far: the bins grow
            // to take it in (with a bin, `put` took the block).
            let base = self.quick_base as usize;
            if base == 0 {
                // (`units` is at least 1 and at most `QUICK_UNITS`.)
                self.quick_base = units as u32;
                self.first.push(addr);
            } else if units < base {
                // A smaller size: it gets `first`, whose blocks go to the table.
                let old = std::mem::take(&mut self.first);
                let mut table = std::mem::take(&mut self.quick).into_vec();
                table.splice(
                    0..0,
                    std::iter::repeat_with(Vec::new)
                        .take(base - units - 1)
                        .chain(std::iter::once(old)),
                );
                self.quick = table.into_boxed_slice();
                self.quick_base = units as u32;
                self.first.push(addr);
            } else {
                let at = units - base - 1;
                if self.quick.len() <= at {
                    let mut table = std::mem::take(&mut self.quick).into_vec();
                    table.resize_with(at + 1, Vec::new);
                    self.quick = table.into_boxed_slice();
                }
                self.quick[at].push(addr);
            }
            self.quick_bytes += size as u32;
            None
        } else if (LARGE_MIN..=LARGE_BYTES).contains(&size) && self.large_cap > 0 {
            let cap = self.large_cap as usize;
            let large = self
                .large
                .get_or_insert_with(|| Box::new(Vec::with_capacity(cap)));
            let oldest = (large.len() == cap).then(|| large.remove(0));
            large.push((addr, size));
            self.large_bytes += size as u32;
            if let Some((old, n)) = oldest {
                self.large_bytes -= n as u32;
                self.insert(old, n);
            }
            None
        } else {
            Some(self.insert_inlined(addr, size))
        }
    }

    /// Frees a block into the index, merged with its neighbours (and with the fresh
    /// extent, which then joins the index, when it ends at the extent's start); returns
    /// the merged block.
    #[inline]
    pub(crate) fn insert(&mut self, addr: usize, size: usize) -> FreeBlock {
        self.insert_inlined(addr, size)
    }

    /// [`insert`](Self::insert), inlined into the free path's
    /// [`put_uncached`](Self::put_uncached) (one call less on every free that coalesces).
    #[inline(always)]
    fn insert_inlined(&mut self, addr: usize, size: usize) -> FreeBlock {
        let starts_chunk = self.chunk_at(addr).is_some();
        let merged = self.free.insert(FreeBlock {
            addr,
            size,
            starts_chunk,
        });
        if self.fresh_held && merged.addr + merged.size == self.fresh().0 {
            return self.spill_fresh().unwrap_or(merged);
        }
        merged
    }

    /// Coalesces the cached small blocks and the fresh extent into the index.
    pub(crate) fn flush(&mut self) {
        self.spill_fresh();
        // (Written only when it holds blocks: a search flushes lists whose state is cold,
        // and the large blocks' fields are on a line the rest of a flush may not read.)
        if self.large_bytes != 0 {
            let mut large = self.large.take();
            for &(addr, size) in large.iter().flat_map(|blocks| blocks.iter()) {
                self.insert(addr, size);
            }
            // (The box and its buffer kept for the next large blocks.)
            if let Some(blocks) = &mut large {
                blocks.clear();
            }
            self.large = large;
            self.large_bytes = 0;
        }
        if self.quick_bytes == 0 {
            return;
        }
        let base = self.quick_base as usize;
        let first = std::mem::take(&mut self.first);
        for &addr in first.iter().rev() {
            self.insert(addr, base * GRANULE);
        }
        self.first = first;
        self.first.clear();
        for at in 0..self.quick.len() {
            let size = (base + 1 + at) * GRANULE;
            while let Some(addr) = self.quick[at].pop() {
                self.insert(addr, size);
            }
        }
        self.quick_bytes = 0;
    }

    /// Gives back the heap memory of a list that holds nothing (see
    /// [`Pool::trim`](crate::suballoc::Pool::trim), which then frees the list itself where it can):
    /// what a stream that is not used any more costs then is its inline fields and the
    /// copy of the chunk table.
    pub(crate) fn release_memory(&mut self) {
        if self.free_bytes() == 0 {
            self.first = Vec::new();
            self.quick = Box::default();
            self.quick_base = 0;
            self.large = None;
            self.free.release_memory();
        }
    }

    /// The cached larger blocks, (address, size), oldest first.
    pub(crate) fn large_blocks(&self) -> &[(usize, usize)] {
        self.large.as_deref().map_or(&[], Vec::as_slice)
    }

    /// Every free extent of the list, (address, size), cached ones included.
    pub(crate) fn free_extents(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        let quick = self
            .quick_bins()
            .flat_map(|(size, addrs)| addrs.iter().map(move |&a| (a, size)));
        let (start, end) = self.fresh();
        self.free
            .blocks()
            .map(|b| (b.addr, b.size))
            .chain((start < end).then_some((start, end - start)))
            .chain(quick)
            .chain(self.large_blocks().iter().copied())
    }

    /// Takes in blocks drained from other lists of the pool (coalescing them with its
    /// own).
    pub(crate) fn absorb(&mut self, mut blocks: Vec<FreeBlock>) {
        self.flush();
        // Highest first, so the lowest blocks head their size classes' lists, whatever
        // order the lists held them in (their maps' order depends on the addresses the
        // upstream gave).
        blocks.sort_unstable_by_key(|b| std::cmp::Reverse(b.addr));
        for b in blocks {
            self.free.insert(b);
        }
    }

    pub(crate) fn drain(&mut self) -> Vec<FreeBlock> {
        self.flush();
        self.free.drain()
    }

    pub(crate) fn free_bytes(&self) -> usize {
        // (The fresh extent's bounds read only when it holds bytes: they lie on a line a
        // pool's request does not otherwise read.)
        let fresh = if self.fresh_held {
            let (start, end) = self.fresh();
            end - start
        } else {
            0
        };
        self.free.bytes() + self.quick_bytes as usize + self.large_bytes as usize + fresh
    }
}

/// The block size for `layout` (a multiple of the granule) and its alignment (at least
/// the granule).
#[inline]
pub(crate) fn block_size(layout: Layout) -> (usize, usize) {
    // `layout.size()` is at most `isize::MAX`, so rounding up cannot overflow.
    (
        layout.size().next_multiple_of(GRANULE),
        layout.align().max(GRANULE),
    )
}

/// A pool's or an arena's list as the core moves it.
impl super::ordered::Contents for FreeList {
    type Item = FreeBlock;

    fn holds_nothing(&self) -> bool {
        self.free_bytes() == 0
    }

    fn drain(&mut self) -> Vec<FreeBlock> {
        FreeList::drain(self)
    }

    fn absorb(&mut self, blocks: Vec<FreeBlock>) {
        FreeList::absorb(self, blocks);
    }

    fn shrink(&mut self) {
        self.release_memory();
    }
}

#[cfg(all(test, not(memres_loom)))]
mod tests {
    use super::{FreeBlock, FreeBlocks, FreeList, GRANULE};
    use crate::suballoc::core::list_table::ListTable;
    use crate::suballoc::core::stream_key::StreamKey;
    use crate::suballoc::superblocks::{SUPERBLOCK_SIZE, Superblocks};
    use crate::sync::Arc;

    /// Where the made-up arena of these tests starts (no memory is touched).
    const BASE: usize = 1 << 32;

    /// An arena's list holding one superblock at `BASE`, fresh.
    fn arena_list() -> FreeList {
        let table = Arc::new(Superblocks::new(BASE, 4 * SUPERBLOCK_SIZE));
        table.set(BASE, SUPERBLOCK_SIZE);
        table.set(BASE + SUPERBLOCK_SIZE, SUPERBLOCK_SIZE);
        let mut list = FreeList::in_arena(table);
        list.add_superblock(BASE, SUPERBLOCK_SIZE);
        list
    }

    /// A superblock given to a list serves requests from its front without entering the
    /// index; the padding an alignment needs goes to the index.
    #[test]
    fn a_fresh_superblock_serves_requests_from_its_front_outside_the_index() {
        let mut list = arena_list();
        assert_eq!(list.take_uncached(4096, GRANULE), Some(BASE));
        assert_eq!(list.take_uncached(4096, GRANULE), Some(BASE + 4096));
        assert_eq!(list.free.len(), 0, "nothing indexed");
        assert_eq!(list.free_bytes(), SUPERBLOCK_SIZE - 8192);
        let aligned = list.take_uncached(GRANULE, 1 << 16).unwrap();
        assert_eq!(aligned, BASE + (1 << 16));
        let padding: Vec<FreeBlock> = list.free.blocks().collect();
        assert_eq!(
            padding,
            [FreeBlock {
                addr: BASE + 8192,
                size: (1 << 16) - 8192,
                starts_chunk: false,
            }]
        );
        assert_eq!(
            list.largest_coalesced(),
            SUPERBLOCK_SIZE - (1 << 16) - GRANULE
        );
        assert_eq!(list.take_uncached(SUPERBLOCK_SIZE, GRANULE), None);
    }

    /// A block freed next to the fresh extent's start merges with it (in the index), so
    /// a superblock whole again is found whole; a flush puts the extent in the index.
    #[test]
    fn a_free_reaching_the_fresh_extent_merges_with_it() {
        let mut list = arena_list();
        let big = 1 << 17; // (above the small blocks' cache)
        assert_eq!(list.take_uncached(big, GRANULE), Some(BASE));
        let merged = list.insert(BASE, big);
        assert_eq!(
            merged,
            FreeBlock {
                addr: BASE,
                size: SUPERBLOCK_SIZE,
                starts_chunk: true,
            }
        );
        assert_eq!(list.free.len(), 1);
        assert_eq!(list.free_bytes(), SUPERBLOCK_SIZE);
        let mut other = arena_list();
        other.flush();
        assert_eq!(other.free.len(), 1);
        assert_eq!(other.free_bytes(), SUPERBLOCK_SIZE);
    }

    /// An idle list gives its superblock back whole when what it holds is exactly that
    /// superblock (fresh extent and cached small blocks), and not otherwise.
    #[test]
    fn an_idle_list_gives_back_exactly_its_superblock() {
        let mut list = arena_list();
        let a = list.take(4096, GRANULE).unwrap();
        let _still_out = list.take(4096, GRANULE).unwrap();
        assert_eq!(list.put(a, 4096), None, "cached");
        assert!(!list.take_whole(BASE, SUPERBLOCK_SIZE), "a block still out");
        // A block of another superblock in the cache: the bytes add up, the range not.
        list.put(BASE + SUPERBLOCK_SIZE, 4096);
        assert!(!list.take_whole(BASE, SUPERBLOCK_SIZE));
        assert_eq!(list.free_bytes(), SUPERBLOCK_SIZE);
        let mut list = arena_list();
        let a = list.take(4096, GRANULE).unwrap();
        list.put(a, 4096);
        assert!(list.take_whole(BASE, SUPERBLOCK_SIZE));
        assert_eq!(list.free_bytes(), 0);
        assert_eq!(list.free_extents().count(), 0);
    }

    /// An idle list's cached blocks of several sizes (bins past the first) are checked
    /// and emptied too: a block of another size outside the superblock keeps it.
    #[test]
    fn an_idle_list_with_blocks_of_several_sizes_gives_back_exactly_its_superblock() {
        let mut list = arena_list();
        let a = list.take(4096, GRANULE).unwrap();
        let b = list.take(8192, GRANULE).unwrap();
        let _still_out = list.take(8192, GRANULE).unwrap();
        list.put(a, 4096);
        list.put(b, 8192);
        assert!(!list.take_whole(BASE, SUPERBLOCK_SIZE), "a block still out");
        // An 8 KiB block of the next superblock cached beside `b`: the bytes add up, but
        // a bin past the first holds a block outside.
        list.put(BASE + SUPERBLOCK_SIZE, 8192);
        assert_eq!(list.quick_blocks(), (3, 8192));
        assert_eq!(list.free_bytes(), SUPERBLOCK_SIZE);
        assert!(!list.take_whole(BASE, SUPERBLOCK_SIZE));
        assert_eq!(list.free_bytes(), SUPERBLOCK_SIZE, "nothing taken");
        assert_eq!(list.quick_blocks(), (3, 8192));
        // The superblock's own blocks only: taken whole, every bin emptied.
        let mut list = arena_list();
        let a = list.take(4096, GRANULE).unwrap();
        let b = list.take(8192, GRANULE).unwrap();
        list.put(a, 4096);
        list.put(b, 8192);
        assert_eq!(list.quick_blocks(), (2, 8192));
        assert!(list.take_whole(BASE, SUPERBLOCK_SIZE));
        assert_eq!(list.free_bytes(), 0);
        assert_eq!(list.quick_blocks(), (0, 0));
        assert_eq!(list.free_extents().count(), 0);
    }

    /// A stream's list keeps what other threads read (the key a lookup compares, the
    /// searches' hint) on its first cache line, and what its users write at every call
    /// (the lock's flag, the small blocks' cache) on the line 128 bytes on, in 512 bytes
    /// in all (see `List`'s layout). Sharing one line made threads on one stream 7x
    /// slower; a larger list costs a stream's lanes more heap.
    #[test]
    fn a_lists_shared_fields_and_its_written_state_are_on_separate_lines() {
        let table = ListTable::default();
        let _pin = table.pin();
        let list = table.get_or_insert_with(StreamKey::host(1), || {
            FreeList::new(std::iter::empty(), None)
        });
        // (A list starts a cache line: `List` is aligned to 128 bytes.)
        let base = std::ptr::from_ref(list).addr();
        let key = std::ptr::from_ref(&list.key).addr() - base;
        let hint = std::ptr::from_ref(&list.holds_free).addr() - base;
        // The flag is the lock's first field.
        let flag = std::ptr::from_ref(&*list.state).addr() - base;
        let state = list.state.lock();
        let start = |p: usize| p - base;
        let end = |p: usize, len: usize| p + len - base;
        let cache_start = start(std::ptr::from_ref(&state.first).addr());
        let cache_end = [
            end(
                std::ptr::from_ref(&state.first).addr(),
                size_of::<Vec<usize>>(),
            ),
            end(
                std::ptr::from_ref(&state.quick_base).addr(),
                size_of::<u32>(),
            ),
            end(
                std::ptr::from_ref(&state.quick_bytes).addr(),
                size_of::<u32>(),
            ),
            end(
                std::ptr::from_ref(&state.quick).addr(),
                size_of::<Box<[Vec<usize>]>>(),
            ),
        ]
        .into_iter()
        .max()
        .unwrap();
        // What searches read, on the first line; what the list's users write at every
        // call, on a line of its own 128 bytes on (no adjacent-line prefetch pairs them).
        assert!(key < 64 && hint < 64, "key at {key}, hint at {hint}");
        assert_eq!(flag, 128, "the lock at {flag}");
        // 512 bytes in all: 16 lanes' lists of a stream within issue 49's 16 KiB
        // (`tests/stream_memory.rs`); one more 128-byte step was 16,421 bytes a stream.
        assert_eq!(
            size_of_val(list),
            512,
            "a list of {} bytes",
            size_of_val(list)
        );
        assert!(
            cache_start >= 128 && cache_end <= 192,
            "the small blocks' cache at {cache_start}..{cache_end}"
        );
        // What a request the cache cannot serve reads first (the large blocks' and the
        // coalesced blocks' bytes, their class summary), on the state's second line.
        let large = start(std::ptr::from_ref(&state.large_bytes).addr());
        let free = start(std::ptr::from_ref(&state.free).addr());
        let free_end = free + FreeBlocks::HOT_BYTES;
        assert!(
            large >= 192 && free_end <= 256,
            "the slow path's first fields at {large}..{free_end}"
        );
        // The class table's vector there too: whether an emptied list holds heap memory
        // (what an arena reads of an idle stream's list it takes a superblock back from).
        let table_end = free + FreeBlocks::TABLE_END;
        assert!(
            table_end <= 256,
            "the class table's vector ends at {table_end}"
        );
        // The fresh extent's flag there too (its bounds, in `chunks`, are further on).
        let held = start(std::ptr::from_ref(&state.fresh_held).addr());
        assert!((192..256).contains(&held), "the fresh flag at {held}");
    }
}

#[cfg(all(test, not(memres_loom)))]
mod bin_tests {
    use super::{FreeList, GRANULE};

    /// Small blocks of several sizes, the smallest freed last (it takes the first bin
    /// from a larger size, whose blocks move to the table of bins): each size's blocks
    /// come back newest first and whole, the counts and extents see every cached block,
    /// and a flush hands them all to the coalesced blocks.
    #[test]
    fn the_first_bin_moves_to_the_table_when_a_smaller_size_comes() {
        let mut list = FreeList::new(std::iter::once((0, 1 << 20)), None);
        let g = GRANULE;
        let frees = [(3, 0), (3, 3), (5, 10), (1, 20), (2, 30), (1, 40)];
        for &(units, at) in &frees {
            assert!(
                list.put(at * g, units * g).is_none(),
                "{units} granules cached"
            );
        }
        let cached: usize = frees.iter().map(|&(units, _)| units * g).sum();
        assert_eq!(list.free_bytes(), cached);
        assert_eq!(list.quick_blocks(), (6, 5 * g));
        let mut extents: Vec<_> = list.free_extents().collect();
        extents.sort_unstable();
        let mut expected: Vec<_> = frees.iter().map(|&(u, at)| (at * g, u * g)).collect();
        expected.sort_unstable();
        assert_eq!(extents, expected);
        assert_eq!(list.take(g, g), Some(40 * g));
        assert_eq!(list.take(3 * g, g), Some(3 * g));
        assert_eq!(list.take(3 * g, g), Some(0));
        assert_eq!(list.take(5 * g, g), Some(10 * g));
        assert_eq!(list.free_bytes(), 3 * g);
        list.flush();
        assert_eq!(list.quick_blocks(), (0, 0));
        assert_eq!(list.free_bytes(), 3 * g);
        // Coalesced: the 1- and 2-granule blocks at 20 and 30 granules, apart.
        assert_eq!(list.take(2 * g, g), Some(30 * g));
        assert_eq!(list.take(g, g), Some(20 * g));
        assert_eq!(list.free_bytes(), 0);
        list.release_memory();
        assert!(list.put(7 * g, 2 * g).is_none());
        assert_eq!(list.take(2 * g, g), Some(7 * g));
    }
}
