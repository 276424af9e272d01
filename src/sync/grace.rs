//! Grace periods: when memory that other threads reach through lock-free pointers may be
//! freed.
//!
//! A reader marks the time it may hold such pointers by [`pin`]ning its thread in the
//! [`Domain`] the memory belongs to (a guard; pins nest, also pins of several domains: a
//! pool whose upstream is another pool). A reclaimer takes a [`Waiter`] ([`can_wait`]),
//! makes the memory unreachable (no pointer to it is left where a reader could newly
//! load one), then calls [`wait_for_readers`] with the memory's domain: once it returns,
//! every reader of that domain that could have loaded a pointer to the memory has
//! unpinned, and the memory can be freed. Each pool (each stream map) is a domain of its
//! own, so a `trim` waits only for calls in its own pool (issue 49: it waited for a call
//! in any pool, twice, and never returned when that call waited for the trimming thread).
//!
//! **Protocol.** Each thread has a slot with a word that only it writes: its pinned bit
//! set while it is pinned, the domains of its current pins (the outermost pin's, and one
//! nested pin's of another domain; a thread pinned in more than two at once, or in
//! domain 0, is marked as in every domain) and a count of its outermost pins. Pinning
//! stores the word (relaxed) and runs the light fence ([`barrier::light`], a compiler
//! fence); a nested pin of another domain stores it again with that domain and runs the
//! light fence again; unpinning stores the word with the pinned bit clear (release). The
//! reclaimer, after unlinking, runs the heavy fence ([`barrier::heavy`]: every thread
//! executes a full fence), then reads every registered slot (acquire) and waits until
//! each one pinned in its domain has changed. The fences order each side's store before
//! its later loads (the pattern of [`barrier`]), so for every pin either the reclaimer
//! reads it, with its domain (and waits for its end), or the reader's loads after its
//! light fence see the unlinking, and never reach the memory. A thread that registers its
//! slot after the reclaimer's read of the registry takes the registry's lock after it, so
//! its loads see the unlinking too. A thread whose slot is gone (code in its
//! thread-local destructors) pins through a process-wide count instead, with a
//! read-modify-write and a full fence; the reclaimer (of any domain) waits for that count
//! to reach 0.
//!
//! **Fork.** A child process runs only the thread that forked: the slots of the others,
//! perhaps pinned, would be waited for forever. A `pthread_atfork` handler holds the
//! registry's lock across the fork and, in the child, keeps only the forking thread's slot
//! and its own part of the exiting threads' count (and has the child register for
//! `membarrier` again).
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

use crate::sync::{Mutex, barrier, lock, lock_std, yield_now};

// The word of a slot: the pinned bit, the "every domain" bit, two domains of 20 bits
// (the outermost pin's; a nested pin's of another, 0 for none) and the count of
// outermost pins above them (so that every pin stores a new word).
const PINNED: u64 = 1;
const EVERY_DOMAIN: u64 = 2;
const DOMAIN_BITS: u32 = 20;
const DOMAIN_MASK: u64 = (1 << DOMAIN_BITS) - 1;
const FIRST_SHIFT: u32 = 2;
const SECOND_SHIFT: u32 = FIRST_SHIFT + DOMAIN_BITS;
const COUNT_SHIFT: u32 = SECOND_SHIFT + DOMAIN_BITS;

/// Whether a pin whose word is `word` is in domain `id` (not 0; the pinned bit aside).
#[inline]
fn covers(word: u64, id: u64) -> bool {
    word & EVERY_DOMAIN != 0
        || (word >> FIRST_SHIFT) & DOMAIN_MASK == id
        || (word >> SECOND_SHIFT) & DOMAIN_MASK == id
}

/// The readers a reclaimer waits for together: a pool's (its stream map's) calls.
/// Identified by a number unique among the domains that exist (numbers are reused once
/// a domain drops); past 2^20 - 1 domains at once, a new one is domain 0, which a
/// reclaimer of any domain waits for and whose reclaimers wait for every domain.
pub(crate) struct Domain {
    /// The bits an outermost pin in the domain sets in its slot's word: `id <<
    /// FIRST_SHIFT`, `EVERY_DOMAIN` for domain 0, and `PINNED`.
    bits: u64,
}

/// The numbers of the domains: the next never given, and those given back. A `std`
/// mutex also under loom: no ordering of the protocol rests on the numbers.
struct Numbers {
    next: u64,
    free: Vec<u64>,
}

static NUMBERS: std::sync::Mutex<Numbers> = std::sync::Mutex::new(Numbers {
    next: 1,
    free: Vec::new(),
});

impl Domain {
    pub(crate) fn new() -> Domain {
        #[cfg(all(not(memres_loom), target_os = "linux"))]
        fork::handle();
        let id = {
            let mut numbers = lock_std(&NUMBERS);
            match numbers.free.pop() {
                Some(id) => id,
                None if numbers.next <= DOMAIN_MASK => {
                    numbers.next += 1;
                    numbers.next - 1
                }
                None => 0,
            }
        };
        Domain {
            bits: (id << FIRST_SHIFT) | if id == 0 { EVERY_DOMAIN } else { 0 } | PINNED,
        }
    }

    fn id(&self) -> u64 {
        (self.bits >> FIRST_SHIFT) & DOMAIN_MASK
    }

    /// Whether a pin's `word` is in this domain (the pinned bit aside): for domain 0,
    /// only a pin in every domain is.
    #[inline]
    fn named_in(&self, word: u64) -> bool {
        if self.bits & EVERY_DOMAIN != 0 {
            word & EVERY_DOMAIN != 0
        } else {
            covers(word, self.id())
        }
    }
}

impl Drop for Domain {
    fn drop(&mut self) {
        // No thread is pinned in it any more (its owner is going, and pins live inside
        // calls on it), so no slot's current pin names the number.
        if self.id() != 0 {
            lock_std(&NUMBERS).free.push(self.id());
        }
    }
}

/// One thread's pin word (see the module); only the thread writes it.
struct Slot {
    word: AtomicU64,
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
        // slot reads unpinned; from now on the thread pins through `EXITING`.
        let _ = SLOT.try_with(|s| s.set(std::ptr::null()));
        // (Under loom a thread's thread-locals drop after the model's lazy statics are
        // gone: the slot stays listed, unpinned, which a reclaimer passes over.)
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
                word: AtomicU64::new(0),
            });
            lock(&SLOTS).push(Arc::clone(&slot));
            let at: *const Slot = &*slot;
            let _ = r.set(Registration { slot });
            SLOT.with(|s| s.set(at));
            at
        })
        .unwrap_or(std::ptr::null())
}

/// A pinned thread: memory of the domain reached through pointers loaded while it lives
/// is not freed by a reclaimer that waits for the domain's readers
/// ([`wait_for_readers`]). Not `Send`: it marks the thread that made it.
#[must_use = "the thread is pinned only while the guard lives"]
pub(crate) struct Pin {
    /// The thread's slot, where this is its outermost pin; null for a nested pin, and
    /// where the thread pinned through the process-wide count (its slot was gone: it is
    /// exiting; `exiting` says which).
    slot: *const Slot,
    exiting: bool,
}

/// Pins the calling thread in `domain` until the guard drops.
#[inline]
pub(crate) fn pin(domain: &Domain) -> Pin {
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
    // Only this thread writes its slot: a relaxed load reads its own last store.
    let word = s.word.load(Ordering::Relaxed);
    if word & PINNED != 0 {
        // This pin nests in another, which keeps the thread pinned; its domain joins
        // the outer pin's unless they are the same.
        if !domain.named_in(word) {
            nest(s, word, domain);
        }
        return Pin {
            slot: std::ptr::null(),
            exiting: false,
        };
    }
    // The count goes up by one (all bits below it set, plus one, carries into it and
    // clears them), and the domain's bits and the pinned bit go in.
    let counted = (word | ((1 << COUNT_SHIFT) - 1)).wrapping_add(1);
    s.word.store(counted | domain.bits, Ordering::Relaxed);
    barrier::light();
    Pin {
        slot,
        exiting: false,
    }
}

/// A nested pin of a domain the thread's word does not name yet: the second domain, or
/// every domain if there is one already.
#[cold]
#[inline(never)]
fn nest(s: &Slot, word: u64, domain: &Domain) {
    let added = if domain.bits & EVERY_DOMAIN == 0 && (word >> SECOND_SHIFT) & DOMAIN_MASK == 0 {
        domain.id() << SECOND_SHIFT
    } else {
        EVERY_DOMAIN
    };
    s.word.store(word | added, Ordering::Relaxed);
    barrier::light();
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
            let word = s.word.load(Ordering::Relaxed);
            s.word.store(word & !PINNED, Ordering::Release);
        }
    }
}

/// Whether the calling thread is pinned now (in any domain).
fn pinned_here() -> bool {
    let slot = SLOT.with(Cell::get);
    // SAFETY: as in `pin`: a slot in `SLOT` is registered.
    let in_slot = !slot.is_null() && unsafe { &*slot }.word.load(Ordering::Relaxed) & PINNED != 0;
    in_slot || EXIT_DEPTH.with(Cell::get) > 0
}

/// Proof that the calling thread may wait for readers ([`can_wait`]): grace periods are
/// offered here, and the thread was not pinned when it got this (it must not pin while
/// it waits: it could wait for itself). Not `Send`: it speaks for one thread.
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

/// Waits until every thread that was pinned in `domain` when this was called has
/// unpinned, so that memory of the domain unlinked before the call (unreachable to new
/// loads) can be freed. Threads pinned only in other domains are not waited for.
pub(crate) fn wait_for_readers(_: &Waiter, domain: &Domain) {
    debug_assert!(!pinned_here(), "a pinned thread could wait for itself");
    barrier::heavy();
    // Domain 0's reclaimers wait for every pinned thread.
    let every = domain.id() == 0;
    let pinned: Vec<(Arc<Slot>, u64)> = lock(&SLOTS)
        .iter()
        .map(|s| (Arc::clone(s), s.word.load(Ordering::Acquire)))
        .filter(|&(_, word)| word & PINNED != 0 && (every || domain.named_in(word)))
        .collect();
    for (slot, word) in pinned {
        // The same outermost pin while the thread is pinned with the same count: a pin
        // nested in it adds domains to the word, which does not end it.
        let same_pin = |now: u64| now & PINNED != 0 && now >> COUNT_SHIFT == word >> COUNT_SHIFT;
        while same_pin(slot.word.load(Ordering::Acquire)) {
            yield_now();
        }
    }
    while EXITING.load(Ordering::Acquire) != 0 {
        yield_now();
    }
}

/// The `pthread_atfork` handlers (see the module).
#[cfg(all(not(memres_loom), target_os = "linux"))]
mod fork {
    use std::cell::RefCell;
    use std::sync::{MutexGuard, Once};

    use super::{EXIT_DEPTH, EXITING, NUMBERS, Numbers, SLOT, SLOTS, Slot, lock, lock_std};
    use crate::sync::atomic::Ordering;

    type Held = (
        MutexGuard<'static, Vec<std::sync::Arc<Slot>>>,
        MutexGuard<'static, Numbers>,
    );

    thread_local! {
        /// The registry's and the numbers' locks, held by the forking thread from
        /// `prepare` to `parent` or `child`.
        static HELD: RefCell<Option<Held>> = const { RefCell::new(None) };
    }

    /// Installs the handlers, once per process.
    pub(super) fn handle() {
        static ONCE: Once = Once::new();
        ONCE.call_once(|| {
            // SAFETY: the handlers are `extern "C"` functions without arguments that
            // never unwind (no panic: locks that ignore poisoning, `try_with`).
            let r = unsafe { libc::pthread_atfork(Some(prepare), Some(parent), Some(child)) };
            if r != 0 {
                tracing::warn!(
                    "memres: pthread_atfork failed ({r}): a forked child's trims may wait \
                     for threads of its parent"
                );
            }
        });
    }

    /// Before the fork: no other thread holds the registry or the numbers as the child's
    /// copy is taken.
    extern "C" fn prepare() {
        let held = (lock(&SLOTS), lock_std(&NUMBERS));
        let _ = HELD.try_with(|h| *h.borrow_mut() = Some(held));
    }

    /// In the parent after the fork.
    extern "C" fn parent() {
        let _ = HELD.try_with(|h| h.borrow_mut().take());
    }

    /// In the child, which runs only this thread: the other threads' slots go (they
    /// would read pinned forever), and so does their part of the exiting count.
    extern "C" fn child() {
        let _ = HELD.try_with(|h| {
            if let Some((mut slots, numbers)) = h.borrow_mut().take() {
                let own = SLOT
                    .try_with(std::cell::Cell::get)
                    .unwrap_or(std::ptr::null());
                slots.retain(|s| std::ptr::eq(&**s, own));
                let depth = EXIT_DEPTH.try_with(std::cell::Cell::get).unwrap_or(0);
                EXITING.store(depth as usize, Ordering::SeqCst);
                drop((slots, numbers));
            }
        });
        crate::sync::barrier::forget_registration();
    }
}

#[cfg(all(test, not(memres_loom)))]
mod tests {
    use super::*;

    /// Pins nest: the thread stays pinned until the outer guard drops.
    #[test]
    fn pins_nest() {
        let domain = Domain::new();
        assert!(!pinned_here());
        let outer = pin(&domain);
        {
            let _inner = pin(&domain);
            assert!(pinned_here());
        }
        assert!(pinned_here());
        drop(outer);
        assert!(!pinned_here());
    }

    /// A pinned thread cannot wait for readers (it could wait for itself).
    #[test]
    fn a_pinned_thread_does_not_wait_for_itself() {
        let _pin = pin(&Domain::new());
        assert!(can_wait().is_none());
    }

    /// The reclaimer of a domain waits while another thread is pinned in it (directly,
    /// nested in another domain's pin, or in domain 0), and returns once it unpins.
    #[test]
    fn waits_for_a_thread_pinned_in_its_domain() {
        if !barrier::heavy_available() {
            println!("memres-skip: no membarrier here: grace periods are not offered");
            return;
        }
        let (domain, other) = (Domain::new(), Domain::new());
        let zero = Domain {
            bits: EVERY_DOMAIN | PINNED,
        };
        for how in ["directly", "nested", "nested third", "domain 0"] {
            let released = std::sync::atomic::AtomicBool::new(false);
            let (pinned_tx, pinned_rx) = std::sync::mpsc::channel();
            std::thread::scope(|s| {
                s.spawn(|| {
                    let third = Domain::new();
                    let _pins = match how {
                        "directly" => vec![pin(&domain)],
                        "nested" => vec![pin(&other), pin(&domain)],
                        "nested third" => vec![pin(&other), pin(&third), pin(&domain)],
                        _ => vec![pin(&zero)],
                    };
                    pinned_tx.send(()).unwrap();
                    std::thread::sleep(std::time::Duration::from_millis(50));
                    released.store(true, std::sync::atomic::Ordering::SeqCst);
                });
                pinned_rx.recv().unwrap();
                let waiter = can_wait().expect("membarrier, checked above");
                wait_for_readers(&waiter, &domain);
                assert!(
                    released.load(std::sync::atomic::Ordering::SeqCst),
                    "returned while the other thread was pinned ({how})"
                );
            });
        }
    }

    /// The reclaimer of a domain does not wait for a thread pinned in another only: that
    /// thread here waits for the reclaimer to return (issue 49: a trim waited for calls
    /// in every pool, so this never returned).
    #[test]
    fn does_not_wait_for_a_thread_pinned_in_another_domain() {
        if !barrier::heavy_available() {
            println!("memres-skip: no membarrier here: grace periods are not offered");
            return;
        }
        let (domain, other) = (Domain::new(), Domain::new());
        let (pinned_tx, pinned_rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        std::thread::scope(|s| {
            let other = &other;
            let reader = s.spawn(move || {
                let _pin = pin(other);
                pinned_tx.send(()).unwrap();
                done_rx.recv_timeout(std::time::Duration::from_secs(10))
            });
            pinned_rx.recv().unwrap();
            let waiter = can_wait().expect("membarrier, checked above");
            wait_for_readers(&waiter, &domain);
            done_tx.send(()).unwrap();
            assert!(
                reader.join().unwrap().is_ok(),
                "the reclaimer waited for a thread pinned in another domain"
            );
        });
    }

    /// A pin's word names its domains: the outermost, a nested one, then every domain;
    /// a new outermost pin names its own only.
    #[test]
    fn words_name_the_domains_of_the_pins() {
        let (a, b, c) = (Domain::new(), Domain::new(), Domain::new());
        assert!(a.id() != 0 && a.id() != b.id() && b.id() != c.id() && a.id() != c.id());
        let word = || {
            // SAFETY: called while this thread is pinned, so its slot is registered.
            let slot = unsafe { &*SLOT.with(Cell::get) };
            slot.word.load(Ordering::Relaxed)
        };
        let outer = pin(&a);
        let w = word();
        assert!(a.named_in(w) && !b.named_in(w) && !c.named_in(w));
        let inner = pin(&b);
        let w = word();
        assert!(a.named_in(w) && b.named_in(w) && !c.named_in(w));
        let innermost = pin(&c);
        let w = word();
        assert!(a.named_in(w) && b.named_in(w) && c.named_in(w));
        drop((innermost, inner, outer));
        let again = pin(&c);
        let w = word();
        assert!(!a.named_in(w) && !b.named_in(w) && c.named_in(w));
        drop(again);
    }
}
