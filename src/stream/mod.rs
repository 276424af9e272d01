//! Stream handles: the "when" of stream-ordered allocation.
//!
//! A [`StreamRef`] names a stream without owning it, like RMM's `cuda_stream_view`. It is
//! `Copy`, two words, and `Send + Sync` (it is only a name; CUDA streams may be used from
//! any thread). Owned streams, stream pools and events come with the CUDA resources.
//!
//! Unlike `cuda_stream_view`, a `StreamRef<'a>` carries the lifetime of the stream it
//! names, so the compiler rejects using a handle after its stream is destroyed (the
//! driver cannot be relied on to catch that). The streams that always exist (the default
//! and per-thread streams, host streams) are `StreamRef<'static>`; most signatures elide
//! the lifetime (`StreamRef<'_>`).
//!
//! Besides CUDA streams there is a *host* kind: streams of host-backed resources whose
//! work is always complete. Stream-ordered logic (a pool's per-stream free lists, for
//! example) is tested on machines with no GPU by handing it several distinct host streams.

mod capture;
mod event;
mod owned;
mod recorded;

use std::fmt;
use std::marker::PhantomData;

pub(crate) use capture::{Frontier, Relaxed, ancestors, on_capture_path};
pub use event::Event;
pub use owned::{Stream, StreamFlags, StreamPool};
pub(crate) use recorded::Recorded;

/// A CUDA stream handle as the driver takes it, for calls memres does not wrap: an opaque
/// pointer whatever the features (so that turning `cudarc-interop` on in one crate of a
/// build never changes another's types). cudarc's `CUstream` is the same pointer:
/// `.cast()` turns one into the other.
pub type RawStream = *mut std::ffi::c_void;

use crate::device::{Context, bind};
use crate::error::Error;
use crate::platform::{Active, Platform, StreamHandle};

/// The handle value of CUDA's legacy default stream when named explicitly
/// (`CU_STREAM_LEGACY`).
const LEGACY_HANDLE: usize = 0x1;
/// The handle value of CUDA's per-thread default stream (`CU_STREAM_PER_THREAD`).
const PER_THREAD_HANDLE: usize = 0x2;

/// A copyable, non-owning handle to a stream.
///
/// ```
/// use memres::StreamRef;
///
/// let s = StreamRef::DEFAULT;
/// assert!(s.is_default());
/// assert_ne!(StreamRef::host(1), StreamRef::host(2));
/// assert!(StreamRef::host(1).is_host());
/// assert_eq!(StreamRef::HOST.as_raw(), None);
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamRef<'a> {
    repr: Repr,
    stream: PhantomData<&'a ()>,
}

#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Repr {
    /// A CUDA stream handle, kept as an integer so that the handle is `Send + Sync`.
    Cuda(usize),
    /// A host stream: its work is always complete.
    Host(u32),
}

impl StreamRef<'static> {
    /// CUDA's legacy default stream (the null handle).
    pub const DEFAULT: StreamRef<'static> = StreamRef::new(Repr::Cuda(0));

    /// CUDA's per-thread default stream: a different stream on every host thread.
    pub const PER_THREAD: StreamRef<'static> = StreamRef::new(Repr::Cuda(PER_THREAD_HANDLE));

    /// The host stream number 0; see [`StreamRef::host`].
    pub const HOST: StreamRef<'static> = StreamRef::new(Repr::Host(0));

    /// A host stream, told apart from other host streams by `id`. Work on a host stream is
    /// always complete, so memory freed on one may be reused on any other at once; stream
    /// -ordered code can still keep separate books per stream, which is what host streams
    /// let tests exercise without a GPU.
    pub const fn host(id: u32) -> StreamRef<'static> {
        StreamRef::new(Repr::Host(id))
    }
}

impl<'a> StreamRef<'a> {
    const fn new(repr: Repr) -> Self {
        StreamRef {
            repr,
            stream: PhantomData,
        }
    }

    /// A handle to an existing CUDA stream.
    ///
    /// # Safety
    /// `stream` must be the null handle, `CU_STREAM_LEGACY`, `CU_STREAM_PER_THREAD`, or a
    /// stream created by the CUDA driver that is not destroyed during `'a`. Resources hand
    /// the handle to the driver, which cannot check it. If memory is freed on it to a
    /// sub-allocator (`memres::suballoc`), its work must be complete before it is
    /// destroyed: a later stream may get the same handle (as memres's own `Stream` does
    /// on drop, by synchronising it).
    pub unsafe fn from_raw(stream: RawStream) -> StreamRef<'a> {
        StreamRef::new(Repr::Cuda(stream as usize))
    }

    /// The driver's handle as the platform seam takes it, for memres's own driver calls,
    /// or `None` for a host stream.
    pub(crate) fn cu(self) -> Option<StreamHandle> {
        match self.repr {
            Repr::Cuda(handle) => Some(handle),
            Repr::Host(_) => None,
        }
    }

    /// The same handle with its borrow forgotten, for a table that keeps it until a
    /// free that comes before the stream goes.
    ///
    /// # Safety
    /// The stream stays live while the returned handle is used as a stream.
    pub(crate) const unsafe fn detach(self) -> StreamRef<'static> {
        StreamRef::new(self.repr)
    }

    /// The CUDA handle, or `None` for a host stream.
    pub fn as_raw(self) -> Option<RawStream> {
        match self.repr {
            Repr::Cuda(handle) => Some(handle as RawStream),
            Repr::Host(_) => None,
        }
    }

    /// The id of a host stream, or `None` for a CUDA stream.
    pub const fn host_id(self) -> Option<u32> {
        match self.repr {
            Repr::Host(id) => Some(id),
            Repr::Cuda(_) => None,
        }
    }

    /// True for a host stream, whose work is always complete.
    pub const fn is_host(self) -> bool {
        matches!(self.repr, Repr::Host(_))
    }

    /// True for CUDA's legacy default stream, named by the null handle or by
    /// `CU_STREAM_LEGACY`.
    pub const fn is_default(self) -> bool {
        matches!(self.repr, Repr::Cuda(0 | LEGACY_HANDLE))
    }

    /// True for CUDA's per-thread default stream. Stream-ordered code must treat it with
    /// care: it names a different stream on each thread.
    pub const fn is_per_thread(self) -> bool {
        matches!(self.repr, Repr::Cuda(PER_THREAD_HANDLE))
    }

    /// Waits until all work enqueued on the stream so far is complete. A host stream has
    /// none, so this returns at once; a CUDA stream needs a driver ([`Error::NoDriver`]).
    ///
    /// The default and per-thread streams are those of the current device.
    pub fn synchronize(self) -> Result<(), Error> {
        match self.cu() {
            None => Ok(()),
            Some(raw) => {
                let _current = bind(Context::current()?)?;
                // SAFETY: `raw` is a live stream for `'a` (the promise of `from_raw` or the
                // borrow it came from), or a default stream of the current context.
                unsafe { Active::stream_synchronize(raw) }
            }
        }
    }

    /// Synchronises the stream with `ctx` current (for resources, which know their
    /// context and must not depend on the caller's current device).
    pub(crate) fn synchronize_in(self, ctx: Context) -> Result<(), Error> {
        match self.cu() {
            None => Ok(()),
            Some(raw) => {
                let _current = bind(ctx)?;
                // SAFETY: as in `synchronize`.
                unsafe { Active::stream_synchronize(raw) }
            }
        }
    }

    /// Makes all work enqueued on this stream from now on wait until `event` completes. For
    /// a host stream (which has no queue) this waits for the event on the host.
    ///
    /// The default and per-thread streams are those of the current device, as in
    /// [`synchronize`](Self::synchronize).
    pub fn wait_for(self, event: &Event) -> Result<(), Error> {
        match self.cu() {
            None => event.synchronize(),
            Some(raw) if self.is_default() || self.is_per_thread() => {
                event.enqueue_wait(raw, Context::current()?)
            }
            Some(raw) => event.enqueue_wait(raw, event.context()),
        }
    }
}

impl StreamRef<'_> {
    /// Makes work enqueued on this stream from now on wait until the work enqueued on
    /// `earlier` so far is complete, so that it is safe to hand memory used on `earlier`
    /// to work on this stream.
    ///
    /// Nothing happens where both are the same stream or `earlier` is a host stream (its
    /// work is always complete); where this is a host stream, `earlier` is synchronised;
    /// between CUDA streams an event is recorded on `earlier` and waited for. Default and
    /// per-thread streams are those of the current device.
    pub fn wait_for_stream(self, earlier: StreamRef<'_>) -> Result<(), Error> {
        let same = self.repr == earlier.repr || (self.is_default() && earlier.is_default());
        if same || earlier.is_host() {
            return Ok(());
        }
        if self.is_host() {
            return earlier.synchronize();
        }
        // The event belongs to `earlier`'s device: it is recorded there, and may be waited
        // for from a stream of any device.
        let done = Event::new_in(earlier.context()?)?;
        done.record(earlier)?;
        self.wait_for(&done)
    }
}

impl StreamRef<'_> {
    /// The context of the stream's device: an explicit stream's own; the current one for
    /// the default and per-thread streams (which name the current device's). Not for host
    /// streams, which have none.
    pub(crate) fn context(self) -> Result<Context, Error> {
        match self.cu() {
            Some(raw) if !self.is_default() && !self.is_per_thread() => Context::of_stream(raw),
            _ => Context::current(),
        }
    }
}

#[cfg(feature = "cudarc-interop")]
impl<'a> From<&'a cudarc::driver::CudaStream> for StreamRef<'a> {
    /// Names a cudarc stream; the borrow keeps the stream alive while the handle is used.
    fn from(stream: &'a cudarc::driver::CudaStream) -> Self {
        StreamRef::new(Repr::Cuda(stream.cu_stream() as usize))
    }
}

impl Default for StreamRef<'_> {
    /// The legacy default stream, as RMM's `cuda_stream_view{}`.
    fn default() -> Self {
        StreamRef::DEFAULT
    }
}

impl fmt::Debug for StreamRef<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.repr {
            Repr::Cuda(0 | LEGACY_HANDLE) => f.write_str("StreamRef(default)"),
            Repr::Cuda(PER_THREAD_HANDLE) => f.write_str("StreamRef(per-thread)"),
            Repr::Cuda(handle) => write!(f, "StreamRef({handle:#x})"),
            Repr::Host(id) => write!(f, "StreamRef(host {id})"),
        }
    }
}

static_assertions::assert_impl_all!(StreamRef<'static>: Send, Sync, Copy);
static_assertions::assert_eq_size!(StreamRef<'static>, [usize; 2]);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_are_told_apart() {
        assert!(StreamRef::DEFAULT.is_default());
        // SAFETY: `CU_STREAM_LEGACY` is always valid.
        assert!(unsafe { StreamRef::from_raw(LEGACY_HANDLE as RawStream) }.is_default());
        assert!(!StreamRef::DEFAULT.is_per_thread());
        assert!(StreamRef::PER_THREAD.is_per_thread());
        assert!(!StreamRef::PER_THREAD.is_host());
        assert!(StreamRef::HOST.is_host());
        assert_eq!(StreamRef::HOST, StreamRef::host(0));
        assert_ne!(StreamRef::host(0), StreamRef::DEFAULT);
        assert_eq!(StreamRef::default(), StreamRef::DEFAULT);
    }

    #[test]
    fn raw_round_trip() {
        let raw = 0x7f00_1234usize as RawStream;
        // SAFETY: the handle is only stored and read back, never given to the driver.
        let s = unsafe { StreamRef::from_raw(raw) };
        assert_eq!(s.as_raw(), Some(raw));
        assert_eq!(StreamRef::DEFAULT.as_raw(), Some(std::ptr::null_mut()));
        assert_eq!(format!("{s:?}"), "StreamRef(0x7f001234)");
        assert_eq!(format!("{:?}", StreamRef::host(3)), "StreamRef(host 3)");
    }
}
