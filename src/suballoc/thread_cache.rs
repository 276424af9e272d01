//! Per-thread caches ("magazines") of free fixed-size blocks: a free pushes onto the
//! calling thread's magazine for (resource, stream) and an allocation pops from it, with
//! no atomic read-modify-write at all. A magazine trades blocks with its stream's shared
//! list in batches (when it runs empty or overflows), and gives everything back when its
//! thread exits or when a reclaim asks for it. A thread keeps magazines for at most
//! [`MAGAZINES_PER_OWNER`] streams of one resource; its calls on further streams go to
//! the streams' lists (so a thread on thousands of streams does not scan a magazine per
//! stream on every call).
//!
//! Safety rests on one rule: a magazine's list and owner-state pointers are dereferenced
//! only (1) inside a call on the resource that owns them (the magazine is found by the
//! owner's id, unique for the life of the process, so the owner is alive and borrowed for
//! the call), or (2) at thread exit while holding the registry lock, after checking that
//! the owner is still registered; an owner leaves the registry (under that lock) before
//! it frees anything. Magazines of owners that are gone hold plain addresses that are
//! never handed out. A magazine's list pointer is dereferenced only while its blocks
//! have not been taken: `FixedSize::trim` frees a list only after a reclaim has taken the
//! blocks of every magazine that points at it (see its `StreamOrdered::retired`).
//!
//! **Reclaim.** A thread about to report out-of-memory may hold the owner's growth lock
//! and still find no free block while other threads' magazines hold some. It starts a
//! reclaim ([`Cache::reclaim`]): the owner's epoch turns odd, so that no thread keeps a
//! magazine of the owner (calls go straight to the lists) until the epoch turns even
//! again, when the owner next grows, when the trim that reclaimed returns, or after
//! 65,536 calls without caches ([`Cache::resume`]); and the reclaimer takes the blocks of every thread's magazines
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
struct Shared {
    /// Even: caches work. Odd: a reclaim is under way. Turned odd only under
    /// `stashes`' lock.
    epoch: AtomicU64,
    /// The stashes of the owner's magazines on all threads.
    stashes: Mutex<Vec<Arc<Stash>>>,
    /// Calls made while the caches are off (see [`CALLS_OFF`]).
    calls_off: AtomicU64,
}

/// Calls on an owner without caches after which they come back on.
pub(crate) const CALLS_OFF: u64 = 1 << 16;

/// A resource's identity for the caches, registered while it lives.
#[derive(Debug)]
pub(crate) struct Owner {
    id: u64,
    retired: bool,
    shared: Box<Shared>,
}

impl Owner {
    pub(crate) fn new() -> Owner {
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

impl Drop for Owner {
    fn drop(&mut self) {
        self.retire();
    }
}

/// A magazine's blocks, where a reclaim can take them (see the module's "Taking another
/// thread's blocks" and [`Takeable`]).
#[derive(Debug)]
struct Stash {
    blocks: Takeable<Vec<usize>>,
    /// The list the blocks go back to.
    list: *const List<Vec<usize>>,
}

// SAFETY: `blocks` is a `Takeable` (Send and Sync); `list` is dereferenced only under
// the module's rules (1) and (2).
unsafe impl Send for Stash {}
// SAFETY: as for `Send`.
unsafe impl Sync for Stash {}

impl Stash {
    /// Runs `f` on the blocks, as the magazine's thread; `None` if a reclaim took them.
    #[inline]
    fn with<R>(&self, f: impl FnOnce(&mut Vec<usize>) -> R) -> Option<R> {
        self.blocks.with(f)
    }
}

/// Puts blocks back in a stream's list, with its mark of blocks to spare (see
/// [`List::mark_spare`]).
fn put_back(list: &List<Vec<usize>>, blocks: impl IntoIterator<Item = usize>) {
    let mut held = list.state.lock();
    held.extend(blocks);
    list.mark_spare(held.len());
}

struct Magazine {
    owner: u64,
    key: StreamKey,
    /// The owner's epoch when the magazine was made: another one means "give back".
    epoch: u64,
    stash: Arc<Stash>,
    shared: *const Shared,
}

impl Magazine {
    /// Gives the blocks back to their list (unless a reclaim took them) and leaves the
    /// owner's list of stashes.
    ///
    /// # Safety
    /// The owner is alive until this returns (rule (1) or (2) of the module).
    ///
    /// Returns the list the blocks went to, or `None` if a reclaim had taken them (the
    /// list may then be gone: a `FixedSize::trim` retires lists only after a reclaim
    /// has taken every stash that points at them).
    unsafe fn give_back(self) -> Option<*const List<Vec<usize>>> {
        let gave = self.stash.with(|blocks| {
            // SAFETY: the caller's promise; the blocks were not taken, so the list is not
            // freed yet: `FixedSize::trim` frees a list only after its reclaim has taken
            // every stash pointing at it, and that take waits for this `with` to end.
            let list = unsafe { &*self.stash.list };
            put_back(list, blocks.drain(..));
        });
        // SAFETY: as above; `shared` is the owner's boxed state.
        let shared = unsafe { &*self.shared };
        lock(&shared.stashes).retain(|s| !Arc::ptr_eq(s, &self.stash));
        gave.map(|()| self.stash.list)
    }
}

/// Slots of the lookup hint (a power of two).
const HINTS: usize = 32;

/// A thread's magazines, and for each (owner, stream) hash the index where its magazine
/// was last found, so a thread with magazines of many resources (a `Binning`'s bins)
/// finds one in a step.
struct Magazines {
    list: Vec<Magazine>,
    hint: [u8; HINTS],
    /// The last (owner, stream, epoch) found to have no magazine with the owner already
    /// at [`MAGAZINES_PER_OWNER`] on this thread: a thread going round more streams than
    /// that asks for one up to three times per allocate and free (pop, refill, push),
    /// and scanned its magazines each time (issue 33, finding 3). Cleared whenever the
    /// thread's magazines of an owner go.
    full_miss: Option<(u64, StreamKey, u64)>,
}

impl Magazines {
    const fn new() -> Magazines {
        Magazines {
            list: Vec::new(),
            hint: [0; HINTS],
            full_miss: None,
        }
    }

    /// The hint's slot for (owner, key): the key's hash, whose multiply does not wait
    /// for the owner (a `Binning` finds its bin, and so the owner, by loads that the key
    /// does not need), then the owner's id mixed in with one `xor`. Owners made together
    /// (a `Binning`'s bins) have consecutive ids, so up to [`HINTS`] of them never share
    /// a slot for one stream.
    #[inline]
    fn slot(owner: u64, key: StreamKey) -> usize {
        let stream = key.hash() >> (u64::BITS - HINTS.trailing_zeros());
        (stream ^ owner) as usize % HINTS
    }

    /// The index of the magazine of (owner, key) if the hint knows it: one load and a
    /// compare, the whole lookup on a cache hit.
    #[inline]
    fn hinted(&self, owner: u64, key: StreamKey) -> Option<usize> {
        let at = usize::from(self.hint[Self::slot(owner, key)]);
        let m = self.list.get(at)?;
        (m.owner == owner && m.key == key).then_some(at)
    }

    /// Points the hint for (owner, key) at index `at`.
    fn point_at(&mut self, owner: u64, key: StreamKey, at: usize) {
        if let Ok(at) = u8::try_from(at) {
            self.hint[Self::slot(owner, key)] = at;
        }
    }

    /// Gives back every magazine of `owner` on this thread.
    ///
    /// # Safety
    /// Inside a call on the owner (rule (1) of the module).
    unsafe fn give_back(&mut self, owner: u64) -> Vec<*const List<Vec<usize>>> {
        self.full_miss = None;
        let mut lists = Vec::new();
        let mut i = 0;
        while i < self.list.len() {
            if self.list[i].owner == owner {
                let m = self.list.swap_remove(i);
                // SAFETY: the caller's promise.
                lists.extend(unsafe { m.give_back() });
            } else {
                i += 1;
            }
        }
        lists
    }
}

impl Drop for Magazines {
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

/// A thread with this many magazines drops those of owners that are gone.
const PRUNE_AT: usize = 16;

/// The most magazines of one owner on one thread (one per stream the thread uses it on);
/// calls on further streams go to the streams' lists.
const MAGAZINES_PER_OWNER: usize = 16;

/// Drops the magazines of owners that are gone (their blocks are only addresses).
fn prune(list: &mut Vec<Magazine>) {
    let live = lock(&LIVE);
    list.retain(|m| live.as_ref().is_some_and(|l| l.contains(&m.owner)));
}

#[cfg(not(memres_loom))]
thread_local! {
    static MAGAZINES: RefCell<Magazines> = const { RefCell::new(Magazines::new()) };
}

#[cfg(memres_loom)]
loom::thread_local! {
    static MAGAZINES: RefCell<Magazines> = RefCell::new(Magazines::new());
}

/// What a thread's exit does to its magazines, called by a loom model's thread as its
/// last act: loom's `join` returns before a thread's thread-locals are dropped, and its
/// lazy statics (the registry) are gone when the model's main thread ends, so a model
/// cannot leave the drop to the thread's exit.
#[cfg(all(test, memres_loom))]
pub(crate) fn exit_thread() {
    let list = MAGAZINES.with(|m| std::mem::take(&mut m.borrow_mut().list));
    drop(Magazines {
        list,
        ..Magazines::new()
    });
}

/// The calling thread's magazines for one resource, within one call on it.
pub(crate) struct Cache<'a> {
    pub(crate) owner: &'a Owner,
    /// The grace domain of the owner's lists (pinned in while a magazine is made).
    pub(crate) domain: &'a grace::Domain,
    /// Most blocks one magazine holds.
    pub(crate) capacity: usize,
}

impl<'a> Cache<'a> {
    /// Runs `f` on this thread's magazines, if the thread still has them (not during its
    /// exit) and `f` returns something.
    #[inline]
    fn with<R>(&self, f: impl FnOnce(&mut Magazines) -> Option<R>) -> Option<R> {
        MAGAZINES
            .try_with(|m| f(&mut *m.try_borrow_mut().ok()?))
            .ok()
            .flatten()
    }

    /// The magazine of (owner, key) on this thread, made if `make` and no reclaim is
    /// under way; a stale one (made before a reclaim began) is given back first, with
    /// every other magazine of the owner on this thread.
    #[inline]
    fn magazine<'m, 's>(
        &self,
        mags: &'m mut Magazines,
        key: StreamKey,
        make: Option<&dyn Fn() -> &'s List<Vec<usize>>>,
    ) -> Option<&'m mut Magazine> {
        let epoch = self.owner.shared.epoch.load(Ordering::Relaxed);
        if let Some(at) = mags.hinted(self.owner.id, key)
            && mags.list[at].epoch == epoch
        {
            return Some(&mut mags.list[at]);
        }
        if mags.full_miss == Some((self.owner.id, key, epoch)) {
            return None;
        }
        self.magazine_slow(mags, key, make)
    }

    /// [`magazine`](Self::magazine) where the hint does not lead to a current magazine:
    /// a scan, a stale magazine given back, or a new one made.
    // long: the outcomes of one pass, in order, each using what it found.
    #[cold]
    #[inline(never)]
    fn magazine_slow<'m, 's>(
        &self,
        mags: &'m mut Magazines,
        key: StreamKey,
        make: Option<&dyn Fn() -> &'s List<Vec<usize>>>,
    ) -> Option<&'m mut Magazine> {
        let shared = &*self.owner.shared;
        let mut epoch = shared.epoch.load(Ordering::Relaxed);
        let id = self.owner.id;
        // One pass over the thread's magazines: this stream's, whether the owner's are
        // stale, how many the owner has (a call on a stream past the owner's limit comes
        // here every time).
        let (mut found, mut stale, mut own) = (None, false, 0);
        for (at, m) in mags.list.iter().enumerate() {
            if m.owner == id {
                own += 1;
                stale |= m.epoch != epoch;
                if m.key == key {
                    found = Some(at);
                }
            }
        }
        if let Some(at) = found
            && mags.list[at].epoch == epoch
        {
            mags.point_at(id, key, at);
            return Some(&mut mags.list[at]);
        }
        // A stale magazine here, or (a call on another stream) elsewhere on the thread:
        // the owner's magazines on a thread are given back together, so they always share
        // one epoch, and a thread answers a reclaim at its next call on any stream.
        if stale {
            // SAFETY: inside a call on the owner (rule (1)).
            unsafe { mags.give_back(id) };
            own = 0;
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
        // A thread on many streams keeps magazines for the first few only and goes
        // straight to the lists for the others: its lookups stay short however many
        // streams it uses (a magazine per stream made the lookup a scan of all of them:
        // 79 us per allocation over 16,384 streams).
        if own >= MAGAZINES_PER_OWNER {
            mags.full_miss = Some((id, key, epoch));
            return None;
        }
        if mags.list.len() >= PRUNE_AT {
            prune(&mut mags.list);
        }
        // Pinned from the lookup until the magazine is listed: a magazine of a list that
        // `FixedSize::trim` retires is then listed before the trim's first grace period
        // ends, and the reclaim the trim runs after it takes the magazine's blocks (see
        // `FixedSize`'s `StreamOrdered::retired`). (`make` is a lookup: no retired list comes
        // from one after that grace period.)
        let _pin = grace::pin(self.domain);
        let stash = Arc::new(Stash {
            blocks: Takeable::new(Vec::with_capacity(self.capacity)),
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
        mags.list.push(Magazine {
            owner: self.owner.id,
            key,
            epoch,
            stash,
            shared,
        });
        mags.list.last_mut()
    }

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

    /// Gives every block of the owner's magazines on this thread back to their lists, and
    /// returns those lists (the owner's lists; one `FixedSize::trim` retires is freed
    /// only after every call pinned when it left the tables has returned, so a caller
    /// pinned before this call may use them until it unpins).
    pub(crate) fn flush(&self) -> Vec<*const List<Vec<usize>>> {
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
                    let blocks = unsafe { stash.blocks.take() };
                    // SAFETY: inside a call on the owner (rule (1)), or in `FixedSize::trim`'s
                    // retirement before the lists it retires are freed: the list lives.
                    let list = unsafe { &*stash.list };
                    put_back(list, blocks);
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
    /// grown (memory is no longer short), after a trim's reclaims (`FixedSize::trim`),
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

    /// Magazines of the owner on all threads (for the loom models).
    #[cfg(all(test, memres_loom))]
    pub(crate) fn magazines(&self) -> usize {
        lock(&self.owner.shared.stashes).len()
    }

    /// Blocks of the owner in this thread's magazines.
    pub(crate) fn cached_here(&self) -> usize {
        self.with(|mags| {
            Some(
                mags.list
                    .iter()
                    .filter(|m| m.owner == self.owner.id)
                    .map(|m| m.stash.with(|blocks| blocks.len()).unwrap_or(0))
                    .sum(),
            )
        })
        .unwrap_or(0)
    }
}
