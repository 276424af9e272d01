//! [`Statistics`]: counts bytes and allocations, with nested counter frames.

use std::alloc::Layout;
use std::fmt;
use std::ptr::NonNull;

use super::{eq_by_upstream, upstream_access};
use crate::error::Error;
use crate::resource::{Resource, SyncResource};
use crate::stream::StreamRef;
use crate::sync::RwLock;
use crate::sync::atomic::{AtomicI64, Ordering};

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

/// Both statistics of one counter frame.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StatisticsSnapshot {
    /// Bytes.
    pub bytes: Counter,
    /// Allocations.
    pub allocations: Counter,
}

/// A counter updated with relaxed atomics.
#[derive(Default)]
struct AtomicCounter {
    current: AtomicI64,
    peak: AtomicI64,
    total: AtomicI64,
}

impl AtomicCounter {
    fn with(c: Counter) -> Self {
        AtomicCounter {
            current: AtomicI64::new(c.current),
            peak: AtomicI64::new(c.peak),
            total: AtomicI64::new(c.total),
        }
    }

    #[inline]
    fn add(&self, n: i64) {
        // Every value `current` passes through is seen by the thread that made it, which
        // raises `peak` to it: the peak is the exact maximum of the sequence of updates.
        let now = self.current.fetch_add(n, Ordering::Relaxed) + n;
        // A plain load first: most updates do not raise the peak, and a load does not
        // take the cache line exclusively.
        if now > self.peak.load(Ordering::Relaxed) {
            self.peak.fetch_max(now, Ordering::Relaxed);
        }
        self.total.fetch_add(n, Ordering::Relaxed);
    }

    #[inline]
    fn sub(&self, n: i64) {
        self.current.fetch_sub(n, Ordering::Relaxed);
    }

    fn get(&self) -> Counter {
        Counter {
            current: self.current.load(Ordering::Relaxed),
            peak: self.peak.load(Ordering::Relaxed),
            total: self.total.load(Ordering::Relaxed),
        }
    }
}

#[derive(Default)]
struct Frame {
    bytes: AtomicCounter,
    allocations: AtomicCounter,
}

impl Frame {
    fn snapshot(&self) -> StatisticsSnapshot {
        StatisticsSnapshot {
            bytes: self.bytes.get(),
            allocations: self.allocations.get(),
        }
    }
}

/// Merges a popped child frame into its parent, as RMM does: the child's peak counts on
/// top of the parent's current value, current and total add up.
fn merge(parent: Counter, child: Counter) -> Counter {
    Counter {
        current: parent.current + child.current,
        peak: parent.peak.max(parent.current + child.peak),
        total: parent.total + child.total,
    }
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
/// - Cost: each call takes a shared (read) lock on the frame stack and updates relaxed
///   atomics; only push and pop take the lock exclusively.
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
    /// Never empty; the last frame is the one counted into.
    frames: RwLock<Vec<Frame>>,
}

upstream_access!(Statistics<U>);

impl<U> Statistics<U> {
    /// Counts what goes through to `upstream`, starting from zero.
    pub fn new(upstream: U) -> Self {
        Statistics {
            upstream,
            frames: RwLock::new(vec![Frame::default()]),
        }
    }

    fn read(&self) -> crate::sync::RwLockReadGuard<'_, Vec<Frame>> {
        // The frame stack is never left half-updated (push and pop are single Vec
        // operations), so a poisoned lock is still good.
        self.frames
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn write(&self) -> crate::sync::RwLockWriteGuard<'_, Vec<Frame>> {
        self.frames
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
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
        self.read().last().expect("never empty").snapshot()
    }

    /// Starts a fresh frame of zero counters; returns the counters of the frame below it.
    pub fn push_counters(&self) -> StatisticsSnapshot {
        let mut frames = self.write();
        let below = frames.last().expect("never empty").snapshot();
        frames.push(Frame::default());
        below
    }

    /// Ends the current frame, merging it into the one below; returns its counters.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when only the first frame is left.
    pub fn pop_counters(&self) -> Result<StatisticsSnapshot, Error> {
        let mut frames = self.write();
        if frames.len() == 1 {
            return Err(Error::invalid_argument(
                "pop_counters: there is no pushed frame to pop",
            ));
        }
        let child = frames.pop().expect("checked above").snapshot();
        let parent = frames.last_mut().expect("checked above");
        let p = parent.snapshot();
        *parent = Frame {
            bytes: AtomicCounter::with(merge(p.bytes, child.bytes)),
            allocations: AtomicCounter::with(merge(p.allocations, child.allocations)),
        };
        Ok(child)
    }

    #[inline]
    fn count(&self, size: usize) {
        let frames = self.read();
        let top = frames.last().expect("never empty");
        top.bytes.add(size as i64);
        top.allocations.add(1);
    }

    #[inline]
    fn uncount(&self, size: usize) {
        let frames = self.read();
        let top = frames.last().expect("never empty");
        top.bytes.sub(size as i64);
        top.allocations.sub(1);
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

    #[inline]
    fn allocate_sync(&self, layout: Layout) -> Result<NonNull<u8>, Error> {
        let p = self.upstream.allocate_sync(layout)?;
        self.count(layout.size());
        Ok(p)
    }

    #[inline]
    unsafe fn deallocate_sync(&self, ptr: NonNull<u8>, layout: Layout) {
        self.uncount(layout.size());
        // SAFETY: the caller's promise, for the upstream that allocated the block.
        unsafe { self.upstream.deallocate_sync(ptr, layout) }
    }
}

// SAFETY: as for `SyncResource`.
unsafe impl<U: Resource> Resource for Statistics<U> {
    #[inline]
    fn allocate(&self, stream: StreamRef<'_>, layout: Layout) -> Result<NonNull<u8>, Error> {
        let p = self.upstream.allocate(stream, layout)?;
        self.count(layout.size());
        Ok(p)
    }

    #[inline]
    unsafe fn deallocate(&self, stream: StreamRef<'_>, ptr: NonNull<u8>, layout: Layout) {
        self.uncount(layout.size());
        // SAFETY: the caller's promise, for the upstream that allocated the block.
        unsafe { self.upstream.deallocate(stream, ptr, layout) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_follows_rmm() {
        let parent = Counter {
            current: 100,
            peak: 150,
            total: 300,
        };
        let child = Counter {
            current: -20,
            peak: 80,
            total: 40,
        };
        assert_eq!(
            merge(parent, child),
            Counter {
                current: 80,
                peak: 180,
                total: 340
            }
        );
    }
}
