//! CUDA events: points in a stream that other streams and the host can wait for.

use super::StreamRef;
use crate::device::{Context, bind, process_is_exiting};
use crate::driver::report;
use crate::error::Error;
use crate::platform::{Active, EventHandle, Platform, StreamHandle};

/// A CUDA event (timing disabled: it only orders work), destroyed when dropped.
///
/// ```no_run
/// use memres::stream::{Event, Stream};
///
/// let (a, b) = (Stream::new()?, Stream::new()?);
/// let done_on_a = Event::new()?;
/// // ... enqueue work on `a` ...
/// done_on_a.record(a.as_ref())?;
/// b.as_ref().wait_for(&done_on_a)?; // work enqueued on `b` from now waits for it
/// # Ok::<(), memres::Error>(())
/// ```
#[derive(Debug)]
pub struct Event {
    raw: usize,
    ctx: Context,
}

impl Event {
    /// A new event on the current device. Until it is recorded, it counts as complete.
    pub fn new() -> Result<Event, Error> {
        Event::new_in(Context::current()?)
    }

    /// A new event of `ctx`'s device (events are recorded on streams of their own
    /// device).
    pub(crate) fn new_in(ctx: Context) -> Result<Event, Error> {
        let _current = bind(ctx)?;
        // A context is current (above).
        let raw = Active::event_create()?;
        Ok(Event { raw, ctx })
    }

    fn raw(&self) -> EventHandle {
        self.raw
    }

    /// Captures the work enqueued on `stream` so far: the event completes when it does.
    /// On a host stream, whose work is always complete, this waits for the event's
    /// previous capture, so the event then counts as complete as well.
    pub fn record(&self, stream: StreamRef<'_>) -> Result<(), Error> {
        match stream.cu() {
            None => self.synchronize(),
            Some(raw) => {
                let _current = bind(self.ctx)?;
                // SAFETY: the event is ours; `raw` is live for the borrow of `stream`.
                unsafe { Active::event_record(self.raw(), raw) }
            }
        }
    }

    /// Waits on the host until the captured work is complete.
    pub fn synchronize(&self) -> Result<(), Error> {
        let _current = bind(self.ctx)?;
        // SAFETY: the event is ours and live.
        unsafe { Active::event_synchronize(self.raw()) }
    }

    /// True when the captured work is complete; does not wait.
    pub fn is_complete(&self) -> Result<bool, Error> {
        let _current = bind(self.ctx)?;
        // SAFETY: the event is ours and live.
        unsafe { Active::event_query(self.raw()) }
    }

    pub(crate) fn context(&self) -> Context {
        self.ctx
    }

    /// Makes work enqueued on `stream` from now on wait for the event, with `ctx` current
    /// (it decides which stream a default-stream handle names).
    pub(super) fn enqueue_wait(&self, stream: StreamHandle, ctx: Context) -> Result<(), Error> {
        let _current = bind(ctx)?;
        // SAFETY: the event is ours; `stream` is live for the caller's borrow.
        unsafe { Active::stream_wait_event(stream, self.raw()) }
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if process_is_exiting() {
            return;
        }
        let Ok(_current) = bind(self.ctx) else { return };
        // SAFETY: the event is ours; waits already enqueued on it stay valid (the driver
        // defers the release until they are done).
        report("cuEventDestroy", unsafe {
            Active::event_destroy(self.raw())
        });
    }
}

// A CUDA event handle may be recorded, queried, waited for and destroyed from any thread.
static_assertions::assert_impl_all!(Event: Send, Sync);
