//! The workloads of `docs/workloads.md` (spec v1) over memres's stacks, printing
#![allow(missing_docs)] // a bench binary
//! the same CSV as the RMM and PyTorch anchors so the figures sit side by side.
//!
//! ```sh
//! cargo bench --bench workloads                # every stack this machine has
//! cargo bench --bench workloads -- cuda_async  # one stack
//! ```
//!
//! On a machine with a CUDA driver the GPU stacks run (each on non-blocking streams, as
//! the anchors do); without one, the host stacks run instead.
//!
//! The `floor` row is `random`'s own loop with no resource under it (sizes drawn, the
//! live list kept, layouts built): part of every stack's `random` figure.
//!
//! `MEMRES_THREADS=N` runs `random-mt` on N threads and `random-1stream` on N and 2N
//! (8, 8 and 16 without it).
//!
//! `MEMRES_MADE_UP_STREAMS=1` (only without a CUDA driver) runs the host stacks on
//! made-up CUDA stream handles instead of host streams: the lists are then kept and
//! merged as for CUDA streams, and the footprint rows are the GPU's (see `Streams`).
//!
//! `MEMRES_FOOTPRINT_SEEDS=N` adds to the `footprint` stack's `random` and `cross-stream`
//! (seed 42) the mean, max and min of peak held / peak live over seeds 1..=N.
//!
//! `MEMRES_CACHES_PAIRED=N` runs instead the pool, then the arena, each with and without
//! its thread caches in one process, `N` rounds alternating (see `caches_paired`).
//!
//! `MEMRES_PAIRED=N` runs instead the adaptors' comparison of issue 5: `pool` and each
//! adaptor over that same pool (by reference), `N` rounds of `random` (or the workloads
//! in `MEMRES_WORKLOADS`) in one process, each round running every stack once in a
//! random order (the log flushed, untimed, after each of its runs); it prints per stack
//! the min and median ns per op and the median of the rounds' ratios to `pool`. Stacks timed side by side in one process, over one
//! pool, share the machine's slow and fast moments, which separate processes do not.

use memres::adaptor::{Limiting, Logging, Statistics, Tracking};
use memres::stream::{Stream, StreamFlags};
use memres::suballoc::{Arena, Binning, FixedSize, Growth, Pool, PoolConfig, VirtualPoolConfig};
use memres::{
    Cuda, CudaVirtual, HostHeap, Resource, StreamRef,
    upstream::{CudaAsync, HostVirtual},
};
use memres_workloads::{self as workloads, Suite};

/// Where the work goes: CUDA streams on a GPU, host streams without one, or, without a
/// driver and with `MEMRES_MADE_UP_STREAMS=1`, made-up CUDA stream handles.
enum Streams {
    Cuda(Vec<Stream>),
    Host,
    /// Handles no driver ever sees: the sub-allocators key and merge their lists as for
    /// CUDA streams (another stream's frees reached only through a merge of the lists,
    /// its wait for the device a no-op without a driver), so the GPU's footprint rows
    /// come out on a machine without one (`virtual_pool`'s `cross-stream`: 1.114 either
    /// way, where host streams give 1.100).
    MadeUp,
}

impl Streams {
    fn new(gpu: bool, n: usize) -> Streams {
        if gpu {
            let make = || Stream::with_flags(StreamFlags::NonBlocking).expect("a stream");
            Streams::Cuda((0..n).map(|_| make()).collect())
        } else if std::env::var("MEMRES_MADE_UP_STREAMS").is_ok_and(|v| v == "1")
            && !memres::driver::is_present()
        {
            Streams::MadeUp
        } else {
            Streams::Host
        }
    }

    fn get(&self, i: usize) -> StreamRef<'_> {
        match self {
            Streams::Cuda(s) => s[i].as_ref(),
            Streams::Host => StreamRef::host(i as u32),
            // SAFETY: only without a driver (`new`), so the handle is never given to one;
            // distinct and non-null, as streams' handles are.
            Streams::MadeUp => unsafe { StreamRef::from_raw((0x5000 * (i + 1)) as _) },
        }
    }

    /// Waits for every stream's work (host streams have none).
    fn synchronize(&self) {
        if let Streams::Cuda(streams) = self {
            for s in streams {
                s.synchronize().expect("a stream synchronisation");
            }
        }
    }
}

/// The suite for one stack (`slow`: the stack calls the driver on every allocation, so
/// fewer ops, as the anchors do).
fn suite<R: Resource + Sync>(name: &str, r: &R, gpu: bool, slow: bool) {
    suite_of(name, r, gpu, slow, false);
}

/// As `suite`; `small_only`: only the pairs up to 64 KiB (a fixed-size resource of 1 MiB
/// blocks, as the anchors run theirs). The workloads themselves are `memres_workloads` (the `workloads/` package),
/// shared with `memres bench`.
fn suite_of<R: Resource + Sync>(name: &str, r: &R, gpu: bool, slow: bool, small_only: bool) {
    let threads = threads();
    let streams = Streams::new(gpu, 1 + threads);
    let refs: Vec<StreamRef<'_>> = (0..=threads).map(|i| streams.get(i)).collect();
    // Run as a test (`run.sh` passes `--include-ignored`): a smoke run, 1/1000 of the ops.
    let config = Suite {
        slow,
        small_only,
        scale: if smoke_run() { 1000 } else { 1 },
    };
    // `MEMRES_WORKLOADS` (comma-separated names) limits which workloads run.
    let only = std::env::var("MEMRES_WORKLOADS").ok();
    let want = |w: &str| only.as_deref().is_none_or(|o| o.split(',').any(|x| x == w));
    workloads::suite(name, r, &refs, config, &want, &mut |row| {
        println!("{}", row.csv())
    })
    .expect("a workload suite");
}

/// Threads of `random-mt` and `random-1stream` (which also runs twice as many): 8, as
/// the anchors run, or `MEMRES_THREADS`.
fn threads() -> usize {
    std::env::var("MEMRES_THREADS")
        .ok()
        .and_then(|t| t.parse().ok())
        .filter(|&t: &usize| t > 0)
        .unwrap_or(8)
}

/// True when the binary runs as a test (the GPU bundle's `run.sh` runs every binary of
/// its tests folder with `--include-ignored`, and bench targets land there).
fn smoke_run() -> bool {
    std::env::args().any(|a| a == "--include-ignored" || a == "--test")
}

fn main() {
    // `cargo bench` passes `--bench`; a bare word picks one stack.
    let only = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let want = |name: &str| only.as_deref().is_none_or(|o| o == name);
    let gpu = memres::driver::is_present() && memres::device::DeviceId::count().unwrap_or(0) > 0;
    if let Ok(rounds) = std::env::var("MEMRES_CACHES_PAIRED") {
        let rounds: usize = rounds
            .parse()
            .ok()
            .filter(|&n: &usize| n > 0)
            .expect("MEMRES_CACHES_PAIRED: a number of rounds, at least 1");
        let rounds = if smoke_run() { 2 } else { rounds };
        let bytes = if gpu { 16 << 30 } else { 4 << 30 };
        if gpu {
            let base = || Cuda::new().expect("Cuda");
            caches_paired("pool", &pools(&|c| Pool::new(base(), c), bytes), rounds);
            caches_paired(
                "arena",
                &arenas(&|| Arena::with_size(base(), bytes)),
                rounds,
            );
        } else {
            let base = HostHeap::new;
            caches_paired("pool", &pools(&|c| Pool::new(base(), c), bytes), rounds);
            caches_paired(
                "arena",
                &arenas(&|| Arena::with_size(base(), bytes)),
                rounds,
            );
        }
        return;
    }
    if let Ok(rounds) = std::env::var("MEMRES_PAIRED") {
        let rounds = rounds
            .parse()
            .ok()
            .filter(|&n: &usize| n > 0)
            .expect("MEMRES_PAIRED: a number of rounds, at least 1");
        let rounds = if smoke_run() { 2 } else { rounds };
        if gpu {
            let pool = Pool::new(
                Cuda::new().expect("Cuda"),
                PoolConfig::new().initial_size(16 << 30),
            );
            paired("pool", &pool.expect("Pool"), true, rounds);
        } else {
            let pool = Pool::new(HostHeap::new(), PoolConfig::new().initial_size(4 << 30));
            paired("pool[host_heap]", &pool.expect("Pool"), false, rounds);
        }
        return;
    }
    println!("{}", workloads::Row::CSV_HEADER);
    // `random`'s own loop with no resource under it: what every stack's figure includes.
    if want("floor") {
        let scale = if smoke_run() { 1000 } else { 1 };
        println!(
            "{}",
            workloads::floor(Suite {
                scale,
                ..Suite::default()
            })
            .csv()
        );
    }
    if gpu {
        if want("cuda") {
            suite("cuda", &Cuda::new().expect("Cuda"), true, true);
        }
        let base = || CudaAsync::new().expect("CudaAsync");
        if want("cuda_async") {
            suite("cuda_async", &base(), true, false);
        }
        adaptor_suites("cuda_async", base, true, &want);
        suballoc_suites("", || Cuda::new().expect("Cuda"), 16 << 30, true, &want);
        let pool = || {
            Pool::new(
                Cuda::new().expect("Cuda"),
                PoolConfig::new().initial_size(16 << 30),
            )
        };
        adaptor_suites("pool", || pool().expect("Pool"), true, &want);
        if want("virtual_pool") {
            let in_place = CudaVirtual::new()
                .and_then(|v| v.virtual_pool(VirtualPoolConfig::new().initial_size(16 << 30)))
                .expect("a virtual pool");
            suite("virtual_pool", &in_place, true, false);
        }
        if want("footprint") {
            for (name, growth) in [("pool", Growth::Eighth), ("pool_rmm", Growth::Rmm)] {
                let config = PoolConfig::new().growth(growth);
                let pool = Pool::new(Cuda::new().expect("Cuda"), config).expect("Pool");
                let trim = || {
                    pool.trim().expect("trim");
                };
                footprints(name, &pool, &|| pool.pool_size(), &trim, true);
            }
            let in_place = CudaVirtual::new()
                .and_then(|v| v.virtual_pool(VirtualPoolConfig::new()))
                .expect("a virtual pool");
            let trim = || {
                in_place.trim().expect("trim");
            };
            footprints(
                "virtual_pool",
                &in_place,
                &|| in_place.pool_size(),
                &trim,
                true,
            );
            let asynch = CudaAsync::new().expect("CudaAsync");
            let reserved = || asynch.reserved_bytes().expect("reserved bytes") as usize;
            let trim = || asynch.trim_to(0).expect("trim");
            footprints("cuda_async", &asynch, &reserved, &trim, true);
        }
    } else {
        eprintln!("no CUDA device: running the host stacks");
        if want("host_heap") {
            suite("host_heap", &HostHeap::new(), false, false);
        }
        adaptor_suites("host_heap", HostHeap::new, false, &want);
        // 8 GiB (address space: the heap commits only what is touched): `random-1stream`
        // on 16 threads has up to 3.7 GiB live at once.
        suballoc_suites("host_heap", HostHeap::new, 8 << 30, false, &want);
        let pool = || Pool::new(HostHeap::new(), PoolConfig::new().initial_size(4 << 30));
        adaptor_suites("pool[host_heap]", || pool().expect("Pool"), false, &want);
        if want("footprint") {
            for (name, growth) in [
                ("pool[host_heap]", Growth::Eighth),
                ("pool_rmm[host_heap]", Growth::Rmm),
            ] {
                let config = PoolConfig::new().growth(growth);
                let pool = Pool::new(HostHeap::new(), config).expect("Pool");
                let trim = || {
                    pool.trim().expect("trim");
                };
                footprints(name, &pool, &|| pool.pool_size(), &trim, false);
            }
            let in_place = HostVirtual::new(64 << 30, 2 << 20)
                .and_then(|v| v.virtual_pool(VirtualPoolConfig::new()))
                .expect("a virtual pool");
            let trim = || {
                in_place.trim().expect("trim");
            };
            let held = || in_place.pool_size();
            footprints("virtual_pool[host]", &in_place, &held, &trim, false);
        }
        if want("virtual_pool[host]") {
            let in_place = HostVirtual::new(64 << 30, 2 << 20)
                .and_then(|v| v.virtual_pool(VirtualPoolConfig::new().initial_size(4 << 30)))
                .expect("a virtual pool");
            suite("virtual_pool[host]", &in_place, false, false);
        }
    }
}

/// The sub-allocators over `base` as the anchors build theirs (pools and arena of `pool_bytes`,
/// Two pools of `bytes`, the first with thread caches and the second without (a release
/// threshold that never triggers turns them off).
fn pools<R: Resource>(
    make: &dyn Fn(PoolConfig) -> Result<Pool<R>, memres::Error>,
    bytes: usize,
) -> [Pool<R>; 2] {
    let config = PoolConfig::new().initial_size(bytes);
    [
        make(config).expect("Pool"),
        make(config.release_threshold(usize::MAX / 2)).expect("Pool"),
    ]
}

/// Two arenas, the first with thread caches and the second without.
fn arenas<R: Resource>(make: &dyn Fn() -> Result<Arena<R>, memres::Error>) -> [Arena<R>; 2] {
    [
        make().expect("Arena"),
        make().expect("Arena").thread_caches(false),
    ]
}

/// A resource's thread caches on and off in one process (`MEMRES_CACHES_PAIRED=N`):
/// `[on, off]`, the same resource with the caches and without, `pair-256B` and `random`
/// on the host stream, `rounds` rounds alternating which goes first; prints each's
/// minimum and median and the median of the rounds' ratios (on / off). Both share the
/// binary and the process, so the comparison is of the two paths, not of two builds'
/// code layouts.
fn caches_paired<R: Resource>(name: &str, [on, off]: &[R; 2], rounds: usize) {
    let scale = if smoke_run() { 1000 } else { 1 };
    let s = StreamRef::HOST;
    for workload in ["pair-256B", "random"] {
        let run = |p: &R| match workload {
            // (ns per op: a pair is two.)
            "pair-256B" => workloads::pairs(p, s, 256, 1_000_000 / scale).expect("pairs") / 2.0,
            _ => workloads::random(p, s, 42, 200_000 / scale).expect("random"),
        };
        let (mut a, mut b, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
        for round in 0..rounds {
            let (x, y) = if round % 2 == 0 {
                let x = run(on);
                (x, run(off))
            } else {
                let y = run(off);
                (run(on), y)
            };
            a.push(x);
            b.push(y);
            ratios.push(x / y);
        }
        let stat = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            (v[0], v[v.len() / 2])
        };
        let ((a_min, a_med), (b_min, b_med), (_, ratio)) =
            (stat(&mut a), stat(&mut b), stat(&mut ratios));
        println!(
            "caches,{name},{workload},on {a_min:.1} / {a_med:.1},off {b_min:.1} / {b_med:.1},on/off {ratio:.3}"
        );
    }
}

/// binning 2^8..2^22 over a pool, 1 MiB fixed blocks 1024 at a time), then the footprint
/// of a pool grown from nothing.
fn suballoc_suites<R: Resource + Send + Sync + 'static>(
    base_name: &str,
    base: impl Fn() -> R,
    pool_bytes: usize,
    gpu: bool,
    want: &dyn Fn(&str) -> bool,
) {
    // On a GPU the names are the anchors' (their base is `cuda`); on the host they name
    // the base.
    let name = |s: &str| {
        if base_name.is_empty() {
            s.to_string()
        } else {
            format!("{s}[{base_name}]")
        }
    };
    let pool = || Pool::new(base(), PoolConfig::new().initial_size(pool_bytes)).expect("Pool");
    if want(&name("pool")) {
        suite(&name("pool"), &pool(), gpu, false);
    }
    if want(&name("arena")) {
        let arena = Arena::with_size(base(), pool_bytes).expect("Arena");
        suite(&name("arena"), &arena, gpu, false);
    }
    if want(&name("binning(pool)")) {
        let binning = Binning::new(pool(), 8, 22).expect("Binning");
        suite(&name("binning(pool)"), &binning, gpu, false);
    }
    if want(&name("fixed_size_1MiB")) {
        let fixed = FixedSize::with_block_size(base(), 1 << 20, 1024).expect("FixedSize");
        suite_of(&name("fixed_size_1MiB"), &fixed, gpu, false, true);
    }
    for (stack, growth) in [
        ("pool_from_0", Growth::Eighth),
        ("pool_rmm_from_0", Growth::Rmm),
    ] {
        if want(&name(stack)) {
            let config = PoolConfig::new().growth(growth);
            let make = || Pool::new(Statistics::new(base()), config).expect("Pool");
            footprint(&name(stack), make, gpu);
        }
    }
}

/// The footprint workloads (peak held / peak live, docs/workloads.md, v1.1), each over a stack
/// grown from nothing:
/// - `random`: the `random` workload's walk, seed 42, 200,000 ops.
/// - `fragmenting`: 8 rounds; round r allocates 400 blocks of 2^(16 + r/2) bytes plus a
///   random part below that (splitmix64, seed 7), then frees every other block of the
///   round, so each round's sizes outgrow the holes the last one left.
/// - `cross-stream`: `random`'s sequence with every allocation on stream A and every
///   free on stream B (a producer/consumer pair: data made on a side stream, consumed
///   and freed on the compute stream). Two non-blocking CUDA streams on a GPU; on the
///   host, two host streams (always complete, so the host cannot show the defect).
///
/// - `serve`: [`workloads::serve_with`], seed 42, [`SERVE_REQUESTS`] requests.
/// - `mixed`: [`workloads::mixed_with`], seed 7, [`MIXED_STEPS`] steps.
///
/// `held` reads what the stack holds from the device (sampled after every op, untimed
/// runs only).
/// Requests of the `serve` footprint workload.
const SERVE_REQUESTS: usize = 1_000;
/// Steps of the `mixed` footprint workload.
const MIXED_STEPS: usize = 20_000;

fn footprints<R: Resource + ?Sized>(
    name: &str,
    r: &R,
    held: &dyn Fn() -> usize,
    trim: &dyn Fn(),
    gpu: bool,
) {
    let streams = Streams::new(gpu, 2);
    let (a, b) = (streams.get(0), streams.get(1));
    let ops = 200_000 / if smoke_run() { 1000 } else { 1 };
    // Each workload starts from nothing: what the last one left is given back first,
    // once the streams' work is done (a driver pool keeps what was freed on a stream
    // until the stream reaches the free: without the wait, `cuda_async` started each
    // workload holding the last one's peak, as RMM's run, a fresh resource per workload,
    // does not).
    let trim = || {
        streams.synchronize();
        trim();
    };
    let report = |workload: &str, peak_held: usize, peak_live: usize| {
        trim();
        println!(
            "# footprint,{name},{workload},peak_held_bytes={peak_held},\
             peak_live_bytes={peak_live},ratio={:.3},held_after_trim={}",
            peak_held as f64 / peak_live.max(1) as f64,
            held(),
        );
    };
    trim();
    // random
    let random = |seed: u64| {
        let (mut peak_live, mut peak_held) = (0, 0);
        workloads::random_with(r, a, seed, ops, |live| {
            peak_live = peak_live.max(live);
            peak_held = peak_held.max(held());
        })
        .expect("allocation in random");
        (peak_held, peak_live)
    };
    let (peak_held, peak_live) = random(42);
    report("random", peak_held, peak_live);
    // fragmenting
    let (mut peak_live, mut peak_held, mut live_bytes) = (0, 0, 0);
    let mut rng = 7u64;
    let mut kept = Vec::new();
    let rounds = if smoke_run() { 2 } else { 8 };
    for round in 0..rounds {
        let e = 16 + round / 2;
        let mut this = Vec::new();
        for _ in 0..400 {
            let n = (1usize << e) + (workloads::splitmix64(&mut rng) % (1 << e)) as usize;
            let l = memres::layout(n).expect("a layout");
            let p = r.allocate(a, l).expect("allocation in fragmenting");
            live_bytes += n;
            peak_live = peak_live.max(live_bytes);
            peak_held = peak_held.max(held());
            this.push((p, l));
        }
        for (i, (p, l)) in this.into_iter().enumerate() {
            if i % 2 == 0 {
                // SAFETY: from `r` with `l` on `a`; never used.
                unsafe { r.deallocate(a, p, l) };
                live_bytes -= l.size();
            } else {
                kept.push((p, l));
            }
        }
    }
    for (p, l) in kept {
        // SAFETY: as above.
        unsafe { r.deallocate(a, p, l) };
    }
    report("fragmenting", peak_held, peak_live);
    // cross-stream, with how often the stack grew while it held at least as much free
    // as the growth (memory it had but could not use: fragmented, or freed on the other
    // stream and not yet reached)
    let (mut peak_live, mut peak_held) = (0, 0);
    let (mut last_live, mut last_held) = (0, held());
    let (mut growths, mut with_free, mut most_free) = (0, 0, 0);
    workloads::cross_stream_with(r, [a, b], 42, ops, |live| {
        let now = held();
        if now > last_held {
            growths += 1;
            let free = last_held.saturating_sub(last_live);
            with_free += usize::from(free >= now - last_held);
            most_free = most_free.max(free);
        }
        (last_live, last_held) = (live, now);
        peak_live = peak_live.max(live);
        peak_held = peak_held.max(now);
    })
    .expect("allocation in cross-stream");
    report("cross-stream", peak_held, peak_live);
    println!(
        "# growths,{name},cross-stream,growths={growths},with_as_much_free={with_free},\
         most_free_at_a_growth={most_free}"
    );
    // serve: requests of varying batch and length through a model, overlapping.
    let (mut peak_live, mut peak_held) = (0, 0);
    let requests = if smoke_run() { 20 } else { SERVE_REQUESTS };
    workloads::serve_with(r, a, 42, requests, |live| {
        peak_live = peak_live.max(live);
        peak_held = peak_held.max(held());
    })
    .expect("allocation in serve");
    report("serve", peak_held, peak_live);
    // mixed: sizes that vary widely, with how often and how much what the stack held
    // fell between two ops (a virtual pool's growth that gives back more than it maps)
    let (mut peak_live, mut peak_held) = (0, 0);
    let (mut last_held, mut falls, mut fallen) = (held(), 0, 0);
    let steps = if smoke_run() { 200 } else { MIXED_STEPS };
    workloads::mixed_with(r, a, 7, steps, |live| {
        let now = held();
        if now < last_held {
            falls += 1;
            fallen += last_held - now;
        }
        last_held = now;
        peak_live = peak_live.max(live);
        peak_held = peak_held.max(now);
    })
    .expect("allocation in mixed");
    report("mixed", peak_held, peak_live);
    println!("# falls,{name},mixed,falls={falls},bytes={fallen}");
    // Last, so that the standard sequences start as they always did. A peak is one
    // moment of one sequence: seeds 1..=N show how typical seed 42 is.
    let seeds: u64 = std::env::var("MEMRES_FOOTPRINT_SEEDS").map_or(0, |n| {
        n.parse()
            .expect("MEMRES_FOOTPRINT_SEEDS: a number of seeds")
    });
    if seeds > 0 {
        let ratios: Vec<f64> = (1..=seeds)
            .map(|seed| {
                let (peak_held, peak_live) = random(seed);
                trim();
                peak_held as f64 / peak_live as f64
            })
            .collect();
        let summary = |workload: &str, ratios: &[f64]| {
            println!(
                "# footprint,{name},{workload} seeds 1..={seeds},mean={:.3},max={:.3},min={:.3}",
                ratios.iter().sum::<f64>() / ratios.len() as f64,
                ratios.iter().copied().fold(0.0, f64::max),
                ratios.iter().copied().fold(f64::INFINITY, f64::min),
            );
        };
        summary("random", &ratios);
        // `cross-stream` over the same seeds: its figure is one moment of one sequence too.
        let ratios: Vec<f64> = (1..=seeds)
            .map(|seed| {
                let (mut peak_live, mut peak_held) = (0, 0);
                workloads::cross_stream_with(r, [a, b], seed, ops, |live| {
                    peak_live = peak_live.max(live);
                    peak_held = peak_held.max(held());
                })
                .expect("allocation in cross-stream");
                trim();
                peak_held as f64 / peak_live as f64
            })
            .collect();
        summary("cross-stream", &ratios);
    }
}

/// Peak bytes a pool grown from nothing takes from its upstream while running `random`
/// (seed 42, the full op count), against the peak bytes live; also the pool's state once
/// everything is freed again.
fn footprint<R: Resource>(name: &str, make: impl Fn() -> Pool<Statistics<R>>, gpu: bool) {
    let streams = Streams::new(gpu, 1);
    let s = streams.get(0);
    let ops = 200_000 / if smoke_run() { 1000 } else { 1 };
    let pool = make();
    let mut peak_live = 0;
    let ns = workloads::random_with(&pool, s, 42, ops, |live| peak_live = peak_live.max(live))
        .expect("allocation in random");
    let peak_upstream = pool.upstream().snapshot().bytes.peak as usize;
    println!(
        "# footprint,{name},random,{ops},peak_upstream_bytes={peak_upstream},\
         peak_live_bytes={peak_live},ratio={:.3},upstream_allocations={},\
         ns_per_op_growths_included={ns:.1}",
        peak_upstream as f64 / peak_live as f64,
        pool.stats().upstream_allocations,
    );
}

/// The adaptors over `base`, each named `adaptor(base)` as the anchors name theirs.
fn adaptor_suites<R: Resource + Send + Sync>(
    base_name: &str,
    base: impl Fn() -> R,
    gpu: bool,
    want: &dyn Fn(&str) -> bool,
) {
    let name = |adaptor: &str| format!("{adaptor}({base_name})");
    if want(&name("statistics")) {
        suite(&name("statistics"), &Statistics::new(base()), gpu, false);
    }
    if want(&name("tracking")) {
        suite(&name("tracking"), &Tracking::new(base()), gpu, false);
    }
    if want(&name("limiting")) {
        suite(
            &name("limiting"),
            &Limiting::new(base(), usize::MAX),
            gpu,
            false,
        );
    }
    if want(&name("logging")) {
        let path = std::env::temp_dir().join(format!("memres-bench-{}.csv", std::process::id()));
        let logged = Logging::to_file(base(), &path).expect("a log file");
        suite(&name("logging"), &logged, gpu, false);
        drop(logged);
        std::fs::remove_file(&path).ok();
    }
}

/// One stack's timed run of a workload over the given streams, ns per op.
type Run<'a> = dyn Fn(&str, &[StreamRef<'_>]) -> f64 + 'a;

/// `MEMRES_PAIRED`: `pool` and the adaptors over it, timed in turns (see the top).
fn paired<P: Resource + Sync>(pool_name: &str, pool: &P, gpu: bool, rounds: usize) {
    const THREADS: usize = 8;
    let streams = Streams::new(gpu, 1 + THREADS);
    let refs: Vec<StreamRef<'_>> = (0..=THREADS).map(|i| streams.get(i)).collect();
    let path = std::env::temp_dir().join(format!("memres-paired-{}.csv", std::process::id()));
    let statistics = Statistics::new(pool);
    let limiting = Limiting::new(pool, usize::MAX);
    let tracking = Tracking::new(pool);
    let logging = Logging::to_file(pool, &path).expect("a log file");
    // (The log's threads nap when idle, but a 2-core machine still feels them: leave
    // `logging` out with `MEMRES_STACKS` to time the others alone.)
    let scale = if smoke_run() { 1000 } else { 1 };
    let only = std::env::var("MEMRES_WORKLOADS").unwrap_or_else(|_| "random".into());
    for workload in only.split(',') {
        // One closure per stack, so each runs its own monomorphic code.
        let run = |r: &Run<'_>| r(workload, &refs);
        let stacks: [(&str, &Run<'_>); 5] = [
            ("", &|w, s| one(w, pool, s, scale)),
            ("statistics", &|w, s| one(w, &statistics, s, scale)),
            ("limiting", &|w, s| one(w, &limiting, s, scale)),
            ("tracking", &|w, s| one(w, &tracking, s, scale)),
            ("logging", &|w, s| {
                let ns = one(w, &logging, s, scale);
                // Untimed: the log's threads finish their rows before the next stack
                // runs, so it does not pay for them.
                logging.flush().expect("the log written");
                ns
            }),
        ];
        // `MEMRES_STACKS` (comma-separated adaptor names) leaves the others out.
        let picked = std::env::var("MEMRES_STACKS").ok();
        let stacks: Vec<_> = stacks
            .into_iter()
            .filter(|(a, _)| {
                a.is_empty()
                    || picked
                        .as_deref()
                        .is_none_or(|p| p.split(',').any(|x| x == *a))
            })
            .collect();
        for (_, r) in &stacks {
            run(r); // warm-up
        }
        let mut times = vec![Vec::with_capacity(rounds); stacks.len()];
        let mut rng = 7;
        for _ in 0..rounds {
            // Each round in a fresh random order, so that no stack always follows the
            // same one.
            let mut order: Vec<usize> = (0..stacks.len()).collect();
            for k in (1..order.len()).rev() {
                order.swap(
                    k,
                    (workloads::splitmix64(&mut rng) % (k as u64 + 1)) as usize,
                );
            }
            for i in order {
                times[i].push(run(stacks[i].1));
            }
        }
        let median = |v: &[f64]| {
            let mut v = v.to_vec();
            v.sort_by(f64::total_cmp);
            let n = v.len();
            (v[(n - 1) / 2] + v[n / 2]) / 2.0
        };
        let min = |v: &[f64]| v.iter().copied().fold(f64::INFINITY, f64::min);
        let base = &times[0];
        for ((adaptor, _), t) in stacks.iter().zip(&times) {
            let name = if adaptor.is_empty() {
                pool_name.to_string()
            } else {
                format!("{adaptor}({pool_name})")
            };
            let ratios: Vec<f64> = t.iter().zip(base).map(|(a, b)| a / b).collect();
            println!(
                "paired,{name},{workload},rounds={rounds},min={:.1},median={:.1},\
                 ratio_of_mins={:.3},median_ratio={:.3}",
                min(t),
                median(t),
                min(t) / min(base),
                median(&ratios),
            );
        }
    }
    drop(logging);
    std::fs::remove_file(&path).ok();
}

/// One timed run of `workload` over `r`, ns per op.
fn one<R: Resource + Sync>(workload: &str, r: &R, streams: &[StreamRef<'_>], scale: usize) -> f64 {
    let s = streams[0];
    match workload {
        "random" => workloads::random(r, s, 42, 200_000 / scale),
        "random-mt" => workloads::random_mt(r, &streams[1..], 100_000 / scale),
        "pair-256B" => workloads::pairs(r, s, 256, 1_000_000 / scale),
        "pair-64KiB" => workloads::pairs(r, s, 64 << 10, 1_000_000 / scale),
        other => panic!("MEMRES_WORKLOADS: no workload {other} in the paired runs"),
    }
    .expect("a workload run")
}
