//! Replaying a log: every thread of the log by its own thread, in the log's global order
//! (as RMM's replay benchmark does), through one stack.

use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};
use std::thread::Thread;
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
pub(crate) struct Plan {
    ops: Vec<Op>,
    /// The logged thread (index) of each op.
    op_thread: Vec<u32>,
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
    pub(crate) fn new(events: &[Event]) -> Plan {
        let mut threads: HashMap<u64, u32> = HashMap::new();
        let mut streams: HashMap<LoggedStream, u32> = HashMap::new();
        let mut stream_list = Vec::new();
        let mut live_slots: HashMap<usize, u32> = HashMap::new();
        let mut plan = Plan {
            ops: Vec::with_capacity(events.len()),
            op_thread: Vec::with_capacity(events.len()),
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
        const DAY: u64 = 86_400_000_000;
        let start = events.first().map_or(0, |e| e.micros);
        // Times are of day: a log running past midnight goes on in the next day.
        let (mut day, mut last_time) = (0u64, start);
        let mut orphans: Vec<u32> = Vec::new();
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
                        orphans.push(old);
                        plan.warnings.push(format!(
                            "line {}: {ptr:#x} allocated again while the allocation of line {} \
                             was live (that one counts as never freed)",
                            event.line, plan.slot_line[old as usize]
                        ));
                    }
                    live = live.saturating_add(event.size as u64);
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
                        live = live.saturating_sub(size as u64);
                        op = Op {
                            kind: OpKind::Free,
                            slot,
                        };
                    }
                    None => plan.warnings.push(format!(
                        "line {}: free of {ptr:#x}, which the log never allocated or already \
                         freed (skipped)",
                        event.line
                    )),
                },
                (Action::AllocateFailure, _) => plan.failures_in_log += 1,
                // The reader gives every allocate and free a pointer; an action of a
                // later log format is skipped.
                _ => {}
            }
            if live > plan.peak_live.0 {
                plan.peak_live = (live, event.line);
            }
            plan.per_thread[thread as usize].push(plan.ops.len() as u32);
            plan.ops.push(op);
            plan.op_thread.push(thread);
            plan.live.push(live);
            if event.micros < last_time && last_time - event.micros > DAY / 2 {
                day += DAY;
            }
            last_time = event.micros;
            plan.micros.push((event.micros + day).saturating_sub(start));
        }
        let never_freed: Vec<u32> = live_slots.values().copied().chain(orphans).collect();
        plan.never_freed = (
            never_freed.len(),
            never_freed.iter().fold(0u64, |sum, &s| {
                sum.saturating_add(plan.slot_size[s as usize] as u64)
            }),
        );
        plan.streams = stream_list;
        plan
    }

    pub(crate) fn len(&self) -> usize {
        self.ops.len()
    }

    pub(crate) fn threads(&self) -> usize {
        self.per_thread.len()
    }

    /// Allocations and frees the replay performs.
    pub(crate) fn replayed_ops(&self) -> usize {
        self.ops.iter().filter(|o| o.kind != OpKind::Skip).count()
    }
}

/// One point of a replay's timeline.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sample {
    /// Index of the op after which it was taken.
    pub op: usize,
    /// Bytes the stack held from its memory.
    pub footprint: i64,
    /// The pool's largest free block, where there is a pool.
    pub largest_free: Option<u64>,
}

/// What one replay found.
#[derive(Debug, Clone)]
pub(crate) struct Outcome {
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
    /// What each tier of a `fallback(..)` served (peak bytes, blocks in all).
    pub tiers: Option<[memres::adaptor::StatisticsSnapshot; 2]>,
}

impl Outcome {
    pub(crate) fn ns_per_op(&self) -> f64 {
        self.elapsed.as_nanos() as f64 / self.ops.max(1) as f64
    }
}

/// The baton the replay threads pass: the index of the next op, who waits for it, and
/// whether the replay was stopped.
struct Baton {
    next: AtomicUsize,
    stopped: AtomicBool,
    /// Each replay thread's handle, to wake it when its turn comes.
    threads: Vec<OnceLock<Thread>>,
    /// How many times a waiting thread yields before it parks: many where the log has
    /// few threads (a handoff then costs a yield, not a wakeup), few where it has many
    /// (thousands of yielding threads would starve the one whose turn it is).
    yields: u32,
}

impl Baton {
    /// Waits until `next` reaches `index`: spinning briefly, then yielding, then parking
    /// (a log may have far more threads than the machine has cores). False if stopped.
    fn wait_turn(&self, index: usize) -> bool {
        let mut tries = 0u32;
        loop {
            if self.stopped.load(Ordering::Relaxed) {
                return false;
            }
            if self.next.load(Ordering::Acquire) == index {
                return true;
            }
            tries += 1;
            match tries {
                0..64 => std::hint::spin_loop(),
                t if t < 64 + self.yields => std::thread::yield_now(),
                // Woken by `pass` or `stop` (an unpark that comes before the park is not
                // lost: the thread's handle is registered before its first wait). The
                // timeout is only a safety net; short ones would wake thousands of idle
                // threads of a large log for nothing.
                _ => std::thread::park_timeout(Duration::from_secs(1)),
            }
        }
    }

    /// Hands the baton on after op `index`, waking the thread whose op is next.
    fn pass(&self, index: usize, plan: &Plan, mine: u32) {
        self.next.store(index + 1, Ordering::Release);
        if let Some(&next_thread) = plan.op_thread.get(index + 1)
            && next_thread != mine
            && let Some(t) = self.threads[next_thread as usize].get()
        {
            t.unpark();
        }
    }

    /// Stops the replay: every thread returns at its next wait.
    fn stop(&self) {
        self.stopped.store(true, Ordering::Relaxed);
        for t in self.threads.iter().filter_map(OnceLock::get) {
            t.unpark();
        }
    }
}

/// Replays `plan` through `stack` on `streams` (one per logged stream). `sample_every`:
/// record a [`Sample`] every that many ops (for plots; it perturbs the timing). `tick` is
/// called every 4096 ops with the number done, for a progress bar.
pub(crate) fn replay(
    plan: &Plan,
    stack: &Stack,
    streams: &[StreamRef<'_>],
    sample_every: Option<usize>,
    tick: &(dyn Fn(u64) + Sync),
) -> Result<Outcome, String> {
    let slots: Vec<AtomicPtr<u8>> = (0..plan.slot_size.len())
        .map(|_| AtomicPtr::new(std::ptr::null_mut()))
        .collect();
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
                    Ok(p) => slots[slot].store(p.as_ptr(), Ordering::Relaxed),
                    Err(e) => {
                        if failures.fetch_add(1, Ordering::Relaxed) == 0 {
                            *lock(&first_failure) =
                                Some((plan.slot_line[slot], size, e.to_string()));
                        }
                    }
                }
            }
            OpKind::Free => {
                // Back to the allocating stream's order: the logged free may name another
                // stream, which the replay maps the same way.
                free_slot(plan, &slots, slot, top, streams);
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
            lock(&samples).push(sample);
        }
        if index % 4096 == 4095 {
            tick(index as u64 + 1);
        }
    };
    let baton = Baton {
        next: AtomicUsize::new(0),
        stopped: AtomicBool::new(false),
        threads: (0..plan.per_thread.len())
            .map(|_| OnceLock::new())
            .collect(),
        yields: {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            if plan.per_thread.len() <= 4 * cores {
                100_000
            } else {
                8
            }
        },
    };
    let trouble: Mutex<Option<String>> = Mutex::new(None);
    let report = |what: String| {
        lock(&trouble).get_or_insert(what);
        baton.stop();
    };
    let start = Instant::now();
    std::thread::scope(|scope| {
        for (t, mine) in plan.per_thread.iter().enumerate() {
            let (baton, perform, report) = (&baton, &perform, &report);
            let spawned = std::thread::Builder::new().spawn_scoped(scope, move || {
                let _ = baton.threads[t].set(std::thread::current());
                for &index in mine {
                    let index = index as usize;
                    if !baton.wait_turn(index) {
                        return;
                    }
                    if catch_unwind(AssertUnwindSafe(|| perform(index))).is_err() {
                        report(format!("the replay of op {index} failed unexpectedly"));
                        return;
                    }
                    baton.pass(index, plan, t as u32);
                }
            });
            if let Err(e) = spawned {
                report(format!(
                    "cannot start a thread for each of the log's {} threads: {e}",
                    plan.per_thread.len()
                ));
                break;
            }
        }
    });
    let elapsed = start.elapsed();
    if let Some(what) = trouble.into_inner().unwrap_or_else(PoisonError::into_inner) {
        free_all(plan, &slots, top, streams);
        return Err(what);
    }
    tick(plan.len() as u64);
    let fragmentation = stack.pool_stats().map(|s| s.fragmentation());
    let leaks = free_all(plan, &slots, top, streams);
    let mut samples = samples.into_inner().unwrap_or_else(PoisonError::into_inner);
    samples.sort_by_key(|s| s.op);
    Ok(Outcome {
        elapsed,
        ops: plan.replayed_ops(),
        failures: failures.into_inner(),
        first_failure: first_failure
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner),
        peak_footprint: stack.footprint().peak,
        fragmentation,
        leaks,
        samples,
        tiers: stack.tiers(),
    })
}

/// Frees what the replay still holds; returns how many blocks and bytes that was.
fn free_all(
    plan: &Plan,
    slots: &[AtomicPtr<u8>],
    top: &memres::AnyResource<()>,
    streams: &[StreamRef<'_>],
) -> (usize, u64) {
    let mut leaks = (0, 0u64);
    for slot in 0..slots.len() {
        if free_slot(plan, slots, slot, top, streams) {
            leaks.0 += 1;
            leaks.1 = leaks.1.saturating_add(plan.slot_size[slot] as u64);
        }
    }
    leaks
}

/// Frees the block `slot` holds, if it holds one (on its allocating stream); true if it
/// did.
fn free_slot(
    plan: &Plan,
    slots: &[AtomicPtr<u8>],
    slot: usize,
    top: &memres::AnyResource<()>,
    streams: &[StreamRef<'_>],
) -> bool {
    let ptr = slots[slot].swap(std::ptr::null_mut(), Ordering::Relaxed);
    let (Some(p), Ok(l)) = (NonNull::new(ptr), layout(plan.slot_size[slot])) else {
        return false;
    };
    // SAFETY: `p` came from `top` with this layout (stored when the allocation was
    // replayed) and is freed once (swapped out); replays never touch the memory.
    unsafe { top.deallocate(streams[plan.slot_stream[slot] as usize], p, l) };
    true
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}
