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
//!     cargo bench --bench many_streams            (MANY_STREAMS=N: only N streams;
//!                                                  ONLY=fixed,steady: only those resources
//!                                                  and patterns, e.g. under `perf record`)

use std::time::Instant;

use memres::{
    Arena, Binning, FixedSize, HostHeap, HostVirtual, Pool, PoolConfig, Resource, StreamRef, layout,
};

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
        report("pool", streams, || {
            Box::new(Pool::new(HostHeap, PoolConfig::new().initial_size(64 << 20)).unwrap())
        });
        report("pool_in_place", streams, || {
            let leaf = HostVirtual::new(1 << 30, 64 << 10).unwrap();
            Box::new(leaf.pool_in_place(PoolConfig::new()).unwrap())
        });
        report("arena", streams, || {
            Box::new(Arena::with_size(HostHeap, 64 << 20).unwrap())
        });
        report("fixed", streams, || {
            Box::new(FixedSize::with_block_size(HostHeap, 4096, 1024).unwrap())
        });
        report("binning", streams, || {
            let pool = Pool::new(HostHeap, PoolConfig::new().initial_size(64 << 20)).unwrap();
            Box::new(Binning::new(pool, 8, 16).unwrap())
        });
    }
}

/// Whether ONLY (a comma-separated list of resource and pattern names) lets `name` run.
fn wanted(name: &str) -> bool {
    std::env::var("ONLY").map_or(true, |only| only.split(',').any(|n| n == name))
}

fn report(name: &str, streams: u32, make: impl Fn() -> Box<dyn Dyn>) {
    if !wanted(name) {
        return;
    }
    let only_patterns = std::env::var("ONLY").is_ok_and(|only| {
        only.split(',')
            .any(|n| ["first", "steady", "cross", "seen", "seen-cross"].contains(&n))
    });
    let run = |pattern: &str| !only_patterns || wanted(pattern);
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
trait Dyn {
    fn pair(&self, on: StreamRef<'_>, off: StreamRef<'_>);
}

impl<R: Resource> Dyn for R {
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
