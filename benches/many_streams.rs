//! What an allocation costs as the number of streams a sub-allocator has seen grows
//! (issue 33, finding 3). Over host memory on host streams: first every stream allocates
//! and frees one 4 KiB block (so each has a list), then the timed loop goes round the
//! streams, (a) "steady": allocating and freeing on the same stream, (b) "cross":
//! allocating on one stream and freeing on the next; (c) "seen" and "seen-cross": the
//! same round the first 16 streams only, after all were used once (what the streams a
//! resource has seen cost the ones in use); (d) "first": each stream's first pair, with
//! every stream before it seen (the untimed set-up of the others). "floor" is the cost of any per-stream state
//! used round all the streams: a hash map of lists, no resource. Prints nanoseconds per
//! allocate + free pair, the best of three rounds, for 16 to 16,384 streams.
//!
//! Issue 49's patterns (an audit's, which the ones above missed): (e) "random": each pair
//! allocates on a stream drawn at random and frees on another drawn at random; (f)
//! "lanes": 16 threads (one per lane of a stream, `LANES` threads to change it) each use
//! every stream once, then all go round the streams, each from its own start, allocating
//! and freeing on one stream (ns per pair: the wall time over all the threads' pairs);
//! (g) "lanes-random": the same threads, each pair on a random stream. Then, per
//! resource, "kib-per-stream" (not a time): the heap memory that one use of every stream
//! by each of the 16 threads left, per stream, less what the resource holds from its
//! upstream (counted by this bench's global allocator); and for `FixedSize` "after-trim":
//! ns per pair of the 100,000 pairs on one stream right after a `trim` that took another
//! thread's cached blocks back.
//!
//!     cargo bench --bench many_streams            (MANY_STREAMS=N: only N streams;
//!                                                  ONLY=fixed,steady: only those resources
//!                                                  and patterns, e.g. under `perf record`)

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::Instant;

use memres::{
    HostHeap, Pool, PoolConfig, Resource, StreamRef, VirtualPoolConfig, layout,
    suballoc::{Arena, Binning, FixedSize},
    upstream::HostVirtual,
};

/// Live heap bytes of the process (see "kib-per-stream").
static LIVE: AtomicIsize = AtomicIsize::new(0);

/// The system allocator, counting live bytes.
struct Counting;

// SAFETY: every call is `System`'s, with the same arguments; the counter is only a figure.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's promise, passed on.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's promise, passed on.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's promise, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

/// Every pattern's name, for ONLY.
const PATTERNS: [&str; 10] = [
    "first",
    "steady",
    "cross",
    "seen",
    "seen-cross",
    "random",
    "lanes",
    "lanes-random",
    "kib-per-stream",
    "after-trim",
];

/// Threads of the "lanes" patterns (LANES=N to change it).
fn lanes() -> u32 {
    std::env::var("LANES").map_or(16, |n| n.parse().expect("LANES: a number"))
}

/// Pairs timed per round (PAIRS=N to change it, e.g. for a profile of the loop alone).
fn pairs() -> usize {
    std::env::var("PAIRS").map_or(200_000, |n| n.parse().expect("PAIRS: a number"))
}

fn main() {
    // MANY_STREAMS=N runs N streams only (e.g. under `perf record`).
    let counts: Vec<u32> = match std::env::var("MANY_STREAMS") {
        Ok(n) => vec![n.parse().expect("MANY_STREAMS: a number of streams")],
        Err(_) => vec![16, 1_024, 4_096, 16_384],
    };
    println!("resource,pattern,streams,ns_per_pair");
    for streams in counts {
        let best = (0..3).map(|_| floor(streams)).fold(f64::INFINITY, f64::min);
        println!("floor,steady,{streams},{best:.1}");
        report(
            "pool",
            streams,
            || Box::new(Pool::new(HostHeap, PoolConfig::new().initial_size(64 << 20)).unwrap()),
            |p| p.stats().pool_size,
        );
        // (Its memory is mapped pages, not the heap.)
        report(
            "virtual_pool",
            streams,
            || {
                let leaf = HostVirtual::new(1 << 30, 64 << 10).unwrap();
                Box::new(leaf.virtual_pool(VirtualPoolConfig::new()).unwrap())
            },
            |_| 0,
        );
        // (One upstream allocation, made with it.)
        report(
            "arena",
            streams,
            || Box::new(Arena::with_size(HostHeap, 64 << 20).unwrap()),
            |_| 0,
        );
        let fixed = || FixedSize::with_block_size(HostHeap, 4096, 1024).unwrap();
        report(
            "fixed",
            streams,
            || Box::new(fixed()),
            |f| f.upstream_allocations() * f.block_size() * f.blocks_per_chunk(),
        );
        let binning = || {
            let pool = Pool::new(HostHeap, PoolConfig::new().initial_size(64 << 20)).unwrap();
            Binning::new(pool, 8, 16).unwrap()
        };
        report(
            "binning",
            streams,
            || Box::new(binning()),
            // (Its bins' chunks come from the pool.)
            |b| b.upstream().stats().pool_size,
        );
        if streams == 16 {
            after_trim("fixed", fixed, FixedSize::trim);
            after_trim("binning", binning, Binning::trim);
        }
    }
}

/// Whether ONLY (a comma-separated list of resource and pattern names) lets `name` run.
fn wanted(name: &str) -> bool {
    std::env::var("ONLY").map_or(true, |only| only.split(',').any(|n| n == name))
}

/// Whether ONLY lets `pattern` run (it names no pattern, or this one).
fn pattern_wanted(pattern: &str) -> bool {
    let only_patterns =
        std::env::var("ONLY").is_ok_and(|only| only.split(',').any(|n| PATTERNS.contains(&n)));
    !only_patterns || wanted(pattern)
}

/// Every pattern over `streams` streams, for the resource `make` makes;
/// `upstream_bytes`: what it holds from its upstream on the heap.
fn report<R: Dyn + 'static>(
    name: &str,
    streams: u32,
    make: impl Fn() -> Box<R>,
    upstream_bytes: impl Fn(&R) -> usize,
) {
    if !wanted(name) {
        return;
    }
    let run = pattern_wanted;
    // A stream's first pair, with all the streams before it seen.
    if run("first") {
        let best = (0..3)
            .map(|_| {
                let r = make();
                let start = Instant::now();
                for id in 1..=streams {
                    r.pair(StreamRef::host(id), StreamRef::host(id));
                }
                start.elapsed().as_nanos() as f64 / f64::from(streams)
            })
            .fold(f64::INFINITY, f64::min);
        println!("{name},first,{streams},{best:.1}");
    }
    // Round all the streams, or (after all were used once) round the first 16 only.
    for (pattern, active, cross) in [
        ("steady", streams, false),
        ("cross", streams, true),
        ("seen", streams.min(16), false),
        ("seen-cross", streams.min(16), true),
    ] {
        if !run(pattern) {
            continue;
        }
        let best = (0..3)
            .map(|_| round(&*make(), streams, active, cross))
            .fold(f64::INFINITY, f64::min);
        println!("{name},{pattern},{streams},{best:.1}");
    }
    if run("random") {
        let best = (0..3)
            .map(|_| random(&*make(), streams))
            .fold(f64::INFINITY, f64::min);
        println!("{name},random,{streams},{best:.1}");
    }
    let threads = lanes();
    for (pattern, at_random) in [("lanes", false), ("lanes-random", true)] {
        if !run(pattern) {
            continue;
        }
        let best = (0..3)
            .map(|_| on_lanes(&*make(), streams, threads, at_random))
            .fold(f64::INFINITY, f64::min);
        println!("{name},{pattern}-{threads},{streams},{best:.1}");
    }
    if run("kib-per-stream") {
        let r = make();
        let before = LIVE.load(Ordering::Relaxed) - upstream_bytes(&r) as isize;
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| {
                    for id in 1..=streams {
                        r.pair(StreamRef::host(id), StreamRef::host(id));
                    }
                });
            }
        });
        let after = LIVE.load(Ordering::Relaxed) - upstream_bytes(&r) as isize;
        let kib = (after - before) as f64 / f64::from(streams) / 1024.0;
        println!("{name},kib-per-stream-{threads},{streams},{kib:.1}");
    }
}

/// A xorshift generator of stream ids from 1 to `streams`, the same in every run.
fn stream_ids(streams: u32, seed: u64) -> impl FnMut() -> u32 {
    let mut x = 0x9E37_79B9_7F4A_7C15 ^ seed;
    move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % u64::from(streams)) as u32 + 1
    }
}

/// Every stream used once, then pairs each allocating on a random stream and freeing on
/// another random one.
fn random(r: &dyn Dyn, streams: u32) -> f64 {
    for id in 1..=streams {
        r.pair(StreamRef::host(id), StreamRef::host(id));
    }
    let mut next = stream_ids(streams, 0);
    let start = Instant::now();
    for _ in 0..pairs() {
        let (a, b) = (next(), next());
        r.pair(StreamRef::host(a), StreamRef::host(b));
    }
    start.elapsed().as_nanos() as f64 / pairs() as f64
}

/// `threads` threads (lanes) each use every stream once, then all make pairs at once:
/// round the streams from their own start, or on random streams. The time is from the
/// first thread's start to the last one's end (each reads the clock itself: on two cores
/// the threads can be done before the thread that started them runs again).
fn on_lanes(r: &dyn Dyn, streams: u32, threads: u32, at_random: bool) -> f64 {
    let per = pairs() / threads as usize;
    let ready = std::sync::Barrier::new(threads as usize);
    let ready = &ready;
    let spans: Vec<(Instant, Instant)> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                s.spawn(move || {
                    for id in 1..=streams {
                        r.pair(StreamRef::host(id), StreamRef::host(id));
                    }
                    ready.wait();
                    let first = t * (streams / threads).max(1);
                    let mut next = stream_ids(streams, u64::from(t) + 1);
                    let start = Instant::now();
                    for i in 0..per {
                        let id = if at_random {
                            next()
                        } else {
                            (first + i as u32) % streams + 1
                        };
                        r.pair(StreamRef::host(id), StreamRef::host(id));
                    }
                    (start, Instant::now())
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().unwrap()).collect()
    });
    let start = spans.iter().map(|s| s.0).min().expect("threads");
    let end = spans.iter().map(|s| s.1).max().expect("threads");
    (end - start).as_nanos() as f64 / (per * threads as usize) as f64
}

/// ns per pair of the 100,000 pairs on one stream right after a trim that took another
/// thread's cached blocks back (a thread cache of its own is what a pair on one stream
/// is fast with).
fn after_trim<R: Resource + Sync>(
    name: &str,
    make: impl Fn() -> R,
    trim: impl Fn(&R) -> Result<(), memres::Error>,
) {
    if !wanted(name) || !pattern_wanted("after-trim") {
        return;
    }
    let l = layout(4096).unwrap();
    let pairs = 100_000;
    let best = (0..3)
        .map(|_| {
            let r = make();
            let (cached, trimmed) = (std::sync::Barrier::new(2), std::sync::Barrier::new(2));
            std::thread::scope(|s| {
                s.spawn(|| {
                    r.pair(StreamRef::host(1), StreamRef::host(1));
                    cached.wait();
                    trimmed.wait();
                });
                cached.wait();
                trim(&r).unwrap();
                let start = Instant::now();
                for _ in 0..pairs {
                    let p = r.allocate(StreamRef::host(1), l).expect("memory");
                    // SAFETY: allocated just above, unused; host streams are always complete.
                    unsafe { r.deallocate(StreamRef::host(1), p, l) };
                }
                let ns = start.elapsed().as_nanos() as f64 / f64::from(pairs);
                trimmed.wait();
                ns
            })
        })
        .fold(f64::INFINITY, f64::min);
    println!("{name},after-trim,1,{best:.1}");
}

/// What keeping any state per stream costs when every call is on another of `streams`
/// streams: a hash map from stream to a list of 4 KiB blocks, one pop and one push per
/// pair, no resource and no lock (the caches of the machine are all it measures).
fn floor(streams: u32) -> f64 {
    let mut lists: std::collections::HashMap<u32, Vec<usize>> = (1..=streams)
        .map(|id| (id, vec![id as usize * 4096]))
        .collect();
    let start = Instant::now();
    for i in 0..pairs() {
        let id = (i as u32 % streams) + 1;
        let list = lists.get_mut(&std::hint::black_box(id)).expect("a list");
        let block = list.pop().expect("a block");
        list.push(std::hint::black_box(block));
    }
    start.elapsed().as_nanos() as f64 / pairs() as f64
}

/// The resources behind one object type, for the loop below.
trait Dyn: Sync {
    fn pair(&self, on: StreamRef<'_>, off: StreamRef<'_>);
}

impl<R: Resource + Sync> Dyn for R {
    fn pair(&self, on: StreamRef<'_>, off: StreamRef<'_>) {
        let l = layout(4096).unwrap();
        let p = self.allocate(on, l).expect("memory");
        // SAFETY: allocated just above, unused; host streams are always complete.
        unsafe { self.deallocate(off, p, l) };
    }
}

fn round(r: &dyn Dyn, streams: u32, active: u32, cross: bool) -> f64 {
    for id in 1..=streams {
        r.pair(StreamRef::host(id), StreamRef::host(id));
    }
    let start = Instant::now();
    for i in 0..pairs() {
        let id = (i as u32 % active) + 1;
        let next = if cross { id % active + 1 } else { id };
        r.pair(StreamRef::host(id), StreamRef::host(next));
    }
    start.elapsed().as_nanos() as f64 / pairs() as f64
}
