//! What one growing allocation of a virtual pool costs as its reservation grows (issue
//! 33, finding 5): over `HostVirtual` reservations of 64 MiB to 1 TiB in 4 KiB granules
//! (16 K to 268 M granules), 2,000 allocations of 12 KiB, each mapping the granules it
//! lacks. Prints microseconds per growing allocation, the best of three rounds.
//!
//!     cargo bench --bench virtual_pool_growth

use std::time::Instant;

use memres::{Resource, StreamRef, VirtualPool, VirtualPoolConfig, layout, upstream::HostVirtual};

const GRANULE: usize = 4096;
const ALLOCATIONS: usize = 2_000;

fn main() {
    println!("reservation,granules,us_per_growing_allocation");
    for reserve in [64usize << 20, 1 << 30, 64 << 30, 1 << 40] {
        let best = (0..3).map(|_| round(reserve)).fold(f64::INFINITY, f64::min);
        println!("{} MiB,{},{best:.2}", reserve >> 20, reserve / GRANULE);
    }
}

/// One round over a fresh pool: microseconds per allocation.
fn round(reserve: usize) -> f64 {
    let leaf = HostVirtual::new(reserve, GRANULE).expect("address space to reserve");
    let pool = VirtualPool::new(leaf, VirtualPoolConfig::new()).expect("a virtual pool");
    let l = layout(3 * GRANULE).unwrap();
    let start = Instant::now();
    let blocks: Vec<_> = (0..ALLOCATIONS)
        .map(|_| {
            pool.allocate(StreamRef::HOST, l)
                .expect("room in the reservation")
        })
        .collect();
    let per = start.elapsed().as_secs_f64() * 1e6 / ALLOCATIONS as f64;
    for p in blocks {
        // SAFETY: allocated above with `l` on the host stream; unused.
        unsafe { pool.deallocate(StreamRef::HOST, p, l) };
    }
    per
}
