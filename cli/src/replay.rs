//! Replaying a log: every thread of the log by its own thread, in the log's global order
//! (as RMM's replay benchmark does), through one stack.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use memres::log::{Action, Event, LoggedStream};
use memres::{Resource, StreamRef, layout};

use crate::stacks::Stack;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OpKind {
    Allocate,
    Free,
    /// A row replay leaves out (a failure, a free of an unknown pointer).
    Skip,
}

#[derive(Debug, Clone, Copy)]
struct Op {
    kind: OpKind,
    /// The allocation this op makes or frees.
    slot: u32,
}

/// A log turned into what a replay needs: ops in order, each thread's share, the
/// allocations (slots) with their sizes and streams, and the log's own figures.
pub struct Plan {
    ops: Vec<Op>,
    per_thread: Vec<Vec<u32>>,
    slot_size: Vec<usize>,
    slot_stream: Vec<u32>,
    slot_line: Vec<usize>,
    pub streams: Vec<LoggedStream>,
    /// Live bytes after each op, as the log has them.
    pub live: Vec<u64>,
    /// Microseconds since the first event, per op.
    pub micros: Vec<u64>,
    /// The most bytes live at once, and the line where it was reached.
    pub peak_live: (u64, usize),
    /// Allocations the log never frees: count and bytes.
    pub never_freed: (usize, u64),
    /// `allocate failure` rows, left out of the replay.
    pub failures_in_log: usize,
    /// Things the log got wrong, each naming its line; the replay goes on.
    pub warnings: Vec<String>,
}

impl Plan {
    pub fn new(events: &[Event]) -> Plan {
        let mut threads: HashMap<u64, u32> = HashMap::new();
        let mut streams: HashMap<LoggedStream, u32> = HashMap::new();
        let mut stream_list = Vec::new();
        let mut live_slots: HashMap<usize, u32> = HashMap::new();
        let mut plan = Plan {
            ops: Vec::with_capacity(events.len()),
            per_thread: Vec::new(),
            slot_size: Vec::new(),
            slot_stream: Vec::new(),
            slot_line: Vec::new(),
            streams: Vec::new(),
            live: Vec::with_capacity(events.len()),
            micros: Vec::with_capacity(events.len()),
            peak_live: (0, 0),
            never_freed: (0, 0),
            failures_in_log: 0,
            warnings: Vec::new(),
        };
        let start = events.first().map_or(0, |e| e.micros);
        let mut live = 0u64;
        for event in events {
            let next_thread = threads.len() as u32;
            let thread = *threads.entry(event.thread).or_insert(next_thread);
            if thread as usize == plan.per_thread.len() {
                plan.per_thread.push(Vec::new());
            }
            let stream = *streams.entry(event.stream).or_insert_with(|| {
                stream_list.push(event.stream);
                stream_list.len() as u32 - 1
            });
            let mut op = Op {
                kind: OpKind::Skip,
                slot: 0,
            };
            match (event.action, event.pointer) {
                (Action::Allocate, Some(ptr)) => {
                    let slot = plan.slot_size.len() as u32;
                    plan.slot_size.push(event.size);
                    plan.slot_stream.push(stream);
                    plan.slot_line.push(event.line);
                    if let Some(old) = live_slots.insert(ptr, slot) {
                        plan.warnings.push(format!(
                            "line {}: {ptr:#x} allocated again while the allocation of line {} \
                             was live (that one counts as never freed)",
                            event.line, plan.slot_line[old as usize]
                        ));
                    }
                    live += event.size as u64;
                    op = Op {
                        kind: OpKind::Allocate,
                        slot,
                    };
                }
                (Action::Free, Some(ptr)) => match live_slots.remove(&ptr) {
                    Some(slot) => {
                        let size = plan.slot_size[slot as usize];
                        if size != event.size {
                            plan.warnings.push(format!(
                                "line {}: free of {ptr:#x} with {} bytes; line {} allocated {size} \
                                 (the allocated size is used)",
                                event.line, event.size, plan.slot_line[slot as usize]
                            ));
                        }
                        live -= size as u64;
                        op = Op {
                            kind: OpKind::Free,
                            slot,
                        };
                    }
                    None => plan.warnings.push(format!(
                        "line {}: free of {ptr:#x}, which the log never allocated (skipped)",
                        event.line
                    )),
                },
                (Action::AllocateFailure, _) => plan.failures_in_log += 1,
                (_, None) => {} // the reader gives every allocate and free a pointer
            }
            if live > plan.peak_live.0 {
                plan.peak_live = (live, event.line);
            }
            plan.per_thread[thread as usize].push(plan.ops.len() as u32);
            plan.ops.push(op);
            plan.live.push(live);
            plan.micros.push(event.micros.saturating_sub(start));
        }
        plan.never_freed = (
            live_slots.len(),
            live_slots
                .values()
                .map(|&s| plan.slot_size[s as usize] as u64)
                .sum(),
        );
        plan.streams = stream_list;
        plan
    }

    pub fn len(&self) -> usize {
        self.ops.len()
    }

    pub fn threads(&self) -> usize {
        self.per_thread.len()
    }

    /// Allocations and frees the replay performs.
    pub fn replayed_ops(&self) -> usize {
        self.ops.iter().filter(|o| o.kind != OpKind::Skip).count()
    }
}

/// One point of a replay's timeline.
#[derive(Debug, Clone, Copy)]
pub struct Sample {
    /// Index of the op after which it was taken.
    pub op: usize,
    /// Bytes the stack held from its memory.
    pub footprint: i64,
    /// The pool's largest free block, where there is a pool.
    pub largest_free: Option<u64>,
}

/// What one replay found.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub elapsed: Duration,
    pub ops: usize,
    pub failures: usize,
    /// Line, bytes and error of the first allocation that failed.
    pub first_failure: Option<(usize, usize, String)>,
    pub peak_footprint: i64,
    /// `1 - largest free block / free bytes` of the pool at the end (before leaks are freed).
    pub fragmentation: Option<f64>,
    /// Allocations still live at the end (freed by the replay afterwards): count, bytes.
    pub leaks: (usize, u64),
    pub samples: Vec<Sample>,
}

impl Outcome {
    pub fn ns_per_op(&self) -> f64 {
        self.elapsed.as_nanos() as f64 / self.ops.max(1) as f64
    }
}

/// Waits until `next` reaches `index`: spinning briefly, then yielding (a log may have
/// more threads than the machine has cores).
fn wait_turn(next: &AtomicUsize, index: usize) {
    let mut spins = 0u32;
    while next.load(Ordering::Acquire) != index {
        if spins < 100 {
            spins += 1;
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
}

/// Replays `plan` through `stack` on `streams` (one per logged stream). `sample_every`:
/// record a [`Sample`] every that many ops (for plots; it perturbs the timing). `tick` is
/// called every 4096 ops with the number done, for a progress bar.
pub fn replay(
    plan: &Plan,
    stack: &Stack,
    streams: &[StreamRef<'_>],
    sample_every: Option<usize>,
    tick: &(dyn Fn(u64) + Sync),
) -> Outcome {
    let slots: Vec<AtomicUsize> = (0..plan.slot_size.len())
        .map(|_| AtomicUsize::new(0))
        .collect();
    let next = AtomicUsize::new(0);
    let failures = AtomicUsize::new(0);
    let first_failure = Mutex::new(None);
    let samples = Mutex::new(Vec::new());
    let top = &stack.top;
    let perform = |index: usize| {
        let op = plan.ops[index];
        let slot = op.slot as usize;
        match op.kind {
            OpKind::Skip => {}
            OpKind::Allocate => {
                let size = plan.slot_size[slot];
                let stream = streams[plan.slot_stream[slot] as usize];
                let result = layout(size).and_then(|l| top.allocate(stream, l));
                match result {
                    Ok(p) => slots[slot].store(p.as_ptr() as usize, Ordering::Relaxed),
                    Err(e) => {
                        if failures.fetch_add(1, Ordering::Relaxed) == 0 {
                            *first_failure.lock().unwrap() =
                                Some((plan.slot_line[slot], size, e.to_string()));
                        }
                    }
                }
            }
            OpKind::Free => {
                let addr = slots[slot].swap(0, Ordering::Relaxed);
                if let (Some(p), Ok(l)) = (
                    std::ptr::NonNull::new(std::ptr::without_provenance_mut::<u8>(addr)),
                    layout(plan.slot_size[slot]),
                ) {
                    // Back to the allocating stream's order: the logged free may name
                    // another stream, which the replay maps the same way.
                    let stream = streams[plan.slot_stream[slot] as usize];
                    // SAFETY: `p` came from `top` with this layout (stored above) and is
                    // freed once (swapped out); replays never touch the memory.
                    unsafe { top.deallocate(stream, p, l) };
                }
            }
        }
        if let Some(every) = sample_every
            && index.is_multiple_of(every)
        {
            let sample = Sample {
                op: index,
                footprint: stack.footprint().current,
                largest_free: stack.pool_stats().map(|s| s.largest_free_block as u64),
            };
            samples.lock().unwrap().push(sample);
        }
        if index % 4096 == 4095 {
            tick(index as u64 + 1);
        }
    };
    let start = Instant::now();
    std::thread::scope(|scope| {
        for mine in &plan.per_thread {
            let (next, perform) = (&next, &perform);
            scope.spawn(move || {
                for &index in mine {
                    let index = index as usize;
                    wait_turn(next, index);
                    perform(index);
                    next.store(index + 1, Ordering::Release);
                }
            });
        }
    });
    let elapsed = start.elapsed();
    tick(plan.len() as u64);
    let fragmentation = stack.pool_stats().map(|s| s.fragmentation());
    let mut leaks = (0, 0);
    for (slot, addr) in slots.iter().enumerate() {
        let addr = addr.load(Ordering::Relaxed);
        if let (Some(p), Ok(l)) = (
            std::ptr::NonNull::new(std::ptr::without_provenance_mut::<u8>(addr)),
            layout(plan.slot_size[slot]),
        ) {
            leaks.0 += 1;
            leaks.1 += plan.slot_size[slot] as u64;
            // SAFETY: as in the replay: from `top` with this layout, freed once.
            unsafe { top.deallocate(streams[plan.slot_stream[slot] as usize], p, l) };
        }
    }
    let mut samples = samples.into_inner().unwrap();
    samples.sort_by_key(|s| s.op);
    Outcome {
        elapsed,
        ops: plan.replayed_ops(),
        failures: failures.into_inner(),
        first_failure: first_failure.into_inner().unwrap(),
        peak_footprint: stack.footprint().peak,
        fragmentation,
        leaks,
        samples,
    }
}
