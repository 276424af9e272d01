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

use cudarc::driver::sys::{self, CUresult, CUstreamCaptureMode, CUstreamCaptureStatus};

use super::StreamRef;
use crate::device::{Context, bind};
use crate::driver::{check, report};
use crate::error::Error;

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
        let mut status = CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: `raw` is live for the borrow of `self` (or a default stream of the
        // current context); `status` is a valid place.
        match unsafe { sys::cuStreamIsCapturing(raw, &mut status) } {
            // Asking about the legacy stream while a blocking stream is captured.
            CUresult::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT => Ok(true),
            result => {
                check(result)?;
                Ok(status != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
            }
        }
    }
}

/// Puts the calling thread in the relaxed capture mode until dropped, so that the
/// driver calls memres makes during a capture (`cuMemAlloc`, `cuMemMap`) are allowed.
#[must_use]
pub(crate) struct Relaxed {
    previous: CUstreamCaptureMode,
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
        let mut mode = CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: `mode` is a valid place; the call only swaps the thread's mode.
        check(unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) })?;
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
        let mut mode = self.previous;
        // SAFETY: as in `new`: restores the mode it replaced.
        report("restoring the capture mode", unsafe {
            sys::cuThreadExchangeStreamCaptureMode(&mut mode)
        });
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
        // then the 12.3 entry point, which cudarc would panic on where it is missing.
        if !self.is_capturing_in(ctx).ok()? || crate::driver::version().ok()? < 12030 {
            return None;
        }
        let _current = bind(ctx).ok()?;
        let mut status = CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        let mut capture = 0u64;
        let mut graph = std::ptr::null_mut();
        let mut nodes: *const sys::CUgraphNode = std::ptr::null();
        let mut edges: *const sys::CUgraphEdgeData = std::ptr::null();
        let mut count = 0usize;
        // SAFETY: `raw` is live for the borrow of `self`; every out-pointer is a valid
        // place; the arrays the driver points to live while the capture does, and are
        // copied before this returns.
        let result = unsafe {
            sys::cuStreamGetCaptureInfo_v3(
                raw,
                &mut status,
                &mut capture,
                &mut graph,
                &mut nodes,
                &mut edges,
                &mut count,
            )
        };
        if result != CUresult::CUDA_SUCCESS
            || status != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE
        {
            return None;
        }
        let nodes = if count == 0 || nodes.is_null() {
            Vec::new()
        } else {
            // SAFETY: the driver's array of `count` nodes (above).
            unsafe { std::slice::from_raw_parts(nodes, count) }
                .iter()
                .map(|&node| node as usize)
                .collect()
        };
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
        let raw = node as sys::CUgraphNode;
        let mut count = 0usize;
        // SAFETY: `raw` is a node of the graph being captured (a frontier's, or a
        // dependency the driver listed); null arrays ask for the count only.
        let result = unsafe {
            sys::cuGraphNodeGetDependencies_v2(
                raw,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                &mut count,
            )
        };
        if result != CUresult::CUDA_SUCCESS {
            return None;
        }
        if count == 0 {
            continue;
        }
        let mut deps: Vec<sys::CUgraphNode> = vec![std::ptr::null_mut(); count];
        // SAFETY: zeroed edge data is the default edge's (a plain C struct of integers).
        let mut edges: Vec<sys::CUgraphEdgeData> = vec![unsafe { std::mem::zeroed() }; count];
        // SAFETY: both arrays have room for `count` entries.
        let result = unsafe {
            sys::cuGraphNodeGetDependencies_v2(
                raw,
                deps.as_mut_ptr(),
                edges.as_mut_ptr(),
                &mut count,
            )
        };
        if result != CUresult::CUDA_SUCCESS {
            return None;
        }
        todo.extend(deps.iter().take(count).map(|&d| d as usize));
    }
    Some(seen)
}
