//! [`Statistics`]: counts bytes and allocations, with nested counter frames.

use std::alloc::Layout;
use std::fmt;
use std::ptr::NonNull;

use super::{deallocate_used_on_upstream, eq_by_upstream, upstream_access};
use crate::error::Error;
use crate::resource::{Resource, SyncResource};
use crate::stream::StreamRef;
use crate::sync::Mutex;
use crate::sync::atomic::{AtomicI64, Ordering};
use crate::sync::per_thread::{PerThread, ThreadSlot};

/// One statistic: its value now, the highest it has been, and the sum of everything added.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counter {
    /// The value now (bytes or allocations outstanding).
    pub current: i64,
    /// The highest `current` has been.
    pub peak: i64,
    /// Everything ever added (bytes or allocations made).
    pub total: i64,
}

/// One counter kept exactly under any interleaving of threads: one atomic
/// read-modify-write per change, where [`Statistics`] counts per thread (faster, but its
/// peak across interleaving threads is approximate). For a peak that must be exact, such
/// as memory live through an API that several threads call.
///
/// ```
/// use memres::adaptor::ExactCounter;
///
/// let live = ExactCounter::default();
/// live.add(1000);
/// live.add(500);
/// live.sub(1000);
/// let c = live.read();
/// assert_eq!((c.current, c.peak, c.total), (500, 1500, 1500));
/// live.reset_peak();
/// assert_eq!(live.read().peak, 500);
/// ```
#[derive(Debug, Default)]
pub struct ExactCounter {
    current: AtomicI64,
    peak: AtomicI64,
    total: AtomicI64,
}

impl ExactCounter {
    /// Adds `n` (raising the peak if `current` passes it).
    pub fn add(&self, n: i64) {
        let now = self.current.fetch_add(n, Ordering::Relaxed).wrapping_add(n);
        self.peak.fetch_max(now, Ordering::Relaxed);
        self.total.fetch_add(n, Ordering::Relaxed);
    }

    /// Subtracts `n`.
    pub fn sub(&self, n: i64) {
        self.current.fetch_sub(n, Ordering::Relaxed);
    }

    /// The figures now.
    pub fn read(&self) -> Counter {
        Counter {
            current: self.current.load(Ordering::Relaxed),
            peak: self.peak.load(Ordering::Relaxed),
            total: self.total.load(Ordering::Relaxed),
        }
    }

    /// Starts a new peak from the value now.
    pub fn reset_peak(&self) {
        self.peak
            .store(self.current.load(Ordering::Relaxed), Ordering::Relaxed);
        // An `add` between the load and the store raised `current` past the stored peak,
        // and its own `fetch_max` may have come before the store.
        self.peak
            .fetch_max(self.current.load(Ordering::Relaxed), Ordering::Relaxed);
    }
}

/// Both statistics of one counter frame.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct StatisticsSnapshot {
    /// Bytes.
    pub bytes: Counter,
    /// Allocations.
    pub allocations: Counter,
}

/// How many allocations a thread counts before it publishes its changes to the shared
/// counters (see [`Statistics`]'s notes on concurrency).
const PUBLISH_EVERY: u64 = 64;

/// One thread's changes to one counter since it last published them. Only the owning
/// thread writes (a relaxed load and store, no atomic read-modify-write); readers load.
#[derive(Default)]
struct LocalCounter {
    /// Change of `current` since the last publication.
    delta: AtomicI64,
    /// The highest `delta` has been since then (at least 0).
    high: AtomicI64,
    /// Everything this thread added, ever.
    total: AtomicI64,
}

impl LocalCounter {
    /// Adds `n`; returns the new total.
    #[inline]
    fn add(&self, n: i64) -> i64 {
        let d = self.delta.load(Ordering::Relaxed) + n;
        self.delta.store(d, Ordering::Relaxed);
        // Stored whether or not it rose: a branch on it would be mispredicted as often as
        // a random walk of allocations and frees turns, a store costs less.
        let high = self.high.load(Ordering::Relaxed);
        self.high.store(high.max(d), Ordering::Relaxed);
        let t = self.total.load(Ordering::Relaxed) + n;
        self.total.store(t, Ordering::Relaxed);
        t
    }

    /// Subtracts `n`; returns the new `delta`.
    #[inline]
    fn sub(&self, n: i64) -> i64 {
        let d = self.delta.load(Ordering::Relaxed) - n;
        self.delta.store(d, Ordering::Relaxed);
        d
    }

    /// Moves `delta` into the shared counter and raises its peak to the highest value
    /// this thread saw it reach, then starts afresh. Called by the owning thread (also as
    /// it exits).
    fn publish(&self, shared: &SharedCounter) {
        let delta = self.delta.load(Ordering::Relaxed);
        let high = self.high.load(Ordering::Relaxed);
        let before = shared.current.fetch_add(delta, Ordering::Relaxed);
        shared.raise_peak(before + high);
        self.delta.store(0, Ordering::Relaxed);
        self.high.store(0, Ordering::Relaxed);
    }
}

/// One thread's counts.
#[derive(Default)]
struct Local {
    bytes: LocalCounter,
    allocations: LocalCounter,
}

impl Local {
    /// Publishes after every [`PUBLISH_EVERY`] allocations of this thread, and when its
    /// frees since the last publication outnumber its allocations by as many (a thread
    /// that only frees must still publish, or others' peaks would be raised over memory
    /// it gave back). The counters themselves say when: no operation count of its own.
    #[inline]
    fn allocated(&self, size: usize, shared: &Shared) {
        self.bytes.add(size as i64);
        if (self.allocations.add(1) as u64).is_multiple_of(PUBLISH_EVERY) {
            self.publish(shared);
        }
    }

    #[inline]
    fn freed(&self, size: usize, shared: &Shared) {
        self.bytes.sub(size as i64);
        if self.allocations.sub(1) <= -(PUBLISH_EVERY as i64) {
            self.publish(shared);
        }
    }

    #[cold]
    #[inline(never)]
    fn publish(&self, shared: &Shared) {
        self.bytes.publish(&shared.bytes);
        self.allocations.publish(&shared.allocations);
    }
}

impl ThreadSlot for Local {
    type Shared = Shared;

    fn retire(&self, shared: &Shared) {
        self.publish(shared);
        for (local, shared) in [
            (&self.bytes, &shared.bytes),
            (&self.allocations, &shared.allocations),
        ] {
            shared
                .total
                .fetch_add(local.total.swap(0, Ordering::Relaxed), Ordering::Relaxed);
        }
    }
}

/// What all threads share of one counter. Values are absolute (since the adaptor was
/// made); frames are views on them (see [`Base`]).
#[derive(Default)]
struct SharedCounter {
    /// `current` as published by the threads.
    current: AtomicI64,
    /// The highest published `current` (including each thread's highest unpublished
    /// value on top of it) since the top frame was pushed.
    peak: AtomicI64,
    /// Totals of threads that have exited (live threads keep theirs).
    total: AtomicI64,
}

impl SharedCounter {
    #[inline]
    fn raise_peak(&self, value: i64) {
        // A plain load first: most publications do not raise the peak.
        if value > self.peak.load(Ordering::Relaxed) {
            self.peak.fetch_max(value, Ordering::Relaxed);
        }
    }
}

/// The state of [`Statistics`] that every thread shares.
#[derive(Default)]
struct Shared {
    bytes: SharedCounter,
    allocations: SharedCounter,
}

/// Absolute values of one counter, summed over the shared state and every thread.
#[derive(Clone, Copy, Default, Debug)]
struct Absolute {
    current: i64,
    /// The peak since the top frame was pushed.
    peak: i64,
    total: i64,
}

/// Where a frame starts, for one counter: a frame's `current` is the absolute current
/// minus `current`, and so on.
#[derive(Clone, Copy, Default, Debug)]
struct Base {
    current: i64,
    total: i64,
    /// The frame below's absolute peak when this frame was pushed.
    below_peak: i64,
}

impl Base {
    fn view(&self, abs: Absolute) -> Counter {
        Counter {
            current: abs.current - self.current,
            peak: abs.peak - self.current,
            total: abs.total - self.total,
        }
    }
}

#[derive(Clone, Copy, Default, Debug)]
struct Frame {
    bytes: Base,
    allocations: Base,
}

/// Counts the bytes and allocations that go through it (RMM's
/// `statistics_resource_adaptor`).
///
/// - Allocation: the upstream first, then the count (a failed allocation counts nothing).
///   Free: the count first, then the upstream. Zero-byte allocations count as allocations
///   of 0 bytes.
/// - Counter frames: [`push_counters`](Self::push_counters) starts a fresh frame (to
///   measure one phase of a program); [`pop_counters`](Self::pop_counters) ends it and
///   merges it into the frame below, whose peak becomes
///   `max(parent.peak, parent.current + child.peak)`. Popping the last frame is an error.
/// - Counters are signed: freeing memory that was allocated before a frame was pushed (or
///   through another resource) makes that frame's `current` negative. That is by design.
/// - Equality is the upstream's (RMM's rule), so memory may be freed through another
///   `Statistics` over an equal upstream; each adaptor counts what goes through it.
///
/// # Cost and exactness under concurrency
/// Each thread counts into a slot of its own with plain loads and stores (no atomic
/// read-modify-write, no lock), and publishes its changes to shared counters every 64
/// allocations (and when its frees outnumber its allocations by 64); readers add up the
/// shared counters and every thread's slot. So:
/// - `current` and `total` are exact whenever no thread is in the middle of a call (after
///   the threads that used the adaptor are joined, say), and at most a moment stale
///   otherwise.
/// - `peak` is exact when one thread uses the adaptor, or threads that ran one after
///   another (each done before the next began). When threads interleave (at once, or
///   taking turns), each thread's highest point is put on top of the shared value as it
///   stood when that thread published, so the peak may be off (either way) by what other
///   threads did since their last publication (each: fewer than 64 allocations, and
///   frees outnumbering them by fewer than 64, so up to 126 frees); it never falls below
///   the highest `current` read. Where an exact peak across threads matters more than
///   speed, count with an [`ExactCounter`] instead (the `memres replay` command and the C
///   ABI do).
/// - `push_counters` and `pop_counters` publish the calling thread's slot; other threads'
///   unpublished highs from before a push may count towards the new frame's peak.
///
/// ```
/// use memres::adaptor::Statistics;
/// use memres::{HostHeap, SyncResource, layout};
///
/// let stats = Statistics::new(HostHeap::new());
/// let l = layout(1000)?;
/// let p = stats.allocate_sync(l)?;
/// assert_eq!(stats.bytes().current, 1000);
/// // SAFETY: allocated above with `l`.
/// unsafe { stats.deallocate_sync(p, l) };
/// assert_eq!((stats.bytes().current, stats.bytes().peak), (0, 1000));
/// assert_eq!(stats.allocations().total, 1);
/// # Ok::<(), memres::Error>(())
/// ```
pub struct Statistics<U> {
    upstream: U,
    counts: PerThread<Local>,
    /// Never empty; the last frame is the one counted into. Locked before the registry
    /// of `counts` when both are.
    frames: Mutex<Vec<Frame>>,
}

upstream_access!(Statistics<U>);

impl<U> Statistics<U> {
    /// Counts what goes through to `upstream`, starting from zero.
    pub fn new(upstream: U) -> Self {
        Statistics {
            upstream,
            counts: PerThread::new(Shared::default()),
            frames: Mutex::new(vec![Frame::default()]),
        }
    }

    fn frames(&self) -> crate::sync::MutexGuard<'_, Vec<Frame>> {
        // The frame stack is never left half-updated (single Vec operations).
        crate::sync::lock(&self.frames)
    }

    /// The byte counter of the current frame.
    pub fn bytes(&self) -> Counter {
        self.snapshot().bytes
    }

    /// The allocation counter of the current frame.
    pub fn allocations(&self) -> Counter {
        self.snapshot().allocations
    }

    /// Both counters of the current frame.
    pub fn snapshot(&self) -> StatisticsSnapshot {
        let frames = self.frames();
        let top = frames.last().expect("never empty");
        let (bytes, allocations) = self.absolute();
        StatisticsSnapshot {
            bytes: top.bytes.view(bytes),
            allocations: top.allocations.view(allocations),
        }
    }

    /// The absolute counters: the shared ones plus every thread's unpublished changes.
    fn absolute(&self) -> (Absolute, Absolute) {
        let mut sums = [Absolute::default(); 2];
        let mut highs = [0i64; 2];
        let visit = |local: &Local| {
            for (i, c) in [&local.bytes, &local.allocations].into_iter().enumerate() {
                sums[i].current += c.delta.load(Ordering::Relaxed);
                highs[i] += c.high.load(Ordering::Relaxed);
                sums[i].total += c.total.load(Ordering::Relaxed);
            }
        };
        // The shared counters are read under the same lock as the slots, so a thread that
        // exits meanwhile is counted once (in its slot or folded into them).
        let shared = |shared: &Shared| {
            [&shared.bytes, &shared.allocations].map(|c| {
                (
                    c.current.load(Ordering::Relaxed),
                    c.peak.load(Ordering::Relaxed),
                    c.total.load(Ordering::Relaxed),
                )
            })
        };
        let read = self.counts.read(visit, shared);
        let mut out = [Absolute::default(); 2];
        for (i, (published, peak, total)) in read.into_iter().enumerate() {
            let current = published + sums[i].current;
            out[i] = Absolute {
                current,
                peak: peak.max(published + highs[i]).max(current),
                total: total + sums[i].total,
            };
        }
        (out[0], out[1])
    }

    /// Publishes the calling thread's counts, so that a frame boundary falls after them.
    fn publish_own(&self) {
        if let Some(local) = self.counts.get() {
            local.publish(self.counts.shared());
        }
    }

    /// Starts a fresh frame of zero counters; returns the counters of the frame below it.
    pub fn push_counters(&self) -> StatisticsSnapshot {
        let mut frames = self.frames();
        self.publish_own();
        let (bytes, allocations) = self.absolute();
        let below = *frames.last().expect("never empty");
        let shared = self.counts.shared();
        let base = |abs: Absolute, c: &SharedCounter| {
            c.peak.store(abs.current, Ordering::Relaxed);
            Base {
                current: abs.current,
                total: abs.total,
                below_peak: abs.peak,
            }
        };
        frames.push(Frame {
            bytes: base(bytes, &shared.bytes),
            allocations: base(allocations, &shared.allocations),
        });
        StatisticsSnapshot {
            bytes: below.bytes.view(bytes),
            allocations: below.allocations.view(allocations),
        }
    }

    /// Ends the current frame, merging it into the one below; returns its counters.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when only the first frame is left.
    pub fn pop_counters(&self) -> Result<StatisticsSnapshot, Error> {
        let mut frames = self.frames();
        if frames.len() == 1 {
            return Err(Error::invalid_argument(
                "pop_counters: there is no pushed frame to pop",
            ));
        }
        self.publish_own();
        let (bytes, allocations) = self.absolute();
        let top = frames.pop().expect("checked above");
        // The frame below takes back its peak, raised to the popped frame's: RMM's
        // `max(parent.peak, parent.current + child.peak)`, in absolute values.
        let shared = self.counts.shared();
        shared.bytes.raise_peak(top.bytes.below_peak);
        shared.allocations.raise_peak(top.allocations.below_peak);
        Ok(StatisticsSnapshot {
            bytes: top.bytes.view(bytes),
            allocations: top.allocations.view(allocations),
        })
    }

    #[inline]
    fn count(&self, size: usize) {
        match self.counts.get() {
            Some(local) => local.allocated(size, self.counts.shared()),
            None => self.count_shared(size as i64, 1),
        }
    }

    #[inline]
    fn uncount(&self, size: usize) {
        match self.counts.get() {
            Some(local) => local.freed(size, self.counts.shared()),
            None => self.count_shared(-(size as i64), -1),
        }
    }

    /// Counts straight into the shared counters: for a thread whose slot is gone (it is
    /// exiting; a thread-local cache freeing into this adaptor, say).
    #[cold]
    #[inline(never)]
    fn count_shared(&self, bytes: i64, allocations: i64) {
        let shared = self.counts.shared();
        for (c, n) in [(&shared.bytes, bytes), (&shared.allocations, allocations)] {
            let now = c.current.fetch_add(n, Ordering::Relaxed) + n;
            c.raise_peak(now);
            if n > 0 {
                c.total.fetch_add(n, Ordering::Relaxed);
            }
        }
    }
}

eq_by_upstream!(Statistics<U>);

impl<U: fmt::Debug> fmt::Debug for Statistics<U> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Statistics")
            .field("upstream", &self.upstream)
            .field("counters", &self.snapshot())
            .finish()
    }
}

// SAFETY: every block comes from the upstream unchanged; counting does not touch memory.
unsafe impl<U: SyncResource> SyncResource for Statistics<U> {
    type Properties = U::Properties;

    #[inline(always)]
    fn allocate_sync(&self, layout: Layout) -> Result<NonNull<u8>, Error> {
        let p = self.upstream.allocate_sync(layout)?;
        self.count(layout.size());
        Ok(p)
    }

    #[inline(always)]
    unsafe fn deallocate_sync(&self, ptr: NonNull<u8>, layout: Layout) {
        self.uncount(layout.size());
        // SAFETY: the caller's promise, for the upstream that allocated the block.
        unsafe { self.upstream.deallocate_sync(ptr, layout) }
    }
}

// SAFETY: as for `SyncResource`.
unsafe impl<U: Resource> Resource for Statistics<U> {
    #[inline(always)]
    fn allocate(&self, stream: StreamRef<'_>, layout: Layout) -> Result<NonNull<u8>, Error> {
        let p = self.upstream.allocate(stream, layout)?;
        self.count(layout.size());
        Ok(p)
    }

    #[inline(always)]
    unsafe fn deallocate(&self, stream: StreamRef<'_>, ptr: NonNull<u8>, layout: Layout) {
        self.uncount(layout.size());
        // SAFETY: the caller's promise, for the upstream that allocated the block.
        unsafe { self.upstream.deallocate(stream, ptr, layout) }
    }

    deallocate_used_on_upstream!(|self, stream, ptr, layout| {
        // Freed by the caller: no longer live, whenever the upstream reuses it.
        self.uncount(layout.size());
    });
}
