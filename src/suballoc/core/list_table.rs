//! The list table: each stream's free list (a [`List`]; with lanes, each of a stream's
//! lists), found by its [`StreamKey`] without taking a lock.
//!
//! Every stream a sub-allocator sees gets one list: its free memory behind its own lock.
//! Threads on different streams therefore never wait for each other on the allocation
//! path. The map from stream to list is an insert-only open-addressing table of slots, each
//! a stream's key beside an atomic pointer to its list, at most half full: lookups are
//! lock-free (acquire loads), O(1) however many streams there are, and read no list but
//! the one they return; insertions are serialised by a mutex and publish a fully built
//! list with a release store. When the table would be more than half full, a table of
//! twice the size is filled and published in its place; old tables stay allocated until
//! the table drops (a reader may still be probing one; together they are smaller than the
//! current one), and a reader that misses a list in an old table finds it under the
//! insertion lock. Lists live until the table drops, or until [`ListTable::retire`] frees
//! the idle ones of an owner whose readers pin their threads ([`grace`]).
//!
//! The per-thread default stream has one list per thread. Threads are numbered
//! (`crate::sync::threads`), and the number of a thread that has exited goes to the next
//! new thread, so the lists of a program that starts and ends many threads stay as many
//! as it runs at once. A thread that takes over a list first waits for the device work of the exited thread (whose
//! per-thread stream was another stream), so the blocks it finds there are free.

use std::ptr;

use crate::device::Context;
use crate::driver;
use crate::error::Error;
use crate::sync::CachePadded;
use crate::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use crate::sync::grace;
use crate::sync::spin::SpinLock;
use crate::sync::threads::this_thread;
use crate::sync::{Mutex, lock};

use super::stream_key::{LANES, StreamKey};

/// Slots of a new map's table, a power of two. (Few under loom, where every slot read is
/// a step to explore; the models then also cover the table's growth.)
const FIRST_SLOTS: usize = if cfg!(memres_loom) { 2 } else { 64 };

/// One stream's state, on cache lines of its own: the lists of threads sharing a stream
/// (lanes) are written by those threads at once, and lists are allocated one by one,
/// so two could otherwise share the line where one ends and the next begins (128 bytes:
/// the unit the adjacent-line prefetcher fetches).
///
/// Laid out in two parts (`repr(C)`): first what other threads read (the key and the
/// hints that searches through every list look at), then, on lines of its own
/// ([`CachePadded`]), the lock and the state that the list's own users write on every
/// allocation and free (the lock's flag first, then a pool's cache of small blocks,
/// `FreeList`). A lookup compares the key in the table's slot, not this one (see
/// `Slot`), so a cold list costs its user's allocation one miss of the list, the
/// state's line (a free also reads the `holds_free` hint; an arena's allocation reads
/// the first line too, for its `idle` hint, which spares the lock of a list found
/// empty). Putting the key and the state on one line instead saved a miss with thousands
/// of streams (issue 49), but every search through the lists then read a line that each
/// list's owner wrote at every call: 16 threads on one stream (lanes) went from 7.0 to
/// 46.7 ns a call on the H100 (`random-1stream`, 2026-11-27).
#[repr(C, align(128))]
pub(crate) struct List<S> {
    pub(crate) key: StreamKey,
    /// A hint for searches through other streams' lists: set (under the state's lock)
    /// when memory is freed into the list, cleared (under the lock) by a search that
    /// finds the list empty. Searches skip lists whose hint is clear, so a pool with
    /// thousands of streams does not lock each one on its slow path.
    pub(crate) holds_free: AtomicBool,
    /// Whether the list is on its owner's stack of lists with blocks to spare (a
    /// `FixedSize`'s donors; unused elsewhere).
    pub(crate) in_donors: AtomicBool,
    /// Set (once) the first time the list's own stream finds no block in it, for a virtual
    /// pool's host streams (the only lists it is read for): its stream allocates. A host
    /// stream's list without it has only been freed into (the freeing side of a hand-off
    /// between streams), and a host stream that misses merges it whole rather than take one
    /// block of it (issue 51, item 5). A hint: read and written relaxed.
    pub(crate) allocates: AtomicBool,
    /// An arena's hint that the list is empty: set (under the state's lock) when the
    /// arena takes an idle stream's superblock back and the list is left with nothing
    /// (`Arena::take_idle_superblocks`), cleared (under the lock) by a free into it and on
    /// entry to its stream's slow path, whatever that finds. While set, the list's own
    /// allocations that its thread caches do not serve go straight to the slow path
    /// without taking the list's lock to find it empty (issue 51 item 4: with thousands of
    /// streams in turn, each pair found its list so, and a lock is about 6 ns of a pair's
    /// 114 on the VM). Only a hint: memory that comes in without clearing it (a thread
    /// cache's blocks put back, a trim's merge, a put-back after a failed wait) costs one
    /// slow path, which finds it. Unused elsewhere.
    pub(crate) idle: AtomicBool,
    /// Set when [`ListTable::retire`] takes the list out of the table: from then on no
    /// place that outlives a call (`recent`, a `FixedSize`'s donors and thread caches)
    /// takes it in.
    retired: AtomicBool,
    /// For a per-thread list: the generation of the thread that uses it now.
    owner: AtomicU64,
    /// For CUDA streams, the context whose synchronisation completes the stream's work
    /// (the stream's own device's; `None` without a driver, where no GPU work can be
    /// pending).
    pub(crate) ctx: Option<Context>,
    pub(crate) state: CachePadded<SpinLock<S>>,
}

impl<S> List<S> {
    /// Whether [`ListTable::retire`] has taken the list out of the table (it is freed
    /// once no reader can hold it).
    #[inline]
    pub(crate) fn is_retired(&self) -> bool {
        self.retired.load(Ordering::Relaxed)
    }

    /// A new list of `old`'s stream, with its context and owner (see
    /// [`ListTable::retire`]: not the inserting thread's).
    fn like(old: &List<S>, state: S) -> List<S> {
        List {
            key: old.key,
            ctx: old.ctx,
            state: CachePadded(SpinLock::new(state)),
            owner: AtomicU64::new(old.owner.load(Ordering::Relaxed)),
            holds_free: AtomicBool::new(false),
            in_donors: AtomicBool::new(false),
            allocates: AtomicBool::new(old.allocates.load(Ordering::Relaxed)),
            idle: AtomicBool::new(false),
            retired: AtomicBool::new(false),
        }
    }

    /// A new list of `key`'s stream; a per-thread list is owned by the thread of
    /// generation `owner` (0 for other streams).
    fn new(key: StreamKey, owner: u64, state: S) -> List<S> {
        let ctx = if key.is_host() || !driver::is_present() {
            None
        } else {
            // An explicit stream's own device; the default and per-thread streams name
            // the current device's (the pool's, by RMM's rule that a resource is used
            // with its device current).
            match key.explicit_stream() {
                Some(raw) => Context::of_stream(raw).or_else(|_| Context::current()).ok(),
                None => Context::current().ok(),
            }
        };
        List {
            key,
            ctx,
            state: CachePadded(SpinLock::new(state)),
            owner: AtomicU64::new(owner),
            holds_free: AtomicBool::new(false),
            in_donors: AtomicBool::new(false),
            allocates: AtomicBool::new(false),
            idle: AtomicBool::new(false),
            retired: AtomicBool::new(false),
        }
    }

    /// A new thread with an exited thread's number uses its list: blocks freed there may
    /// still be in use by the exited thread's device work, on its own per-thread stream.
    /// Waits for that work (one context synchronisation) before the list changes hands.
    #[cold]
    #[inline(never)]
    fn take_over(&self, generation: u64) {
        self.wait_for_owner(self.owner.load(Ordering::Relaxed));
        self.owner.store(generation, Ordering::Relaxed);
    }

    /// Waits for the device work of the thread of generation `owner`, whose per-thread
    /// stream this list's blocks were freed on (one synchronisation of the list's
    /// context, which covers that stream), before another thread may use them.
    fn wait_for_owner(&self, owner: u64) {
        if let Some(ctx) = self.ctx
            && let Err(e) = ctx.synchronize()
        {
            // A failed synchronisation is a broken context: every later use of its memory
            // fails too, so the list is taken over all the same.
            tracing::error!(
                "memres: could not wait for an exited thread's work before reusing its list: {e}"
            );
        }
        #[cfg(test)]
        waits::waited_for(owner);
        #[cfg(not(test))]
        let _ = owner;
    }

    /// Makes the calling thread the owner of a per-thread list (see [`List::take_over`]),
    /// this list of `key` (the caller's: the list's own is on the line other threads'
    /// searches read, which a lookup does not touch).
    #[inline]
    fn claim(&self, key: StreamKey) {
        if key.is_per_thread() {
            self.claim_as(this_thread().generation);
        }
    }

    /// Makes the thread of generation `generation` the owner of a per-thread list.
    #[inline]
    fn claim_as(&self, generation: u64) {
        if self.owner.load(Ordering::Relaxed) != generation {
            self.take_over(generation);
        }
    }
}

/// The generations whose device work a list was waited for before it (or blocks freed
/// on their per-thread streams) went to another thread: what the host tests and the
/// loom models see of a take-over, whose wait has no device work to wait for there.
#[cfg(test)]
pub(crate) mod waits {
    static WAITED: std::sync::Mutex<Vec<u64>> = std::sync::Mutex::new(Vec::new());

    pub(crate) fn waited_for(generation: u64) {
        WAITED
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(generation);
    }

    /// Whether a list's blocks were waited for before they went to another thread than
    /// the one of generation `generation`, which freed them.
    pub(crate) fn waited(generation: u64) -> bool {
        WAITED
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .contains(&generation)
    }
}

impl List<Vec<usize>> {
    /// Whether a fixed-size list holding `len` blocks has blocks to spare for other
    /// streams: more than it keeps for its own (see [`StreamKey::kept_for_itself`]).
    #[inline]
    pub(crate) fn spares(&self, len: usize) -> bool {
        len > self.key.kept_for_itself()
    }

    /// Sets the [`holds_free`](List::holds_free) mark of a fixed-size list that now
    /// holds `len` blocks to whether it has blocks to spare. The caller holds the list's
    /// lock, so the mark follows the list's length (a reader without the lock may see
    /// it stale: it is a hint, never a promise).
    #[inline]
    pub(crate) fn mark_spare(&self, len: usize) {
        self.holds_free.store(self.spares(len), Ordering::Relaxed);
    }
}

/// One slot of a table: a list's key beside its pointer, so that a lookup compares keys
/// without reading any list. A list's first line is what other threads' searches read,
/// its state's what its users write; with the key in the list a lookup read that first
/// line too, a third miss for each call on a cold list (issue 49: pairs on random
/// streams of 16,384). Sixteen bytes aligned to sixteen: a slot never straddles two
/// lines.
///
/// A slot is written once, under the insertion lock: the key, then the pointer with a
/// release store. Readers load the pointer (acquire) and only then the key, so a
/// non-null pointer comes with its own list's key, never with the zero an unwritten key
/// reads as (the key of the CUDA default stream's lane 0). Slots are never emptied or
/// rewritten: a growth or a retirement fills a new table before publishing it, so a
/// pair, once its pointer is set, stays as long as its table.
#[repr(C, align(16))]
struct Slot<S> {
    list: AtomicPtr<List<S>>,
    key: AtomicU64,
}

impl<S> Slot<S> {
    /// The slot's list, null while it is empty.
    #[inline]
    fn list(&self) -> *mut List<S> {
        self.list.load(Ordering::Acquire)
    }

    /// The key of a filled slot's list, read under the insertion lock (which every
    /// slot's writer held).
    fn key(&self) -> StreamKey {
        StreamKey::from_bits(self.key.load(Ordering::Relaxed))
    }
}

/// One open-addressing table of list slots; its length is a power of two.
struct Table<S> {
    slots: Box<[Slot<S>]>,
}

impl<S> Table<S> {
    fn new(len: usize) -> Table<S> {
        Table {
            slots: (0..len)
                .map(|_| Slot {
                    list: AtomicPtr::new(ptr::null_mut()),
                    key: AtomicU64::new(0),
                })
                .collect(),
        }
    }

    /// The list of `key` and, if it has none, the empty slot where its probe ended
    /// (there is always one: a table is at most half full). Reads the table only.
    #[inline]
    fn find(&self, key: StreamKey) -> Result<*mut List<S>, usize> {
        let mask = self.slots.len() - 1;
        let mut i = key.slot(mask);
        loop {
            let slot = &self.slots[i];
            let p = slot.list();
            if p.is_null() {
                return Err(i);
            }
            // (Stored before the pointer that the acquire load above read.)
            if slot.key.load(Ordering::Relaxed) == key.bits() {
                return Ok(p);
            }
            i = (i + 1) & mask;
        }
    }

    /// Puts `key`'s list `p` in the empty slot `at` (the caller holds the insertion lock):
    /// the key first, then the pointer that publishes both.
    #[inline]
    fn put(&self, at: usize, key: StreamKey, p: *mut List<S>) {
        let slot = &self.slots[at];
        slot.key.store(key.bits(), Ordering::Relaxed);
        slot.list.store(p, Ordering::Release);
    }

    /// Puts every list of `from` into this table (not yet published; the caller holds
    /// the insertion lock), each with its key.
    fn fill_from(&self, from: &Table<S>) {
        for slot in from.slots.iter() {
            let p = slot.list.load(Ordering::Relaxed);
            if !p.is_null() {
                let key = slot.key();
                self.put(self.find(key).unwrap_err(), key, p);
            }
        }
    }
}

/// What the insertion lock guards: every table made so far (the current one last) and
/// the number of lists.
struct Tables<S> {
    all: Vec<*mut Table<S>>,
    lists: usize,
    /// The contexts of every list made so far, each once: what waiting for "every stream
    /// seen" waits for, retired lists included (a block allocated on a stream whose list
    /// went may still be freed later).
    contexts: Vec<Context>,
}

/// The map from stream to list.
pub(crate) struct ListTable<S> {
    /// The current table, where lock-free lookups start.
    table: AtomicPtr<Table<S>>,
    /// The list whose [`List::holds_free`] was set last: where a search for free memory
    /// in other streams' lists looks first.
    recent: AtomicPtr<List<S>>,
    /// The grace domain of the map's readers: every call of its owner pins in it
    /// ([`pin`](Self::pin)), and a retirement waits for those only.
    domain: grace::Domain,
    /// What insertions and [`retire`](ListTable::retire) use (boxed: off the allocation
    /// path, and a `Binning` holds many maps).
    rare: Box<Rare<S>>,
}

/// The map's state that lookups do not touch.
struct Rare<S> {
    /// Merges that moved other streams' free items (each after a wait for their work).
    merges: AtomicU64,
    /// Serialises insertions and owns the tables.
    tables: Mutex<Tables<S>>,
    /// Whether `limbo` holds any (so that iterations take its lock only then).
    limbo_any: AtomicBool,
    /// Lists taken out of the table that readers may still hold:
    /// [`iter`](ListTable::iter) still visits them (a growth's new chunk must reach every
    /// list a block can be freed into), until a grace period has passed.
    limbo: Mutex<Vec<*mut List<S>>>,
    /// Held through a retirement: one at a time, so that the lists one finds for its
    /// late items (`home`) are not another's to free.
    one_at_a_time: Mutex<()>,
    /// Where the next [`search`](ListTable::search) starts: the table slot where the last
    /// one stopped (a hint; masked to the current table's length).
    cursor: AtomicUsize,
    /// Bit `l` is set once a list of lane `l` (of any stream but the per-thread default
    /// one) has been made: [`other_lanes`](ListTable::other_lanes) looks up only those
    /// lanes (a program whose streams each have one thread looked up 15 lanes that
    /// never existed at every miss).
    lanes: AtomicU64,
}

// SAFETY: the map owns its tables and lists (boxed, freed only in `drop`); sending it
// sends them.
unsafe impl<S: Send> Send for ListTable<S> {}
// SAFETY: shared access hands out `&List<S>`, whose state is behind a `SpinLock` (which
// shares `S` the way `Mutex<S>` does: safe when `S: Send`); its other fields (a key, a
// `Context`, an atomic) are `Send + Sync`. Tables are only read through atomics.
unsafe impl<S: Send> Sync for ListTable<S> {}

impl<S> Default for ListTable<S> {
    fn default() -> Self {
        let first = Box::into_raw(Box::new(Table::new(FIRST_SLOTS)));
        ListTable {
            table: AtomicPtr::new(first),
            recent: AtomicPtr::new(ptr::null_mut()),
            domain: grace::Domain::new(),
            rare: Box::new(Rare {
                merges: AtomicU64::new(0),
                tables: Mutex::new(Tables {
                    all: vec![first],
                    lists: 0,
                    contexts: Vec::new(),
                }),
                limbo_any: AtomicBool::new(false),
                limbo: Mutex::new(Vec::new()),
                one_at_a_time: Mutex::new(()),
                cursor: AtomicUsize::new(0),
                lanes: AtomicU64::new(0),
            }),
        }
    }
}

impl<S> ListTable<S> {
    /// Pins the calling thread in the map's grace domain: every use of the map's lists
    /// is inside such a pin (see [`retire`](Self::retire)).
    #[inline]
    pub(crate) fn pin(&self) -> grace::Pin {
        grace::pin(&self.domain)
    }

    /// The map's grace domain (for pins made where the map is not at hand).
    pub(crate) fn domain(&self) -> &grace::Domain {
        &self.domain
    }

    /// The current table.
    #[inline]
    fn table(&self) -> &Table<S> {
        // SAFETY: the pointer was made by `Box::into_raw` and published with a release
        // store after the table was filled; a table is freed only by `retire`, two grace
        // periods after it stopped being current, which the caller's pin (or the
        // `tables` lock) outlasts (or when the map drops).
        unsafe { &*self.table.load(Ordering::Acquire) }
    }

    /// A list of this map from its pointer.
    ///
    /// # Safety
    /// `p` was read from a slot of one of this map's tables.
    #[inline]
    unsafe fn at(&self, p: *mut List<S>) -> &List<S> {
        // SAFETY: (the caller's promise) `p` is a published list; lists are freed only
        // by `retire`, after every reader pinned when it left the tables has unpinned (the
        // caller is pinned), or when the map drops, which `&self` outlives.
        unsafe { &*p }
    }

    /// The list of `key`, if it exists; lock-free and O(1). A per-thread list that a
    /// new thread finds under an exited thread's number is taken over first.
    #[inline]
    pub(crate) fn get(&self, key: StreamKey) -> Option<&List<S>> {
        let list = self.find(key)?;
        list.claim(key);
        Some(list)
    }

    /// The list of `key`, made with `state` if there is none yet.
    pub(crate) fn get_or_insert_with(&self, key: StreamKey, state: impl FnOnce() -> S) -> &List<S> {
        let owner = || {
            if key.is_per_thread() {
                this_thread().generation
            } else {
                0
            }
        };
        let list = self.insert(key, || List::new(key, owner(), state()));
        list.claim(key);
        list
    }

    /// The per-thread list `key` as the thread of generation `generation` gets it (found
    /// and claimed, or made), for tests and models where one thread plays several.
    #[cfg(test)]
    pub(crate) fn get_or_insert_as(
        &self,
        key: StreamKey,
        generation: u64,
        state: impl FnOnce() -> S,
    ) -> &List<S> {
        debug_assert!(key.is_per_thread());
        let list = self.insert(key, || List::new(key, generation, state()));
        list.claim_as(generation);
        list
    }

    /// The list of `old`'s stream, made if there is none with `old`'s context and owner
    /// (for a retired list's late items: see [`retire`](Self::retire)); nobody claims
    /// it.
    pub(crate) fn get_or_insert_like(&self, old: &List<S>, state: impl FnOnce() -> S) -> &List<S> {
        self.insert(old.key, || List::like(old, state()))
    }

    /// The list of `key` if it exists, as [`get`](Self::get) but without claiming a
    /// per-thread list for the calling thread.
    pub(crate) fn find(&self, key: StreamKey) -> Option<&List<S>> {
        let p = self.table().find(key).ok()?;
        // SAFETY: read from a slot.
        Some(unsafe { self.at(p) })
    }

    /// The list of `key`, made by `make` if there is none.
    fn insert(&self, key: StreamKey, make: impl FnOnce() -> List<S>) -> &List<S> {
        let mut tables = lock(&self.rare.tables);
        let mut table = self.table();
        let mut empty = match table.find(key) {
            // SAFETY: read from a slot.
            Ok(p) => return unsafe { self.at(p) },
            Err(empty) => empty,
        };
        if (tables.lists + 1) * 2 > table.slots.len() {
            let bigger = Table::new(table.slots.len() * 2);
            bigger.fill_from(table);
            let bigger = Box::into_raw(Box::new(bigger));
            tables.all.push(bigger);
            self.table.store(bigger, Ordering::Release);
            table = self.table();
            empty = table.find(key).unwrap_err();
        }
        if !key.is_per_thread() {
            // Before the list is published: a thread that finds it looks for its lane.
            self.rare.lanes.fetch_or(1 << key.lane(), Ordering::Relaxed);
        }
        let new = Box::into_raw(Box::new(make()));
        // SAFETY: made just above, not yet shared.
        if let Some(ctx) = unsafe { &*new }.ctx
            && !tables.contexts.contains(&ctx)
        {
            tables.contexts.push(ctx);
        }
        table.put(empty, key, new);
        tables.lists += 1;
        // SAFETY: just published in a slot.
        unsafe { self.at(new) }
    }

    /// Every list so far (a list being inserted concurrently may be missing).
    pub(crate) fn all(&self) -> Vec<&List<S>> {
        self.iter().collect()
    }

    /// As [`all`](Self::all), without collecting them (but those in limbo: see
    /// [`retire`](Self::retire)).
    pub(crate) fn iter(&self) -> impl Iterator<Item = &List<S>> {
        // The table first, then limbo: a list on its way from one to the other (which
        // enters limbo before it leaves the table) is in one or both; once in both
        // (limbo not empty) the table's copy is passed over.
        let table = self.table();
        let limbo = if self.rare.limbo_any.load(Ordering::Acquire) {
            lock(&self.rare.limbo).clone()
        } else {
            Vec::new()
        };
        // Only while a retirement is under way (else no set is built on this path).
        let in_limbo: Option<std::collections::HashSet<*mut List<S>>> =
            (!limbo.is_empty()).then(|| limbo.iter().copied().collect());
        table
            .slots
            .iter()
            .map(Slot::list)
            .filter(move |p| !p.is_null() && !in_limbo.as_ref().is_some_and(|l| l.contains(p)))
            .chain(limbo)
            // SAFETY: read from a slot, or from limbo (whose lists are freed only a grace
            // period after they left it, which the caller's pin outlasts).
            .map(|p| unsafe { self.at(p) })
    }

    /// The first list `f` gives something for, in the order of the table's slots
    /// starting where the last search that stopped stopped (then the lists in limbo),
    /// `f` called for at most `most` lists. A search that stops at its first find thus
    /// goes on where the one before it found something, instead of passing again over
    /// every list at the table's start that earlier searches emptied (issue 49: searches
    /// from the start, through a `Vec` of every list, cost a pool 11.6 us a pair on
    /// random streams at 16,384 streams, and a `FixedSize` 14.2 us round-robin).
    pub(crate) fn search<'a, R>(
        &'a self,
        most: usize,
        mut f: impl FnMut(&'a List<S>) -> Option<R>,
    ) -> Option<R> {
        let table = self.table();
        let mask = table.slots.len() - 1;
        let start = self.rare.cursor.load(Ordering::Relaxed) & mask;
        let mut looked = 0;
        for k in 0..=mask {
            let at = (start + k) & mask;
            let p = table.slots[at].list();
            if p.is_null() {
                continue;
            }
            if looked == most {
                self.rare.cursor.store(at, Ordering::Relaxed);
                return None;
            }
            looked += 1;
            // SAFETY: read from a slot.
            if let Some(found) = f(unsafe { self.at(p) }) {
                self.rare.cursor.store(at, Ordering::Relaxed);
                return Some(found);
            }
        }
        if !self.rare.limbo_any.load(Ordering::Acquire) {
            return None;
        }
        let limbo = lock(&self.rare.limbo).clone();
        limbo
            .into_iter()
            .take(most - looked)
            // SAFETY: from limbo, whose lists are freed only a grace period after they
            // left it, which the caller's pin outlasts.
            .find_map(|p| f(unsafe { self.at(p) }))
    }

    /// Sets `list`'s [`List::holds_free`] hint (the caller holds its state's lock) and,
    /// if it was clear, makes `list` the first a search looks at.
    #[inline]
    pub(crate) fn note_free(&self, list: &List<S>) {
        if !list.holds_free.load(Ordering::Relaxed) {
            list.holds_free.store(true, Ordering::Relaxed);
            self.set_recent(list);
        }
    }

    /// Makes `list` the first a search looks at, unless it is retired.
    #[inline]
    pub(crate) fn set_recent(&self, list: &List<S>) {
        if !list.is_retired() {
            self.recent
                .store(ptr::from_ref(list).cast_mut(), Ordering::Release);
        }
    }

    /// The list that last started to hold free memory, if any.
    pub(crate) fn recent(&self) -> Option<&List<S>> {
        let p = self.recent.load(Ordering::Acquire);
        // SAFETY: `recent` only ever holds pointers of published lists of this map.
        (!p.is_null()).then(|| unsafe { self.at(p) })
    }

    /// How many merges moved other lists' free items (see [`ListTable::merge_into`]).
    pub(crate) fn merges(&self) -> u64 {
        self.rare.merges.load(Ordering::Relaxed)
    }

    /// How many lists (streams) the map holds.
    pub(crate) fn len(&self) -> usize {
        lock(&self.rare.tables).lists
    }

    /// Moves the free items of every list but `into` into `into`, once the work of the
    /// CUDA streams they were freed on is complete (one `cuCtxSynchronize` per context).
    /// `drain` empties a list; `absorb` adds items to one (those of all the lists at
    /// once, when they go to `into`). If the wait fails, the items
    /// go back where they came from and the error is returned. Returns whether anything
    /// moved.
    pub(crate) fn merge_into<T>(
        &self,
        into: &List<S>,
        drain: impl Fn(&mut S) -> Vec<T>,
        absorb: impl Fn(&mut S, Vec<T>),
    ) -> Result<bool, Error> {
        let mut moved = Vec::new();
        for other in self.iter() {
            if !ptr::eq(other, into) {
                let items = drain(&mut other.state.lock());
                if !items.is_empty() {
                    moved.push((other, items));
                }
            }
        }
        if let Err(e) = synchronize(moved.iter().filter_map(|(s, _)| s.ctx)) {
            // Their streams may still be using them.
            for (list, items) in moved {
                absorb(&mut list.state.lock(), items);
            }
            return Err(e);
        }
        let any = !moved.is_empty();
        let all: Vec<T> = moved.into_iter().flat_map(|(_, items)| items).collect();
        absorb(&mut into.state.lock(), all);
        if any {
            self.note_free(into);
            self.rare.merges.fetch_add(1, Ordering::Relaxed);
        }
        Ok(any)
    }

    /// The other lanes of `own`'s stream (see [`StreamKey::of_lane`]) that exist: one
    /// lookup per lane that some stream of the map has, however many streams it holds.
    pub(crate) fn other_lanes(&self, own: &List<S>) -> impl Iterator<Item = &List<S>> {
        let table = self.table();
        let made = self.rare.lanes.load(Ordering::Relaxed);
        // With one lane made (a stream's list's own: its bit is set before the list is
        // published) there is no other, and the list's key, on the line other threads'
        // searches read, is not read (issue 49: a miss on most empty lists' requests at
        // 16,384 streams of one thread each).
        let lanes = if made.count_ones() <= 1 || own.key.is_per_thread() {
            0
        } else {
            LANES
        };
        (0..lanes)
            .filter(move |lane| made & (1 << lane) != 0)
            .map(move |lane| own.key.in_lane(lane))
            .filter(move |&key| key != own.key)
            .filter_map(move |key| table.find(key).ok())
            // SAFETY: read from a slot.
            .map(move |p| unsafe { self.at(p) })
    }

    /// Waits for the work of every CUDA stream seen so far (once per context).
    pub(crate) fn synchronize_streams(&self) -> Result<(), Error> {
        let contexts = lock(&self.rare.tables).contexts.clone();
        synchronize(contexts.into_iter())
    }
}

/// Synchronises each distinct context once.
pub(crate) fn synchronize(ctxs: impl Iterator<Item = Context>) -> Result<(), Error> {
    let mut done: Vec<Context> = Vec::new();
    for ctx in ctxs {
        if !done.contains(&ctx) {
            ctx.synchronize()?;
            done.push(ctx);
        }
    }
    Ok(())
}

impl<S> Drop for ListTable<S> {
    fn drop(&mut self) {
        // The current table holds every list.
        for slot in self.table().slots.iter() {
            let p = slot.list();
            if !p.is_null() {
                // SAFETY: made by `Box::into_raw` in `get_or_insert_with`, in the current
                // table once; `&mut self` means no reference handed out is still alive.
                drop(unsafe { Box::from_raw(p) });
            }
        }
        for &table in lock(&self.rare.tables).all.iter() {
            // SAFETY: made by `Box::into_raw` (in `default`, `get_or_insert_with` or
            // `retire`), once.
            drop(unsafe { Box::from_raw(table) });
        }
        for &p in lock(&self.rare.limbo).iter() {
            // SAFETY: made by `Box::into_raw`; in limbo, so in no table.
            drop(unsafe { Box::from_raw(p) });
        }
    }
}

/// [`ListTable::retire`] stopped after its first grace period (in `unlinked`: the retired
/// list is then in limbo) while this thread, pinned, uses the list as an iteration
/// found it: what iterations see, when the list may be freed, and what `recent` may
/// point at (issue 49: no test noticed the removal of the second grace period, of the
/// retired mark or of the iterations over limbo).
mod retire;
