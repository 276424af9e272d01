//! A scope profiler: allocations, bytes and peaks attributed to named regions of a
//! program (RMM's `rmm.statistics.profiler`).
//!
//! Open a scope with [`scope`] (it counts what the calling thread allocates) or
//! [`scope_all_threads`] (what every thread allocates: for work that a framework runs on
//! threads of its own, such as PyTorch's backward pass on its autograd threads). Scopes
//! nest; while one is open, every allocation that goes through a
//! [`Profiling`](crate::adaptor::Profiling) adaptor (or through the C ABI, which counts
//! every call) counts towards it and towards every scope around it. When a scope closes,
//! its figures are added to the record of its name; [`report`] lists the records, the one
//! with the highest peak first.
//!
//! ```
//! use memres::adaptor::Profiling;
//! use memres::{HostHeap, SyncResource, layout, profile};
//!
//! let mr = Profiling::new(HostHeap::new());
//! let l = layout(4096)?;
//! {
//!     let _step = profile::scope("step");
//!     let kept = {
//!         let _forward = profile::scope("forward");
//!         let a = mr.allocate_sync(l)?;
//!         let b = mr.allocate_sync(l)?;
//!         // SAFETY: allocated above with `l`.
//!         unsafe { mr.deallocate_sync(b, l) };
//!         a
//!     };
//!     // SAFETY: allocated above with `l`.
//!     unsafe { mr.deallocate_sync(kept, l) };
//! }
//! let report = profile::report();
//! let forward = report.get("forward").unwrap();
//! assert_eq!((forward.calls, forward.allocations, forward.bytes), (1, 2, 8192));
//! assert_eq!((forward.peak_bytes, forward.retained_bytes), (8192, 4096));
//! assert_eq!(report.get("step").unwrap().retained_bytes, 0);
//! println!("{report}"); // a table, highest peak first
//! # Ok::<(), memres::Error>(())
//! ```
//!
//! # What is counted
//! - A scope's `bytes` and `allocations` are what was allocated while it was open; its
//!   current bytes go up by each allocation and down by each free made while it is open
//!   (of any memory, also memory allocated before it opened: a scope that only frees ends
//!   below zero); its peak is the highest its current bytes went, at least 0.
//! - A [`scope`] counts the calls of the thread that opened it; a [`scope_all_threads`]
//!   counts every thread's. Memory freed on another thread than the one that allocated it
//!   counts where it is freed.
//! - A record sums its name's closed scopes: `calls`, `allocations`, `bytes` and
//!   `retained_bytes` (the current bytes at each close) add up; `peak_bytes` is the
//!   highest peak of one call. Scopes still open are not in the report.
//!
//! # Cost
//! With no scope open anywhere, counting is one relaxed load of a global counter and a
//! branch. While scopes are open, each allocation and free adds to every open scope of its
//! thread (atomic adds on counters only that thread touches) and, while an all-threads
//! scope is open, takes a lock to add to those too.
//!
//! The counters here are plain atomics updated independently and one lock; there is no
//! hand-off between threads to model-check.

use crate::sync::lock_std as lock;
use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::HashMap;
use std::fmt;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex};

// No loom model for these: the registries below change only under their mutexes, and
// the counters are figures and a fast-path hint (a scope that opens while an
// allocation reads `OPEN` as 0 misses that one allocation, as if it had come just
// before), not a hand-off of memory between threads.

/// How many scopes are open, on all threads together: the fast path's only read.
static OPEN: AtomicUsize = AtomicUsize::new(0);
/// How many all-threads scopes are open.
static OPEN_ALL_THREADS: AtomicUsize = AtomicUsize::new(0);
/// The open all-threads scopes, outermost first.
static ALL_THREADS: Mutex<Vec<Arc<Frame>>> = Mutex::new(Vec::new());
/// The records of closed scopes, by name.
static RECORDS: LazyLock<Mutex<HashMap<Arc<str>, Totals>>> = LazyLock::new(Mutex::default);

thread_local! {
    /// The calling thread's open scopes, outermost first.
    static THREAD: RefCell<Vec<Arc<Frame>>> = const { RefCell::new(Vec::new()) };
}

/// The counters of one open scope.
struct Frame {
    name: Arc<str>,
    allocations: AtomicU64,
    bytes: AtomicU64,
    current: AtomicI64,
    peak: AtomicI64,
}

impl Frame {
    fn new(name: Arc<str>) -> Frame {
        Frame {
            name,
            allocations: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            current: AtomicI64::new(0),
            peak: AtomicI64::new(0),
        }
    }

    fn allocated(&self, size: u64) {
        self.allocations.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(size, Ordering::Relaxed);
        let now = self.current.fetch_add(size as i64, Ordering::Relaxed) + size as i64;
        self.peak.fetch_max(now, Ordering::Relaxed);
    }

    fn freed(&self, size: u64) {
        self.current.fetch_sub(size as i64, Ordering::Relaxed);
    }
}

/// A record's sums (see [`Record`]).
#[derive(Default, Clone, Copy)]
struct Totals {
    calls: u64,
    allocations: u64,
    bytes: u64,
    peak_bytes: u64,
    retained_bytes: i64,
}

/// Applies `f` to every scope that counts the calling thread's allocations now.
#[cold]
#[inline(never)]
fn each_open_frame(f: impl Fn(&Frame)) {
    // `try_with`: the thread may be exiting (its list already gone); `try_borrow`: the
    // list may be in the middle of a push that allocates through a profiled global
    // allocator. Either way this call is not counted rather than panicking.
    let _ = THREAD.try_with(|frames| {
        if let Ok(frames) = frames.try_borrow() {
            frames.iter().for_each(|frame| f(frame));
        }
    });
    if OPEN_ALL_THREADS.load(Ordering::Relaxed) != 0 {
        lock(&ALL_THREADS).iter().for_each(|frame| f(frame));
    }
}

/// Counts an allocation of `size` bytes towards the scopes open for the calling thread.
///
/// [`Profiling`](crate::adaptor::Profiling) calls this after each allocation that
/// succeeded; call it yourself from a resource or binding that does not go through one.
#[inline]
pub fn count_allocation(size: usize) {
    if OPEN.load(Ordering::Relaxed) != 0 {
        each_open_frame(|frame| frame.allocated(size as u64));
    }
}

/// Counts a free of `size` bytes towards the scopes open for the calling thread (see
/// [`count_allocation`]).
#[inline]
pub fn count_free(size: usize) {
    if OPEN.load(Ordering::Relaxed) != 0 {
        each_open_frame(|frame| frame.freed(size as u64));
    }
}

/// An open scope; it closes when dropped, adding its figures to its name's record.
///
/// Not `Send`: a scope of the calling thread must close on that thread. Scopes may close
/// in any order (each takes its own counters off the list).
#[must_use = "the scope closes when this is dropped"]
pub struct Scope {
    frame: Arc<Frame>,
    all_threads: bool,
    _not_send: PhantomData<*const ()>,
}

/// Opens a scope named `name` that counts the calling thread's allocations.
pub fn scope(name: impl Into<Cow<'static, str>>) -> Scope {
    open(name.into(), false)
}

/// Opens a scope named `name` that counts the allocations of every thread.
pub fn scope_all_threads(name: impl Into<Cow<'static, str>>) -> Scope {
    open(name.into(), true)
}

fn open(name: Cow<'static, str>, all_threads: bool) -> Scope {
    let frame = Arc::new(Frame::new(Arc::from(name.as_ref())));
    if all_threads {
        lock(&ALL_THREADS).push(Arc::clone(&frame));
        OPEN_ALL_THREADS.fetch_add(1, Ordering::Relaxed);
    } else {
        // A thread that is exiting has no list: the scope then counts nothing.
        let _ = THREAD.try_with(|frames| frames.borrow_mut().push(Arc::clone(&frame)));
    }
    OPEN.fetch_add(1, Ordering::Relaxed);
    Scope {
        frame,
        all_threads,
        _not_send: PhantomData,
    }
}

impl Scope {
    /// The scope's name.
    pub fn name(&self) -> &str {
        &self.frame.name
    }
}

/// Takes `frame` off `frames` (searching from the innermost).
fn remove(frames: &mut Vec<Arc<Frame>>, frame: &Arc<Frame>) {
    if let Some(i) = frames.iter().rposition(|f| Arc::ptr_eq(f, frame)) {
        frames.remove(i);
    }
}

impl Drop for Scope {
    fn drop(&mut self) {
        if self.all_threads {
            remove(&mut lock(&ALL_THREADS), &self.frame);
            OPEN_ALL_THREADS.fetch_sub(1, Ordering::Relaxed);
        } else {
            let _ = THREAD.try_with(|frames| remove(&mut frames.borrow_mut(), &self.frame));
        }
        OPEN.fetch_sub(1, Ordering::Relaxed);
        let f = &self.frame;
        let mut records = lock(&RECORDS);
        let record = records.entry(Arc::clone(&f.name)).or_default();
        record.calls += 1;
        record.allocations += f.allocations.load(Ordering::Relaxed);
        record.bytes += f.bytes.load(Ordering::Relaxed);
        record.peak_bytes = record.peak_bytes.max(f.peak.load(Ordering::Relaxed) as u64);
        record.retained_bytes += f.current.load(Ordering::Relaxed);
    }
}

impl fmt::Debug for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Scope")
            .field("name", &self.name())
            .field("all_threads", &self.all_threads)
            .finish()
    }
}

/// The figures of one name's closed scopes (see the [module docs](self)).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Record {
    /// The scopes' name.
    pub name: String,
    /// How many scopes of this name have closed.
    pub calls: u64,
    /// Allocations made inside them.
    pub allocations: u64,
    /// Bytes allocated inside them.
    pub bytes: u64,
    /// The highest peak of one call: the most bytes it held at once above what was live
    /// when it opened.
    pub peak_bytes: u64,
    /// Bytes allocated inside them and not freed by their close, less what they freed of
    /// memory from before (summed over calls).
    pub retained_bytes: i64,
}

/// The records of every name, highest peak first (then by name).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    records: Vec<Record>,
}

impl Report {
    /// The records, highest peak first.
    pub fn records(&self) -> &[Record] {
        &self.records
    }

    /// The record of `name`, if a scope of that name has closed.
    pub fn get(&self, name: &str) -> Option<&Record> {
        self.records.iter().find(|r| r.name == name)
    }
}

impl fmt::Display for Report {
    /// A table: one row per name, highest peak first, bytes in MiB.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const MIB: f64 = (1u64 << 20) as f64;
        let width = self
            .records
            .iter()
            .map(|r| r.name.chars().count())
            .max()
            .unwrap_or(0)
            .max("scope".len());
        writeln!(
            f,
            "{:<width$}  {:>8}  {:>12}  {:>14}  {:>14}  {:>14}",
            "scope", "calls", "allocations", "total MiB", "peak MiB", "retained MiB"
        )?;
        for r in &self.records {
            writeln!(
                f,
                "{:<width$}  {:>8}  {:>12}  {:>14.1}  {:>14.1}  {:>14.1}",
                r.name,
                r.calls,
                r.allocations,
                r.bytes as f64 / MIB,
                r.peak_bytes as f64 / MIB,
                r.retained_bytes as f64 / MIB,
            )?;
        }
        Ok(())
    }
}

/// The records of every scope closed so far (since the last [`reset`]).
pub fn report() -> Report {
    let mut records: Vec<Record> = lock(&RECORDS)
        .iter()
        .map(|(name, t)| Record {
            name: name.to_string(),
            calls: t.calls,
            allocations: t.allocations,
            bytes: t.bytes,
            peak_bytes: t.peak_bytes,
            retained_bytes: t.retained_bytes,
        })
        .collect();
    records.sort_by(|a, b| b.peak_bytes.cmp(&a.peak_bytes).then(a.name.cmp(&b.name)));
    Report { records }
}

/// Forgets every record (open scopes go on counting and are recorded when they close).
pub fn reset() {
    lock(&RECORDS).clear();
}
