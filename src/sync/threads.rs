//! Thread numbers and lanes: which per-thread list and which lane of a shared stream the
//! calling thread uses (the sub-allocators' stream keys, `suballoc/lists.rs`).
//!
//! A thread's number names its per-thread-stream list; the number of a thread that has
//! exited goes to the next new thread, so a program that starts and ends many threads
//! keeps as many lists as it runs at once, and a generation no other thread ever has
//! tells a list's new thread from its old one. A thread's lane (of [`LANES`]) is handed
//! out in turn, so threads that run together use different lists of one stream.
//!
//! These are process-wide statics of `std` even under loom (a loom model's threads would
//! otherwise need numbering per model run): they decide only which list a thread uses,
//! and every list is correct for every thread, so no model of them is needed; loom's
//! threads share one lane (`ARCHITECTURE.md`, "Lanes").

/// Lanes of one stream (see `StreamKey::of_lane`).
pub(crate) const LANES: u64 = 16;

/// Lanes are handed to threads in turn, so threads that run together have different ones.
static NEXT_LANE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

// The calling thread's lane, `u64::MAX` until its first use. A plain `Cell` with a const
// initialiser and no destructor: the cheapest thread-local there is (one load), and
// usable in every thread-local destructor.
thread_local!(static LANE: std::cell::Cell<u64> = const { std::cell::Cell::new(u64::MAX) });

/// The calling thread's lane of a shared stream.
#[inline]
pub(crate) fn this_lane() -> u64 {
    let lane = LANE.with(std::cell::Cell::get);
    if lane != u64::MAX {
        return lane;
    }
    let lane = NEXT_LANE.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % LANES;
    LANE.with(|l| l.set(lane));
    lane
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
