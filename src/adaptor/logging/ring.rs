//! The queue between the threads that log events and the threads that write them: a
//! bounded ring of fixed-size records in one global order.
//!
//! A producer takes a position with one atomic add on `tail` (that add is the event's
//! place in the log: an allocation logged before its pointer reaches another thread is
//! ordered before that thread's free of it). Each slot's `seq` says what it holds: `pos`
//! when it is free for position `pos`, `pos + 1` once the record of `pos` is written. A
//! producer waits until its slot is free for its position, writes the record and stores
//! `pos + 1`; a consumer of position `pos` waits for `pos + 1`, reads the record in place
//! and stores `pos + capacity`, freeing the slot for the next lap. Consumers of different
//! positions never touch the same slot, so several of them (the writer's lanes) can drain
//! disjoint ranges of positions at once; nothing but the slots is shared with producers.

use crate::sync::CachePadded;
use crate::sync::atomic::{AtomicU64, Ordering};
use crate::sync::cell::UnsafeCell;

/// One logged event, as the producer saw it; formatted by the consumer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) struct Record {
    /// The event's time on the log's [`Clock`](super::clock::Clock).
    pub(super) time: u64,
    /// The OS thread id.
    pub(super) thread: u64,
    /// 0 allocate, 1 free, 2 allocate failure.
    pub(super) action: u8,
    /// The pointer, 0 for none.
    pub(super) pointer: usize,
    pub(super) size: usize,
    /// The CUDA stream handle, or the host stream's id when `host` is set.
    pub(super) stream: u64,
    pub(super) host: bool,
}

/// One cache line per slot, so an event touches one line.
#[repr(align(64))]
struct Slot {
    /// `position + 1` once the record of `position` is written.
    seq: AtomicU64,
    record: UnsafeCell<Record>,
}

/// See the module.
pub(super) struct Ring {
    slots: Box<[Slot]>,
    mask: u64,
    /// The next position a producer takes (alone on its lines: producers hammer it).
    tail: CachePadded<AtomicU64>,
}

// SAFETY: a slot's record is written only by the producer that holds its position, once
// `seq` says the slot is free for it (the consumer of the previous lap released it after
// reading the record, and positions are unique), and read only by the one consumer of
// that position after the producer's release store of `pos + 1`.
unsafe impl Sync for Ring {}

/// How far ahead of its own slot a producer prefetches.
const PREFETCH_AHEAD: u64 = 16;
/// How far ahead of the slot it takes a consumer prefetches.
const TAKE_AHEAD: u64 = 8;

/// What a producer does while the ring is full.
pub(super) trait Wait {
    /// Called while waiting for the consumers, with how many times it was called before
    /// for this record; `false` gives up (the consumers are gone: the record is dropped).
    fn full(&self, attempt: u32) -> bool;
}

impl Ring {
    /// A ring of `capacity` slots (a power of two, at least 2: with one slot, "free for
    /// the next lap" and "written" would be the same `seq`).
    pub(super) fn new(capacity: usize) -> Ring {
        assert!(capacity.is_power_of_two() && capacity >= 2);
        Ring {
            slots: (0..capacity as u64)
                .map(|i| Slot {
                    seq: AtomicU64::new(i),
                    record: UnsafeCell::new(Record::default()),
                })
                .collect(),
            mask: capacity as u64 - 1,
            tail: CachePadded(AtomicU64::new(0)),
        }
    }

    /// Appends the record `make` returns; waits (calling `wait.full()`) while the ring is
    /// full. `make` runs once the event has its place and its slot is free, so the record
    /// is built straight in the slot rather than on the stack and copied.
    #[inline]
    pub(super) fn push(&self, make: impl FnOnce() -> Record, wait: &impl Wait) {
        let pos = self.tail.0.fetch_add(1, Ordering::Relaxed);
        let slot = &self.slots[(pos & self.mask) as usize];
        if slot.seq.load(Ordering::Acquire) != pos && !Self::wait_for(slot, pos, wait) {
            return;
        }
        // SAFETY: position `pos` is ours alone, and the slot's previous record has been
        // read (its consumer stored `pos`, acquired above); see `impl Sync`.
        slot.record.get_mut().with(|r| unsafe { *r = make() });
        slot.seq.store(pos + 1, Ordering::Release);
        // Ask for a slot a little ahead in writable state now: the consumer read it last,
        // so writing it later would wait for its cache line to come back from the
        // consumer's core, a wait the next event's atomic add would sit out in full.
        crate::cache_prefetch::for_write(
            &self.slots[((pos + PREFETCH_AHEAD) & self.mask) as usize],
        );
    }

    /// Waits until `slot` is free for position `pos` (true), or the consumers are gone
    /// (false). Out of line: the ring is rarely full, and the producer's path stays short.
    #[cold]
    #[inline(never)]
    fn wait_for(slot: &Slot, pos: u64, wait: &impl Wait) -> bool {
        let mut attempt = 0;
        while slot.seq.load(Ordering::Acquire) != pos {
            if !wait.full(attempt) {
                return false;
            }
            attempt = attempt.wrapping_add(1);
        }
        true
    }

    /// Positions taken so far (records pushed or being pushed).
    pub(super) fn taken(&self) -> u64 {
        self.tail.0.load(Ordering::Acquire)
    }

    /// [`take_with`](Self::take_with), copying the record out (for the loom models).
    #[cfg(all(test, memres_loom))]
    pub(super) fn take(&self, pos: u64) -> Option<Record> {
        let mut out = None;
        self.take_with(pos, |r| out = Some(*r));
        out
    }

    /// Hands the record of position `pos`, if it is written, to `use_it` in place in its
    /// slot (not copied out: a copy through the stack, in moves of other widths than its
    /// stores, stalled the consumer on every record); true if it was. The slot is free
    /// for the next lap once `use_it` returns. Each position must be taken by one
    /// consumer, once, and the positions of a slot in lap order (`pos` before
    /// `pos + capacity`), which in-order consumers of disjoint ranges do.
    #[inline]
    pub(super) fn take_with(&self, pos: u64, use_it: impl FnOnce(&Record)) -> bool {
        let slot = &self.slots[(pos & self.mask) as usize];
        if slot.seq.load(Ordering::Acquire) != pos + 1 {
            return false;
        }
        // SAFETY: `seq` says the record of `pos` is written (acquired), and no producer
        // writes the slot again before the release below; see `impl Sync`.
        slot.record.get().with(|r| use_it(unsafe { &*r }));
        slot.seq.store(pos + self.mask + 1, Ordering::Release);
        // The records a little further on come from the producer's cache: ask for them
        // now, so that the consumer does not wait for each in turn. (Near the producer
        // this may fetch a slot not yet written, which the producer then takes back: a
        // few slots at the end of each burst.)
        crate::cache_prefetch::for_read(&self.slots[((pos + TAKE_AHEAD) & self.mask) as usize]);
        true
    }
}

#[cfg(all(test, memres_loom))]
mod loom_models {
    use super::*;
    use loom::sync::Arc;
    use loom::thread;

    struct Yield;
    impl Wait for Yield {
        fn full(&self, _: u32) -> bool {
            thread::yield_now();
            true
        }
    }

    fn record(n: u64) -> Record {
        Record {
            size: n as usize,
            ..Record::default()
        }
    }

    /// Takes position `pos`, yielding until it is written.
    fn take_wait(ring: &Ring, pos: u64) -> u64 {
        loop {
            if let Some(r) = ring.take(pos) {
                return r.size as u64;
            }
            thread::yield_now();
        }
    }

    /// Two producers racing for positions, and the consumer: every record arrives
    /// once, whole.
    #[test]
    fn loom_log_ring_delivers_every_record_once() {
        loom::model(|| {
            let ring = Arc::new(Ring::new(2));
            let producers: Vec<_> = (1..=2u64)
                .map(|p| {
                    let ring = Arc::clone(&ring);
                    thread::spawn(move || ring.push(|| record(p), &Yield))
                })
                .collect();
            let mut got = vec![take_wait(&ring, 0), take_wait(&ring, 1)];
            for p in producers {
                p.join().unwrap();
            }
            got.sort();
            assert_eq!(got, [1, 2]);
        });
    }

    /// One producer's records arrive in its order, through a ring of two slots (so the
    /// producer waits for room, and a slot is reused).
    #[test]
    fn loom_log_ring_keeps_a_producers_order() {
        loom::model(|| {
            let ring = Arc::new(Ring::new(2));
            let producer = {
                let ring = Arc::clone(&ring);
                thread::spawn(move || {
                    for n in 1..=3 {
                        ring.push(|| record(n), &Yield);
                    }
                })
            };
            let got = [
                take_wait(&ring, 0),
                take_wait(&ring, 1),
                take_wait(&ring, 2),
            ];
            producer.join().unwrap();
            assert_eq!(got, [1, 2, 3]);
        });
    }

    /// Two consumers of disjoint positions (the writer's lanes) at once, while a
    /// producer waits to reuse the first lane's slot: each lane gets its own record, and
    /// the slot's next lap is written only after its first was copied out.
    #[test]
    fn loom_log_ring_lanes_take_their_own_positions() {
        loom::model(|| {
            let ring = Arc::new(Ring::new(2));
            ring.push(|| record(1), &Yield);
            ring.push(|| record(2), &Yield);
            let other_lane = {
                let ring = Arc::clone(&ring);
                thread::spawn(move || ring.take(1).map(|r| r.size))
            };
            let producer = {
                let ring = Arc::clone(&ring);
                thread::spawn(move || ring.push(|| record(3), &Yield))
            };
            assert_eq!(ring.take(0).map(|r| r.size), Some(1));
            assert_eq!(take_wait(&ring, 2), 3);
            assert_eq!(other_lane.join().unwrap(), Some(2));
            producer.join().unwrap();
        });
    }
}
