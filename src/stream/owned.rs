//! Owned CUDA streams, and a pool of them.

use std::sync::Arc;

#[cfg(feature = "cudarc-interop")]
use cudarc::driver::CudaContext;
use cudarc::driver::CudaStream;

use super::{RawStream, StreamRef};
use crate::device::{Context, DeviceId, bind, process_is_exiting};
use crate::driver::report;
use crate::error::Error;
use crate::platform::{Active, Platform, StreamHandle};
use crate::sync::atomic::{AtomicUsize, Ordering};

/// How a new stream orders itself against the legacy default stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum StreamFlags {
    /// Work on it waits for, and is waited for by, the legacy default stream.
    #[default]
    Default,
    /// Independent of the legacy default stream (`CU_STREAM_NON_BLOCKING`).
    NonBlocking,
}

/// An owned, non-default CUDA stream of one device, destroyed when dropped (RMM's
/// `cuda_stream`).
///
/// Lend it out as a [`StreamRef`] with [`Stream::as_ref`]; the borrow checker keeps those
/// from outliving it.
///
/// Dropping a stream waits for its work (`cuStreamSynchronize`) before destroying it,
/// unlike `cudaStreamDestroy` (and RMM's `cuda_stream`). The sub-allocators keep memory
/// freed on a stream in that stream's list, found by the stream's handle, and reuse it on
/// the stream without waiting; a new stream may get the handle of a destroyed one, and
/// must then not find memory that the old stream's work still uses.
///
/// ```no_run
/// use memres::stream::{Stream, StreamFlags};
///
/// let stream = Stream::with_flags(StreamFlags::NonBlocking)?;
/// let s = stream.as_ref();
/// // ... enqueue work on `s` ...
/// stream.synchronize()?;
/// # Ok::<(), memres::Error>(())
/// ```
#[derive(Debug)]
pub struct Stream {
    raw: usize,
    ctx: Context,
    /// A cudarc stream this one wraps, kept alive (and destroyed by cudarc) with it.
    cudarc: Option<Arc<CudaStream>>,
}

impl Stream {
    /// A new stream on the current device, ordered against the legacy default stream.
    pub fn new() -> Result<Stream, Error> {
        Stream::with_flags(StreamFlags::Default)
    }

    /// A new stream on the current device with the given flags.
    pub fn with_flags(flags: StreamFlags) -> Result<Stream, Error> {
        Stream::on(DeviceId::current()?, flags)
    }

    /// A new stream on `device`.
    pub fn on(device: DeviceId, flags: StreamFlags) -> Result<Stream, Error> {
        let ctx = Context::primary(device)?;
        let _current = bind(ctx)?;
        // `ctx` is current (above).
        let raw = Active::stream_create(flags == StreamFlags::NonBlocking)?;
        Ok(Stream {
            raw,
            ctx,
            cudarc: None,
        })
    }

    /// A handle for resources and kernel launches; it cannot outlive the stream.
    pub fn as_ref(&self) -> StreamRef<'_> {
        // SAFETY: the stream is live for as long as `self` is borrowed.
        unsafe { StreamRef::from_raw(self.raw()) }
    }

    /// Waits until all work enqueued on the stream so far is complete.
    pub fn synchronize(&self) -> Result<(), Error> {
        self.as_ref().synchronize_in(self.ctx)
    }

    /// The device the stream belongs to.
    pub fn device(&self) -> DeviceId {
        self.ctx.device()
    }

    /// The handle as the platform seam takes it, for memres's own driver calls.
    pub(crate) fn cu(&self) -> StreamHandle {
        self.raw
    }

    /// The raw handle, for calls memres does not wrap. Do not destroy it.
    pub fn raw(&self) -> RawStream {
        self.raw as RawStream
    }

    /// The same stream as a cudarc [`CudaStream`], for cudarc's copies and launches
    /// (feature `cudarc-interop`).
    ///
    /// # Safety
    /// `ctx` is the primary context of this stream's device (what
    /// `CudaContext::new(ordinal)` returns), and the returned stream, and every clone of
    /// it, is dropped before this `Stream`.
    #[cfg(feature = "cudarc-interop")]
    pub unsafe fn as_cudarc(&self, ctx: &Arc<CudaContext>) -> Arc<CudaStream> {
        // SAFETY: the caller promises the context matches and the wrapper does not outlive
        // the stream; a borrowed wrapper never destroys the stream.
        unsafe { ctx.wrap_borrowed_stream(self.cu() as cudarc::driver::sys::CUstream) }
    }
}

#[cfg(feature = "cudarc-interop")]
impl Stream {
    /// Takes a cudarc stream of a device's primary context (what cudarc's
    /// `CudaContext::new` makes); it stays alive as long as this `Stream`, and cudarc
    /// destroys it when its last reference goes (feature `cudarc-interop`).
    pub fn from_cudarc(stream: Arc<CudaStream>) -> Result<Stream, Error> {
        let device = DeviceId::new(stream.context().ordinal() as i32);
        let ctx = Context::primary(device)?;
        Ok(Stream {
            raw: stream.cu_stream() as usize,
            ctx,
            cudarc: Some(stream),
        })
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if process_is_exiting() {
            // cudarc's own drop would call the driver (destroy the stream, release the
            // context): leave everything to the process's teardown.
            std::mem::forget(self.cudarc.take());
            return;
        }
        let Ok(_current) = bind(self.ctx) else { return };
        if let Some(theirs) = &self.cudarc {
            // cudarc destroys its stream when its last reference goes: wait for its work
            // first if this is the last one (see the type's docs).
            if Arc::strong_count(theirs) == 1 {
                // SAFETY: the stream is live (we hold a reference to it).
                report("cuStreamSynchronize", unsafe {
                    Active::stream_synchronize(self.cu())
                });
            }
            return;
        }
        // SAFETY: the stream is ours and live; waiting for its work has no precondition.
        report("cuStreamSynchronize", unsafe {
            Active::stream_synchronize(self.cu())
        });
        // SAFETY: the stream is ours and no `StreamRef` to it outlives `self` (borrowck).
        // Its work is complete (above).
        report("cuStreamDestroy", unsafe {
            Active::stream_destroy(self.cu())
        });
    }
}

// A CUDA stream handle may be used and destroyed from any thread.
static_assertions::assert_impl_all!(Stream: Send, Sync);

/// A fixed set of streams handed out round-robin (RMM's `cuda_stream_pool`), for spreading
/// independent work without creating streams on the hot path.
#[derive(Debug)]
pub struct StreamPool {
    streams: Vec<Stream>,
    next: AtomicUsize,
}

impl StreamPool {
    /// RMM's default: 16 streams.
    pub const DEFAULT_SIZE: usize = 16;

    /// [`DEFAULT_SIZE`](Self::DEFAULT_SIZE) non-blocking streams on the current device.
    pub fn new() -> Result<StreamPool, Error> {
        StreamPool::with_size(Self::DEFAULT_SIZE, StreamFlags::NonBlocking)
    }

    /// `size` streams with `flags` on the current device; `size` 0 is
    /// [`Error::InvalidArgument`].
    pub fn with_size(size: usize, flags: StreamFlags) -> Result<StreamPool, Error> {
        if size == 0 {
            return Err(Error::invalid_argument(
                "a stream pool needs at least one stream",
            ));
        }
        let device = DeviceId::current()?;
        let streams = (0..size)
            .map(|_| Stream::on(device, flags))
            .collect::<Result<_, _>>()?;
        Ok(StreamPool {
            streams,
            next: AtomicUsize::new(0),
        })
    }

    /// The next stream, round-robin; safe to call from many threads at once.
    pub fn get(&self) -> StreamRef<'_> {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.streams.len();
        self.streams[i].as_ref()
    }

    /// The stream with index `id` modulo the pool's size (stable: the same id, the same
    /// stream).
    pub fn get_by_id(&self, id: usize) -> StreamRef<'_> {
        self.streams[id % self.streams.len()].as_ref()
    }

    /// How many streams the pool holds.
    pub fn len(&self) -> usize {
        self.streams.len()
    }

    /// Always false: a pool holds at least one stream.
    pub fn is_empty(&self) -> bool {
        self.streams.is_empty()
    }
}
