//! Per-thread caches ("magazines") of free blocks: a free pushes onto the calling
//! thread's magazine for (resource, stream) and an allocation pops from it, with no
//! atomic read-modify-write at all, no pin and no list lookup. Two kinds ([`Blocks`]),
//! each with a thread-local of its own: a `FixedSize`'s magazine holds blocks of its one
//! size and trades them with its stream's shared list in batches (when it runs empty or
//! overflows); a `Pool`'s ([`SmallBlocks`]) holds small blocks by size, up to as many
//! bytes as a stream's list caches, a miss going to the list and an overflow coalescing
//! there. Either gives everything back when its thread exits or when a reclaim asks for
//! it. A thread keeps at most [`SLOTS`] magazines of one kind, found in a table where
//! each (resource, stream) has four slots; a stream whose slots are taken has none, and
//! its calls go to its list (so a thread on thousands of streams finds out in four
//! compares, not a scan, that most have no magazine).
//!
//! Safety rests on one rule: a magazine's list and owner-state pointers are dereferenced
//! only (1) inside a call on the resource that owns them (the magazine is found by the
//! owner's id, unique for the life of the process, so the owner is alive and borrowed for
//! the call), or (2) at thread exit while holding the registry lock, after checking that
//! the owner is still registered; an owner leaves the registry (under that lock) before
//! it frees anything. Magazines of owners that are gone hold plain addresses that are
//! never handed out. A magazine's list pointer is dereferenced only while its blocks
//! have not been taken: a trim frees a list only after a reclaim has taken the blocks of
//! every magazine that points at it (see `StreamOrdered::retired` of `FixedSize` and of
//! the pools' `Coalescing`).
//!
//! **Reclaim.** A thread about to report out-of-memory may hold the owner's growth lock
//! and still find no free block while other threads' magazines hold some. It starts a
//! reclaim ([`Cache::reclaim`]): the owner's epoch turns odd, so that no thread keeps a
//! magazine of the owner (calls go straight to the lists) until the epoch turns even
//! again, when the owner next grows, when the trim (or a pool's `coalesce`) that
//! reclaimed returns, or after 65,536 calls without caches ([`Cache::resume`]); and the
//! reclaimer takes the blocks of every thread's magazines
//! itself, also from threads that never call the owner again (an idle thread's cache
//! would otherwise starve the others: issue 33, finding 8).
//!
//! **Taking another thread's blocks.** A magazine's blocks live in a [`Stash`], which the
//! owner also lists: a [`Takeable`] (`crate::sync::takeable`, where the protocol and its
//! own loom model are), which the magazine's thread uses with two plain stores and a load
//! on a line only it writes, and which the reclaimer marks on every listed stash, runs
//! the heavy fence once (Linux's `membarrier`), then takes, moving the blocks to their
//! stream's list. A magazine whose blocks were taken is dropped by its thread at its next
//! call. The models in `suballoc/loom_models.rs` check the reclaim through the thread
//! caches. Where the kernel has no `membarrier` (before Linux 4.14), the reclaimer instead
//! waits a short while for the threads to give their blocks back at their next call on
//! the owner (a thread that does not call again cannot answer).
//!
//! A magazine is made (and listed) under the list's lock only while the epoch is the one
//! it was read as, and a reclaim turns the epoch odd under the same lock: a magazine is
//! either listed before a reclaim takes the list's stashes, or never made.

use std::cell::RefCell;
use std::collections::HashSet;

use super::core::free_blocks::GRANULE;
use super::core::free_list::FreeList;
use super::core::list_table::List;
use super::core::stream_key::StreamKey;
use crate::sync::atomic::{AtomicU64, Ordering};
use crate::sync::lock;
use crate::sync::takeable::Takeable;
use crate::sync::{Arc, Mutex, barrier, grace};

// Owners alive now. Taken only when an owner comes or goes and when a thread exits.
// (Under loom, a lazy static, which each model execution builds afresh.)
#[cfg(not(memres_loom))]
static LIVE: Mutex<Option<HashSet<u64>>> = Mutex::new(None);
#[cfg(memres_loom)]
loom::lazy_static! {
    static ref LIVE: Mutex<Option<HashSet<u64>>> = Mutex::new(None);
}

/// Owner ids, never reused (they only need to be unique, so no model checks them).
static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// How long a reclaim waits for the threads holding magazines to answer (where it cannot
/// take their blocks itself).
#[cfg(not(memres_loom))]
const RECLAIM_WAIT: std::time::Duration = std::time::Duration::from_millis(2);

/// What the owner's threads read and write of it; boxed, so that its address (kept in
/// every magazine) survives the owner being moved.
#[derive(Debug)]
struct Shared<B: Blocks> {
    /// Even: caches work. Odd: a reclaim is under way. Turned odd only under
    /// `stashes`' lock.
    epoch: AtomicU64,
    /// The stashes of the owner's magazines on all threads.
    stashes: Mutex<Vec<Arc<Stash<B>>>>,
    /// Calls made while the caches are off (see [`CALLS_OFF`]).
    calls_off: AtomicU64,
}

/// Calls on an owner without caches after which they come back on.
pub(crate) const CALLS_OFF: u64 = 1 << 16;

/// A resource's identity for the caches, registered while it lives.
#[derive(Debug)]
pub(crate) struct Owner<B: Blocks> {
    id: u64,
    retired: bool,
    shared: Box<Shared<B>>,
}

impl<B: Blocks> Owner<B> {
    pub(crate) fn new() -> Owner<B> {
        // Registers the process for `membarrier` now, not inside a reclaim (where the
        // registration's wait would hold the growth lock).
        barrier::heavy_available();
        let id = NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut live = lock(&LIVE);
        live.get_or_insert_with(HashSet::new).insert(id);
        Owner {
            id,
            retired: false,
            shared: Box::new(Shared {
                epoch: AtomicU64::new(0),
                stashes: Mutex::new(Vec::new()),
                calls_off: AtomicU64::new(0),
            }),
        }
    }

    /// Leaves the registry: no thread's exit touches the owner's lists afterwards. The
    /// owner calls it first thing in its drop, before freeing anything.
    pub(crate) fn retire(&mut self) {
        if !self.retired {
            let mut live = lock(&LIVE);
            if let Some(live) = live.as_mut() {
                live.remove(&self.id);
            }
            self.retired = true;
        }
    }
}

impl<B: Blocks> Drop for Owner<B> {
    fn drop(&mut self) {
        self.retire();
    }
}

/// A magazine's blocks, where a reclaim can take them (see the module's "Taking another
/// thread's blocks" and [`Takeable`]).
struct Stash<B: Blocks> {
    blocks: Takeable<B>,
    /// The list the blocks go back to.
    list: *const List<B::Free>,
}

impl<B: Blocks> std::fmt::Debug for Stash<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stash")
            .field("blocks", &self.blocks)
            .field("list", &self.list)
            .finish()
    }
}

// SAFETY: `blocks` is a `Takeable` (Send and Sync); `list` is dereferenced only under
// the module's rules (1) and (2).
unsafe impl<B: Blocks> Send for Stash<B> {}
// SAFETY: as for `Send`.
unsafe impl<B: Blocks> Sync for Stash<B> {}

impl<B: Blocks> Stash<B> {
    /// Runs `f` on the blocks, as the magazine's thread; `None` if a reclaim took them.
    #[inline]
    fn with<R>(&self, f: impl FnOnce(&mut B) -> R) -> Option<R> {
        self.blocks.with(f)
    }
}

/// What one kind of resource keeps in its magazines: blocks of one size (`FixedSize`,
/// a vector of addresses) or small blocks by size (a `Pool`, [`SmallBlocks`]). Each
/// kind has a thread-local of its own for a thread's magazines.
pub(crate) trait Blocks: Default + Send + std::fmt::Debug + Sized + 'static {
    /// What a stream's list holds.
    type Free: Send + 'static;
    /// The calling thread's magazines of this kind.
    fn magazines() -> &'static LocalKey<RefCell<Magazines<Self>>>;
    /// Moves every block into `list` (locking it), leaving the magazine empty (its
    /// buffers kept).
    fn put_back(&mut self, list: &List<Self::Free>);
    /// Whether the magazine holds no block.
    fn is_empty(&self) -> bool;
}

impl Blocks for Vec<usize> {
    type Free = Vec<usize>;

    fn magazines() -> &'static LocalKey<RefCell<Magazines<Self>>> {
        &FIXED_MAGAZINES
    }

    fn put_back(&mut self, list: &List<Vec<usize>>) {
        put_back(list, self.drain(..));
    }

    fn is_empty(&self) -> bool {
        Vec::is_empty(self)
    }
}

/// A pool's magazine: recently freed small blocks (up to [`QUICK_UNITS`](super::core::free_list::QUICK_UNITS) granules, 64
/// KiB) by size, handed out again whole to a request of the same size, as the small
/// blocks' cache of a stream's list ([`FreeList`]) does, but without the list's lock.
#[derive(Debug, Default)]
pub(crate) struct SmallBlocks {
    /// Entry `i` holds blocks of `i + 1` granules, newest last; as many entries as the
    /// largest size held so far needs (none, and no heap, until the first block).
    bins: Vec<Vec<usize>>,
    /// Bytes of the blocks held.
    bytes: usize,
}

impl SmallBlocks {
    /// A block of `units` granules, if one is held.
    #[inline(always)]
    fn pop(&mut self, units: usize) -> Option<usize> {
        let addr = self.bins.get_mut(units.wrapping_sub(1))?.pop()?;
        self.bytes -= units * GRANULE;
        Some(addr)
    }

    /// Keeps the block at `addr` of `units` granules (1 to [`QUICK_UNITS`](super::core::free_list::QUICK_UNITS)) unless that
    /// would take the bytes held past `capacity`.
    #[inline(always)]
    fn push(&mut self, addr: usize, units: usize, capacity: usize) -> bool {
        let size = units * GRANULE;
        if self.bytes + size > capacity {
            return false;
        }
        if self.bins.len() < units {
            // Only as many bins as the sizes freed so far need (a thread's magazines of
            // a stream it used once for a 4 KiB block cost 16 bins, not 256).
            self.bins.resize_with(units, Vec::new);
        }
        self.bins[units - 1].push(addr);
        self.bytes += size;
        true
    }

    /// Bytes of the blocks held.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    /// How many blocks are held.
    pub(crate) fn len(&self) -> usize {
        self.bins.iter().map(Vec::len).sum()
    }

    /// The largest block held (0 if none).
    pub(crate) fn largest(&self) -> usize {
        self.bins
            .iter()
            .rposition(|bin| !bin.is_empty())
            .map_or(0, |at| (at + 1) * GRANULE)
    }
}

impl Blocks for SmallBlocks {
    type Free = FreeList;

    fn magazines() -> &'static LocalKey<RefCell<Magazines<Self>>> {
        &POOL_MAGAZINES
    }

    /// Into the list's own small blocks' cache where it has room (where they would have
    /// been without the thread's cache), else coalesced; the list then marked as holding
    /// free memory.
    fn put_back(&mut self, list: &List<FreeList>) {
        if self.bytes == 0 {
            return;
        }
        let mut free = list.state.lock();
        for (at, bin) in self.bins.iter_mut().enumerate() {
            for addr in bin.drain(..) {
                free.put(addr, (at + 1) * GRANULE);
            }
        }
        self.bytes = 0;
        list.holds_free.store(true, Ordering::Relaxed);
    }

    fn is_empty(&self) -> bool {
        self.bytes == 0
    }
}

/// Puts blocks back in a stream's list, with its mark of blocks to spare (see
/// [`List::mark_spare`]).
fn put_back(list: &List<Vec<usize>>, blocks: impl IntoIterator<Item = usize>) {
    let mut held = list.state.lock();
    held.extend(blocks);
    list.mark_spare(held.len());
}

struct Magazine<B: Blocks> {
    owner: u64,
    key: StreamKey,
    /// The owner's epoch when the magazine was made: another one means "give back".
    epoch: u64,
    stash: Arc<Stash<B>>,
    shared: *const Shared<B>,
}

impl<B: Blocks> Magazine<B> {
    /// Gives the blocks back to their list (unless a reclaim took them) and leaves the
    /// owner's list of stashes. Returns the list the blocks went to, or `None` if a
    /// reclaim had taken them (the list may then be gone: a trim retires lists only after
    /// a reclaim has taken every stash that points at them).
    ///
    /// # Safety
    /// The owner is alive until this returns (rule (1) or (2) of the module).
    unsafe fn give_back(self) -> Option<*const List<B::Free>> {
        let gave = self.stash.with(|blocks| {
            // SAFETY: the caller's promise; the blocks were not taken, so the list is not
            // freed yet: a trim frees a list only after its reclaim has taken every stash
            // pointing at it, and that take waits for this `with` to end.
            let list = unsafe { &*self.stash.list };
            blocks.put_back(list);
        });
        // SAFETY: as above; `shared` is the owner's boxed state.
        let shared = unsafe { &*self.shared };
        lock(&shared.stashes).retain(|s| !Arc::ptr_eq(s, &self.stash));
        gave.map(|()| self.stash.list)
    }
}

/// Slots of a thread's table of magazines of one kind (a power of two): the most
/// magazines the thread keeps of that kind, over all owners.
const SLOTS: usize = 64;
/// Slots each (owner, stream) may use: a group of this many neighbours.
const WAYS: usize = 4;
/// Calls that found their slots taken by other owners' magazines between two looks
/// for magazines of owners that are gone (which take the registry's lock).
const PRUNE_EVERY: u16 = 256;

/// A thread's magazines of one kind, found through a table of [`SLOTS`] slots, [`WAYS`]
/// candidates for each (owner, stream): a lookup is a few loads and compares however
/// many streams the thread uses, and a stream whose slots are all taken has no magazine (its
/// calls go to its list), so a thread on thousands of streams keeps magazines for a few
/// and finds out in a step that the others have none (a scan of the thread's magazines
/// at every such call made a pool's pair on 16,384 streams cost 1.3-2x; issue 33,
/// finding 3, and issue 51).
pub(crate) struct Magazines<B: Blocks> {
    /// For each slot, the (owner, stream) of its magazine, (0, _) if none (owner ids
    /// start at 1): 16 bytes each, so that the slots a lookup reads (a group of [`WAYS`])
    /// are one cache line, and a lookup that finds none reads nothing else.
    tags: Tags,
    /// For each slot with a magazine, its index in `list`.
    index: [u8; SLOTS],
    list: Vec<Magazine<B>>,
    /// Calls left before the next look for magazines of owners that are gone.
    prune_in: u16,
}

/// The slots' tags, a group of [`WAYS`] to a cache line.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Tags([(u64, u64); SLOTS]);

impl<B: Blocks> Magazines<B> {
    const fn new() -> Magazines<B> {
        Magazines {
            tags: Tags([(0, 0); SLOTS]),
            index: [0; SLOTS],
            list: Vec::new(),
            prune_in: 0,
        }
    }

    /// The slots of (owner, key), first choice first: the key's hash, whose multiply
    /// does not wait for the owner (a `Binning` finds its bin, and so the owner, by loads
    /// that the key does not need), the owner's id mixed in with one `xor`, and its
    /// group's other slots. Owners made together (a `Binning`'s bins) have consecutive
    /// ids, so on one stream up to [`SLOTS`] of them never share a first choice.
    #[inline(always)]
    fn ways(owner: u64, key: StreamKey) -> [usize; WAYS] {
        let stream = key.hash() >> (u64::BITS - SLOTS.trailing_zeros());
        let first = (stream ^ owner) as usize % SLOTS;
        std::array::from_fn(|i| first ^ i)
    }

    /// The slot of the magazine of (owner, key), if the thread has one.
    #[inline(always)]
    fn slot_of(&self, owner: u64, key: StreamKey) -> Option<usize> {
        let tag = (owner, key.raw());
        Self::ways(owner, key)
            .into_iter()
            .find(|&slot| self.tags.0[slot] == tag)
    }

    /// The index of the magazine of (owner, key), if the thread has one.
    #[inline(always)]
    fn find(&self, owner: u64, key: StreamKey) -> Option<usize> {
        self.slot_of(owner, key)
            .map(|slot| usize::from(self.index[slot]))
    }

    /// A free slot of (owner, key)'s.
    #[inline(always)]
    fn free_way(&self, owner: u64, key: StreamKey) -> Option<usize> {
        Self::ways(owner, key)
            .into_iter()
            .find(|&slot| self.tags.0[slot].0 == 0)
    }

    /// Whether a slot of (owner, key)'s holds another owner's magazine.
    #[inline(always)]
    fn shares_ways_with_others(&self, owner: u64, key: StreamKey) -> bool {
        Self::ways(owner, key).into_iter().any(|slot| {
            let other = self.tags.0[slot].0;
            other != 0 && other != owner
        })
    }

    /// Adds `m` in `slot` (free, one of its own).
    fn insert(&mut self, slot: usize, m: Magazine<B>) -> &mut Magazine<B> {
        debug_assert_eq!(self.tags.0[slot].0, 0);
        self.tags.0[slot] = (m.owner, m.key.raw());
        // (At most `SLOTS` magazines, one per slot: the index fits a byte.)
        self.index[slot] = self.list.len() as u8;
        self.list.push(m);
        let last = self.list.len() - 1;
        &mut self.list[last]
    }

    /// Takes the magazine at index `at` out of the table.
    fn remove(&mut self, at: usize) -> Magazine<B> {
        let m = self.list.swap_remove(at);
        if let Some(slot) = self.slot_of(m.owner, m.key) {
            self.tags.0[slot] = (0, 0);
        }
        if let Some(moved) = self.list.get(at)
            && let Some(slot) = self.slot_of(moved.owner, moved.key)
        {
            self.index[slot] = at as u8;
        }
        m
    }

    /// Gives back every magazine of `owner` on this thread.
    ///
    /// # Safety
    /// Inside a call on the owner (rule (1) of the module).
    unsafe fn give_back(&mut self, owner: u64) -> Vec<*const List<B::Free>> {
        let mut lists = Vec::new();
        let mut i = 0;
        while i < self.list.len() {
            if self.list[i].owner == owner {
                let m = self.remove(i);
                // SAFETY: the caller's promise.
                lists.extend(unsafe { m.give_back() });
            } else {
                i += 1;
            }
        }
        lists
    }

    /// Drops the magazines of owners that are gone (their blocks are only addresses).
    fn prune(&mut self) {
        let live = lock(&LIVE);
        let mut i = 0;
        while i < self.list.len() {
            if live
                .as_ref()
                .is_some_and(|l| l.contains(&self.list[i].owner))
            {
                i += 1;
            } else {
                drop(self.remove(i));
            }
        }
    }
}

impl<B: Blocks> Drop for Magazines<B> {
    fn drop(&mut self) {
        if self.list.is_empty() {
            return;
        }
        let live = lock(&LIVE);
        for m in self.list.drain(..) {
            if live.as_ref().is_some_and(|l| l.contains(&m.owner)) {
                // SAFETY: the owner is registered and the registry is locked, so it has
                // not begun to drop (it retires first) and cannot until we unlock.
                let _ = unsafe { m.give_back() };
            }
        }
    }
}

#[cfg(not(memres_loom))]
type LocalKey<T> = std::thread::LocalKey<T>;
#[cfg(memres_loom)]
type LocalKey<T> = loom::thread::LocalKey<T>;

#[cfg(not(memres_loom))]
thread_local! {
    static FIXED_MAGAZINES: RefCell<Magazines<Vec<usize>>> = const { RefCell::new(Magazines::new()) };
    static POOL_MAGAZINES: RefCell<Magazines<SmallBlocks>> = const { RefCell::new(Magazines::new()) };
}

#[cfg(memres_loom)]
loom::thread_local! {
    static FIXED_MAGAZINES: RefCell<Magazines<Vec<usize>>> = RefCell::new(Magazines::new());
    static POOL_MAGAZINES: RefCell<Magazines<SmallBlocks>> = RefCell::new(Magazines::new());
}

/// What a thread's exit does to its magazines, called by a loom model's thread as its
/// last act: loom's `join` returns before a thread's thread-locals are dropped, and its
/// lazy statics (the registry) are gone when the model's main thread ends, so a model
/// cannot leave the drop to the thread's exit.
#[cfg(all(test, memres_loom))]
pub(crate) fn exit_thread() {
    fn exit<B: Blocks>() {
        // The whole table, its slots too (a later model on the thread starts empty).
        let old =
            B::magazines().with(|m| std::mem::replace(&mut *m.borrow_mut(), Magazines::new()));
        drop(old);
    }
    exit::<Vec<usize>>();
    exit::<SmallBlocks>();
}

/// The calling thread's magazines for one resource, within one call on it.
pub(crate) struct Cache<'a, B: Blocks> {
    pub(crate) owner: &'a Owner<B>,
    /// The grace domain of the owner's lists (pinned in while a magazine is made).
    pub(crate) domain: &'a grace::Domain,
    /// Most blocks (a `FixedSize`'s) or bytes (a pool's) one magazine holds.
    pub(crate) capacity: usize,
}

impl<'a, B: Blocks> Cache<'a, B> {
    /// Runs `f` on this thread's magazines, if the thread still has them (not during its
    /// exit) and `f` returns something.
    #[inline]
    fn with<R>(&self, f: impl FnOnce(&mut Magazines<B>) -> Option<R>) -> Option<R> {
        B::magazines()
            .try_with(|m| f(&mut *m.try_borrow_mut().ok()?))
            .ok()
            .flatten()
    }

    /// The magazine of (owner, key) on this thread, made if `make`, no reclaim is under
    /// way and one of its slots is free; a stale one (made before a reclaim began) is
    /// given back first, with every other magazine of the owner on this thread.
    #[inline(always)]
    fn magazine<'m, 's>(
        &self,
        mags: &'m mut Magazines<B>,
        key: StreamKey,
        make: Option<&dyn Fn() -> &'s List<B::Free>>,
    ) -> Option<&'m mut Magazine<B>> {
        let id = self.owner.id;
        match mags.find(id, key) {
            Some(at) => {
                let epoch = self.owner.shared.epoch.load(Ordering::Relaxed);
                if mags.list[at].epoch == epoch {
                    Some(&mut mags.list[at])
                } else {
                    self.magazine_slow(mags, key, make)
                }
            }
            None => {
                let make = make?;
                // Every slot taken by the owner's magazines of other streams: none for
                // this one (the common answer on a thread that uses many streams, from
                // the one line of slots the lookup read).
                if mags.free_way(id, key).is_none() && !mags.shares_ways_with_others(id, key) {
                    return None;
                }
                self.magazine_slow(mags, key, Some(make))
            }
        }
    }

    /// [`magazine`](Self::magazine) where no current magazine was found: a stale one
    /// given back, or a new one made.
    // long: the outcomes of one pass, in order, each using what it found.
    #[cold]
    #[inline(never)]
    fn magazine_slow<'m, 's>(
        &self,
        mags: &'m mut Magazines<B>,
        key: StreamKey,
        make: Option<&dyn Fn() -> &'s List<B::Free>>,
    ) -> Option<&'m mut Magazine<B>> {
        let shared = &*self.owner.shared;
        let mut epoch = shared.epoch.load(Ordering::Relaxed);
        let id = self.owner.id;
        if mags.find(id, key).is_none() && mags.free_way(id, key).is_none() {
            // Every slot taken: no magazine for this stream (the first call's answer
            // for every later one, in a few compares), unless one of them holds a gone
            // owner's magazine (looked for now and then: the look takes the registry's
            // lock).
            if !mags.shares_ways_with_others(id, key) {
                return None;
            }
            if mags.prune_in > 0 {
                mags.prune_in -= 1;
                return None;
            }
            mags.prune_in = PRUNE_EVERY;
            mags.prune();
            mags.free_way(id, key)?;
        }
        // The owner's magazines on a thread are given back together, so they always
        // share one epoch: a stale one here means all of them (a thread answers a
        // reclaim at its next call on a stream it keeps a magazine for, or that makes
        // one).
        if mags.list.iter().any(|m| m.owner == id && m.epoch != epoch) {
            // SAFETY: inside a call on the owner (rule (1)).
            unsafe { mags.give_back(id) };
        }
        let make = make?;
        if epoch % 2 == 1 {
            // Caches off: after enough calls without them, they come back (a resource at
            // a hard limit never grows again); if memory is still short, the next
            // failure reclaims again.
            if shared.calls_off.fetch_add(1, Ordering::Relaxed) + 1 < CALLS_OFF {
                return None;
            }
            self.resume();
            epoch = shared.epoch.load(Ordering::Relaxed);
            if epoch % 2 == 1 {
                return None;
            }
        }
        let slot = mags.free_way(id, key)?;
        // Pinned from the lookup until the magazine is listed: a magazine of a list that
        // a trim retires is then listed before the trim's first grace period ends, and
        // the reclaim the trim runs after it takes the magazine's blocks (see the
        // owners' `StreamOrdered::retired`). (`make` is a lookup: no retired list comes
        // from one after that grace period.)
        let _pin = grace::pin(self.domain);
        let stash = Arc::new(Stash {
            blocks: Takeable::new(B::default()),
            list: make(),
        });
        {
            // Listed while the epoch is still the one read: else a reclaim has begun (and
            // may have taken the list's stashes already), and no magazine is made.
            let mut stashes = lock(&shared.stashes);
            if shared.epoch.load(Ordering::Relaxed) != epoch {
                return None;
            }
            stashes.push(Arc::clone(&stash));
        }
        Some(mags.insert(
            slot,
            Magazine {
                owner: id,
                key,
                epoch,
                stash,
                shared,
            },
        ))
    }

    /// Moves the blocks of the owner's magazines on this thread into their lists, the
    /// magazines kept (a thread on more streams than it keeps magazines for, whose lists
    /// run dry in turn, would otherwise make them anew after every miss); returns the
    /// lists that received blocks (as [`flush`](Self::flush)).
    pub(crate) fn put_back_all(&self) -> Vec<*const List<B::Free>> {
        self.with(|mags| {
            let mut lists = Vec::new();
            for m in mags.list.iter().filter(|m| m.owner == self.owner.id) {
                m.stash.with(|blocks| {
                    if !blocks.is_empty() {
                        // SAFETY: the owner is alive (found by its id: rule (1)), the blocks
                        // not taken (inside `with`), so the list is not freed (see the module).
                        blocks.put_back(unsafe { &*m.stash.list });
                        lists.push(m.stash.list);
                    }
                });
            }
            Some(lists)
        })
        .unwrap_or_default()
    }

    /// Gives every block of the owner's magazines on this thread back to their lists, and
    /// returns those lists (the owner's lists; one a trim retires is freed
    /// only after every call pinned when it left the tables has returned, so a caller
    /// pinned before this call may use them until it unpins).
    pub(crate) fn flush(&self) -> Vec<*const List<B::Free>> {
        self.with(|mags| {
            // SAFETY: inside a call on the owner (rule (1)).
            Some(unsafe { mags.give_back(self.owner.id) })
        })
        .unwrap_or_default()
    }

    /// Takes the blocks of the owner's magazines on every thread back to their lists
    /// (this thread's given back, the others' taken: see the module's docs) and turns the
    /// caches off until [`resume`](Self::resume). The caller then takes blocks from the
    /// lists; it holds the owner's growth lock, so reclaims do not overlap (a resume may:
    /// a thread past its count of calls without caches turns them back on, which can
    /// only make a later allocation find fewer blocks in the lists). True if no
    /// magazine is left. Without `membarrier` other threads give their blocks
    /// back at their next call on the owner: the first such reclaim waits a short while
    /// for them, later ones (while the caches are still off) do not wait again.
    pub(crate) fn reclaim(&self) -> bool {
        self.flush();
        let shared = &*self.owner.shared;
        let waits = {
            let mut stashes = lock(&shared.stashes);
            if stashes.is_empty() {
                // No other thread has a magazine: nothing to take or turn off.
                return true;
            }
            let was_on = shared.epoch.load(Ordering::Relaxed).is_multiple_of(2);
            if was_on {
                shared.calls_off.store(0, Ordering::Relaxed);
                shared.epoch.fetch_add(1, Ordering::Relaxed);
            }
            if barrier::heavy_available() {
                for stash in stashes.iter() {
                    stash.blocks.mark_taken();
                }
                barrier::heavy();
                for stash in stashes.drain(..) {
                    // SAFETY: marked above, before the heavy fence; the stashes list is
                    // locked, and a stash leaves it as it is taken, so no other reclaim
                    // takes it.
                    let mut blocks = unsafe { stash.blocks.take() };
                    // SAFETY: a listed stash's list is not freed (a retirement empties
                    // this list, under this lock, first) and the owner is alive (rule 1).
                    let list = unsafe { &*stash.list };
                    blocks.put_back(list);
                }
                return true;
            }
            was_on
        };
        if !waits {
            return lock(&shared.stashes).is_empty();
        }
        #[cfg(not(memres_loom))]
        let deadline = std::time::Instant::now() + RECLAIM_WAIT;
        loop {
            if lock(&shared.stashes).is_empty() {
                return true;
            }
            #[cfg(not(memres_loom))]
            if std::time::Instant::now() >= deadline {
                return false;
            }
            crate::sync::yield_now();
        }
    }

    /// Whether the caches are on (no [`reclaim`](Self::reclaim) has turned them off
    /// since the last [`resume`](Self::resume)).
    pub(crate) fn on(&self) -> bool {
        self.owner
            .shared
            .epoch
            .load(Ordering::Relaxed)
            .is_multiple_of(2)
    }

    /// Turns the caches back on after a [`reclaim`](Self::reclaim): when the owner has
    /// grown (memory is no longer short), after a trim's reclaims (`FixedSize::trim`, `Pool::trim`),
    /// or after [`CALLS_OFF`] calls without caches.
    pub(crate) fn resume(&self) {
        let shared = &*self.owner.shared;
        let epoch = shared.epoch.load(Ordering::Relaxed);
        if epoch % 2 == 1 {
            shared.calls_off.store(0, Ordering::Relaxed);
            // Only from this odd epoch: a concurrent resume or reclaim wins instead.
            let _ = shared.epoch.compare_exchange(
                epoch,
                epoch + 1,
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
        }
    }

    /// Runs `f` (which reclaims, turning the caches off), then turns the caches back on
    /// if they were on before it, unless an out-of-memory had turned them off already
    /// (a trim's reclaim is not memory being short: `FixedSize::trim` once left them off
    /// for up to [`CALLS_OFF`] calls after it; issue 49).
    pub(crate) fn resume_after<T>(&self, f: impl FnOnce() -> T) -> T {
        let were_on = self.on();
        let done = f();
        if were_on {
            self.resume();
        }
        done
    }

    /// Magazines of the owner on all threads (for the loom models).
    #[cfg(all(test, memres_loom))]
    pub(crate) fn magazines(&self) -> usize {
        lock(&self.owner.shared.stashes).len()
    }

    /// `f` folded over the blocks of the owner's magazines on this thread, from `init`.
    pub(crate) fn fold_here<T: Copy>(&self, init: T, f: impl Fn(T, &B) -> T) -> T {
        self.with(|mags| {
            Some(
                mags.list
                    .iter()
                    .filter(|m| m.owner == self.owner.id)
                    .fold(init, |acc, m| {
                        m.stash.with(|blocks| f(acc, blocks)).unwrap_or(acc)
                    }),
            )
        })
        .unwrap_or(init)
    }

    /// Blocks of the owner in this thread's magazines (of a `FixedSize`: its blocks).
    pub(crate) fn cached_here(&self, count: impl Fn(&B) -> usize) -> usize {
        self.fold_here(0, |n, blocks| n + count(blocks))
    }
}

/// A `FixedSize`'s magazines: blocks of one size.
impl Cache<'_, Vec<usize>> {
    /// A block from the thread's magazine, if it has one.
    #[inline]
    pub(crate) fn pop(&self, key: StreamKey) -> Option<usize> {
        self.with(|mags| self.magazine(mags, key, None)?.stash.with(Vec::pop)?)
    }

    /// Puts a freed block in the thread's magazine; when the magazine overflows, half of
    /// it goes to the stream's list. Returns the block if there is no magazine to take it
    /// (the thread is exiting, or a reclaim is under way).
    ///
    /// # Safety
    /// `list` returns the owner's list for `key` (a new magazine keeps a pointer to it,
    /// which later calls on the owner dereference).
    #[inline]
    pub(crate) unsafe fn push<'s>(
        &self,
        key: StreamKey,
        list: impl Fn() -> &'s List<Vec<usize>>,
        addr: usize,
    ) -> Option<usize> {
        let capacity = self.capacity;
        let done = self.with(|mags| {
            let stash = &*self.magazine(mags, key, Some(&list))?.stash;
            stash.with(|blocks| {
                if blocks.len() >= capacity {
                    // SAFETY: the magazine (found by the owner's id) points at the owner's
                    // list (`magazine` made it so), alive during this call on the owner.
                    let list = unsafe { &*stash.list }; // (rule (1) of the module)
                    let keep = capacity / 2;
                    put_back(list, blocks.drain(keep..));
                }
                blocks.push(addr);
            })
        });
        match done {
            Some(()) => None,
            None => Some(addr),
        }
    }

    /// Takes a block from `list`'s list and moves up to half a magazine more into the
    /// thread's magazine, under one lock; `None` if the list is empty.
    ///
    /// # Safety
    /// `list` is the owner's list for `key`, as for [`push`](Self::push).
    #[inline]
    pub(crate) unsafe fn refill(&self, key: StreamKey, list: &List<Vec<usize>>) -> Option<usize> {
        let more = (self.capacity / 2).saturating_sub(1);
        let mut got = None;
        let refilled = self.with(|mags| {
            let m = self.magazine(mags, key, Some(&|| list))?;
            m.stash.with(|blocks| {
                let mut from = list.state.lock();
                got = from.pop();
                if got.is_some() {
                    let n = more.min(from.len());
                    let start = from.len() - n;
                    blocks.extend(from.drain(start..));
                }
            })
        });
        match refilled {
            Some(()) => got,
            // No magazine (the thread is exiting, or a reclaim is under way or took this
            // one's blocks): straight from the list.
            None => list.state.lock().pop(),
        }
    }
}

/// Where [`Cache::push_small`] put a freed block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pushed {
    /// In the thread's magazine.
    Kept,
    /// Nowhere: the magazine is full (the caller coalesces the block into the list, as a
    /// list whose small blocks' cache is full does).
    Full,
    /// Nowhere: the thread has no magazine for it (the thread is exiting, a reclaim is
    /// under way, or the thread is on more streams than it keeps magazines for).
    Elsewhere,
}

/// What [`Cache::pop_small`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Popped {
    /// A block of the size asked for.
    Block(usize),
    /// None of that size: the thread's magazine for the stream may hold others (which
    /// the slow path puts back into the list, [`Cache::put_back_here`]).
    Missed,
    /// The thread has no magazine for the stream (or a reclaim took its blocks): no
    /// block of the thread's for the stream to put back.
    Nothing,
}

/// A pool's magazines: small blocks by size (a magazine holds up to `capacity` bytes).
impl<'a> Cache<'a, SmallBlocks> {
    /// The calling thread's caches of `owner`'s small blocks (whose lists are in
    /// `domain`): per stream, up to as many bytes as a stream's list caches
    /// ([`QUICK_BYTES`](super::core::free_list::QUICK_BYTES)).
    #[inline(always)]
    pub(crate) fn small_blocks(owner: &'a Owner<SmallBlocks>, domain: &'a grace::Domain) -> Self {
        Cache {
            owner,
            domain,
            capacity: super::core::free_list::QUICK_BYTES,
        }
    }

    /// Moves the blocks of the thread's magazine for `key` (if any) into its list, the
    /// magazine kept.
    pub(crate) fn put_back_here(&self, key: StreamKey) {
        self.with(|mags| {
            let m = self.magazine(mags, key, None)?;
            m.stash.with(|blocks| {
                // SAFETY: the owner is alive (found by its id: rule (1)), the blocks not
                // taken (inside `with`), so the list is not freed (see the module).
                blocks.put_back(unsafe { &*m.stash.list });
            })
        });
    }

    /// A block of `units` granules from the thread's magazine for `key`, if it has one.
    #[inline]
    pub(crate) fn pop_small(&self, key: StreamKey, units: usize) -> Popped {
        self.with(|mags| {
            let popped = self
                .magazine(mags, key, None)?
                .stash
                .with(|blocks| blocks.pop(units))?;
            Some(popped.map_or(Popped::Missed, Popped::Block))
        })
        .unwrap_or(Popped::Nothing)
    }

    /// Keeps a freed block of `units` granules (1 to [`QUICK_UNITS`](super::core::free_list::QUICK_UNITS)) in the thread's
    /// magazine for `key`, made if need be.
    ///
    /// # Safety
    /// `list` returns the owner's list for `key` (a new magazine keeps a pointer to it,
    /// which later calls on the owner dereference).
    #[inline]
    pub(crate) unsafe fn push_small<'s>(
        &self,
        key: StreamKey,
        list: impl Fn() -> &'s List<FreeList>,
        addr: usize,
        units: usize,
    ) -> Pushed {
        let capacity = self.capacity;
        self.with(|mags| {
            let stash = &*self.magazine(mags, key, Some(&list))?.stash;
            stash.with(|blocks| {
                if blocks.push(addr, units, capacity) {
                    Pushed::Kept
                } else {
                    Pushed::Full
                }
            })
        })
        .unwrap_or(Pushed::Elsewhere)
    }
}
