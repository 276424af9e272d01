//! [`Logging`]: a CSV log of every allocation and free, readable by RMM's tools and ours.

mod clock;
mod ring;
mod row;
mod writer;

use std::alloc::Layout;
use std::cell::Cell;
use std::fmt;
use std::fs::File;
use std::io::{self, Write};
use std::path::Path;
use std::ptr::NonNull;

use super::{deallocate_used_on_upstream, eq_by_upstream, upstream_access};
use crate::error::Error;
use crate::log::{Action, HEADER};
use crate::resource::{Resource, SyncResource};
use crate::stream::StreamRef;
use clock::Clock;
use ring::Record;
use writer::Writer;

/// The environment variable [`Logging::from_env`] reads the log's path from.
pub const LOG_FILE_VARIABLE: &str = "MEMRES_LOG_FILE";

/// Writes one CSV row per allocation, free and failed allocation (RMM's
/// `logging_resource_adaptor`, same format: see [`crate::log`]).
///
/// - Frees are logged before the upstream free (so the row exists even if the free
///   crashes); failures are logged and returned.
/// - The logging thread only reads a clock (the CPU's time-stamp counter where it is
///   invariant, else the wall clock; not for every event: see below), takes the event's
///   place in the log (one atomic add) and copies a 48-byte record into a ring; threads
///   that the adaptor owns do the rest: four lanes (`memres-log-0`..`3`) take turns by
///   chunks of 256 events to format rows, one thread (`memres-log`) puts them back in
///   order and writes them, a megabyte per write call (one formatting thread could not
///   keep up with a fast allocator: each record comes from another core's cache). The
///   place taken is the event's place in the file, so the file order is a real order of
///   events: an allocation's row precedes any free of that pointer on another thread and
///   any reuse of its address (a free is logged before the upstream free), which a
///   replay relies on.
/// - Nothing is lost: [`flush`](Self::flush) waits until every event logged before it is
///   in the sink and the sink is flushed; drop writes everything out and ends the
///   threads (an error there goes to `tracing`: call `flush` first to see it). In between,
///   rows reach the sink within about a millisecond of the lanes falling idle, or a
///   megabyte at a time. When the ring (8,192 events) is full, logging threads wait for
///   the lanes. Idle lanes nap up to a millisecond.
/// - [`auto_flush`](Self::auto_flush) makes every call wait for its row to be flushed
///   (slow; for logs that must survive a crash).
/// - Times are UTC wall clock (`HH:MM:SS.ffffff`); threads are OS thread ids. Where
///   events are stamped with counter ticks, the writer converts them against wall-clock
///   readings it takes at every drain, with a rate measured over a baseline of at least a
///   millisecond (so the writer's first drain waits that long).
/// - Times are approximate; the order is not. A thread reads the clock as a call begins
///   (so that the reading overlaps the upstream's work), for at least every eighth event
///   it logs, and again whenever a writer lane has moved on since its last reading (a
///   lane does at each wake-up, at least every millisecond while idle, and after every
///   256 rows it formats); its events in between carry that last reading. Reading the
///   clock was most of what logging cost (about 20 of 26 ns an event on the H100 host).
///   So a row's time may be earlier than its call by up to seven of the thread's calls
///   and at most the lanes' longest nap (about a millisecond); in a burst, well under the
///   microsecond a row shows. Rows of different threads may step back in time by as
///   much, even where one call followed the other (a free on one thread may show a time
///   before that of the allocation it frees, made on another); a thread's own rows never
///   step back. [`exact_times`](Self::exact_times) reads the clock for every event.
/// - A sink that allocates through this same adaptor would wait on itself: do not.
///
/// ```
/// use memres::adaptor::Logging;
/// use memres::{HostHeap, SyncResource, layout};
///
/// let path = std::env::temp_dir().join("memres-doc-example.csv");
/// let logged = Logging::to_file(HostHeap::new(), &path)?;
/// let l = layout(100)?;
/// let p = logged.allocate_sync(l)?;
/// // SAFETY: allocated above with `l`.
/// unsafe { logged.deallocate_sync(p, l) };
/// logged.flush()?;
/// let events = memres::log::read_events_from_path(&path)?;
/// assert_eq!(events.len(), 2);
/// # std::fs::remove_file(&path).ok();
/// # Ok::<(), memres::Error>(())
/// ```
pub struct Logging<U> {
    upstream: U,
    writer: Writer,
    clock: Clock,
    auto_flush: bool,
    exact_times: bool,
}

upstream_access!(Logging<U>);

impl<U> Logging<U> {
    /// Logs to `writer`, writing the header first; starts the writer thread.
    pub fn to_writer(upstream: U, writer: impl Write + Send + 'static) -> Result<Self, Error> {
        let mut sink: Box<dyn Write + Send> = Box::new(writer);
        writeln!(sink, "{HEADER}").map_err(io_error)?;
        let clock = Clock::detect();
        let writer = Writer::start(sink, clock).map_err(|e| {
            Error::invalid_argument(format!("cannot start the log's writer thread: {e}"))
        })?;
        Ok(Logging {
            upstream,
            writer,
            clock,
            auto_flush: false,
            exact_times: false,
        })
    }

    /// Logs to the file at `path`, created or truncated.
    pub fn to_file(upstream: U, path: impl AsRef<Path>) -> Result<Self, Error> {
        let path = path.as_ref();
        let file = File::create(path).map_err(|e| {
            Error::invalid_argument(format!("cannot create the log {}: {e}", path.display()))
        })?;
        Logging::to_writer(upstream, file)
    }

    /// Logs to the file named by the environment variable `MEMRES_LOG_FILE`; its absence is
    /// [`Error::InvalidArgument`] naming the variable.
    pub fn from_env(upstream: U) -> Result<Self, Error> {
        match std::env::var_os(LOG_FILE_VARIABLE) {
            Some(path) => Logging::to_file(upstream, path),
            None => Err(Error::invalid_argument(format!(
                "no log file given and {LOG_FILE_VARIABLE} is not set"
            ))),
        }
    }

    /// Flushes after every row when `on` (slow; for logs that must survive a crash).
    pub fn auto_flush(mut self, on: bool) -> Self {
        self.auto_flush = on;
        self
    }

    /// Reads the clock for every event when `on`, so that each row carries the time its
    /// own call began (off by default: a thread's reading then serves up to seven more of
    /// its events while the writer has not moved on; see the type's docs). Costs about
    /// 20 ns an event on the H100 host.
    pub fn exact_times(mut self, on: bool) -> Self {
        self.exact_times = on;
        self
    }

    /// An event's time, read as its call begins.
    #[inline(always)]
    fn time(&self) -> u64 {
        if self.exact_times {
            self.clock.now()
        } else {
            self.clock.stamp()
        }
    }

    /// Waits until everything logged so far is written to the sink, and flushes it.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] with the first write error since the last `flush` that
    /// reported one.
    pub fn flush(&self) -> Result<(), Error> {
        self.writer.flush().map_err(io_error)
    }

    /// Logs one event that happened at `time` (on `self.clock`).
    #[inline(always)]
    fn log(
        &self,
        time: u64,
        action: Action,
        pointer: Option<NonNull<u8>>,
        size: usize,
        stream: StreamRef<'_>,
    ) {
        let (stream, host) = match stream.cu() {
            Some(raw) => (raw as u64, false),
            None => (u64::from(stream.host_id().unwrap_or(0)), true),
        };
        let thread = thread_id();
        self.writer.log(move || Record {
            time,
            thread,
            action: row::action_code(action),
            pointer: pointer.map_or(0, |p| p.as_ptr() as usize),
            size,
            stream,
            host,
        });
        if self.auto_flush {
            self.flush_after_event();
        }
    }

    /// [`auto_flush`](Self::auto_flush)'s flush after each event; out of line, so that
    /// the logging path stays short where it is off.
    #[cold]
    #[inline(never)]
    fn flush_after_event(&self) {
        if let Err(e) = self.writer.flush() {
            tracing::error!(%e, "memres::Logging: cannot write the log");
        }
    }
}

thread_local! {
    /// The OS thread id, looked up on the thread's first event (0: not yet). No lazy
    /// initialisation and no destructor, so reading it is one load (with native
    /// thread-locals, even during the thread's exit).
    static THREAD: Cell<u64> = const { Cell::new(0) };
}

/// The calling thread's OS id.
#[inline]
fn thread_id() -> u64 {
    // `try_with`: where thread-locals are emulated, even this one is gone once the
    // thread's thread-local destructors have run; ask the OS then.
    let known = THREAD.try_with(Cell::get).unwrap_or(0);
    if known != 0 {
        return known;
    }
    let id = os_thread_id();
    let _ = THREAD.try_with(|t| t.set(id));
    id
}

#[cfg(target_os = "linux")]
fn os_thread_id() -> u64 {
    unsafe extern "C" {
        fn gettid() -> i32;
    }
    // SAFETY: `gettid` (glibc 2.30 and later) has no preconditions and cannot fail.
    (unsafe { gettid() }) as u64
}

#[cfg(not(target_os = "linux"))]
fn os_thread_id() -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    std::thread::current().id().hash(&mut h);
    h.finish()
}

fn io_error(e: io::Error) -> Error {
    Error::invalid_argument(format!("cannot write the log: {e}"))
}

eq_by_upstream!(Logging<U>);

impl<U: fmt::Debug> fmt::Debug for Logging<U> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Logging")
            .field("upstream", &self.upstream)
            .finish_non_exhaustive()
    }
}

// SAFETY: every block comes from the upstream unchanged; logging never touches memory.
unsafe impl<U: SyncResource> SyncResource for Logging<U> {
    type Properties = U::Properties;

    #[inline(always)]
    fn allocate_sync(&self, layout: Layout) -> Result<NonNull<u8>, Error> {
        // The time first (see the type's docs): its latency overlaps the upstream's work.
        let time = self.time();
        let result = self.upstream.allocate_sync(layout);
        self.log_allocation(time, &result, layout, StreamRef::DEFAULT);
        result
    }

    #[inline(always)]
    unsafe fn deallocate_sync(&self, ptr: NonNull<u8>, layout: Layout) {
        let time = self.time();
        self.log(
            time,
            Action::Free,
            Some(ptr),
            layout.size(),
            StreamRef::DEFAULT,
        );
        // SAFETY: the caller's promise, for the upstream that allocated the block.
        unsafe { self.upstream.deallocate_sync(ptr, layout) }
    }
}

impl<U> Logging<U> {
    #[inline(always)]
    fn log_allocation(
        &self,
        time: u64,
        result: &Result<NonNull<u8>, Error>,
        layout: Layout,
        stream: StreamRef<'_>,
    ) {
        match result {
            Ok(p) => self.log(time, Action::Allocate, Some(*p), layout.size(), stream),
            Err(_) => self.log(time, Action::AllocateFailure, None, layout.size(), stream),
        }
    }
}

// SAFETY: as for `SyncResource`.
unsafe impl<U: Resource> Resource for Logging<U> {
    #[inline(always)]
    fn allocate(&self, stream: StreamRef<'_>, layout: Layout) -> Result<NonNull<u8>, Error> {
        let time = self.time();
        let result = self.upstream.allocate(stream, layout);
        self.log_allocation(time, &result, layout, stream);
        result
    }

    #[inline(always)]
    unsafe fn deallocate(&self, stream: StreamRef<'_>, ptr: NonNull<u8>, layout: Layout) {
        let time = self.time();
        self.log(time, Action::Free, Some(ptr), layout.size(), stream);
        // SAFETY: the caller's promise, for the upstream that allocated the block.
        unsafe { self.upstream.deallocate(stream, ptr, layout) }
    }

    deallocate_used_on_upstream!(|self, stream, ptr, layout| {
        let time = self.time();
        self.log(time, Action::Free, Some(ptr), layout.size(), stream);
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::upstream::HostHeap;

    /// With exact times every event reads the clock (a real reading is never 42); without,
    /// a thread's recent reading stamps its next event (retried: other tests' lanes move
    /// on now and then, which forces a fresh reading).
    #[test]
    fn exact_times_read_the_clock_for_every_event() {
        let exact = Logging::to_writer(HostHeap::new(), io::sink())
            .unwrap()
            .exact_times(true);
        clock::set_recent(42, 7);
        assert_ne!(exact.time(), 42);
        let reusing = exact.exact_times(false);
        let reused = (0..1000).any(|_| {
            clock::set_recent(42, 7);
            reusing.time() == 42
        });
        assert!(reused);
    }
}
