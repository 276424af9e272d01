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
const QUICK_BYTES: usize = 8 << 20;

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
/// The small blocks' cache comes first (`repr(C)`): with the list's lock before it, a
/// cached block is found on the state's first cache line and one line of its bin.
#[repr(C)]
pub(crate) struct FreeList {
    /// Recently freed small blocks by size in granules, handed out again whole: entry
    /// `i` for blocks of `quick_base + i` granules, the table only as long as the sizes
    /// freed so far need (issue 49: a table of every size, `QUICK_UNITS + 1` entries or
    /// 6 KiB, made a list cost 7 KiB, and a stream used by 16 threads' lanes 112.8 KiB,
    /// for one 4 KiB block). Empty (no heap) until the first small block is freed, and
    /// again after `release_memory`.
    quick: Vec<Vec<usize>>,
    /// The size in granules of `quick`'s first entry.
    quick_base: u32,
    /// (At most `QUICK_BYTES`; this and `quick_base` are 32-bit so that a stream's
    /// `List` fits 512 bytes.)
    quick_bytes: u32,
    pub(crate) free: FreeBlocks,
    /// Recently freed larger blocks, (address, size), oldest first: at most
    /// `large_cap` (0 for an arena, whose frees must coalesce to return superblocks).
    pub(crate) large: Vec<(usize, usize)>,
    large_bytes: u32,
    large_cap: u32,
    /// The pool's chunks, start to size (a copy per stream, so the free path needs no
    /// shared lock); blocks never merge across a chunk's start. Empty in an arena's
    /// lists, which read `superblocks`.
    pub(crate) chunks: AddrMap<usize>,
    /// An arena's superblocks, shared by all its lists.
    superblocks: Option<Arc<Superblocks>>,
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
            quick: Vec::new(),
            quick_base: 0,
            quick_bytes: 0,
            large: Vec::new(),
            large_bytes: 0,
            large_cap: 0,
            chunks: chunks.collect(),
            superblocks: None,
        }
    }

    /// The list of an arena with these superblocks (which are its chunks).
    pub(crate) fn in_arena(superblocks: Arc<Superblocks>) -> FreeList {
        FreeList {
            superblocks: Some(superblocks),
            ..FreeList::new(std::iter::empty(), None)
        }
    }

    /// The size of the chunk starting at `addr`, if one does.
    #[inline]
    pub(crate) fn chunk_at(&self, addr: usize) -> Option<usize> {
        match &self.superblocks {
            Some(table) => table.size_at(addr),
            None => self.chunks.get(&addr).copied(),
        }
    }

    /// Also keeps the last [`LARGE_BLOCKS`] larger blocks freed (see there): a pool's
    /// lists do, an arena's do not.
    pub(crate) fn with_large_cache(mut self) -> FreeList {
        self.large_cap = LARGE_BLOCKS as u32;
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
            self.quick_bytes -= size as u32;
            return Some(addr);
        }
        self.take_uncached(size, align)
    }

    /// The small blocks' cache's bin for blocks of `units` granules, if the table has one
    /// (an index below `quick_base` wraps far past its end).
    #[inline(always)]
    fn quick_bin(&mut self, units: usize) -> Option<&mut Vec<usize>> {
        self.quick
            .get_mut(units.wrapping_sub(self.quick_base as usize))
    }

    /// How many small blocks the cache holds, and the largest one's size.
    pub(crate) fn quick_blocks(&self) -> (usize, usize) {
        let count = self.quick.iter().map(Vec::len).sum();
        let largest = self
            .quick
            .iter()
            .rposition(|bin| !bin.is_empty())
            .map_or(0, |at| (self.quick_base as usize + at) * GRANULE);
        (count, largest)
    }

    /// [`take`](Self::take) past the small blocks' cache.
    #[inline(never)]
    fn take_uncached(&mut self, size: usize, align: usize) -> Option<usize> {
        if align == GRANULE
            && size >= LARGE_MIN
            && let Some(i) = self.large.iter().rposition(|&(_, n)| n == size)
        {
            self.large_bytes -= size as u32;
            return Some(self.large.remove(i).0);
        }
        self.free.take(size, align)
    }

    /// Frees a block into the list: cached if small, else coalesced (and then returned,
    /// merged with its neighbours).
    #[inline(always)]
    pub(crate) fn put(&mut self, addr: usize, size: usize) -> Option<FreeBlock> {
        let units = size / GRANULE;
        if units <= QUICK_UNITS
            && self.quick_bytes as usize + size <= QUICK_BYTES
            && let Some(cached) = self.quick_bin(units)
        {
            cached.push(addr);
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
        if units <= QUICK_UNITS && self.quick_bytes as usize + size <= QUICK_BYTES {
            // The first block of a size outside the sizes cached so far: the table grows
            // to take it in (with a bin, `put` took the block).
            if self.quick.is_empty() {
                self.quick_base = units as u32;
            } else if units < self.quick_base as usize {
                let lower = self.quick_base as usize - units;
                self.quick
                    .splice(0..0, std::iter::repeat_with(Vec::new).take(lower));
                self.quick_base = units as u32;
            }
            let at = units - self.quick_base as usize;
            if self.quick.len() <= at {
                self.quick.resize_with(at + 1, Vec::new);
            }
            self.quick[at].push(addr);
            self.quick_bytes += size as u32;
            None
        } else if (LARGE_MIN..=LARGE_BYTES).contains(&size) && self.large_cap > 0 {
            if self.large.len() == self.large_cap as usize {
                let (old, n) = self.large.remove(0);
                self.large_bytes -= n as u32;
                self.insert(old, n);
            }
            self.large.push((addr, size));
            self.large_bytes += size as u32;
            None
        } else {
            Some(self.insert(addr, size))
        }
    }

    #[inline]
    pub(crate) fn insert(&mut self, addr: usize, size: usize) -> FreeBlock {
        let starts_chunk = self.chunk_at(addr).is_some();
        self.free.insert(FreeBlock {
            addr,
            size,
            starts_chunk,
        })
    }

    /// Coalesces the cached small blocks into the free list.
    pub(crate) fn flush(&mut self) {
        for (addr, size) in std::mem::take(&mut self.large) {
            self.insert(addr, size);
        }
        self.large_bytes = 0;
        if self.quick_bytes == 0 {
            return;
        }
        for at in 0..self.quick.len() {
            let size = (self.quick_base as usize + at) * GRANULE;
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
            self.quick = Vec::new();
            self.quick_base = 0;
            self.large = Vec::new();
            self.free.release_memory();
        }
    }

    /// Every free extent of the list, (address, size), cached ones included.
    pub(crate) fn free_extents(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        let base = self.quick_base as usize;
        let quick =
            self.quick.iter().enumerate().flat_map(move |(at, addrs)| {
                addrs.iter().map(move |&a| (a, (base + at) * GRANULE))
            });
        self.free
            .blocks()
            .map(|b| (b.addr, b.size))
            .chain(quick)
            .chain(self.large.iter().copied())
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
        self.free.bytes() + self.quick_bytes as usize + self.large_bytes as usize
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
    use super::FreeList;
    use crate::suballoc::core::list_table::ListTable;
    use crate::suballoc::core::stream_key::StreamKey;

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
        let cache_end = std::ptr::from_ref(&state.quick_bytes).addr() + size_of::<u32>() - base;
        let cache_start = std::ptr::from_ref(&state.quick).addr() - base;
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
    }
}
