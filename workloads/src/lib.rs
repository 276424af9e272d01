//! The standard benchmark workloads (`docs/workloads.md`, spec v1; the same ones the RAPIDS
//! RMM and PyTorch anchors of `benches/anchor/` run), for timing any resource.
//!
//! - `pair-<size>`: allocate and free one block of `size` bytes, `n` times; ns per pair.
//! - `random`: a seeded random walk of allocations (256 B to 8 MiB, log-uniform) and frees
//!   of random live blocks, at most 10,000 live; ns per op.
//! - `random-mt`: `random` on each of several threads, each on its own stream.
//! - `random-1stream`: `random` on each of several threads (each its own seed), all on one
//!   stream; run with as many threads as `random-mt`, then twice as many.
//! - `handoff`: a training step's blocks allocated on one thread and freed on another
//!   that takes its turn after it (PyTorch's autograd thread), on one stream.
//!
//! [`suite`] runs them in the anchors' configuration and hands each result row to a
//! callback; `benches/workloads.rs` and `memres bench` both print those rows as CSV.
//!
//! ```
//! use memres_workloads::{Suite, suite};
//! use memres::{HostHeap, StreamRef};
//!
//! let streams: Vec<_> = (0..9).map(StreamRef::host).collect();
//! let mut rows = Vec::new();
//! let quick = Suite { scale: 10_000, ..Suite::default() }; // 1/10,000 of the ops
//! suite("host_heap", &HostHeap::new(), &streams, quick, &|_| true, &mut |row| rows.push(row))?;
//! assert!(rows.iter().any(|r| r.workload == "random" && r.ns_per_op_min > 0.0));
//! # Ok::<(), memres::Error>(())
//! ```

use std::alloc::Layout;
use std::hint::black_box;
use std::ptr::NonNull;
use std::sync::atomic::Ordering;
use std::time::Instant;

use memres::{Error, Resource, StreamRef, layout};

/// The workloads' random number generator (SplitMix64), as the anchors use it.
#[inline]
pub fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// `n` allocate + free pairs of `bytes` on `stream`; ns per pair.
pub fn pairs<R: Resource + ?Sized>(
    r: &R,
    stream: StreamRef<'_>,
    bytes: usize,
    n: usize,
) -> Result<f64, Error> {
    let l = layout(bytes)?;
    let t0 = Instant::now();
    for _ in 0..n {
        // `black_box` keeps the compiler from eliding a heap allocate/free pair.
        let p = black_box(r.allocate(stream, l)?);
        // SAFETY: allocated just above with `l` on `stream`; never used.
        unsafe { r.deallocate(stream, p, l) };
    }
    Ok(t0.elapsed().as_nanos() as f64 / n.max(1) as f64)
}

/// One step of the `random` walk: `Some(size)` to allocate, `None` to free a random live
/// block (chosen with the next number).
#[inline]
fn random_step(rng: &mut u64, live: usize) -> Option<usize> {
    const CAP: usize = 10_000;
    let alloc = live == 0 || (live < CAP && splitmix64(rng).is_multiple_of(2));
    alloc.then(|| {
        let e = 8 + splitmix64(rng) % 15;
        (1usize << e) + (splitmix64(rng) % (1u64 << e)) as usize
    })
}

/// `random`'s sequence with every allocation on `streams[0]` and every free on
/// `streams[1]` (the footprint bench's `cross-stream`); calls `observe(live_bytes)` after
/// every op. What is live at the end is freed on `streams[1]`.
pub fn cross_stream_with<R: Resource + ?Sized>(
    r: &R,
    streams: [StreamRef<'_>; 2],
    seed: u64,
    ops: usize,
    mut observe: impl FnMut(usize),
) -> Result<(), Error> {
    let [a, b] = streams;
    let mut rng = seed;
    let mut live: Vec<(NonNull<u8>, Layout)> = Vec::with_capacity(10_000);
    let mut live_bytes = 0;
    let mut result = Ok(());
    for _ in 0..ops {
        match random_step(&mut rng, live.len()) {
            Some(n) => match layout(n).and_then(|l| r.allocate(a, l).map(|p| (p, l))) {
                Ok(block) => {
                    live.push(block);
                    live_bytes += n;
                }
                Err(e) => {
                    result = Err(e);
                    break;
                }
            },
            None => {
                let k = (splitmix64(&mut rng) % live.len() as u64) as usize;
                let (p, l) = live.swap_remove(k);
                live_bytes -= l.size();
                // SAFETY: `p` came from `r` with `l`; nothing used it, so its (empty) work
                // on `a` is ordered before the free on `b`.
                unsafe { r.deallocate(b, p, l) };
            }
        }
        observe(live_bytes);
    }
    for (p, l) in live {
        // SAFETY: as above.
        unsafe { r.deallocate(b, p, l) };
    }
    result
}

/// Requests in flight at once in [`serve_with`]: a finished request's KV cache is freed
/// when this many newer ones hold theirs.
pub const SERVE_IN_FLIGHT: usize = 4;
/// Layers of [`serve_with`]'s model (GPT-2 small's 12).
pub const SERVE_LAYERS: usize = 12;
/// Bytes of one token's activation in [`serve_with`]: GPT-2 small's 768 values in fp16.
pub const SERVE_TOKEN_BYTES: usize = 768 * 2;

/// The `serve` footprint workload (docs/workloads.md, v1.2): `requests` inference
/// requests, each of a batch of 1 to 32 sequences of 16 to 1,024 tokens (splitmix64 from
/// `seed`: batch `1 + x % 32`, then tokens `16 + x % 1009`), through a 12-layer model on
/// one stream. With `a = batch * tokens * 1536` bytes, a request allocates its KV cache
/// (a key and a value block of `a` bytes per layer), then per layer its MLP's hidden
/// activations (`4a`) and the layer's output (`a`), freeing the hidden ones and then the
/// previous layer's output; its last output is freed at the end. Its KV
/// cache stays until [`SERVE_IN_FLIGHT`] newer requests hold theirs (requests
/// overlapping, as a server's do). Calls `observe(live_bytes)` after every allocation
/// and free; what is live at the end is freed.
pub fn serve_with<R: Resource + ?Sized>(
    r: &R,
    stream: StreamRef<'_>,
    seed: u64,
    requests: usize,
    mut observe: impl FnMut(usize),
) -> Result<(), Error> {
    let mut rng = seed;
    let mut live_bytes = 0usize;
    let mut in_flight: std::collections::VecDeque<Vec<(NonNull<u8>, Layout)>> =
        std::collections::VecDeque::new();
    let allocate = |n: usize, live_bytes: &mut usize| -> Result<(NonNull<u8>, Layout), Error> {
        let l = layout(n)?;
        let p = r.allocate(stream, l)?;
        *live_bytes += n;
        Ok((p, l))
    };
    let free = |(p, l): (NonNull<u8>, Layout), live_bytes: &mut usize| {
        *live_bytes -= l.size();
        // SAFETY: allocated by `allocate` above from `r` with `l` on `stream`; never used,
        // freed once.
        unsafe { r.deallocate(stream, p, l) };
    };
    let mut result = Ok(());
    'requests: for _ in 0..requests {
        let batch = 1 + (splitmix64(&mut rng) % 32) as usize;
        let tokens = 16 + (splitmix64(&mut rng) % 1009) as usize;
        let a = batch * tokens * SERVE_TOKEN_BYTES;
        let mut kv = Vec::with_capacity(2 * SERVE_LAYERS);
        let mut output: Option<(NonNull<u8>, Layout)> = None;
        for _ in 0..2 * SERVE_LAYERS {
            match allocate(a, &mut live_bytes) {
                Ok(block) => kv.push(block),
                Err(e) => {
                    result = Err(e);
                    in_flight.push_back(kv);
                    break 'requests;
                }
            }
            observe(live_bytes);
        }
        for _ in 0..SERVE_LAYERS {
            let step = allocate(4 * a, &mut live_bytes).and_then(|hidden| {
                observe(live_bytes);
                let out = allocate(a, &mut live_bytes);
                if out.is_ok() {
                    observe(live_bytes);
                }
                free(hidden, &mut live_bytes);
                observe(live_bytes);
                out
            });
            match step {
                Ok(out) => {
                    if let Some(previous) = output.replace(out) {
                        free(previous, &mut live_bytes);
                        observe(live_bytes);
                    }
                }
                Err(e) => {
                    result = Err(e);
                    kv.extend(output.take());
                    in_flight.push_back(kv);
                    break 'requests;
                }
            }
        }
        if let Some(last) = output.take() {
            free(last, &mut live_bytes);
            observe(live_bytes);
        }
        in_flight.push_back(kv);
        if in_flight.len() > SERVE_IN_FLIGHT {
            for block in in_flight.pop_front().into_iter().flatten() {
                free(block, &mut live_bytes);
                observe(live_bytes);
            }
        }
    }
    for block in in_flight.into_iter().flatten() {
        free(block, &mut live_bytes);
    }
    result
}

/// Blocks live at once in [`mixed_with`].
pub const MIXED_LIVE: usize = 64;

/// The `mixed` footprint workload (docs/workloads.md, v1.4): sizes that vary widely, as a
/// vision model's with varying image sizes do. [`MIXED_LIVE`] blocks are allocated on one
/// stream, then each of `steps` steps frees the oldest live block and allocates one of
/// `2^e + x % 2^e` bytes with `e = 9 + x % 17` (512 B to just under 64 MiB; splitmix64
/// from `seed`, `e`'s draw first). Calls `observe(live_bytes)` after every allocation and
/// free; what is live at the end is freed.
pub fn mixed_with<R: Resource + ?Sized>(
    r: &R,
    stream: StreamRef<'_>,
    seed: u64,
    steps: usize,
    mut observe: impl FnMut(usize),
) -> Result<(), Error> {
    let mut rng = seed;
    let mut draw = move || {
        let e = 9 + splitmix64(&mut rng) % 17;
        (1usize << e) + (splitmix64(&mut rng) % (1 << e)) as usize
    };
    let mut live: std::collections::VecDeque<(NonNull<u8>, Layout)> =
        std::collections::VecDeque::with_capacity(MIXED_LIVE + 1);
    let mut live_bytes = 0usize;
    let mut result = Ok(());
    for step in 0..MIXED_LIVE + steps {
        if step >= MIXED_LIVE
            && let Some((p, l)) = live.pop_front()
        {
            // SAFETY: allocated below from `r` with `l` on `stream`; never used, freed once.
            unsafe { r.deallocate(stream, p, l) };
            live_bytes -= l.size();
            observe(live_bytes);
        }
        let allocated = layout(draw()).and_then(|l| Ok((r.allocate(stream, l)?, l)));
        match allocated {
            Ok((p, l)) => {
                live.push_back((p, l));
                live_bytes += l.size();
                observe(live_bytes);
            }
            Err(e) => {
                result = Err(e);
                break;
            }
        }
    }
    for (p, l) in live {
        // SAFETY: as above.
        unsafe { r.deallocate(stream, p, l) };
    }
    result
}

/// The `random` workload: ns per op. What is live at the end is freed untimed; an
/// allocation that fails frees everything live and returns the error.
pub fn random<R: Resource + ?Sized>(
    r: &R,
    stream: StreamRef<'_>,
    seed: u64,
    ops: usize,
) -> Result<f64, Error> {
    random_with(r, stream, seed, ops, |_| {})
}

/// [`random`], calling `observe(live_bytes)` after every op (untimed work belongs in
/// `observe` only if the caller does not need the timing).
pub fn random_with<R: Resource + ?Sized>(
    r: &R,
    stream: StreamRef<'_>,
    seed: u64,
    ops: usize,
    observe: impl FnMut(usize),
) -> Result<f64, Error> {
    walk(
        seed,
        ops,
        |l| r.allocate(stream, l),
        // SAFETY: `walk` frees only what `allocate` returned, with its layout, on the same
        // stream, once; nothing used the memory.
        |p, l| unsafe { r.deallocate(stream, p, l) },
        observe,
    )
}

/// The cost of `random`'s own loop (drawing sizes, keeping the live list, building
/// layouts) with no resource under it: every allocation "returns" a dangling pointer and
/// every free does nothing. ns per op, to set beside a stack's `random` figure (what is
/// left over is the stack's own cost).
pub fn random_floor(seed: u64, ops: usize) -> f64 {
    let ok = walk(
        seed,
        ops,
        |_| Ok(black_box(NonNull::dangling())),
        |p, l| {
            black_box((p, l));
        },
        |_| {},
    );
    ok.unwrap_or(f64::NAN)
}

/// `random`'s walk over any allocate and free (ns per op); what is live at the end is
/// freed untimed, and an allocation that fails frees everything live and returns the
/// error.
#[inline(always)]
fn walk(
    seed: u64,
    ops: usize,
    mut allocate: impl FnMut(Layout) -> Result<NonNull<u8>, Error>,
    mut free: impl FnMut(NonNull<u8>, Layout),
    mut observe: impl FnMut(usize),
) -> Result<f64, Error> {
    let mut rng = seed;
    let mut live: Vec<(NonNull<u8>, usize)> = Vec::with_capacity(10_000);
    let mut live_bytes = 0;
    let free_all = |live: Vec<(NonNull<u8>, usize)>, free: &mut dyn FnMut(NonNull<u8>, Layout)| {
        for (p, n) in live {
            if let Ok(l) = layout(n) {
                free(p, l);
            }
        }
    };
    let t0 = Instant::now();
    for _ in 0..ops {
        match random_step(&mut rng, live.len()) {
            Some(n) => match layout(n).and_then(&mut allocate) {
                Ok(p) => {
                    live.push((black_box(p), n));
                    live_bytes += n;
                }
                Err(e) => {
                    free_all(live, &mut free);
                    return Err(e);
                }
            },
            None => {
                let k = (splitmix64(&mut rng) % live.len() as u64) as usize;
                let (p, n) = live.swap_remove(k);
                live_bytes -= n;
                if let Ok(l) = layout(n) {
                    free(p, l);
                }
            }
        }
        observe(live_bytes);
    }
    let ns = t0.elapsed().as_nanos() as f64 / ops.max(1) as f64;
    free_all(live, &mut free);
    Ok(ns)
}

/// `random` on one thread per stream (seeds 42, 43, ...), `ops` each; ns per op overall.
pub fn random_mt<R: Resource + Sync + ?Sized>(
    r: &R,
    streams: &[StreamRef<'_>],
    ops: usize,
) -> Result<f64, Error> {
    let t0 = Instant::now();
    let results: Vec<Result<f64, Error>> = std::thread::scope(|scope| {
        let handles: Vec<_> = streams
            .iter()
            .enumerate()
            .map(|(t, &stream)| scope.spawn(move || random(r, stream, 42 + t as u64, ops)))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::invalid_argument("a workload thread panicked")))
            })
            .collect()
    });
    let elapsed = t0.elapsed();
    results.into_iter().collect::<Result<Vec<_>, _>>()?;
    Ok(elapsed.as_nanos() as f64 / (ops * streams.len()).max(1) as f64)
}

/// A training step's hand-over under PyTorch, `steps` times on one stream; ns per op,
/// counting only the time inside the passes (not the threads' wake-ups).
///
/// The calling thread runs the forward pass: for each of `layers` layers it allocates an
/// activation (kept) and a workspace (freed at once). A second thread, as autograd's
/// device thread, runs the backward pass in reverse: each layer allocates the gradient of
/// its input, frees its activation and the gradient of the layer after it, and every
/// fourth layer keeps a parameter gradient. The first thread then frees the parameter
/// gradients (`zero_grad(set_to_none=True)`). So most blocks are allocated on one thread
/// and freed on the other, the threads taking turns, as in every PyTorch training loop.
/// Sizes are drawn once (seed 42, in `random`'s range: 256 B to 8 MiB) and repeat every
/// step, as a model's do (docs/workloads.md, `handoff`). With `threads == 1` the backward pass runs on the calling
/// thread: the same operations with no hand-over. An allocation that fails frees
/// everything live and returns the error.
pub fn handoff<R: Resource + Sync + ?Sized>(
    r: &R,
    stream: StreamRef<'_>,
    layers: usize,
    steps: usize,
    threads: usize,
) -> Result<f64, Error> {
    let mut rng = 42;
    // `random`'s sizes: 2^e plus a draw below 2^e, e from 8 to 22.
    let mut size = || {
        let e = 8 + splitmix64(&mut rng) % 15;
        layout(((1u64 << e) + splitmix64(&mut rng) % (1u64 << e)) as usize)
    };
    let sizes: Vec<(Layout, Layout)> = (0..layers)
        .map(|_| Ok((size()?, size()?)))
        .collect::<Result<_, Error>>()?;
    // Forward: 3 a layer; backward: 3 a layer and the parameter gradients, freed after.
    let ops_per_step = layers * 6 + 2 * layers.div_ceil(4);
    let spent = std::sync::atomic::AtomicU64::new(0);
    // Blocks cross threads as addresses with their layouts.
    let allocate = |l: Layout| r.allocate(stream, l).map(|p| (p.as_ptr() as usize, l));
    let free = |(addr, l): (usize, Layout)| {
        if let Some(p) = NonNull::new(addr as *mut u8) {
            // SAFETY: every block here came from `allocate` on `stream` with `l` and is
            // freed once (each is removed from its list first); nothing used it.
            unsafe { r.deallocate(stream, p, l) };
        }
    };
    let forward = |acts: &mut Vec<(usize, Layout)>| -> Result<(), Error> {
        let t0 = Instant::now();
        for &(act, work) in &sizes {
            acts.push(allocate(act)?);
            free(allocate(work)?);
        }
        spent.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        Ok(())
    };
    // On an error, what is still live is in `acts`, `params` and `after`, all freed.
    let backward = |mut acts: Vec<(usize, Layout)>, params: &mut Vec<(usize, Layout)>| {
        let t0 = Instant::now();
        let mut after = None;
        let mut failed = None;
        while let Some(act) = acts.pop() {
            match allocate(act.1) {
                Ok(grad) => {
                    free(act);
                    after.replace(grad).map(free);
                    if acts.len().is_multiple_of(4) {
                        match allocate(act.1) {
                            Ok(p) => params.push(p),
                            Err(e) => failed = Some(e),
                        }
                    }
                }
                Err(e) => {
                    acts.push(act);
                    failed = Some(e);
                }
            }
            if failed.is_some() {
                break;
            }
        }
        after.map(free);
        spent.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        match failed {
            None => Ok(()),
            Some(e) => {
                acts.into_iter().for_each(free);
                params.drain(..).for_each(free);
                Err(e)
            }
        }
    };
    let zero_grad = |params: Vec<(usize, Layout)>| {
        let t0 = Instant::now();
        params.into_iter().for_each(free);
        spent.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
    };
    // One step's forward pass; on an error its activations are freed.
    let step_forward = || {
        let mut acts = Vec::with_capacity(layers);
        match forward(&mut acts) {
            Ok(()) => Ok(acts),
            Err(e) => {
                acts.into_iter().for_each(free);
                Err(e)
            }
        }
    };
    if threads <= 1 {
        for _ in 0..steps {
            let mut params = Vec::new();
            backward(step_forward()?, &mut params)?;
            zero_grad(params);
        }
    } else {
        std::thread::scope(|scope| -> Result<(), Error> {
            type Params = Result<Vec<(usize, Layout)>, Error>;
            let (to_backward, acts_rx) = std::sync::mpsc::channel::<Vec<(usize, Layout)>>();
            let (to_forward, params_rx) = std::sync::mpsc::channel::<Params>();
            scope.spawn(move || {
                for acts in acts_rx {
                    let mut params = Vec::new();
                    let done = backward(acts, &mut params).map(|()| params);
                    if to_forward.send(done).is_err() {
                        break;
                    }
                }
            });
            let ended = || Error::invalid_argument("the backward thread ended");
            for _ in 0..steps {
                if let Err(std::sync::mpsc::SendError(acts)) = to_backward.send(step_forward()?) {
                    acts.into_iter().for_each(free);
                    return Err(ended());
                }
                zero_grad(params_rx.recv().map_err(|_| ended())??);
            }
            Ok(())
        })?;
    }
    Ok(spent.into_inner() as f64 / (steps * ops_per_step).max(1) as f64)
}

/// One workload's figures, as the anchors' CSV has them.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// The stack's name.
    pub resource: String,
    /// The workload: `pair-256B`, `pair-64KiB`, `pair-4MiB`, `random`, `random-mt`,
    /// `random-1stream`, `handoff`.
    pub workload: &'static str,
    /// Threads it ran on.
    pub threads: usize,
    /// Ops per run.
    pub ops: usize,
    /// The fastest of three timed runs (after one warm-up), ns per op.
    pub ns_per_op_min: f64,
    /// Their median, ns per op.
    pub ns_per_op_median: f64,
}

impl Row {
    /// The CSV header the anchors print.
    pub const CSV_HEADER: &'static str =
        "impl,resource,workload,threads,ops,ns_per_op_min,ns_per_op_median";

    /// The row as the anchors' CSV line (`impl` is `memres`).
    pub fn csv(&self) -> String {
        format!(
            "memres,{},{},{},{},{:.1},{:.1}",
            self.resource,
            self.workload,
            self.threads,
            self.ops,
            self.ns_per_op_min,
            self.ns_per_op_median
        )
    }
}

/// Which workloads [`suite`] runs, and how many ops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Suite {
    /// The stack calls the driver on every allocation: fewer ops (20,000), no `random-mt`,
    /// as the anchors do.
    pub slow: bool,
    /// Only the pairs up to 64 KiB (a fixed-size resource of 1 MiB blocks).
    pub small_only: bool,
    /// Divide every op count by this (1: the full counts; a smoke run uses 1000).
    pub scale: usize,
}

impl Default for Suite {
    fn default() -> Self {
        Suite {
            slow: false,
            small_only: false,
            scale: 1,
        }
    }
}

/// One warm-up run and three timed: (min, median).
fn measure(mut run: impl FnMut() -> Result<f64, Error>) -> Result<(f64, f64), Error> {
    run()?;
    let mut r = [run()?, run()?, run()?];
    r.sort_by(f64::total_cmp);
    Ok((r[0], r[1]))
}

/// `handoff`'s layers and steps per run (docs/workloads.md).
const HANDOFF_LAYERS: usize = 160;
const HANDOFF_STEPS: usize = 200;

/// `random`'s ops per run (docs/workloads.md), for stacks that do not call the driver each time.
const RANDOM_OPS: usize = 200_000;

/// The `floor` row: [`random_floor`] measured as [`suite`] measures `random` (one warm-up,
/// three timed runs), under the resource name `floor`.
pub fn floor(config: Suite) -> Row {
    let ops = RANDOM_OPS / config.scale.max(1);
    let (min, median) = measure(|| Ok(random_floor(42, ops))).unwrap_or((f64::NAN, f64::NAN));
    Row {
        resource: "floor".to_owned(),
        workload: "random",
        threads: 1,
        ops,
        ns_per_op_min: min,
        ns_per_op_median: median,
    }
}

/// The suite for one stack: the pairs and `random` on `streams[0]`, `random-mt` on
/// `streams[1..]` (one thread each). `want(workload)` picks workloads; `emit` gets each
/// row as it is measured.
pub fn suite<R: Resource + Sync + ?Sized>(
    name: &str,
    r: &R,
    streams: &[StreamRef<'_>],
    config: Suite,
    want: &dyn Fn(&str) -> bool,
    emit: &mut dyn FnMut(Row),
) -> Result<(), Error> {
    let Some((&s, others)) = streams.split_first() else {
        return Err(Error::invalid_argument(
            "a workload suite needs at least one stream",
        ));
    };
    let scale = config.scale.max(1);
    let np = if config.slow { 20_000 } else { 1_000_000 } / scale;
    let nr = if config.slow { 20_000 } else { RANDOM_OPS } / scale;
    let mut run = |workload: &'static str,
                   threads: usize,
                   ops: usize,
                   f: &mut dyn FnMut() -> Result<f64, Error>|
     -> Result<(), Error> {
        if want(workload) {
            let (min, median) = measure(f)?;
            emit(Row {
                resource: name.to_owned(),
                workload,
                threads,
                ops,
                ns_per_op_min: min,
                ns_per_op_median: median,
            });
        }
        Ok(())
    };
    run("pair-256B", 1, np, &mut || pairs(r, s, 256, np))?;
    run("pair-64KiB", 1, np, &mut || pairs(r, s, 64 << 10, np))?;
    if config.small_only {
        return Ok(());
    }
    run("pair-4MiB", 1, np, &mut || pairs(r, s, 4 << 20, np))?;
    run("random", 1, nr, &mut || random(r, s, 42, nr))?;
    if config.slow || others.is_empty() {
        return Ok(());
    }
    let nt = 100_000 / scale;
    run("random-mt", others.len(), nt * others.len(), &mut || {
        random_mt(r, others, nt)
    })?;
    // The same threads sharing one stream (PyTorch's current stream, a server's worker
    // pool), then twice as many.
    for threads in [others.len(), 2 * others.len()] {
        let shared = vec![s; threads];
        run("random-1stream", threads, nt * threads, &mut || {
            random_mt(r, &shared, nt)
        })?;
    }
    let steps = (HANDOFF_STEPS / scale).max(1);
    let ops = steps * (HANDOFF_LAYERS * 6 + 2 * HANDOFF_LAYERS.div_ceil(4));
    run("handoff", 2, ops, &mut || {
        handoff(r, s, HANDOFF_LAYERS, steps, 2)
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use memres::adaptor::{Limiting, Statistics};
    use memres::{VirtualPoolConfig, upstream::HostVirtual};

    /// `serve` frees everything it allocated, reports the live bytes it holds, and on
    /// out-of-memory returns the error with everything freed.
    #[test]
    fn serve_frees_what_it_allocates_and_reports_what_is_live() {
        // Address space only: the workload never touches its blocks.
        let leaf = HostVirtual::new(64 << 30, 2 << 20).unwrap();
        let counted = Statistics::new(leaf.virtual_pool(VirtualPoolConfig::new()).unwrap());
        let (mut peak, mut last) = (0, usize::MAX);
        serve_with(&counted, StreamRef::HOST, 42, 12, |live| {
            peak = peak.max(live);
            last = live;
        })
        .unwrap();
        let bytes = counted.snapshot().bytes;
        assert_eq!(bytes.current, 0, "everything freed");
        assert_eq!(bytes.peak as usize, peak, "observe saw the peak");
        assert!(last > 0, "the last observation is before the final frees");
        let limited = Statistics::new(Limiting::new(
            HostVirtual::new(1 << 30, 2 << 20).unwrap(),
            64 << 20,
        ));
        let failed = serve_with(&limited, StreamRef::HOST, 42, 12, |_| {});
        assert!(
            matches!(failed, Err(Error::OutOfMemory { .. })),
            "{failed:?}"
        );
        assert_eq!(
            limited.snapshot().bytes.current,
            0,
            "freed after the failure"
        );
    }

    /// `handoff` frees everything it allocates, on one thread or two, and on
    /// out-of-memory (in the forward pass, a gradient or a parameter gradient, by the
    /// limit) returns the error with everything freed.
    #[test]
    fn handoff_frees_everything_even_when_it_runs_out() {
        for threads in [1, 2] {
            let counted = Statistics::new(HostVirtual::new(64 << 30, 2 << 20).unwrap());
            let ns = handoff(&counted, StreamRef::HOST, 16, 3, threads).unwrap();
            assert!(ns > 0.0);
            let snapshot = counted.snapshot();
            assert_eq!(snapshot.bytes.current, 0, "{threads} threads");
            let peak = snapshot.bytes.peak as usize;
            let mut failures = 0;
            for limit in (1..8).map(|k| peak * k / 8) {
                let limited = Statistics::new(Limiting::new(
                    HostVirtual::new(1 << 30, 2 << 20).unwrap(),
                    limit,
                ));
                let run = handoff(&limited, StreamRef::HOST, 16, 3, threads);
                if run.is_err() {
                    failures += 1;
                    assert!(matches!(run, Err(Error::OutOfMemory { .. })), "{run:?}");
                }
                assert_eq!(limited.snapshot().bytes.current, 0, "limit {limit}");
            }
            assert!(failures > 0, "some limit below the peak failed");
        }
    }
}
