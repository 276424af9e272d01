//! Grace periods: when memory that other threads reach through lock-free pointers may be
//! freed.
//!
//! A reader marks the time it may hold such pointers by [`pin`]ning its thread (a guard;
//! pins nest). A reclaimer takes a [`Waiter`] ([`can_wait`]), makes the memory
//! unreachable (no pointer to it is left where a reader could newly load one), then calls
//! [`wait_for_readers`]: once it returns, every reader that could have loaded a pointer to
//! the memory has unpinned, and the memory can be freed.
//!
//! **Protocol.** Each thread has a slot with a counter that only it writes: odd while it
//! is pinned. Pinning stores the odd value (relaxed) and runs the light fence
//! ([`barrier::light`], a compiler fence); unpinning stores the next even value (release).
//! The reclaimer, after unlinking, runs the heavy fence ([`barrier::heavy`]: every thread
//! executes a full fence), then reads every registered slot (acquire) and waits until each
//! odd one has changed. The fences order each side's store before its later loads (the
//! pattern of [`barrier`]), so for every pin either the reclaimer reads it odd (and waits
//! for its end) or the reader's loads after its light fence see the unlinking, and never
//! reach the memory. A thread that registers its slot after the reclaimer's read of the
//! registry takes the registry's lock after it, so its loads see the unlinking too.
//! A thread whose slot is gone (code in its thread-local destructors) pins through a
//! process-wide count instead, with a read-modify-write and a full fence; the reclaimer
//! waits for that count to reach 0.
//!
//! The hot side costs a thread-local access and two plain stores; the reclaimer's side
//! is a system call and a scan of the threads, for rare work (`Pool::trim`). Where the
//! heavy fence is not offered (no `membarrier`: Linux before 4.14, other systems),
//! [`can_wait`] gives no [`Waiter`] and nothing may be freed. `src/suballoc/
//! loom_models.rs` checks the protocol (under loom both fences are `SeqCst` fences).

use std::cell::Cell;
use std::marker::PhantomData;

use crate::sync::atomic::{AtomicU64, AtomicUsize, Ordering, fence};
// A slot's keep-alive count is std's also under loom: no ordering of the protocol rests
// on it, and a loom count dropped in a thread's thread-local destructors (which loom runs
// in no fixed order once a model's execution ends) made models that also keep loom
// objects in thread-locals (a `Limiting`'s per-thread reserves) nondeterministic.
use std::sync::Arc;

use crate::sync::{Mutex, barrier, lock, yield_now};

/// One thread's pin counter (odd: pinned).
struct Slot {
    /// Odd while the thread is pinned (its outermost pin turns it odd, that pin's drop
    /// even again); only the thread writes it.
    seq: AtomicU64,
}

// Every thread's slot. (Under loom, lazy statics, which each model execution builds
// afresh.)
#[cfg(not(memres_loom))]
static SLOTS: Mutex<Vec<Arc<Slot>>> = Mutex::new(Vec::new());
#[cfg(not(memres_loom))]
static EXITING: AtomicUsize = AtomicUsize::new(0);
#[cfg(memres_loom)]
loom::lazy_static! {
    static ref SLOTS: Mutex<Vec<Arc<Slot>>> = Mutex::new(Vec::new());
    static ref EXITING: AtomicUsize = AtomicUsize::new(0);
}

/// The calling thread's registration: holds its slot in the registry until the thread
/// exits.
struct Registration {
    slot: Arc<Slot>,
}

impl Drop for Registration {
    fn drop(&mut self) {
        // Never pinned here (a pin ends before the code that made it returns), so the
        // slot reads even; from now on the thread pins through `EXITING`.
        let _ = SLOT.try_with(|s| s.set(std::ptr::null()));
        // (Under loom a thread's thread-locals drop after the model's lazy statics are
        // gone: the slot stays listed, even, which a reclaimer passes over.)
        if cfg!(not(memres_loom)) {
            lock(&SLOTS).retain(|s| !Arc::ptr_eq(s, &self.slot));
        }
    }
}

// The thread's slot (null until it registers, and again once it has left the registry)
// and how deep the pins of a thread without a slot (exiting) nest: thread-locals without
// destructors, read in one load each.
#[cfg(not(memres_loom))]
thread_local! {
    static SLOT: Cell<*const Slot> = const { Cell::new(std::ptr::null()) };
    static EXIT_DEPTH: Cell<u32> = const { Cell::new(0) };
    static REGISTRATION: std::cell::OnceCell<Registration> = const { std::cell::OnceCell::new() };
}
#[cfg(memres_loom)]
loom::thread_local! {
    static SLOT: Cell<*const Slot> = Cell::new(std::ptr::null());
    static EXIT_DEPTH: Cell<u32> = Cell::new(0);
    static REGISTRATION: std::cell::OnceCell<Registration> = std::cell::OnceCell::new();
}

/// The calling thread's slot, registered on its first pin; null once the thread has
/// left the registry (it is exiting).
#[cold]
fn register() -> *const Slot {
    REGISTRATION
        .try_with(|r| {
            if r.get().is_some() {
                // Registered and left: the thread is exiting.
                return std::ptr::null();
            }
            let slot = Arc::new(Slot {
                seq: AtomicU64::new(0),
            });
            lock(&SLOTS).push(Arc::clone(&slot));
            let at: *const Slot = &*slot;
            let _ = r.set(Registration { slot });
            SLOT.with(|s| s.set(at));
            at
        })
        .unwrap_or(std::ptr::null())
}

/// A pinned thread: memory reached through pointers loaded while it lives is not freed
/// by a reclaimer that waits for readers ([`wait_for_readers`]). Not `Send`: it marks
/// the thread that made it.
#[must_use = "the thread is pinned only while the guard lives"]
pub(crate) struct Pin {
    /// The thread's slot, where this is its outermost pin; null for a nested pin, and
    /// where the thread pinned through the process-wide count (its slot was gone: it is
    /// exiting; `exiting` says which).
    slot: *const Slot,
    exiting: bool,
}

/// Pins the calling thread until the guard drops.
#[inline]
pub(crate) fn pin() -> Pin {
    let mut slot = SLOT.with(Cell::get);
    if slot.is_null() {
        slot = register();
        if slot.is_null() {
            EXIT_DEPTH.with(|d| d.set(d.get() + 1));
            EXITING.fetch_add(1, Ordering::SeqCst);
            fence(Ordering::SeqCst);
            return Pin {
                slot,
                exiting: true,
            };
        }
    }
    // SAFETY: the registration (alive until the thread exits, and clearing `SLOT`
    // first) holds the slot.
    let s = unsafe { &*slot };
    // Only this thread writes its slot: a relaxed load reads its own last store. Odd:
    // pinned already (this pin nests in another, which keeps the thread pinned).
    let seq = s.seq.load(Ordering::Relaxed);
    if seq % 2 == 1 {
        return Pin {
            slot: std::ptr::null(),
            exiting: false,
        };
    }
    s.seq.store(seq + 1, Ordering::Relaxed);
    barrier::light();
    Pin {
        slot,
        exiting: false,
    }
}

impl Drop for Pin {
    #[inline]
    fn drop(&mut self) {
        if self.exiting {
            EXIT_DEPTH.with(|d| d.set(d.get() - 1));
            EXITING.fetch_sub(1, Ordering::Release);
            return;
        }
        if !self.slot.is_null() {
            // SAFETY: as in `pin`: the thread is pinned, so it has not begun to exit,
            // and its slot is registered.
            let s = unsafe { &*self.slot };
            let seq = s.seq.load(Ordering::Relaxed) + 1;
            s.seq.store(seq, Ordering::Release);
        }
    }
}

/// Whether the calling thread is pinned now.
fn pinned_here() -> bool {
    let slot = SLOT.with(Cell::get);
    // SAFETY: as in `pin`: a slot in `SLOT` is registered.
    let in_slot = !slot.is_null() && unsafe { &*slot }.seq.load(Ordering::Relaxed) % 2 == 1;
    in_slot || EXIT_DEPTH.with(Cell::get) > 0
}

/// Proof that the calling thread may wait for readers ([`can_wait`]): grace periods are
/// offered here, and the thread was not pinned when it got this (it must not pin while
/// it waits: it would wait for itself). Not `Send`: it speaks for one thread.
pub(crate) struct Waiter {
    _thread: PhantomData<*const ()>,
}

/// A [`Waiter`] if the calling thread can wait for readers: grace periods are offered
/// (`membarrier`) and it is not pinned. A caller asks before it unlinks anything, so that
/// it never unlinks what it then cannot free.
pub(crate) fn can_wait() -> Option<Waiter> {
    (barrier::heavy_available() && !pinned_here()).then_some(Waiter {
        _thread: PhantomData,
    })
}

/// Waits until every thread that was pinned when this was called has unpinned, so that
/// memory unlinked before the call (unreachable to new loads) can be freed.
pub(crate) fn wait_for_readers(_: &Waiter) {
    debug_assert!(!pinned_here(), "a pinned thread would wait for itself");
    barrier::heavy();
    let pinned: Vec<(Arc<Slot>, u64)> = lock(&SLOTS)
        .iter()
        .map(|s| (Arc::clone(s), s.seq.load(Ordering::Acquire)))
        .filter(|(_, seq)| seq % 2 == 1)
        .collect();
    for (slot, seq) in pinned {
        while slot.seq.load(Ordering::Acquire) == seq {
            yield_now();
        }
    }
    while EXITING.load(Ordering::Acquire) != 0 {
        yield_now();
    }
}

#[cfg(all(test, not(memres_loom)))]
mod tests {
    use super::*;

    /// Pins nest: the thread stays pinned until the outer guard drops.
    #[test]
    fn pins_nest() {
        assert!(!pinned_here());
        let outer = pin();
        {
            let _inner = pin();
            assert!(pinned_here());
        }
        assert!(pinned_here());
        drop(outer);
        assert!(!pinned_here());
    }

    /// A pinned thread cannot wait for readers (it would wait for itself).
    #[test]
    fn a_pinned_thread_does_not_wait_for_itself() {
        let _pin = pin();
        assert!(can_wait().is_none());
    }

    /// The reclaimer waits while another thread is pinned, and returns once it unpins.
    #[test]
    fn waits_for_a_pinned_thread() {
        if !barrier::heavy_available() {
            println!("memres-skip: no membarrier here: grace periods are not offered");
            return;
        }
        let released = std::sync::atomic::AtomicBool::new(false);
        let (pinned_tx, pinned_rx) = std::sync::mpsc::channel();
        std::thread::scope(|s| {
            s.spawn(|| {
                let _pin = pin();
                pinned_tx.send(()).unwrap();
                std::thread::sleep(std::time::Duration::from_millis(50));
                released.store(true, std::sync::atomic::Ordering::SeqCst);
            });
            pinned_rx.recv().unwrap();
            wait_for_readers(&can_wait().expect("membarrier, checked above"));
            assert!(
                released.load(std::sync::atomic::Ordering::SeqCst),
                "returned while the other thread was pinned"
            );
        });
    }
}
