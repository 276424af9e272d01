//! The queue between the threads that log events and the thread that writes them: a
//! bounded ring of fixed-size records in one global order.
//!
//! A producer takes a position with one atomic add on `tail` (that add is the event's
//! place in the log: an allocation logged before its pointer reaches another thread is
//! ordered before that thread's free of it), waits while the ring is full, writes its
//! record into the slot and publishes it by storing `position + 1` in the slot's `seq`.
//! The one consumer reads slots in order, each once its `seq` says it is written, and
//! publishes its progress in `head`; a producer reuses a slot only after `head` has
//! passed it. The consumer never writes a slot, so producers do not wait for cache lines
//! it holds.

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

/// A value alone on its cache line (producers hammer `tail`, the consumer `head`).
#[repr(align(128))]
struct Padded<T>(T);

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
    /// The next position a producer takes.
    tail: Padded<AtomicU64>,
    /// The next position the consumer reads; every slot before it is free.
    head: Padded<AtomicU64>,
}

// SAFETY: a slot's record is written only by the producer that holds its position (one
// at a time: positions are unique, and a slot is reused only after the consumer passed
// it, which `head`'s release/acquire orders) and read only by the consumer after the
// producer's release store of `seq`.
unsafe impl Sync for Ring {}

/// How far ahead of its own slot a producer prefetches.
const PREFETCH_AHEAD: u64 = 8;

#[cfg(target_arch = "x86_64")]
#[inline]
fn prefetch_for_write(slot: &Slot) {
    // `PREFETCHW` itself: `_mm_prefetch::<_MM_HINT_ET0>` compiles to a plain read
    // prefetch unless the whole crate is built with `+prfchw` (checked in the binary), and
    // a line fetched for reading must still be taken from the consumer's core when
    // written. Processors without the instruction execute it as a no-op.
    // SAFETY: a prefetch is a hint: it never faults and changes no memory, registers or
    // flags; the address is a live slot anyway.
    unsafe {
        std::arch::asm!(
            "prefetchw [{slot}]",
            slot = in(reg) slot as *const Slot,
            options(nostack, preserves_flags, readonly)
        )
    };
}

#[cfg(not(target_arch = "x86_64"))]
#[inline]
fn prefetch_for_write(_: &Slot) {}

/// What a producer does while the ring is full.
pub(super) trait Wait {
    /// Called while waiting for the consumer (repeatedly); `false` gives up (the
    /// consumer is gone: the record is dropped).
    fn full(&self) -> bool;
}

impl Ring {
    /// A ring of `capacity` slots (a power of two).
    pub(super) fn new(capacity: usize) -> Ring {
        assert!(capacity.is_power_of_two());
        Ring {
            slots: (0..capacity)
                .map(|_| Slot {
                    seq: AtomicU64::new(0),
                    record: UnsafeCell::new(Record::default()),
                })
                .collect(),
            mask: capacity as u64 - 1,
            tail: Padded(AtomicU64::new(0)),
            head: Padded(AtomicU64::new(0)),
        }
    }

    /// Appends `record`; waits (calling `wait.full()`) while the ring is full.
    #[inline]
    pub(super) fn push(&self, record: Record, wait: &impl Wait) {
        let pos = self.tail.0.fetch_add(1, Ordering::Relaxed);
        let capacity = self.mask + 1;
        while pos >= self.head.0.load(Ordering::Acquire) + capacity {
            if !wait.full() {
                return;
            }
        }
        let slot = &self.slots[(pos & self.mask) as usize];
        // SAFETY: position `pos` is ours alone, and the consumer is done with the slot's
        // previous record (`head` passed it, acquired above); see `impl Sync`.
        slot.record.get_mut().with(|r| unsafe { *r = record });
        slot.seq.store(pos + 1, Ordering::Release);
        // Ask for a slot a little ahead in writable state now: the consumer read it last,
        // so writing it later would wait for its cache line to come back from the
        // consumer's core, a wait the next event's atomic add would sit out in full.
        prefetch_for_write(&self.slots[((pos + PREFETCH_AHEAD) & self.mask) as usize]);
    }

    /// Positions taken so far (records pushed or being pushed).
    pub(super) fn taken(&self) -> u64 {
        self.tail.0.load(Ordering::Acquire)
    }

    /// The consumer's side. Only one may exist at a time.
    pub(super) fn consumer(&self) -> Consumer<'_> {
        Consumer {
            ring: self,
            head: self.head.0.load(Ordering::Relaxed),
        }
    }
}

/// The single consumer of a [`Ring`].
pub(super) struct Consumer<'a> {
    ring: &'a Ring,
    head: u64,
}

impl Consumer<'_> {
    /// Calls `f` on each record ready now, in order, up to `max`; returns how many.
    pub(super) fn drain(&mut self, max: usize, mut f: impl FnMut(&Record)) -> usize {
        let mut n = 0;
        while n < max {
            let slot = &self.ring.slots[(self.head & self.ring.mask) as usize];
            if slot.seq.load(Ordering::Acquire) != self.head + 1 {
                break;
            }
            // SAFETY: `seq` says the record of this position is written (acquired), and
            // no producer writes the slot again before `head` passes it.
            slot.record.get_mut().with(|r| f(unsafe { &*r }));
            self.head += 1;
            n += 1;
        }
        if n > 0 {
            // Frees the slots for producers (release: our reads happen before reuse).
            self.ring.head.0.store(self.head, Ordering::Release);
        }
        n
    }

    /// Positions consumed so far.
    pub(super) fn position(&self) -> u64 {
        self.head
    }
}

#[cfg(all(test, memres_loom))]
mod loom_models {
    use super::*;
    use loom::sync::Arc;
    use loom::thread;

    struct Yield;
    impl Wait for Yield {
        fn full(&self) -> bool {
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

    /// Two producers racing for positions, and the consumer: every record arrives
    /// once, whole.
    #[test]
    fn loom_log_ring_delivers_every_record_once() {
        loom::model(|| {
            let ring = Arc::new(Ring::new(2));
            let producers: Vec<_> = (1..=2u64)
                .map(|p| {
                    let ring = Arc::clone(&ring);
                    thread::spawn(move || ring.push(record(p), &Yield))
                })
                .collect();
            let mut got = Vec::new();
            let mut consumer = ring.consumer();
            while got.len() < 2 {
                if consumer.drain(usize::MAX, |r| got.push(r.size)) == 0 {
                    thread::yield_now();
                }
            }
            for p in producers {
                p.join().unwrap();
            }
            got.sort();
            assert_eq!(got, [1, 2]);
        });
    }

    /// One producer's records arrive in its order, through a ring of one slot (so the
    /// producer waits for room, and the slot is reused).
    #[test]
    fn loom_log_ring_keeps_a_producers_order() {
        loom::model(|| {
            let ring = Arc::new(Ring::new(1));
            let producer = {
                let ring = Arc::clone(&ring);
                thread::spawn(move || {
                    ring.push(record(1), &Yield);
                    ring.push(record(2), &Yield);
                })
            };
            let mut got = Vec::new();
            let mut consumer = ring.consumer();
            while got.len() < 2 {
                if consumer.drain(usize::MAX, |r| got.push(r.size)) == 0 {
                    thread::yield_now();
                }
            }
            producer.join().unwrap();
            assert_eq!(got, [1, 2]);
        });
    }
}
