//! The free blocks of one stream's list: a two-level segregated fit (TLSF) index for
//! finding a block in O(1), and address maps for coalescing with neighbours in O(1).
//!
//! The memory itself may be on a GPU, so nothing is stored in it: every free block has a
//! node here. Sizes are whole granules of [`GRANULE`] bytes. Blocks carry a flag saying
//! whether they begin an upstream allocation (a *chunk*); a block never merges with the
//! one before it when it begins a chunk, so blocks of different chunks stay apart even
//! where the upstream placed the chunks next to each other.

use crate::suballoc::regions::{Links, Regions};

pub(crate) use crate::suballoc::granule::GRANULE;

/// Classes below this many granules hold one exact size each.
const LINEAR: usize = 16;
/// Log2 of the number of classes per power of two above [`LINEAR`].
const SUB_BITS: u32 = 4;
/// Groups of 16 classes; the first is the linear range, the others one power of two each.
const GROUPS: usize = 56;
const CLASSES: usize = GROUPS * LINEAR;
/// Empty [`FreeBlocks`] of lists that gave their memory back, class table made (every
/// sentinel pointing at itself) and vectors and maps keeping their room, for the next
/// list that needs them. A class table is 7 KiB, and making one was most of a new
/// stream's first allocation in an arena (the heap's fresh pages faulted in, then
/// written); an arena going round many streams empties one list as it fills another,
/// so what is taken here was just used, in the cache, and needs no allocation. Per
/// thread (no lock), at most [`spare_tables::KEEP`]; a thread's are freed when it exits
/// and when it trims a resource (`ordered::trim`).
mod spare_tables {
    use super::FreeBlocks;

    /// The most a thread keeps (an arena hands out up to 64 superblocks between two
    /// returns of idle streams' ones). Under loom none are kept (see [`take`]).
    #[cfg(not(memres_loom))]
    pub(super) const KEEP: usize = 64;

    /// The most nodes a kept index has room for (an idle stream's list held a few
    /// blocks; one that held more is freed, not kept).
    pub(super) const MOST_NODES: usize = 64;

    #[cfg(not(memres_loom))]
    std::thread_local! {
        static SPARE: std::cell::RefCell<Vec<FreeBlocks>> = const { std::cell::RefCell::new(Vec::new()) };
    }

    /// Spare empty blocks, if this thread keeps some.
    pub(super) fn take() -> Option<FreeBlocks> {
        #[cfg(not(memres_loom))]
        return SPARE.try_with(|s| s.borrow_mut().pop()).ok().flatten();
        // Under loom (whose model threads share the process's thread-locals) none are
        // kept: the models check the lists' protocols, not their memory.
        #[cfg(memres_loom)]
        None
    }

    /// Frees what this thread keeps (a trim gives back memory kept for later; other
    /// threads' go as they exit).
    pub(super) fn release() {
        #[cfg(not(memres_loom))]
        let _ = SPARE.try_with(|s| std::mem::take(&mut *s.borrow_mut()));
    }

    /// Keeps `spare` (empty, its class table made) for a later list, or frees it when
    /// this thread keeps enough.
    pub(super) fn give(spare: FreeBlocks) {
        #[cfg(not(memres_loom))]
        {
            let _ = SPARE.try_with(|s| {
                let mut s = s.borrow_mut();
                if s.len() < KEEP {
                    s.push(spare);
                }
            });
        }
        #[cfg(memres_loom)]
        drop(spare);
    }
}

/// Node entries the class table has room for when it is made (a stream's list mostly
/// holds a few blocks).
const FIRST_NODES: usize = 8;
/// How many blocks of a request's own size class are tried before a larger class.
const OWN_CLASS_SCAN: usize = 8;
/// In an address-ordered list, requests below this many granules (512 KiB) are placed by
/// address region ([`Regions`]).
const LOW_FIRST_UNITS: usize = 2048;

use std::num::NonZeroU32;

use crate::addr_map::SparseAddrMap;

/// One free block, as stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FreeBlock {
    pub(crate) addr: usize,
    pub(crate) size: usize,
    /// The block begins an upstream allocation.
    pub(crate) starts_chunk: bool,
}

/// A free block as its node stores it: the block and its size class (cached: a cut or a
/// merge moves a node between class lists by its old class, which is then a load, not a
/// computation; in the block's padding, so a node is 24 bytes as a block is).
#[derive(Clone, Copy, Debug)]
struct Node {
    addr: usize,
    size: usize,
    starts_chunk: bool,
    /// [`class_of`] the block's size in granules.
    class: u16,
}

const _: () = assert!(size_of::<Node>() == size_of::<FreeBlock>());
const _: () = assert!(CLASSES <= u16::MAX as usize);

impl Node {
    #[inline]
    fn of(block: FreeBlock, class: usize) -> Node {
        debug_assert_eq!(class, class_of(block.size / GRANULE));
        Node {
            addr: block.addr,
            size: block.size,
            starts_chunk: block.starts_chunk,
            class: class as u16,
        }
    }

    #[inline]
    fn block(self) -> FreeBlock {
        FreeBlock {
            addr: self.addr,
            size: self.size,
            starts_chunk: self.starts_chunk,
        }
    }
}

/// A place in a class list: a class's sentinel or a block's entry (see
/// [`FreeBlocks::lists`]), by index into that vector.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Link {
    prev: u32,
    next: u32,
}

/// Node `i` as the neighbour maps hold it: never zero, so that a map slot (an address
/// and an optional node) is 16 bytes, not 24, and four share a cache line.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct NodeRef(NonZeroU32);

const _: () = assert!(size_of::<Option<(usize, NodeRef)>>() == 16);

impl NodeRef {
    #[inline]
    fn of(i: u32) -> NodeRef {
        debug_assert!(i < u32::MAX);
        // `i` is below 2^32 - CLASSES (checked where nodes are made): no saturation.
        NodeRef(NonZeroU32::MIN.saturating_add(i))
    }

    #[inline]
    fn index(self) -> u32 {
        self.0.get() - 1
    }
}

/// The entry of node `i` in [`FreeBlocks::lists`].
#[inline]
fn entry(i: u32) -> u32 {
    i + CLASSES as u32
}

/// The free blocks of one list, coalesced and indexed by size class. What a request
/// reads first, `bytes`, `groups_in_use` and `regions` (all a request to an empty list
/// reads), comes first (`repr(C)`; see `FreeList` for where it lies).
#[repr(C)]
pub(crate) struct FreeBlocks {
    bytes: usize,
    /// Bit `g` is set when group `g` has a non-empty class.
    groups_in_use: u64,
    /// Blocks by address region, and each node's links in them, in a list made
    /// [`address_ordered`](FreeBlocks::address_ordered).
    regions: Option<Box<Ordered>>,
    /// The class lists, circular and doubly linked: entry `c < CLASSES` is class `c`'s
    /// sentinel, entry [`entry(i)`](entry) node `i`'s place. With a sentinel, putting a
    /// node in and taking it out are the same few stores whatever its neighbours are:
    /// no branch on whether the list was empty or the node first, which random sizes
    /// made mispredicted (callgrind `--branch-sim` on `random`). Allocated with the first
    /// block (empty before, and again after [`FreeBlocks::release_memory`]).
    ///
    /// Next to the fields a request reads first: whether it holds heap memory is what
    /// [`release_memory`](FreeBlocks::release_memory) reads of an empty list (an arena's
    /// idle stream's, issue 51 item 4), on the line a request to it read just before.
    lists: Vec<Link>,
    /// The blocks, by node number (a number in `spare` is a node not in use).
    nodes: Vec<Node>,
    spare: Vec<u32>,
    /// Per group, bit `c` is set when class `16 g + c` is non-empty.
    classes_in_use: [u16; GROUPS],
    by_start: SparseAddrMap<NodeRef>,
    by_end: SparseAddrMap<NodeRef>,
}

impl FreeBlocks {
    /// The bytes at the start of a `FreeBlocks` that a request to an empty list reads.
    #[cfg(all(test, not(memres_loom)))]
    pub(crate) const HOT_BYTES: usize =
        std::mem::offset_of!(FreeBlocks, regions) + size_of::<Option<Box<Ordered>>>();
    /// The bytes up to the class table's end (what `release_memory` reads of an empty
    /// list, on the same line as the ones above).
    #[cfg(all(test, not(memres_loom)))]
    pub(crate) const TABLE_END: usize =
        std::mem::offset_of!(FreeBlocks, lists) + size_of::<Vec<Link>>();
}

/// The index of an [`address_ordered`](FreeBlocks::address_ordered) list: its regions and
/// each node's links in them (`links[i]` for node `i`). Boxed with the regions, not
/// inline, so that a stream's list fits 512 bytes (`List`'s layout test): every pool's
/// list carries the inline fields, only a virtual pool's uses these.
struct Ordered {
    regions: Regions,
    links: Vec<Links>,
}

impl Ordered {
    fn new(base: usize) -> Box<Ordered> {
        Box::new(Ordered {
            regions: Regions::new(base),
            links: Vec::new(),
        })
    }
}

/// `addr` rounded up to `align`, a power of two (a mask: `next_multiple_of` divides,
/// which on the allocation path cost more than the rest of the arithmetic); `None` past
/// the top of the address space.
#[inline]
fn align_up(addr: usize, align: usize) -> Option<usize> {
    debug_assert!(align.is_power_of_two());
    Some(addr.checked_add(align - 1)? & !(align - 1))
}

/// The class that holds blocks of `units` granules (`units >= 1`).
#[inline]
fn class_of(units: usize) -> usize {
    if units < LINEAR {
        return units;
    }
    let top = usize::BITS - 1 - units.leading_zeros();
    let sub = (units >> (top - SUB_BITS)) & (LINEAR - 1);
    (top - SUB_BITS + 1) as usize * LINEAR + sub
}

/// The lowest class whose every block holds `units` granules (what
/// [`class_at_least_from`] computes from the class of `units`; the tests' reference).
#[cfg(test)]
fn class_at_least(units: usize) -> usize {
    if units < LINEAR {
        return units;
    }
    let top = usize::BITS - 1 - units.leading_zeros();
    let step = 1usize << (top - SUB_BITS);
    class_of(units.saturating_add(step - 1))
}

/// The lowest class whose every block holds `units` granules, given `own`, the
/// [`class_of`] `units`: `own` when `units` is the smallest size of its class, else the
/// next class (one shift and compare, not a second [`class_of`]).
#[inline]
fn class_at_least_from(units: usize, own: usize) -> usize {
    debug_assert_eq!(own, class_of(units));
    if units < LINEAR {
        return own;
    }
    // The bits below a class's step: a class's smallest size has none.
    let top = usize::BITS - 1 - units.leading_zeros();
    let below = units & ((1 << (top - SUB_BITS)) - 1);
    own + usize::from(below != 0)
}

impl Default for FreeBlocks {
    fn default() -> Self {
        FreeBlocks {
            nodes: Vec::new(),
            spare: Vec::new(),
            lists: Vec::new(),
            groups_in_use: 0,
            classes_in_use: [0; GROUPS],
            by_start: SparseAddrMap::default(),
            by_end: SparseAddrMap::default(),
            regions: None,
            bytes: 0,
        }
    }
}

impl FreeBlocks {
    /// A list for blocks at `base` and above that serves requests below 512 KiB from the
    /// lowest address region that has a fit ([`Regions`]) and larger ones by size class
    /// as usual. Small blocks then pack into the low end of the memory, so free memory
    /// gathers into whole granules that a pool growing in place can unmap or hand to a
    /// large request. Measured with a virtual pool on `random` (`benches/workloads.rs`
    /// with `MEMRES_FOOTPRINT_SEEDS=12`, host, 2 MiB granules): see `BENCHMARKS.md`.
    pub(crate) fn address_ordered(base: usize) -> FreeBlocks {
        FreeBlocks {
            regions: Some(Ordered::new(base)),
            ..FreeBlocks::default()
        }
    }

    /// Free bytes in the list.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    /// Number of free blocks.
    pub(crate) fn len(&self) -> usize {
        self.by_start.len()
    }

    /// The largest free block's size (a scan: for statistics, not the allocation path).
    pub(crate) fn largest(&self) -> usize {
        self.blocks().map(|b| b.size).max().unwrap_or(0)
    }

    /// Every free block, in no particular order.
    pub(crate) fn blocks(&self) -> impl Iterator<Item = FreeBlock> + '_ {
        self.by_start
            .values()
            .map(|i| self.nodes[i.index() as usize].block())
    }

    /// The free block that begins at `addr`, if any.
    pub(crate) fn starting_at(&self, addr: usize) -> Option<FreeBlock> {
        self.by_start
            .get(&addr)
            .map(|i| self.nodes[i.index() as usize].block())
    }

    /// The free block that ends at `addr`, if any.
    pub(crate) fn ending_at(&self, addr: usize) -> Option<FreeBlock> {
        self.by_end
            .get(&addr)
            .map(|i| self.nodes[i.index() as usize].block())
    }

    /// Takes every block out of the list, in no particular order.
    pub(crate) fn drain(&mut self) -> Vec<FreeBlock> {
        let out = self.blocks().collect();
        self.nodes.clear();
        self.spare.clear();
        self.lists.clear();
        self.groups_in_use = 0;
        self.classes_in_use = [0; GROUPS];
        self.by_start.clear();
        self.by_end.clear();
        if let Some(r) = &mut self.regions {
            r.regions.clear();
            r.links.clear();
        }
        self.bytes = 0;
        out
    }

    /// Gives back the heap memory of an empty list (a stream's list that holds nothing
    /// costs then only its inline fields). Nothing happens while it holds a block.
    pub(crate) fn release_memory(&mut self) {
        // (`bytes`, among the fields a search reads first, is 0 exactly when it holds no
        // block.)
        if self.bytes != 0 || !self.holds_heap() {
            return;
        }
        let regions = self
            .regions
            .as_ref()
            .map(|r| Ordered::new(r.regions.base()));
        let mut spare = std::mem::replace(
            self,
            FreeBlocks {
                regions,
                ..FreeBlocks::default()
            },
        );
        // Kept only while small: a list that once held many blocks keeps large vectors
        // and maps, which would stay with the thread.
        if spare.lists.len() >= CLASSES && spare.nodes.capacity() <= spare_tables::MOST_NODES {
            // No node is linked, so every class's sentinel points at itself again: the
            // table is as `make_lists` makes it once the nodes' entries are cut off. The
            // other vectors and maps are empty and keep their room.
            spare.lists.truncate(CLASSES);
            spare.lists.shrink_to(CLASSES + spare_tables::MOST_NODES);
            debug_assert!(
                (0..CLASSES as u32).all(|c| spare.lists[c as usize] == Link { prev: c, next: c })
            );
            debug_assert!(spare.groups_in_use == 0 && spare.bytes == 0);
            debug_assert!(spare.classes_in_use.iter().all(|&c| c == 0));
            spare.nodes.clear();
            spare.spare.clear();
            spare.regions = None;
            spare_tables::give(spare);
        }
    }

    /// Whether the list holds any heap memory: its region index, node and class tables,
    /// or maps. (An idle stream's list in an arena, whose superblock stayed outside the
    /// index, mostly holds none: `release_memory` then has nothing to do, where it
    /// otherwise rebuilt the whole `FreeBlocks`, about 100 instructions for each idle
    /// superblock an arena took back, issue 51 item 4.)
    ///
    /// The class table is read, not every vector and map: the others get heap memory
    /// only once a block is linked, which makes the table first (`make_lists`), and
    /// `release_memory` frees them all together (one line of the list read, not three).
    #[inline]
    fn holds_heap(&self) -> bool {
        debug_assert!(
            self.lists.capacity() > 0
                || (self.nodes.capacity() == 0
                    && self.spare.capacity() == 0
                    && !self.by_start.holds_slots()
                    && !self.by_end.holds_slots()),
            "heap memory without a class table"
        );
        self.regions.is_some() || self.lists.capacity() > 0
    }

    /// Whether the list keeps heap memory for its index (class table or nodes).
    #[cfg(all(test, not(memres_loom)))]
    pub(crate) fn keeps_an_index(&self) -> bool {
        self.lists.capacity() > 0 || self.nodes.capacity() > 0
    }

    /// Frees the indexes of emptied lists that the calling thread keeps for the next
    /// lists it makes (see `spare_tables`): the end of a trim.
    pub(crate) fn release_spares() {
        spare_tables::release();
    }

    /// The size of the free block that begins at `addr`, if one does.
    pub(crate) fn size_starting_at(&self, addr: usize) -> Option<usize> {
        let i = self.by_start.get(&addr)?.index();
        Some(self.nodes[i as usize].size)
    }

    /// Removes the block that begins at `addr` (which must be in the list).
    pub(crate) fn remove_starting_at(&mut self, addr: usize) -> Option<FreeBlock> {
        let i = self.by_start.get(&addr)?.index();
        let block = self.nodes[i as usize].block();
        self.unlink(i);
        Some(block)
    }

    /// Adds a free block, merging it with free neighbours of the same chunk; returns the
    /// merged block. A neighbour's node is reused for the merged block, and a neighbour's
    /// map entry is removed where its lookup found it (no second probe): a merge with one
    /// neighbour moves one key, a merge with both removes two and renames one.
    // long: the four merge cases side by side, each keeping both maps in step.
    pub(crate) fn insert(&mut self, block: FreeBlock) -> FreeBlock {
        let end = block.addr + block.size;
        let before = if block.starts_chunk {
            None
        } else {
            self.by_end
                .find_slot(block.addr)
                .map(|(s, i)| (s, i.index()))
        };
        let after = self
            .by_start
            .find_slot(end)
            .map(|(s, i)| (s, i.index()))
            .filter(|&(_, i)| !self.nodes[i as usize].starts_chunk);
        // The node that takes the block in, and its extent then (one `set_extent` for the
        // three merges: inlined once).
        let (i, merged) = match (before, after) {
            (None, None) => {
                self.link(block);
                return block;
            }
            (Some((slot, b)), None) => {
                // The block before grows to this one's end.
                self.by_end.rekey(slot, end);
                let prev = self.nodes[b as usize];
                let size = end - prev.addr;
                (
                    b,
                    FreeBlock {
                        size,
                        ..prev.block()
                    },
                )
            }
            (None, Some((slot, a))) => {
                // The block after grows down to this one's start.
                self.by_start.rekey(slot, block.addr);
                let next = self.nodes[a as usize];
                let size = next.addr + next.size - block.addr;
                (a, FreeBlock { size, ..block })
            }
            (Some((end_slot, b)), Some((start_slot, a))) => {
                // The block before takes this one and the one after, whose node goes; the
                // end key of the one after now names the one before.
                let next = self.nodes[a as usize];
                let next_end = next.addr + next.size;
                let gone = (
                    self.by_start.remove_at(start_slot),
                    self.by_end.remove_at(end_slot),
                );
                debug_assert_eq!(gone, (Some(NodeRef::of(a)), Some(NodeRef::of(b))));
                self.by_end.insert(next_end, NodeRef::of(b));
                self.forget(a);
                let prev = self.nodes[b as usize];
                let size = next_end - prev.addr;
                (
                    b,
                    FreeBlock {
                        size,
                        ..prev.block()
                    },
                )
            }
        };
        self.set_extent(i, merged);
        merged
    }

    /// Takes `size` bytes (a multiple of [`GRANULE`]) aligned to `align` (a power of two,
    /// at least [`GRANULE`]) from a block that fits; the rest of that block stays free.
    pub(crate) fn take(&mut self, size: usize, align: usize) -> Option<usize> {
        self.take_inlined(size, align)
    }

    /// [`take`](Self::take), inlined into the allocation path's caller
    /// (`FreeList::take_uncached`: one call less on every allocation the small blocks'
    /// cache does not serve).
    #[inline(always)]
    pub(crate) fn take_inlined(&mut self, size: usize, align: usize) -> Option<usize> {
        let need = size.checked_add(align - GRANULE)?;
        let units = need / GRANULE;
        let low = match &self.regions {
            Some(regions) if units < LOW_FIRST_UNITS => {
                let fits = |i: u32| {
                    let b = self.nodes[i as usize];
                    align_up(b.addr, align)
                        .and_then(|a| a.checked_add(size))
                        .is_some_and(|end| end <= b.addr + b.size)
                };
                regions
                    .regions
                    .find(&regions.links, units, OWN_CLASS_SCAN, fits)
            }
            _ => None,
        };
        let i = match low {
            Some(i) => i,
            None => self.find(units)?,
        };
        let block = self.nodes[i as usize];
        // The block fits the aligned request (`fits` rounded the same start, or the block
        // holds `need` bytes), so this rounding stays inside it and does not fail.
        let addr = align_up(block.addr, align)?;
        let front = addr - block.addr;
        let back = block.size - front - size;
        if back > 0 {
            // The node lives on as the back remainder: same end, so only its start key
            // moves.
            let rest = addr + size;
            let found = self.by_start.find_slot(block.addr);
            debug_assert!(found.is_some(), "a free block's start is in the map");
            if let Some((slot, _)) = found {
                self.by_start.rekey(slot, rest);
            }
            self.set_extent(
                i,
                FreeBlock {
                    addr: rest,
                    size: back,
                    starts_chunk: false,
                },
            );
        } else {
            self.unlink(i);
        }
        if front > 0 {
            self.link(FreeBlock {
                addr: block.addr,
                size: front,
                starts_chunk: block.starts_chunk,
            });
        }
        Some(addr)
    }

    /// A node holding at least `units` granules: the head of the request's own class when
    /// it is big enough, else the head of the first class whose blocks all fit.
    #[inline]
    fn find(&self, units: usize) -> Option<u32> {
        if self.groups_in_use == 0 {
            return None; // no block (and maybe no `lists` yet)
        }
        // (Below `CLASSES` for every size, `units` being at most `usize::MAX / GRANULE`:
        // the class tests.)
        let own = class_of(units);
        // The first few blocks of the request's own class: a fit there keeps larger
        // blocks whole (measured: a virtual pool's `random` footprint on the host,
        // 1.32 -> 1.29 of live, no other change).
        let mut at = self.lists[own].next;
        for _ in 0..OWN_CLASS_SCAN {
            if at == own as u32 {
                break; // the sentinel: the list's end
            }
            let i = at - CLASSES as u32;
            if self.nodes[i as usize].size >= units * GRANULE {
                return Some(i);
            }
            at = self.lists[at as usize].next;
        }
        let class = class_at_least_from(units, own);
        if class >= CLASSES {
            return None;
        }
        let group = class / LINEAR;
        let here = self.classes_in_use[group] & (u16::MAX << (class % LINEAR));
        let class = if here != 0 {
            group * LINEAR + here.trailing_zeros() as usize
        } else {
            let above = self.groups_in_use & (u64::MAX << group << 1);
            if above == 0 {
                return None;
            }
            let g = above.trailing_zeros() as usize;
            g * LINEAR + self.classes_in_use[g].trailing_zeros() as usize
        };
        // A class's bit is set only while its list holds a block (not its sentinel).
        debug_assert_ne!(self.lists[class].next, class as u32);
        Some(self.lists[class].next - CLASSES as u32)
    }

    /// Gives node `i` a new extent past the maps (which the caller has updated): moves it
    /// to another class list only when its class changed, and updates the address
    /// regions, the node and the byte count. Inlined: a cut's and a merge's one call.
    #[inline(always)]
    fn set_extent(&mut self, i: u32, new: FreeBlock) {
        let old = self.nodes[i as usize];
        let (from, to) = (old.class as usize, class_of(new.size / GRANULE));
        if from != to {
            self.list_remove(i, from);
            self.list_push(i, to);
        }
        if self.regions.is_some() {
            self.move_in_regions(i, old.block(), new);
        }
        self.nodes[i as usize] = Node::of(new, to);
        self.bytes = self.bytes - old.size + new.size;
    }

    /// [`set_extent`](Self::set_extent)'s part for an address-ordered list: node `i`
    /// moves from `old`'s region list to `new`'s when they differ.
    #[inline(never)]
    fn move_in_regions(&mut self, i: u32, old: FreeBlock, new: FreeBlock) {
        if let Some(r) = &mut self.regions
            && !r.regions.same_list(old.addr, old.size, new.addr, new.size)
        {
            r.regions.unlink(&mut r.links, i, old.addr, old.size);
            r.regions.link(&mut r.links, i, new.addr, new.size);
        }
    }

    /// Puts node `i` at the head of `class`'s list.
    #[inline]
    fn list_push(&mut self, i: u32, class: usize) {
        let at = entry(i);
        let first = self.lists[class].next;
        self.lists[at as usize] = Link {
            prev: class as u32,
            next: first,
        };
        self.lists[first as usize].prev = at;
        self.lists[class].next = at;
        self.classes_in_use[class / LINEAR] |= 1 << (class % LINEAR);
        self.groups_in_use |= 1 << (class / LINEAR);
    }

    /// Takes node `i` out of `class`'s list.
    #[inline(always)]
    fn list_remove(&mut self, i: u32, class: usize) {
        let Link { prev, next } = self.lists[entry(i) as usize];
        self.lists[prev as usize].next = next;
        self.lists[next as usize].prev = prev;
        // Clear the class's bit, and its group's, if the list is now empty (no branch).
        let group = class / LINEAR;
        let empty = u16::from(self.lists[class].next == class as u32);
        self.classes_in_use[group] &= !(empty << (class % LINEAR));
        let in_use = u64::from(self.classes_in_use[group] != 0);
        self.groups_in_use = (self.groups_in_use & !(1 << group)) | in_use << group;
    }

    /// Makes the class sentinels (each list empty: the sentinel linked to itself). The
    /// lists go only with the nodes (`drain`, `release_memory`), so there are none yet.
    #[cold]
    fn make_lists(&mut self) {
        debug_assert!(self.nodes.is_empty() && self.by_start.len() == 0);
        if self.lists.capacity() < CLASSES
            && let Some(spare) = spare_tables::take()
        {
            let regions = self.regions.take();
            *self = spare;
            self.regions = regions;
            return;
        }
        self.lists.clear(); // keeps the capacity a drained list had
        // Room for the first few nodes' entries too: with exactly `CLASSES`, the first
        // block's entry reallocated (and copied) the whole table, the larger part of a
        // new stream's first allocation in an arena.
        self.lists.reserve_exact(CLASSES + FIRST_NODES);
        self.lists
            .extend((0..CLASSES as u32).map(|c| Link { prev: c, next: c }));
    }

    fn link(&mut self, block: FreeBlock) {
        if self.lists.is_empty() {
            self.make_lists();
        }
        let class = class_of(block.size / GRANULE);
        let node = Node::of(block, class);
        let i = match self.spare.pop() {
            Some(i) => {
                self.nodes[i as usize] = node;
                i
            }
            None => {
                self.nodes.push(node);
                self.lists.push(Link { prev: 0, next: 0 });
                if let Some(r) = &mut self.regions {
                    r.links.push(Links::NONE);
                }
                // The node's entry in `lists` must fit too.
                u32::try_from(self.nodes.len() - 1 + CLASSES).expect("fewer than 2^32 free blocks")
                    - CLASSES as u32
            }
        };
        self.list_push(i, class);
        self.by_start.insert(block.addr, NodeRef::of(i));
        self.by_end.insert(block.addr + block.size, NodeRef::of(i));
        if let Some(r) = &mut self.regions {
            r.regions.link(&mut r.links, i, block.addr, block.size);
        }
        self.bytes += block.size;
    }

    fn unlink(&mut self, i: u32) {
        let block = self.nodes[i as usize];
        self.by_start.remove(&block.addr);
        self.by_end.remove(&(block.addr + block.size));
        self.forget(i);
    }

    /// [`unlink`](Self::unlink) past the maps (which the caller has updated): node `i`
    /// leaves its class list and regions, its bytes leave the count, and it becomes
    /// spare.
    fn forget(&mut self, i: u32) {
        let block = self.nodes[i as usize];
        self.list_remove(i, block.class as usize);
        if let Some(r) = &mut self.regions {
            r.regions.unlink(&mut r.links, i, block.addr, block.size);
        }
        self.bytes -= block.size;
        self.spare.push(i);
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// `n` free blocks apart from each other (none merges), each starting a chunk.
    #[cfg(not(memres_loom))]
    fn holding(n: usize) -> FreeBlocks {
        let mut f = FreeBlocks::default();
        for i in 0..n {
            f.insert(block(0x10_0000 + i * 4 * GRANULE, GRANULE, true));
        }
        f
    }

    /// Empties `f` (its blocks taken out one by one, as an arena takes an idle list's
    /// superblocks) and gives its memory back.
    #[cfg(not(memres_loom))]
    fn emptied(mut f: FreeBlocks) {
        let starts: Vec<usize> = f.blocks().map(|b| b.addr).collect();
        for addr in starts {
            f.remove_starting_at(addr).unwrap();
        }
        f.release_memory();
    }

    /// An emptied list's index is kept for the next list made on the thread, ready (the
    /// next one takes it with its class table made), but only a small one (one that held
    /// many blocks would keep its large vectors with the thread), and a trim's
    /// `release_spares` frees what the thread keeps.
    #[cfg(not(memres_loom))]
    #[test]
    fn emptied_indexes_are_kept_for_the_next_list_only_while_small() {
        FreeBlocks::release_spares();
        emptied(holding(3));
        let kept = spare_tables::take().expect("a small emptied index is kept");
        assert_eq!(kept.lists.len(), CLASSES);
        assert!(kept.nodes.is_empty() && kept.by_start.len() == 0 && kept.bytes == 0);
        spare_tables::give(kept);
        // The next list takes it and works as a new one.
        let mut next = FreeBlocks::default();
        next.insert(block(0x20_0000, 4 * GRANULE, true));
        assert!(
            spare_tables::take().is_none(),
            "the next list took the kept index"
        );
        assert_eq!(next.take(GRANULE, GRANULE), Some(0x20_0000));

        emptied(holding(spare_tables::MOST_NODES + 1));
        assert!(
            spare_tables::take().is_none(),
            "a large emptied index is freed"
        );

        emptied(holding(2));
        FreeBlocks::release_spares();
        assert!(spare_tables::take().is_none(), "release_spares freed it");
    }

    fn block(addr: usize, size: usize, starts_chunk: bool) -> FreeBlock {
        FreeBlock {
            addr,
            size,
            starts_chunk,
        }
    }

    #[test]
    fn classes_are_monotonic_and_cover_sizes() {
        let mut last = 0;
        for units in 1..100_000 {
            let c = class_of(units);
            assert!(c >= last && c < CLASSES);
            last = c;
            // Every block of `class_at_least(u)` holds `u` granules.
            let at_least = class_at_least(units);
            assert!(at_least >= c);
            assert_eq!(class_at_least_from(units, c), at_least, "{units} granules");
            let lowest_of_next = (units..).find(|&u| class_of(u) >= at_least).unwrap();
            assert!(lowest_of_next >= units);
        }
        assert!(class_of(usize::MAX / GRANULE) < CLASSES);
        // Around every power of two, up to the largest size a request can have.
        for shift in 4..usize::BITS - GRANULE.trailing_zeros() {
            let p = 1usize << shift;
            for units in [p - 1, p, p + 1, p + (p >> 4), p + (p >> 4) + 1, p | (p - 1)] {
                let c = class_of(units);
                assert_eq!(class_at_least_from(units, c), class_at_least(units));
            }
        }
    }

    #[test]
    fn neighbours_merge_within_a_chunk_only() {
        let mut f = FreeBlocks::default();
        f.insert(block(0x1000, 256, true));
        f.insert(block(0x1200, 256, false));
        assert_eq!(f.len(), 2);
        f.insert(block(0x1100, 256, false));
        assert_eq!(f.blocks().collect::<Vec<_>>(), [block(0x1000, 768, true)]);
        // A chunk that happens to follow stays apart.
        f.insert(block(0x1300, 512, true));
        assert_eq!(f.len(), 2);
        assert_eq!(f.bytes(), 1280);
        assert_eq!(f.largest(), 768);
    }

    #[test]
    fn take_splits_and_aligns() {
        let mut f = FreeBlocks::default();
        f.insert(block(0x10100, 0x4000, true));
        let a = f.take(256, 0x1000).unwrap();
        assert_eq!(a, 0x11000);
        assert_eq!(f.len(), 2);
        assert_eq!(f.bytes(), 0x4000 - 256);
        assert_eq!(f.take(0x4000, GRANULE), None);
        f.insert(block(a, 256, false));
        assert_eq!(
            f.blocks().collect::<Vec<_>>(),
            [block(0x10100, 0x4000, true)]
        );
        assert_eq!(f.take(0x4000, GRANULE), Some(0x10100));
        assert_eq!(f.len(), 0);
    }

    #[test]
    fn finds_a_fit_in_any_class() {
        let mut f = FreeBlocks::default();
        let mut addr = 1 << 30;
        for units in [1, 3, 17, 100, 5000, 70_000] {
            f.insert(block(addr, units * GRANULE, true));
            addr += 1 << 26;
        }
        for want in [1, 2, 3, 4, 17, 18, 99, 100, 4000, 5000, 60_000, 70_000] {
            let mut g = FreeBlocks::default();
            for b in f.blocks() {
                g.insert(b);
            }
            let a = g.take(want * GRANULE, GRANULE).expect("a fit");
            assert_eq!(a % GRANULE, 0);
        }
        assert_eq!(f.take(70_001 * GRANULE, GRANULE), None);
        let drained = f.drain();
        assert_eq!(drained.len(), 6);
        assert_eq!(f.len(), 0);
        assert_eq!(f.bytes(), 0);
    }

    impl FreeBlocks {
        /// Checks the class lists against the blocks: every block sits in its class's
        /// list once, the links run both ways, and a class's (and its group's) bit is set
        /// exactly when its list holds a block.
        fn check_lists(&self) {
            let mut listed = 0;
            for class in 0..CLASSES {
                let in_use = self.classes_in_use[class / LINEAR] & (1 << (class % LINEAR)) != 0;
                if self.lists.is_empty() {
                    assert!(!in_use);
                    continue;
                }
                let mut at = self.lists[class].next;
                let mut prev = class as u32;
                let mut n = 0;
                while at != class as u32 {
                    assert_eq!(self.lists[at as usize].prev, prev, "class {class}");
                    let i = (at - CLASSES as u32) as usize;
                    assert_eq!(class_of(self.nodes[i].size / GRANULE), class);
                    assert_eq!(self.nodes[i].class as usize, class);
                    let (b, node) = (self.nodes[i], Some(&NodeRef::of(i as u32)));
                    assert_eq!(self.by_start.get(&b.addr), node);
                    assert_eq!(self.by_end.get(&(b.addr + b.size)), node);
                    (prev, at) = (at, self.lists[at as usize].next);
                    n += 1;
                }
                assert_eq!(
                    self.lists[class].prev, prev,
                    "class {class}: the last block"
                );
                assert_eq!(in_use, n > 0, "class {class}'s bit");
                listed += n;
            }
            for group in 0..GROUPS {
                let bit = self.groups_in_use & (1 << group) != 0;
                assert_eq!(bit, self.classes_in_use[group] != 0, "group {group}");
            }
            assert_eq!(listed, self.len());
            assert_eq!(self.by_end.len(), self.len());
        }
    }

    /// Runs `ops` (see `class_lists_stay_whole`) on `f`, checking the lists after each.
    fn run_ops(mut f: FreeBlocks, ops: Vec<(u8, usize, u32)>) -> Result<(), TestCaseError> {
        let base = 1usize << 32;
        let chunks = [
            (base, 4096 * GRANULE),
            (base + 4096 * GRANULE, 1024 * GRANULE),
        ];
        for &(addr, size) in &chunks {
            f.insert(block(addr, size, true));
        }
        let total: usize = chunks.iter().map(|c| c.1).sum();
        let mut taken: Vec<(usize, usize)> = Vec::new();
        for (op, units, align) in ops {
            match op {
                0..=3 => {
                    let size = units * GRANULE;
                    if let Some(addr) = f.take(size, GRANULE << align) {
                        prop_assert_eq!(addr % (GRANULE << align), 0);
                        for b in f.blocks() {
                            prop_assert!(addr + size <= b.addr || b.addr + b.size <= addr);
                        }
                        for &(t, n) in &taken {
                            prop_assert!(addr + size <= t || t + n <= addr);
                        }
                        taken.push((addr, size));
                    }
                }
                4..=6 => {
                    if !taken.is_empty() {
                        let (addr, size) = taken.swap_remove(units % taken.len());
                        let starts_chunk = chunks.iter().any(|c| c.0 == addr);
                        f.insert(block(addr, size, starts_chunk));
                    }
                }
                _ => {
                    let mut blocks = f.drain();
                    f.check_lists();
                    if units % 2 == 0 {
                        f.release_memory();
                    }
                    blocks.sort_unstable_by_key(|b| std::cmp::Reverse(b.addr));
                    for b in blocks {
                        f.insert(b);
                    }
                }
            }
            f.check_lists();
            let live: usize = taken.iter().map(|t| t.1).sum();
            prop_assert_eq!(f.bytes() + live, total);
        }
        for (addr, size) in taken {
            f.insert(block(addr, size, chunks.iter().any(|c| c.0 == addr)));
        }
        f.check_lists();
        // Everything free again: each chunk one block, never merged with the other.
        let mut all: Vec<_> = f.blocks().map(|b| (b.addr, b.size)).collect();
        all.sort_unstable();
        prop_assert_eq!(all, chunks.to_vec());
        Ok(())
    }

    fn ops() -> impl Strategy<Value = Vec<(u8, usize, u32)>> {
        proptest::collection::vec((0u8..8, 1usize..3000, 0u32..4), 1..400)
    }

    proptest! {
        /// Any sequence of takes, frees, drains and refills keeps the class lists whole
        /// and the blocks apart: what is taken overlaps neither what is free nor other
        /// taken blocks, and free plus taken bytes stay what the list started with.
        #[test]
        fn class_lists_stay_whole(ops in ops()) {
            run_ops(FreeBlocks::default(), ops)?;
        }

        /// The same for a list that places small requests by address region.
        #[test]
        fn class_lists_stay_whole_in_address_order(ops in ops()) {
            run_ops(FreeBlocks::address_ordered(1 << 32), ops)?;
        }
    }
}
