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
        match self.as_raw() {
            None => Ok(false),
            Some(_) => self.is_capturing_in(Context::current()?),
        }
    }

    /// As [`is_capturing`](Self::is_capturing), with `ctx` current for the call (it
    /// decides which stream a default-stream handle names).
    pub(crate) fn is_capturing_in(self, ctx: Context) -> Result<bool, Error> {
        let Some(raw) = self.as_raw() else {
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
