//! The log's writer threads: lanes drain the ring and format rows, a sequencer writes
//! them to the sink in log order, so that the threads being logged pay only for taking a
//! place in the ring and filling it.
//!
//! One thread could not keep up with a fast allocator on a large machine: each record
//! comes from another core's cache and becomes a row, about 80 to 110 ns an event on the
//! H100 host, longer than the allocations it logs; the ring then stays full and the
//! logging threads wait for it. So positions are dealt to [`LANES`] lanes in chunks of
//! [`CHUNK`] (chunk `c` to lane `c % LANES`), each lane formats its chunks in order into
//! pieces of text, and the sequencer puts pieces together by position.

use std::collections::BTreeMap;
use std::io::{self, Write};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError};
use std::thread::{JoinHandle, Thread};
use std::time::Duration;

use super::clock::{Clock, ToWall};
use super::ring::{Record, Ring, Wait};
use super::row::RowFormat;

/// Slots in the ring (64 bytes each: 512 KiB).
const RING_SLOTS: usize = 1 << 13;
/// Lanes formatting rows at once.
const LANES: u64 = 4;
/// Consecutive positions a lane takes at a time.
const CHUNK: u64 = 256;
/// How long the sequencer waits for a piece before it looks at flushes and the stop.
const SEQUENCER_NAP: Duration = Duration::from_micros(250);
/// Bytes of rows gathered before one write call to the sink.
const WRITE_AT: usize = 1 << 20;
/// An idle lane's first nap.
const NAP: Duration = Duration::from_micros(50);
/// The longest an idle lane sleeps before it looks at the ring again (producers that
/// find the ring full, flushes and the drop wake the lanes at once).
const MAX_NAP: Duration = Duration::from_millis(1);

/// What the logging threads and the writer threads share.
///
/// The records themselves go through the ring, whose protocol has loom models
/// (`ring::loom_models`). The rest needs none: what a `flush` waits for (`flushed`,
/// `error` in `status`, and `dead`) changes under the `status` mutex or is followed by
/// taking it before `flushed_cond` is notified, the condition variable's own discipline;
/// `flush_to` and `stop` are requests to the writer threads, which are unparked after
/// each one (a thread's park token makes a wake before its park count).
struct Control {
    ring: Ring,
    /// The lanes, to wake them.
    lanes: Vec<OnceLock<Thread>>,
    /// The sequencer, to wake it for a flush or the stop.
    sequencer: OnceLock<Thread>,
    /// Flush requests: write out everything up to this position.
    flush_to: AtomicU64,
    /// Set once, by the drop: write out everything and stop.
    stop: AtomicBool,
    /// Set if a writer thread ended without being asked to (a panic outside the sink):
    /// producers and flushes stop waiting.
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
    fn wake_lanes(&self) {
        for lane in self.lanes.iter().filter_map(OnceLock::get) {
            lane.unpark();
        }
    }

    fn wake_all(&self) {
        self.wake_lanes();
        if let Some(t) = self.sequencer.get() {
            t.unpark();
        }
    }

    fn status(&self) -> MutexGuard<'_, Status> {
        crate::sync::lock_std(&self.status)
    }
}

impl Wait for Control {
    fn full(&self, attempt: u32) -> bool {
        if self.dead.load(Ordering::Acquire) {
            return false;
        }
        // Wake the lanes once (and again now and then, should they have gone back to
        // sleep), not on every turn of the wait: each wake is a system call per lane.
        if attempt.is_multiple_of(256) {
            self.wake_lanes();
        }
        if attempt < 64 {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
        true
    }
}

/// The producing side, owned by the `Logging` adaptor; dropping it writes everything
/// out and ends the threads.
pub(super) struct Writer {
    control: Arc<Control>,
    threads: Vec<JoinHandle<()>>,
}

impl Writer {
    /// Starts the lanes and the sequencer over `sink`, for events stamped with `clock`.
    /// (Four lanes even on a machine of two cores: one lane there fell behind the program
    /// it logged, and the ring's waits cost more than the lanes taking turns.)
    pub(super) fn start(sink: Box<dyn Write + Send>, clock: Clock) -> io::Result<Writer> {
        Writer::with_lanes(sink, clock, LANES)
    }

    /// [`start`](Self::start) with `lanes` lanes (at least one).
    fn with_lanes(sink: Box<dyn Write + Send>, clock: Clock, lanes: u64) -> io::Result<Writer> {
        let lanes = lanes.max(1);
        let control = Arc::new(Control {
            ring: Ring::new(RING_SLOTS),
            lanes: (0..lanes).map(|_| OnceLock::new()).collect(),
            sequencer: OnceLock::new(),
            flush_to: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            dead: AtomicBool::new(false),
            status: Mutex::new(Status::default()),
            flushed_cond: Condvar::new(),
        });
        let mut writer = Writer {
            control: Arc::clone(&control),
            threads: Vec::new(),
        };
        let (pieces, received) = mpsc::channel();
        for lane in 0..lanes {
            let (c, pieces) = (Arc::clone(&control), pieces.clone());
            let thread = std::thread::Builder::new()
                .name(format!("memres-log-{lane}"))
                .spawn(move || run_lane(&c, lane, lanes, &pieces, ToWall::new(clock)))
                // On failure, dropping `writer` stops the lanes already started.
                .inspect_err(|_| control.stop.store(true, Ordering::Release))?;
            let _ = control.lanes[lane as usize].set(thread.thread().clone());
            writer.threads.push(thread);
        }
        drop(pieces);
        let c = Arc::clone(&control);
        let thread = std::thread::Builder::new()
            .name("memres-log".into())
            .spawn(move || run_sequencer(&c, sink, &received))
            .inspect_err(|_| control.stop.store(true, Ordering::Release))?;
        let _ = control.sequencer.set(thread.thread().clone());
        writer.threads.push(thread);
        Ok(writer)
    }

    /// Appends one event (waits only while the ring is full).
    #[inline(always)]
    pub(super) fn log(&self, record: impl FnOnce() -> Record) {
        self.control.ring.push(record, &*self.control);
    }

    /// Waits until every event logged before the call is written to the sink and the
    /// sink is flushed (a call with nothing logged since the last one does not flush the
    /// sink again); returns the first write error since the last call that returned one.
    pub(super) fn flush(&self) -> io::Result<()> {
        let c = &*self.control;
        let target = c.ring.taken();
        c.flush_to.fetch_max(target, Ordering::Release);
        c.wake_all();
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
        self.control.wake_all();
        for t in self.threads.drain(..) {
            // The threads catch their sink's panics, so they end normally.
            let _ = t.join();
        }
        if let Some(e) = self.control.status().error.take() {
            tracing::error!(%e, "memres::Logging: cannot write the log");
        }
    }
}

/// Marks the writer dead if a thread ends without being asked to, and wakes whoever
/// waits for it.
struct DeathWatch<'a>(&'a Control);

impl Drop for DeathWatch<'_> {
    fn drop(&mut self) {
        if !self.0.stop.load(Ordering::Acquire) || std::thread::panicking() {
            self.0.dead.store(true, Ordering::Release);
            let _status = self.0.status();
            self.0.flushed_cond.notify_all();
            self.0.wake_all();
        }
    }
}

/// The rows of positions `start..end`, formatted by one lane.
struct Piece {
    start: u64,
    end: u64,
    rows: Vec<u8>,
}

impl Piece {
    /// An empty piece starting at `pos`.
    fn at(pos: u64) -> Piece {
        Piece {
            start: pos,
            end: pos,
            rows: Vec::with_capacity(CHUNK as usize * 64),
        }
    }

    /// Sends the rows up to `end` and starts a new piece at `next`; false if the
    /// sequencer is gone.
    fn send(&mut self, end: u64, next: u64, to: &Sender<Piece>) -> bool {
        self.end = end;
        to.send(std::mem::replace(self, Piece::at(next))).is_ok()
    }
}

/// A lane: formats the positions of its chunks, in order, and sends them on in pieces
/// (a whole chunk, or what is ready when the ring runs dry).
fn run_lane(c: &Control, lane: u64, lanes: u64, pieces: &Sender<Piece>, mut to_wall: ToWall) {
    let _watch = DeathWatch(c);
    let mut format = RowFormat::default();
    let mut pos = lane * CHUNK;
    let mut piece = Piece::at(pos);
    let mut naps = 0u32;
    loop {
        super::clock::lane_turned();
        to_wall.calibrate();
        let mut formatted = 0;
        while c.ring.take_with(pos, |r| {
            format.row(&mut piece.rows, r, to_wall.wall(r.time));
        }) {
            pos += 1;
            formatted += 1;
            if pos.is_multiple_of(CHUNK) {
                // The chunk is done: the next of this lane's chunks starts lanes - 1
                // chunks further on. (A turn too: logging threads read the clock afresh,
                // however long the lane stays busy.)
                super::clock::lane_turned();
                let done = pos;
                pos += (lanes - 1) * CHUNK;
                if !piece.send(done, pos, pieces) {
                    return; // the sequencer is gone
                }
            }
        }
        // The ring is dry at `pos`: what is formatted goes now, so flushes and the stop
        // see it.
        if pos > piece.start && !piece.send(pos, pos, pieces) {
            return;
        }
        if c.stop.load(Ordering::Acquire) && pos >= c.ring.taken() {
            return;
        }
        if c.dead.load(Ordering::Acquire) {
            return;
        }
        naps = if formatted > 0 {
            1
        } else {
            naps.saturating_add(1)
        };
        std::thread::park_timeout(MAX_NAP.min(NAP * naps));
    }
}

/// The sequencer: puts the lanes' pieces in position order and writes them out; answers
/// flushes and the stop.
fn run_sequencer(c: &Control, mut sink: Box<dyn Write + Send>, pieces: &Receiver<Piece>) {
    let _watch = DeathWatch(c);
    let mut next = 0u64;
    let mut waiting: BTreeMap<u64, Piece> = BTreeMap::new();
    let mut out: Vec<u8> = Vec::with_capacity(WRITE_AT + (CHUNK as usize) * 128);
    loop {
        let lanes_gone = match pieces.recv_timeout(SEQUENCER_NAP) {
            Ok(piece) => {
                waiting.insert(piece.start, piece);
                false
            }
            Err(RecvTimeoutError::Timeout) => false,
            Err(RecvTimeoutError::Disconnected) => true,
        };
        while let Some(piece) = waiting.remove(&next) {
            out.extend_from_slice(&piece.rows);
            next = piece.end;
            if out.len() >= WRITE_AT {
                write_out(c, &mut sink, &mut out, false);
            }
        }
        let stop = c.stop.load(Ordering::Acquire);
        if (stop && next >= c.ring.taken()) || lanes_gone {
            write_out(c, &mut sink, &mut out, true);
            finish_flush(c, next);
            return;
        }
        let flush_to = c.flush_to.load(Ordering::Acquire);
        if flush_to > c.status().flushed && next >= flush_to {
            write_out(c, &mut sink, &mut out, true);
            finish_flush(c, next);
        } else if flush_to > next || stop {
            c.wake_lanes();
        }
    }
}

/// Writes `rows` to the sink (and flushes it if asked), keeping the first error.
fn write_out(c: &Control, sink: &mut Box<dyn Write + Send>, rows: &mut Vec<u8>, flush: bool) {
    // A panicking sink must not end the thread with rows unwritten: it becomes an error.
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::log::Action;

    /// A sink the test can read back.
    #[derive(Clone, Default)]
    struct Shared(Arc<Mutex<Vec<u8>>>);

    impl Write for Shared {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }

        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    /// Several lanes (more than this machine may pick, so CI covers the dealing of
    /// chunks), two producers, several chunks and laps of the ring: every record is
    /// written once, and each producer's in its order.
    #[test]
    fn lanes_write_every_record_once_in_order() {
        const EACH: u64 = 3 * RING_SLOTS as u64;
        let sink = Shared::default();
        let writer = Writer::with_lanes(Box::new(sink.clone()), Clock::Wall, 3).unwrap();
        std::thread::scope(|scope| {
            for producer in 0..2u64 {
                let writer = &writer;
                scope.spawn(move || {
                    for i in 0..EACH {
                        writer.log(|| Record {
                            time: super::super::clock::wall_ns(),
                            thread: producer + 1,
                            action: super::super::row::action_code(Action::Allocate),
                            pointer: 256,
                            size: (i + 1) as usize,
                            stream: 0,
                            host: false,
                        });
                    }
                });
            }
        });
        writer.flush().unwrap();
        let text = String::from_utf8(sink.0.lock().unwrap().clone()).unwrap();
        let mut next = [1u64; 2];
        for row in text.lines() {
            let fields: Vec<&str> = row.split(',').collect();
            let producer: usize = fields[0].parse::<usize>().unwrap() - 1;
            let size: u64 = fields[4].parse().unwrap();
            assert_eq!(
                size, next[producer],
                "producer {producer}'s rows out of order"
            );
            next[producer] += 1;
        }
        assert_eq!(next, [EACH + 1; 2], "every record written once");
    }
}
