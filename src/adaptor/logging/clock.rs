//! Event times: a cheap tick count on the logging thread, turned into wall-clock time by
//! the writer thread.
//!
//! Reading the wall clock costs about 25 ns (a vDSO call); the x86 time-stamp counter
//! costs a third of that. Where the CPU says its counter is invariant (same rate on every
//! core, in every power state: CPUID 8000_0007h, EDX bit 8), events carry counter
//! ticks, and the writer maps ticks to wall time through calibration points (a counter
//! reading paired with a wall-clock reading) it takes every time it drains the ring;
//! the rate comes from a baseline of at least a millisecond, renewed every minute so that
//! a step of the wall clock spoils at most one baseline. Elsewhere events carry wall
//! time directly.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::sync::CachePadded;

/// Which clock events are stamped with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Clock {
    /// Time-stamp counter ticks.
    Ticks,
    /// Wall-clock nanoseconds since the Unix epoch.
    Wall,
}

impl Clock {
    /// The cheapest clock this machine has that the writer can turn into wall time.
    pub(super) fn detect() -> Clock {
        if invariant_tsc() {
            Clock::Ticks
        } else {
            Clock::Wall
        }
    }

    /// The time now, in this clock's unit.
    #[inline]
    pub(super) fn now(self) -> u64 {
        match self {
            Clock::Ticks => ticks(),
            Clock::Wall => wall_ns(),
        }
    }

    /// An event's time: [`now`](Self::now), or the calling thread's last reading where
    /// that is recent enough (see [`Recent`]). Reading the counter costs more than the
    /// rest of logging an event together (about 20 of 26 ns an event on the H100 host).
    #[inline]
    pub(super) fn stamp(self) -> u64 {
        let turns = TURNS.0.load(Ordering::Relaxed);
        let reused = RECENT
            .try_with(|r| {
                let last = r.get();
                (last.left > 0 && last.turns == turns).then(|| {
                    r.set(Recent {
                        left: last.left - 1,
                        ..last
                    });
                    last.time
                })
            })
            .ok()
            .flatten();
        match reused {
            Some(time) => time,
            None => self.read_for_reuse(turns),
        }
    }

    /// [`stamp`](Self::stamp) when the thread's last reading may not be used: reads the
    /// clock and keeps the reading for the thread's next events.
    #[inline(never)]
    fn read_for_reuse(self, turns: u64) -> u64 {
        let time = self.now();
        let _ = RECENT.try_with(|r| {
            r.set(Recent {
                time,
                turns,
                left: REUSES,
            });
        });
        time
    }
}

/// How many events after it a thread's clock reading may stamp: the clock is read for at
/// least every eighth event of a thread.
const REUSES: u8 = 7;

/// A thread's last clock reading. It stamps the thread's next [`REUSES`] events as long
/// as no writer lane has moved on since (see [`TURNS`]). So an event's time is its own
/// call's, or that of one of the thread's seven calls before it, read since the lanes
/// last moved on: at most a millisecond earlier while they are idle, and about the time
/// a lane takes to format 256 rows while they work. In a burst, where reading the clock
/// costs most (about 20 of the 26 ns that logging an event cost on the H100 host), seven
/// calls take well under the microsecond the log prints. Only times are approximate:
/// the log's order is the ring's, exact.
///
/// Every `Logging` reads the same kind of clock ([`Clock::detect`] depends on the
/// machine alone), so one reading serves the thread's events in all of them.
#[derive(Clone, Copy)]
struct Recent {
    time: u64,
    /// [`TURNS`] when the clock was read.
    turns: u64,
    /// Events the reading may still stamp (0 before the first reading).
    left: u8,
}

thread_local! {
    // Const-initialised, no destructor: one load to read, usable during thread exit.
    static RECENT: Cell<Recent> = const {
        Cell::new(Recent { time: 0, turns: 0, left: 0 })
    };
}

/// Turns of the writer lanes of every log, counted: a lane turns when it wakes up (at
/// least every millisecond while idle, every 50 µs while events keep coming) and after
/// each 256 rows it formats. A thread's clock reading is reused only while this count
/// stays the same. On a cache line of its own: the logging threads read it from their
/// own caches until a lane writes it.
static TURNS: CachePadded<AtomicU64> = CachePadded(AtomicU64::new(0));

/// Called by a writer lane as it wakes up and after each chunk of rows.
pub(super) fn lane_turned() {
    TURNS.0.fetch_add(1, Ordering::Relaxed);
}

/// Wall-clock nanoseconds since the Unix epoch (0 before it).
pub(super) fn wall_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

#[cfg(target_arch = "x86_64")]
fn invariant_tsc() -> bool {
    use std::arch::x86_64::__cpuid;
    __cpuid(0x8000_0000).eax >= 0x8000_0007 && __cpuid(0x8000_0007).edx & (1 << 8) != 0
}

#[cfg(not(target_arch = "x86_64"))]
fn invariant_tsc() -> bool {
    false
}

#[cfg(target_arch = "x86_64")]
#[inline]
fn ticks() -> u64 {
    // SAFETY: `rdtsc` exists on every x86_64 CPU and has no preconditions.
    unsafe { std::arch::x86_64::_rdtsc() }
}

#[cfg(not(target_arch = "x86_64"))]
#[inline]
fn ticks() -> u64 {
    // Never called: `detect` picks `Wall` on these targets.
    wall_ns()
}

/// A counter reading and a wall-clock reading taken together.
#[derive(Debug, Clone, Copy)]
struct Point {
    ticks: u64,
    wall: u64,
}

impl Point {
    fn now() -> Point {
        // The counter read between two wall-clock reads, paired with their midpoint.
        let a = wall_ns();
        let ticks = ticks();
        let b = wall_ns();
        Point {
            ticks,
            wall: a + (b.saturating_sub(a)) / 2,
        }
    }
}

/// The shortest baseline a rate is measured over.
const MIN_BASELINE: Duration = Duration::from_millis(1);
/// How long a baseline is used before a new one starts.
const RENEW_BASELINE: Duration = Duration::from_secs(60);

/// Turns event times into wall-clock nanoseconds (the writer thread's side).
pub(super) struct ToWall {
    clock: Clock,
    /// Where the current baseline starts.
    start: Point,
    /// The newest calibration point.
    anchor: Point,
    /// Nanoseconds per tick, from the last baseline of at least `MIN_BASELINE`.
    ns_per_tick: f64,
    /// When the first baseline started, by the monotonic clock.
    started: std::time::Instant,
}

impl ToWall {
    /// Starts calibrating (for `Clock::Wall` there is nothing to do).
    pub(super) fn new(clock: Clock) -> ToWall {
        let p = match clock {
            Clock::Ticks => Point::now(),
            Clock::Wall => Point { ticks: 0, wall: 0 },
        };
        ToWall {
            clock,
            start: p,
            anchor: p,
            ns_per_tick: 0.0,
            started: std::time::Instant::now(),
        }
    }

    /// Takes a new calibration point (waiting out the first baseline if it is shorter
    /// than a millisecond). Call before converting a batch of events.
    pub(super) fn calibrate(&mut self) {
        if self.clock == Clock::Wall {
            return;
        }
        if self.ns_per_tick == 0.0 {
            // The first baseline: at least a millisecond by the monotonic clock (a wall
            // clock stepping back must not keep the writer asleep).
            let since = self.started.elapsed();
            if since < MIN_BASELINE {
                std::thread::sleep(MIN_BASELINE - since);
            }
        }
        let p = Point::now();
        let span_ns = p.wall.saturating_sub(self.start.wall);
        let span_ticks = p.ticks.saturating_sub(self.start.ticks);
        if span_ns >= MIN_BASELINE.as_nanos() as u64 && span_ticks > 0 {
            self.ns_per_tick = span_ns as f64 / span_ticks as f64;
        }
        if span_ns >= RENEW_BASELINE.as_nanos() as u64 {
            self.start = p;
        }
        self.anchor = p;
    }

    /// The wall-clock time of an event stamped `t`.
    pub(super) fn wall(&self, t: u64) -> u64 {
        match self.clock {
            Clock::Wall => t,
            Clock::Ticks => {
                // In 64-bit integers (an `i128` made a library call of the conversion to
                // `f64`, on every row): two counter readings are far less than 2^63
                // ticks apart, and wall times below 2^63 ns (until 2262).
                let delta = t.wrapping_sub(self.anchor.ticks) as i64 as f64 * self.ns_per_tick;
                (self.anchor.wall as i64)
                    .saturating_add(delta as i64)
                    .max(0) as u64
            }
        }
    }
}

/// Sets the calling thread's last reading to `time`, usable `left` more times (for tests
/// of what reads the clock).
#[cfg(test)]
pub(super) fn set_recent(time: u64, left: u8) {
    let turns = TURNS.0.load(Ordering::Relaxed);
    RECENT.with(|r| r.set(Recent { time, turns, left }));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reading stamps the thread's next events while it may (other tests' lanes wake
    /// meanwhile and force fresh readings now and then: tried until one reuse is seen).
    #[test]
    fn a_recent_reading_stamps_the_next_event() {
        let clock = Clock::detect();
        let reused = (0..1000).any(|_| {
            set_recent(42, 1);
            clock.stamp() == 42
        });
        assert!(reused, "a reading with uses left was never reused");
    }

    /// No reading stamps more than `REUSES` events after its own: with none left, the
    /// clock is read (a real reading is never 42), and each reuse counts down.
    #[test]
    fn a_used_up_reading_is_not_reused() {
        let clock = Clock::detect();
        set_recent(42, 0);
        assert_ne!(clock.stamp(), 42);
        assert_eq!(
            RECENT.with(|r| r.get().left),
            REUSES,
            "a fresh reading's uses"
        );
        for _ in 0..4 * u32::from(REUSES) {
            let before = RECENT.with(Cell::get);
            let time = clock.stamp();
            let after = RECENT.with(Cell::get);
            if before.left == 0 {
                assert_eq!(after.left, REUSES, "a used-up reading was reused");
            }
            // A reuse hands out the kept reading and counts down; anything else is a
            // fresh reading (another test's lanes moved on meanwhile).
            if after.left + 1 == before.left {
                assert_eq!(time, before.time);
            } else {
                assert_eq!((after.left, after.time), (REUSES, time));
            }
        }
    }

    /// A lane's turn ends every thread's reading.
    #[test]
    fn a_lane_turning_ends_the_reuse() {
        let clock = Clock::detect();
        set_recent(42, REUSES);
        lane_turned();
        assert_ne!(clock.stamp(), 42);
    }

    /// Ticks turned into wall time agree with the wall clock read at the same moment.
    #[test]
    fn converted_ticks_match_the_wall_clock() {
        let clock = Clock::detect();
        let mut to_wall = ToWall::new(clock);
        std::thread::sleep(Duration::from_millis(5));
        let before = wall_ns();
        let t = clock.now();
        let after = wall_ns();
        std::thread::sleep(Duration::from_millis(5));
        to_wall.calibrate();
        let w = to_wall.wall(t);
        // Within 50 µs of the interval it was read in (the rate comes from a 10 ms
        // baseline; a wall-clock step during the test would break it).
        assert!(
            w + 50_000 >= before && w <= after + 50_000,
            "{clock:?}: {w} not in [{before}, {after}]"
        );
    }
}
