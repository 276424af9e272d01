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

use std::time::{Duration, SystemTime, UNIX_EPOCH};

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

#[cfg(test)]
mod tests {
    use super::*;

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
