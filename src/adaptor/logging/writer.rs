//! The log's writer thread: drains the ring, formats rows and writes them to the sink, so
//! that the threads being logged pay only for taking a place in the ring and filling it.

use std::io::{self, Write};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError};
use std::thread::{JoinHandle, Thread};
use std::time::Duration;

use super::clock::{Clock, ToWall};
use super::ring::{Record, Ring, Wait};
use super::row::RowFormat;

/// Slots in the ring (64 bytes each: 512 KiB, small enough to stay in a core's cache).
const RING_SLOTS: usize = 1 << 13;
/// Bytes of rows gathered before one write call to the sink.
const WRITE_AT: usize = 1 << 20;
/// Records drained before the writer looks at anything else.
const BATCH: usize = 4096;
/// The idle writer's first nap.
const NAP: Duration = Duration::from_micros(50);
/// The longest the idle writer sleeps before it looks at the ring again.
const MAX_NAP: Duration = Duration::from_micros(250);

/// What the logging threads and the writer thread share.
struct Control {
    ring: Ring,
    /// The writer thread, to wake it.
    writer: OnceLock<Thread>,
    /// Flush requests: write out everything up to this position.
    flush_to: AtomicU64,
    /// Set once, by the drop: write out everything and stop.
    stop: AtomicBool,
    /// Set if the writer thread ended without being asked to (a panic outside the
    /// sink): producers and flushes stop waiting for it.
    dead: AtomicBool,
    status: Mutex<Status>,
    flushed_cond: Condvar,
}

#[derive(Default)]
struct Status {
    /// Every record before this position is in the sink, flushed.
    flushed: u64,
    /// The first write error since the last flush call returned one.
    error: Option<io::Error>,
}

impl Control {
    fn wake_writer(&self) {
        if let Some(t) = self.writer.get() {
            t.unpark();
        }
    }

    fn status(&self) -> MutexGuard<'_, Status> {
        self.status.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Wait for Control {
    fn full(&self) -> bool {
        if self.dead.load(Ordering::Acquire) {
            return false;
        }
        self.wake_writer();
        std::thread::yield_now();
        true
    }
}

/// The producing side, owned by the `Logging` adaptor; dropping it writes everything
/// out and ends the thread.
pub(super) struct Writer {
    control: Arc<Control>,
    thread: Option<JoinHandle<()>>,
}

impl Writer {
    /// Starts the writer thread over `sink`, for events stamped with `clock`.
    pub(super) fn start(sink: Box<dyn Write + Send>, clock: Clock) -> io::Result<Writer> {
        let control = Arc::new(Control {
            ring: Ring::new(RING_SLOTS),
            writer: OnceLock::new(),
            flush_to: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            dead: AtomicBool::new(false),
            status: Mutex::new(Status::default()),
            flushed_cond: Condvar::new(),
        });
        let theirs = Arc::clone(&control);
        let thread = std::thread::Builder::new()
            .name("memres-log".into())
            .spawn(move || run(&theirs, sink, ToWall::new(clock)))?;
        let _ = control.writer.set(thread.thread().clone());
        Ok(Writer {
            control,
            thread: Some(thread),
        })
    }

    /// Appends one event (waits only while the ring is full).
    #[inline]
    pub(super) fn log(&self, record: Record) {
        self.control.ring.push(record, &*self.control);
    }

    /// Waits until every event logged before the call is written to the sink and the
    /// sink is flushed (a call with nothing logged since the last one does not flush the
    /// sink again); returns the first write error since the last call that returned one.
    pub(super) fn flush(&self) -> io::Result<()> {
        let c = &*self.control;
        let target = c.ring.taken();
        c.flush_to.fetch_max(target, Ordering::Release);
        c.wake_writer();
        let mut status = c.status();
        while status.flushed < target && !c.dead.load(Ordering::Acquire) {
            status = c
                .flushed_cond
                .wait(status)
                .unwrap_or_else(PoisonError::into_inner);
        }
        status.error.take().map_or(Ok(()), Err)
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.control.stop.store(true, Ordering::Release);
        self.control.wake_writer();
        if let Some(t) = self.thread.take() {
            // The writer catches its sink's panics, so it ends normally.
            let _ = t.join();
        }
        if let Some(e) = self.control.status().error.take() {
            tracing::error!(%e, "memres::Logging: cannot write the log");
        }
    }
}

/// Marks the writer dead if it ends without being asked to (it unwinds), and wakes
/// whoever waits for it.
struct DeathWatch<'a>(&'a Control);

impl Drop for DeathWatch<'_> {
    fn drop(&mut self) {
        if !self.0.stop.load(Ordering::Acquire) {
            self.0.dead.store(true, Ordering::Release);
            let _status = self.0.status();
            self.0.flushed_cond.notify_all();
        }
    }
}

/// The writer thread.
fn run(c: &Control, mut sink: Box<dyn Write + Send>, mut to_wall: ToWall) {
    let _watch = DeathWatch(c);
    let mut consumer = c.ring.consumer();
    let mut rows: Vec<u8> = Vec::with_capacity(WRITE_AT + 4096);
    let mut naps = 0u32;
    let mut format = RowFormat::default();
    loop {
        to_wall.calibrate();
        let n = consumer.drain(BATCH, |r| format.row(&mut rows, r, to_wall.wall(r.time)));
        if rows.len() >= WRITE_AT {
            write_out(c, &mut sink, &mut rows, false);
        }
        if n == BATCH {
            // A backlog: keep going, but answer a flush request that is covered already
            // (under sustained load the ring may never run dry).
            let at = consumer.position();
            let flush_to = c.flush_to.load(Ordering::Acquire);
            if flush_to > c.status().flushed && at >= flush_to {
                write_out(c, &mut sink, &mut rows, true);
                finish_flush(c, at);
            }
            continue;
        }
        // Caught up: answer a flush request or the drop, or wait a little.
        let at = consumer.position();
        let stop = c.stop.load(Ordering::Acquire);
        if stop && at >= c.ring.taken() {
            write_out(c, &mut sink, &mut rows, true);
            finish_flush(c, at);
            return;
        }
        let flush_to = c.flush_to.load(Ordering::Acquire);
        if flush_to > c.status().flushed && at >= flush_to {
            write_out(c, &mut sink, &mut rows, true);
            finish_flush(c, at);
            continue;
        }
        // Sleep rather than spin or chase the producers: a writer that reads the slot a
        // producer has just filled takes its cache line from the producer on every
        // event. Naps grow from 50 to 250 µs while nothing comes; producers wake us when
        // the ring fills, flush and drop when they need us.
        naps = if n > 0 { 1 } else { naps.saturating_add(1) };
        std::thread::park_timeout(MAX_NAP.min(NAP * naps));
    }
}

/// Writes `rows` to the sink (and flushes it when `flush`), keeping the first error;
/// a panicking sink counts as an error.
fn write_out(c: &Control, sink: &mut Box<dyn Write + Send>, rows: &mut Vec<u8>, flush: bool) {
    let result = catch_unwind(AssertUnwindSafe(|| {
        sink.write_all(rows)?;
        if flush { sink.flush() } else { Ok(()) }
    }))
    .unwrap_or_else(|_| Err(io::Error::other("the log's sink panicked")));
    rows.clear();
    if let Err(e) = result {
        c.status().error.get_or_insert(e);
    }
}

fn finish_flush(c: &Control, at: u64) {
    let mut status = c.status();
    status.flushed = status.flushed.max(at);
    drop(status);
    c.flushed_cond.notify_all();
}
