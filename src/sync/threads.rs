//! Thread numbers and lanes: which per-thread list and which lane of a shared stream the
//! calling thread uses (the sub-allocators' stream keys, `suballoc/lists.rs`).
//!
//! A thread's number names its per-thread-stream list; the number of a thread that has
//! exited goes to the next new thread, so a program that starts and ends many threads
//! keeps as many lists as it runs at once, and a generation no other thread ever has
//! tells a list's new thread from its old one.
//!
//! A thread's lane is 0, the lane every thread shares, until it has found
//! a list's lock held [`WAITS_BEFORE_A_LANE`] times in quick succession
//! ([`note_contention`]: any `SpinLock` of the sub-allocators counts, as any such wait
//! means threads running into each other); then it takes a
//! lane of its own (1 to [`OWN_LANES`], handed out in turn, so threads that run together use
//! different lists of one stream). Threads that use a stream one after another (PyTorch's
//! main thread and its autograd thread, a producer and a consumer that take turns) so keep
//! one list, and a block one of them frees serves the other's next request at once; only
//! threads that run into each other pay for lanes (blocks moving between lists). The
//! environment variable [`LANES_VARIABLE`]`=per-thread` (read once) gives every thread its
//! own lane at its first call instead (the rule before), and `suballoc::own_lane` gives the
//! calling thread its own at once.
//!
//! These are process-wide statics of `std` even under loom (a loom model's threads would
//! otherwise need numbering per model run): they decide only which list a thread uses,
//! and every list is correct for every thread, so no model of them is needed; loom's
//! threads share one lane (`ARCHITECTURE.md`, "Lanes").

/// Lanes of one stream (see `StreamKey::of_lane`): the shared lane 0 and up to
/// [`OWN_LANES`] lanes of their own, in a key space of this many.
pub(crate) const LANES: u64 = 32;

/// Lanes handed to threads of their own (1 to 16): as many as the threads that run on
/// one stream at once in the workloads' `random-1stream` (with 15, two of its 16 threads
/// shared a lane and held the whole run up: 9.5 -> 33 ns an op on the H200's host).
pub(crate) const OWN_LANES: u64 = 16;

/// Times a thread finds a lock held, each within [`QUIET_SPELL`] of the one before,
/// before it takes a lane of its own: a few, so that threads which touch a stream at once
/// only by chance (one at the end of its turn, the other at the start of its own) keep
/// sharing a list.
pub(crate) const WAITS_BEFORE_A_LANE: u32 = 4;

/// The environment variable that, set to `per-thread`, gives every thread a lane of its
/// own at its first call (read once, at the first lane handed out).
pub(crate) const LANES_VARIABLE: &str = "MEMRES_LANES";

/// Lanes of their own are handed to threads in turn, so threads that run together have
/// different ones.
static NEXT_LANE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// [`LANE`] before the thread has looked at [`LANES_VARIABLE`].
const NOT_LOOKED: u64 = u64::MAX;

// The calling thread's lane: `NOT_LOOKED` before its first call, then 0 (shared) until it
// takes one of its own. A plain `Cell` with a const initialiser and no destructor: the
// cheapest thread-local there is (one load on the fast path), and usable in every
// thread-local destructor.
thread_local!(static LANE: std::cell::Cell<u64> = const { std::cell::Cell::new(NOT_LOOKED) });

/// A time without a wait after which a thread's count of waits starts again: threads
/// that take turns meet at a lock now and then; threads that run together meet many
/// times a millisecond.
const QUIET_SPELL: std::time::Duration = std::time::Duration::from_millis(10);

// When the calling thread last found a lock held (no destructor: usable in thread-local
// destructors).
thread_local!(static LAST_WAIT: std::cell::Cell<Option<std::time::Instant>> = const { std::cell::Cell::new(None) });

// Waits for a held list lock the calling thread has made while in lane 0.
thread_local!(static WAITS: std::cell::Cell<u32> = const { std::cell::Cell::new(0) });

/// The calling thread's lane of a shared stream.
#[inline]
pub(crate) fn this_lane() -> u64 {
    let lane = LANE.with(std::cell::Cell::get);
    if lane != NOT_LOOKED {
        return lane;
    }
    first_look()
}

/// A thread's first lane: its own where [`LANES_VARIABLE`] says `per-thread`, else 0.
#[cold]
fn first_look() -> u64 {
    static PER_THREAD: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let per_thread = *PER_THREAD.get_or_init(|| match std::env::var(LANES_VARIABLE) {
        Ok(v) if v == "per-thread" => true,
        Ok(v) => {
            tracing::warn!("memres: {LANES_VARIABLE}={v:?} ignored (the one value is per-thread)");
            false
        }
        Err(_) => false,
    });
    if per_thread {
        take_a_lane()
    } else {
        LANE.with(|l| l.set(0));
        0
    }
}

/// Gives the calling thread a lane of its own (1 to [`OWN_LANES`], in turn).
fn take_a_lane() -> u64 {
    let lane = 1 + NEXT_LANE.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % OWN_LANES;
    LANE.with(|l| l.set(lane));
    lane
}

/// Gives the calling thread a lane of its own unless it has one.
pub(crate) fn own_lane() {
    if this_lane() == 0 {
        take_a_lane();
    }
}

/// The calling thread found a list's lock held (`SpinLock`'s wait): after
/// [`WAITS_BEFORE_A_LANE`] such waits in the shared lane it takes a lane of its own. Not
/// under loom, whose threads share this thread-local across models (every list is correct
/// for every thread; lanes only spread the locks).
#[cold]
pub(crate) fn note_contention() {
    if cfg!(memres_loom) || this_lane() != 0 {
        return;
    }
    // Waits far apart are chance meetings of threads that take turns: the count starts
    // again after a quiet spell.
    let now = std::time::Instant::now();
    let quiet = LAST_WAIT
        .with(std::cell::Cell::get)
        .is_some_and(|last| now.duration_since(last) > QUIET_SPELL);
    LAST_WAIT.with(|l| l.set(Some(now)));
    let waits = if quiet {
        1
    } else {
        WAITS.with(std::cell::Cell::get) + 1
    };
    WAITS.with(|w| w.set(waits));
    if waits >= WAITS_BEFORE_A_LANE {
        take_a_lane();
    }
}

/// The calling thread as the per-thread lists see it: a `number` that names its list (a
/// number freed by an exited thread is given to the next new thread) and a `generation`
/// that no other thread ever has.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct ThisThread {
    pub(crate) number: usize,
    pub(crate) generation: u64,
}

/// Holds the thread's number; gives it back when the thread exits.
struct NumberHolder(ThisThread);

/// Thread numbers that exited threads gave back.
static FREE_NUMBERS: std::sync::Mutex<Vec<usize>> = std::sync::Mutex::new(Vec::new());
static NEXT_NUMBER: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(1);
static NEXT_GENERATION: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl NumberHolder {
    fn take() -> NumberHolder {
        let reused = crate::sync::lock_std(&FREE_NUMBERS).pop();
        NumberHolder(ThisThread {
            number: reused
                .unwrap_or_else(|| NEXT_NUMBER.fetch_add(1, std::sync::atomic::Ordering::Relaxed)),
            generation: new_generation(),
        })
    }
}

pub(crate) fn new_generation() -> u64 {
    NEXT_GENERATION.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

impl Drop for NumberHolder {
    fn drop(&mut self) {
        crate::sync::lock_std(&FREE_NUMBERS).push(self.0.number);
    }
}

thread_local!(static THIS_THREAD: NumberHolder = NumberHolder::take());

/// The calling thread's number and generation. A thread whose number has already been
/// given back (code running in its thread-local destructors) uses list 0 with a fresh
/// generation each time: list 0 is then taken over, after a wait, on every such call.
#[inline]
pub(crate) fn this_thread() -> ThisThread {
    THIS_THREAD
        .try_with(|t| t.0)
        .unwrap_or_else(|_| ThisThread {
            number: 0,
            generation: new_generation(),
        })
}

#[cfg(all(test, not(memres_loom)))]
mod tests {
    use super::*;
    use crate::sync::spin::SpinLock;
    use std::sync::Barrier;
    use std::time::Duration;

    /// A thread starts in the shared lane and takes one of its own once it has found a
    /// list's lock held a few times: here another thread holds a lock for a moment each
    /// round while it asks for it.
    #[test]
    fn a_thread_that_keeps_finding_a_lock_held_takes_a_lane_of_its_own() {
        if std::env::var(LANES_VARIABLE).is_ok() {
            return; // lanes handed out at the first call
        }
        let lock = SpinLock::new(());
        let (held, done) = (Barrier::new(2), Barrier::new(2));
        let spread = std::sync::atomic::AtomicBool::new(false);
        let (first_lane, rounds) = std::thread::scope(|s| {
            let asker = s.spawn(|| {
                // Checked after the join: a panic here would leave the other thread
                // waiting at the barrier for good.
                let first_lane = this_lane();
                for round in 1..=1000 {
                    held.wait();
                    drop(lock.lock());
                    let own = this_lane() != 0;
                    spread.store(own || round == 1000, std::sync::atomic::Ordering::Relaxed);
                    done.wait();
                    if own {
                        return (first_lane, round);
                    }
                }
                (first_lane, usize::MAX) // no lane of its own after 1,000 waits
            });
            while !spread.load(std::sync::atomic::Ordering::Relaxed) {
                let guard = lock.lock();
                held.wait();
                std::thread::sleep(Duration::from_millis(2));
                drop(guard);
                done.wait();
            }
            asker.join().unwrap()
        });
        assert_eq!(first_lane, 0, "a new thread shares lane 0");
        assert!(rounds < usize::MAX, "no lane of its own after 1,000 waits");
        assert!(rounds >= WAITS_BEFORE_A_LANE as usize, "{rounds} rounds");
    }

    /// Waits far apart (threads that take turns and meet now and then) do not add up: a
    /// thread that has found a lock held three times in quick succession, then again
    /// after a quiet spell, keeps the shared lane with a count of one. (Rounds where the
    /// asker came late and found the lock free count nothing and are run again; a
    /// machine too loaded for three waits within the spell leaves the test inconclusive.)
    #[test]
    fn waits_after_a_quiet_spell_start_the_count_again() {
        use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
        if std::env::var(LANES_VARIABLE).is_ok() {
            return; // lanes handed out at the first call
        }
        let lock = SpinLock::new(());
        let (held, done) = (Barrier::new(2), Barrier::new(2));
        let (quiet_next, finished) = (AtomicBool::new(false), AtomicBool::new(false));
        let waits = || WAITS.with(std::cell::Cell::get);
        let outcome = std::thread::scope(|s| {
            let asker = s.spawn(|| {
                let round = |last: bool| {
                    held.wait();
                    drop(lock.lock());
                    let counted = waits();
                    quiet_next.store(counted == WAITS_BEFORE_A_LANE - 1, Relaxed);
                    finished.store(last, Relaxed);
                    done.wait();
                    counted
                };
                // Three waits in quick succession.
                let mut rounds = 0;
                while round(false) + 1 < WAITS_BEFORE_A_LANE {
                    rounds += 1;
                    if rounds == 200 {
                        round(true);
                        return None;
                    }
                }
                // After the quiet spell: rounds until one counts a wait.
                for _ in 0..200 {
                    if round(false) != WAITS_BEFORE_A_LANE - 1 {
                        break;
                    }
                }
                let seen = (this_lane(), waits());
                round(true);
                Some(seen)
            });
            loop {
                let guard = lock.lock();
                held.wait();
                std::thread::sleep(Duration::from_millis(2));
                drop(guard);
                done.wait();
                if finished.load(Relaxed) {
                    break;
                }
                if quiet_next.load(Relaxed) {
                    std::thread::sleep(QUIET_SPELL * 3);
                }
            }
            asker.join().unwrap()
        });
        match outcome {
            Some(seen) => assert_eq!(seen, (0, 1), "the count started again"),
            None => println!("inconclusive: no three waits within {QUIET_SPELL:?} here"),
        }
    }

    /// `own_lane` gives a thread in the shared lane a lane of its own, and keeps it.
    #[test]
    fn own_lane_takes_a_lane_once() {
        std::thread::spawn(|| {
            own_lane();
            let lane = this_lane();
            assert!((1..=OWN_LANES).contains(&lane));
            own_lane();
            assert_eq!(this_lane(), lane);
        })
        .join()
        .unwrap();
    }
}
