//! Stream capture (CUDA graphs): the checks that keep memres from breaking a capture.
//!
//! While a stream is captured, work enqueued on it is recorded into a graph instead of
//! run, and the driver refuses calls that would wait for it (`cuStreamSynchronize`,
//! `cuCtxSynchronize`) or, in the default global capture mode, that are "potentially
//! unsafe" (`cuMemAlloc`): such a call fails and invalidates the capture. memres asks
//! `cuStreamIsCapturing` on its slow paths (never on a pool's fast path) and then skips
//! every wait, and makes the driver calls a capture allows in the relaxed capture mode
//! of the calling thread, as PyTorch's caching allocator does.
//!
//! What a capture does not make safe (say so to users of graphs):
//! - Memory freed inside a capture is free afterwards: a pool hands it out again, and a
//!   synchronous leaf (`Cuda`, `Managed`, `PinnedHost`, `System`) gives it back to the
//!   driver at its next call outside a capture. A graph that uses such memory must not be
//!   launched after that. For graphs that are replayed, allocate their memory outside the
//!   capture (or from a pool of their own kept as long as the graph), or use `CudaAsync`,
//!   whose allocations and frees in a capture become nodes of the graph.
//! - Those deferred frees wait for the device first (`cuCtxSynchronize`). Made while
//!   another thread captures a stream of the same device in the global mode, that wait is
//!   forbidden and breaks the capture: programs that call synchronous leaves on other
//!   streams during a capture should capture in the thread-local or relaxed mode.
//! - The guard adaptor paints canaries by captured sets: a block allocated in a capture
//!   and freed outside it before the graph ran is checked against canaries never written.

use super::StreamRef;
use crate::device::{Context, bind};
use crate::driver::report;
use crate::error::Error;
use crate::platform::{Active, CaptureMode, Platform};

impl StreamRef<'_> {
    /// True while the stream is being captured into a CUDA graph (`cuStreamIsCapturing`;
    /// also true for a capture that has been invalidated and not yet ended, and for the
    /// legacy default stream while a blocking stream is captured, which it would join).
    /// Host streams never are. The default and per-thread streams are those of the
    /// current device.
    ///
    /// ```no_run
    /// use memres::stream::Stream;
    ///
    /// let s = Stream::new()?;
    /// assert!(!s.as_ref().is_capturing()?);
    /// # Ok::<(), memres::Error>(())
    /// ```
    pub fn is_capturing(self) -> Result<bool, Error> {
        match self.cu() {
            None => Ok(false),
            Some(_) => self.is_capturing_in(Context::current()?),
        }
    }

    /// As [`is_capturing`](Self::is_capturing), with `ctx` current for the call (it
    /// decides which stream a default-stream handle names).
    pub(crate) fn is_capturing_in(self, ctx: Context) -> Result<bool, Error> {
        let Some(raw) = self.cu() else {
            return Ok(false);
        };
        let _current = bind(ctx)?;
        // SAFETY: `raw` is live for the borrow of `self` (or a default stream of the
        // current context).
        unsafe { Active::stream_is_capturing(raw) }
    }
}

/// Puts the calling thread in the relaxed capture mode until dropped, so that the
/// driver calls memres makes during a capture (`cuMemAlloc`, `cuMemMap`) are allowed.
#[must_use]
pub(crate) struct Relaxed {
    previous: CaptureMode,
    /// The mode is per thread: the guard must drop on the thread that made it.
    thread: std::marker::PhantomData<*const ()>,
}

thread_local! {
    /// How many [`Relaxed`] guards the thread holds: while any, it is on a capture's slow
    /// path, where nothing may wait for the device.
    static RELAXED: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// True while the calling thread is on a slow path under stream capture (it holds a
/// [`Relaxed`] guard): work that would wait for the device (a synchronous leaf's deferred
/// frees) must be left for later.
pub(crate) fn on_capture_path() -> bool {
    RELAXED.with(|r| r.get() > 0)
}

impl Relaxed {
    pub(crate) fn new() -> Result<Relaxed, Error> {
        let mode = Active::exchange_capture_mode(CaptureMode::Relaxed)?;
        RELAXED.with(|r| r.set(r.get() + 1));
        Ok(Relaxed {
            previous: mode,
            thread: std::marker::PhantomData,
        })
    }
}

impl Drop for Relaxed {
    fn drop(&mut self) {
        RELAXED.with(|r| r.set(r.get() - 1));
        // Restores the mode `new` replaced.
        report(
            "restoring the capture mode",
            Active::exchange_capture_mode(self.previous).map(|_| ()),
        );
    }
}

/// Where a stream's capture has reached: the capture's id and the nodes that the next
/// work captured on the stream would depend on (none yet: empty), as addresses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Frontier {
    pub(crate) capture: u64,
    pub(crate) nodes: Vec<usize>,
}

impl StreamRef<'_> {
    /// The stream's [`Frontier`], or `None` when it is not capturing (a host stream never
    /// is) or the driver cannot say (one older than CUDA 12.3 lacks the calls: its
    /// captures get no frontier).
    pub(crate) fn capture_frontier(self) -> Option<Frontier> {
        let raw = self.cu()?;
        let ctx = self.context().ok()?;
        // `cuStreamIsCapturing` first (every driver has it; the common answer is no),
        // then the platform's frontier call (which checks that the driver has it).
        if !self.is_capturing_in(ctx).ok()? {
            return None;
        }
        let _current = bind(ctx).ok()?;
        // SAFETY: `raw` is live for the borrow of `self`.
        let (capture, nodes) = unsafe { Active::capture_frontier(raw) }?;
        Some(Frontier { capture, nodes })
    }
}

/// The nodes of `from` and every ancestor of theirs in the graph being captured, or
/// `None` when the driver cannot say.
pub(crate) fn ancestors(from: &[usize]) -> Option<std::collections::HashSet<usize>> {
    let mut seen = std::collections::HashSet::new();
    let mut todo = from.to_vec();
    while let Some(node) = todo.pop() {
        if !seen.insert(node) {
            continue;
        }
        // SAFETY: `node` is a node of the graph being captured (a frontier's, or a
        // dependency the driver listed).
        let deps = unsafe { Active::node_dependencies(node) }?;
        todo.extend(deps);
    }
    Some(seen)
}
