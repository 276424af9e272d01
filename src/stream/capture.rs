//! Stream capture (CUDA graphs): the checks that keep memres from breaking a capture.
//!
//! While a stream is captured, work enqueued on it is recorded into a graph instead of
//! run, and the driver refuses calls that would wait for it (`cuStreamSynchronize`,
//! `cuCtxSynchronize`) or, in the default global capture mode, that are "potentially
//! unsafe" (`cuMemAlloc`): such a call fails and invalidates the capture. memres asks
//! `cuStreamIsCapturing` on its slow paths (never on a pool's fast path) and then skips
//! every wait, and makes the driver calls a capture allows in the relaxed capture mode
//! of the calling thread, as PyTorch's caching allocator does.

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

impl Relaxed {
    pub(crate) fn new() -> Result<Relaxed, Error> {
        let mut mode = CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: `mode` is a valid place; the call only swaps the thread's mode.
        check(unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) })?;
        Ok(Relaxed {
            previous: mode,
            thread: std::marker::PhantomData,
        })
    }
}

impl Drop for Relaxed {
    fn drop(&mut self) {
        let mut mode = self.previous;
        // SAFETY: as in `new`: restores the mode it replaced.
        report("restoring the capture mode", unsafe {
            sys::cuThreadExchangeStreamCaptureMode(&mut mode)
        });
    }
}
