//! Per-thread slots of one object: state that each thread updates without atomic
//! read-modify-write operations, and that other threads can still read.
//!
//! A [`PerThread<T>`] holds a shared part (`T::Shared`) and one `T` per thread that has
//! used it. A thread finds its slot through a thread-local list keyed by the object's id
//! (unique for the life of the process, so a new object never finds a slot of an old one
//! at the same address). The object keeps every slot in a registry, so readers can visit
//! them all. When a thread exits, it hands its slot to [`ThreadSlot::retire`] (which folds
//! it into the shared part) and takes it out of the registry, both under the registry's
//! lock.
//!
//! Slots are reference counted (the thread's list and the registry each hold one), so no
//! pointer here outlives its slot. The counters inside a `T` are atomics that the owning
//! thread updates with a relaxed load and store (no lock prefix, a fraction of a
//! nanosecond) and other threads read with relaxed loads: a reader sees each value whole,
//! and everything a thread wrote before it was joined.

use std::cell::{Cell, RefCell};

use crate::sync::atomic::{AtomicBool, Ordering};
use crate::sync::{Arc, Mutex, MutexGuard};

/// What a per-thread slot type provides.
pub(crate) trait ThreadSlot: Default + Send + Sync + 'static {
    /// The state all threads share.
    type Shared: Send + Sync;

    /// Folds the slot into the shared state. Called by the slot's thread as it exits
    /// (so before a `JoinHandle::join` of the thread returns; a scoped thread's scope may
    /// end a moment earlier), with the registry locked; not called for a thread whose
    /// thread-local destructors do not run.
    fn retire(&self, shared: &Self::Shared);
}

/// One thread's slot: the flags its two owners (the thread's list and the object's
/// registry) leave for each other, then the value. `repr(C)` puts the flags first, so a
/// thread's list reads them without knowing `T`. Aligned to two cache lines (the pair the
/// processor fetches together), so that threads writing their own slots never write the
/// same lines.
#[repr(C, align(128))]
struct Slot<T: ThreadSlot> {
    flags: Flags,
    inner: Arc<Inner<T>>,
    value: T,
}

/// What the object and its slots share: the shared state and the registry. (Slots hold
/// it, and it holds the slots; the object's drop clears the registry, which breaks the
/// cycle.)
struct Inner<T: ThreadSlot> {
    shared: T::Shared,
    slots: Mutex<Vec<Arc<Slot<T>>>>,
}

impl<T: ThreadSlot> Inner<T> {
    fn lock(&self) -> MutexGuard<'_, Vec<Arc<Slot<T>>>> {
        // The list is never left half-updated (single Vec operations).
        crate::sync::lock(&self.slots)
    }
}

#[derive(Default)]
struct Flags {
    /// Set by the object when it drops: the thread's list may drop its entry.
    orphaned: AtomicBool,
}

/// Shared state plus one `T` per thread; see the module.
pub(crate) struct PerThread<T: ThreadSlot> {
    id: u64,
    /// Also held by every slot, so that a thread exiting after the object dropped can
    /// still retire its slot.
    inner: Arc<Inner<T>>,
}

/// Ids of objects, never reused. Ids start at 1.
static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl<T: ThreadSlot> PerThread<T> {
    pub(crate) fn new(shared: T::Shared) -> Self {
        PerThread {
            id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            inner: Arc::new(Inner {
                shared,
                slots: Mutex::new(Vec::new()),
            }),
        }
    }

    /// The shared part.
    #[inline]
    pub(crate) fn shared(&self) -> &T::Shared {
        &self.inner.shared
    }

    /// The calling thread's slot, made on its first call; `None` while the thread is
    /// exiting (its thread-locals are gone), when the caller must use the shared state.
    #[inline]
    pub(crate) fn get(&self) -> Option<&T> {
        // The slot this object used last on this thread, checked first: one thread-local
        // read. (Four ways, by id: adaptors stacked on each other take turns without
        // pushing each other out.)
        if let Ok((id, ptr)) = LAST.try_with(|last| last[way(self.id)].get())
            && id == self.id
        {
            // SAFETY: `LAST` holds pointers of live entries of this thread (all its ways
            // are cleared before any entry is removed), here with this object's id.
            return Some(unsafe { self.value_at(ptr) });
        }
        self.get_slow()
    }

    /// [`get`](Self::get) when this object's way of `LAST` holds another object's slot,
    /// or none: out of line, so that the fast path stays small enough to inline into
    /// callers.
    #[cold]
    #[inline(never)]
    fn get_slow(&self) -> Option<&T> {
        let found = ENTRIES
            .try_with(|entries| {
                let entries = entries.try_borrow().ok()?;
                entries.0.iter().find(|e| e.id == self.id).map(|e| e.ptr)
            })
            .ok()
            .flatten();
        let ptr = match found {
            Some(ptr) => ptr,
            None => self.register()?,
        };
        let _ = LAST.try_with(|last| last[way(self.id)].set((self.id, ptr)));
        // SAFETY: `ptr` is the slot of this thread's entry with this object's id.
        Some(unsafe { self.value_at(ptr) })
    }

    /// The value of the slot at `ptr`, for the borrow of `self`.
    ///
    /// # Safety
    /// `ptr` is the slot pointer of a live entry of the calling thread's list whose id is
    /// this object's. Such an entry was made by `register` from an `Arc<Slot<T>>` of this
    /// object (ids are unique, so `T` is this object's), and it holds a reference until
    /// its thread exits (not before the caller's call on `self` returns) or it is pruned
    /// (only once the object is dropped, not during a borrow of it), so the slot outlives
    /// the borrow of `self`.
    #[inline]
    unsafe fn value_at(&self, ptr: *const ()) -> &T {
        // SAFETY: the caller's promise: a live `Slot<T>` for the borrow of `self`.
        unsafe { &(*ptr.cast::<Slot<T>>()).value }
    }

    #[cold]
    fn register(&self) -> Option<*const ()> {
        let slot = Arc::new(Slot {
            flags: Flags::default(),
            inner: Arc::clone(&self.inner),
            value: T::default(),
        });
        let ptr = Arc::into_raw(Arc::clone(&slot)).cast::<()>();
        let pushed = ENTRIES
            .try_with(|entries| {
                let mut entries = entries.try_borrow_mut().ok()?;
                if entries.0.len() >= PRUNE_AT {
                    entries.prune();
                }
                entries.0.push(Entry {
                    id: self.id,
                    ptr,
                    release: release::<T>,
                });
                Some(())
            })
            .ok()
            .flatten();
        if pushed.is_none() {
            // No list to keep it (the thread is exiting).
            // SAFETY: `ptr` is the reference made above, not stored anywhere.
            unsafe { release::<T>(ptr, false) };
            return None;
        }
        // (A thread takes its slot out again as it exits, so the list holds live threads.)
        self.inner.lock().push(slot);
        Some(ptr)
    }

    /// Calls `live` on the slot of every thread that has not exited, then `shared` on the
    /// shared part, with the registry locked throughout: a thread's retirement (which
    /// folds its slot into the shared part under that lock) falls wholly before or after
    /// the read, so the read counts each thread's slot exactly once (in its slot, or in the
    /// shared part), also when the thread exits meanwhile.
    pub(crate) fn read<R>(
        &self,
        mut live: impl FnMut(&T),
        shared: impl FnOnce(&T::Shared) -> R,
    ) -> R {
        let slots = self.inner.lock();
        for slot in slots.iter() {
            live(&slot.value);
        }
        shared(&self.inner.shared)
    }
}

impl<T: ThreadSlot> Drop for PerThread<T> {
    fn drop(&mut self) {
        // Threads' lists see the flag and drop their entries when they prune.
        for slot in self.inner.lock().drain(..) {
            slot.flags.orphaned.store(true, Ordering::Relaxed);
        }
    }
}

/// A thread's reference to one object's slot: an `Arc<Slot<T>>` made raw, so that one
/// list holds slots of every `T`.
struct Entry {
    id: u64,
    ptr: *const (),
    /// Gives the reference back, retiring the slot first if its thread is exiting.
    release: unsafe fn(*const (), bool),
}

impl Entry {
    fn flags(&self) -> &Flags {
        // SAFETY: `ptr` is a live `Slot<T>` (this entry holds a reference to it), whose
        // `repr(C)` layout starts with its `Flags`.
        unsafe { &*self.ptr.cast::<Flags>() }
    }
}

/// # Safety
/// `ptr` came from `Arc::into_raw` of an `Arc<Slot<T>>`, and this is its only release;
/// `exiting` only from the slot's own thread.
unsafe fn release<T: ThreadSlot>(ptr: *const (), exiting: bool) {
    // SAFETY: the caller's promise: one reference, given back once.
    let slot = unsafe { Arc::from_raw(ptr.cast::<Slot<T>>()) };
    if exiting {
        // Under the registry's lock, so a visit sees the slot either in the registry or
        // folded into the shared state, never both.
        let mut slots = slot.inner.lock();
        slot.value.retire(&slot.inner.shared);
        slots.retain(|s| !Arc::ptr_eq(s, &slot));
    }
}

/// How many entries a thread keeps before it drops those of objects that are gone.
const PRUNE_AT: usize = 16;

#[derive(Default)]
struct Entries(Vec<Entry>);

impl Entries {
    /// Drops the entries of objects that are gone: their slot's only owner is this list.
    fn prune(&mut self) {
        forget_last();
        self.0.retain(|e| {
            if e.flags().orphaned.load(Ordering::Relaxed) {
                // SAFETY: the entry holds one reference and is removed here.
                unsafe { (e.release)(e.ptr, false) };
                false
            } else {
                true
            }
        });
    }
}

impl Drop for Entries {
    fn drop(&mut self) {
        // Later thread-local destructors (a cache freeing into an adaptor) must not find
        // a slot through `LAST` once its entry is gone.
        forget_last();
        for e in self.0.drain(..) {
            // SAFETY: the entry holds one reference, given back here once, on the
            // slot's own thread.
            unsafe { (e.release)(e.ptr, true) };
        }
    }
}

/// Entries of `LAST`: an object's is `way(id)`.
const WAYS: usize = 4;

#[inline]
fn way(id: u64) -> usize {
    (id % WAYS as u64) as usize
}

fn forget_last() {
    let _ = LAST.try_with(|last| {
        for way in last {
            way.set((0, std::ptr::null()));
        }
    });
}

// `LAST`: per way, (object id, slot) of the entry of that way used last, or id 0 (never
// an object's). No destructor, so it stays readable while other thread-locals are
// dropped.
#[cfg(not(memres_loom))]
thread_local! {
    static ENTRIES: RefCell<Entries> = const { RefCell::new(Entries(Vec::new())) };
    static LAST: [Cell<(u64, *const ())>; WAYS] =
        const { [const { Cell::new((0, std::ptr::null())) }; WAYS] };
}

#[cfg(memres_loom)]
loom::thread_local! {
    static ENTRIES: RefCell<Entries> = RefCell::new(Entries(Vec::new()));
    static LAST: [Cell<(u64, *const ())>; WAYS] =
        [const { Cell::new((0, std::ptr::null())) }; WAYS];
}

/// loom models of the slots' protocol (run by `.ci/run` with `--cfg memres_loom`): a
/// thread's slot folds into the shared part exactly once as the thread exits, also while
/// another thread reads or the object drops, and a thread that comes after an exited one
/// gets a slot of its own.
#[cfg(all(test, memres_loom))]
mod loom_models {
    use loom::thread;

    use super::{PerThread, ThreadSlot};
    use crate::sync::Arc;
    use crate::sync::atomic::{AtomicU64, Ordering};

    /// A count per thread, folded into a shared count (kept in an `Arc` so that a model
    /// can read it after the object is gone).
    struct Count(AtomicU64);

    impl Default for Count {
        fn default() -> Self {
            Count(AtomicU64::new(0))
        }
    }

    impl ThreadSlot for Count {
        type Shared = Arc<AtomicU64>;

        fn retire(&self, shared: &Self::Shared) {
            shared.fetch_add(self.0.load(Ordering::Relaxed), Ordering::Relaxed);
        }
    }

    /// Adds `n` as the counters do: a load and a store on the thread's own slot.
    fn add(counts: &PerThread<Count>, n: u64) {
        match counts.get() {
            Some(slot) => {
                let v = slot.0.load(Ordering::Relaxed);
                slot.0.store(v + n, Ordering::Relaxed);
            }
            None => {
                counts.shared().fetch_add(n, Ordering::Relaxed);
            }
        }
    }

    fn total(counts: &PerThread<Count>) -> u64 {
        let mut live = 0;
        let shared = counts.read(
            |slot| live += slot.0.load(Ordering::Relaxed),
            |shared| shared.load(Ordering::Relaxed),
        );
        live + shared
    }

    fn counts() -> (Arc<PerThread<Count>>, Arc<AtomicU64>) {
        let shared = Arc::new(AtomicU64::new(0));
        (Arc::new(PerThread::new(Arc::clone(&shared))), shared)
    }

    /// A read racing a thread's exit counts the thread's slot once (in the slot or in
    /// the shared part, never both); after the join the count is exact.
    #[test]
    fn loom_per_thread_a_read_during_an_exit_counts_each_slot_once() {
        loom::model(|| {
            let (counts, _) = counts();
            let other = Arc::clone(&counts);
            let t = thread::spawn(move || add(&other, 1));
            add(&counts, 10);
            let seen = total(&counts);
            assert!(seen == 10 || seen == 11, "read {seen}");
            t.join().unwrap();
            assert_eq!(total(&counts), 11);
        });
    }

    /// The object drops while a thread that used it exits: the slot still folds into
    /// the shared part (which the slot keeps alive), once, and nothing leaks (loom
    /// checks that every `Arc` is dropped).
    #[test]
    fn loom_per_thread_an_exit_while_the_object_drops() {
        loom::model(|| {
            let (counts, shared) = counts();
            let other = Arc::clone(&counts);
            let t = thread::spawn(move || {
                add(&other, 1);
                drop(other);
            });
            add(&counts, 10);
            drop(counts);
            t.join().unwrap();
            // loom's `join` returns before the thread's thread-locals are dropped (as
            // `std::thread::scope` may): wait for the fold, which must come, once. The
            // main thread's slot folds in when the model's main thread exits.
            while shared.load(Ordering::Relaxed) == 0 {
                thread::yield_now();
            }
            assert_eq!(shared.load(Ordering::Relaxed), 1);
        });
    }

    /// A thread that starts after another has exited gets a slot of its own, and counts
    /// stay exact across both.
    #[test]
    fn loom_per_thread_a_new_thread_after_an_exited_one() {
        loom::model(|| {
            let (counts, _) = counts();
            let first = Arc::clone(&counts);
            thread::spawn(move || add(&first, 1)).join().unwrap();
            let second = Arc::clone(&counts);
            let t = thread::spawn(move || add(&second, 2));
            let seen = total(&counts);
            assert!(seen == 1 || seen == 3, "read {seen}");
            t.join().unwrap();
            assert_eq!(total(&counts), 3);
        });
    }
}
