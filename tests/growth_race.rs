//! Threads sharing one stream while the resource grows: a growth must hand the grower its
//! block in the same critical section that adds the memory, or another thread can take
//! it first and the grower reports a false out-of-memory (issue 17). These failed on the
//! code before the fix within a few runs; each runs enough operations to catch it.

mod common;

use common::faulty::{Fault, Faulty};
use memres::suballoc::{FixedSize, Pool, PoolConfig};
use memres::{Resource, StreamRef, layout};

/// `threads` threads on the host stream, started together on a fresh resource from
/// `make`, each allocating `hold` blocks of the sizes `size(thread, i)` gives (so nearly
/// every allocation grows the resource), then freeing them; `rounds` times, each on a new
/// resource. No allocation may fail.
fn hammer<R: Resource + Sync>(
    make: impl Fn() -> R,
    threads: usize,
    rounds: usize,
    hold: usize,
    size: impl Fn(usize, usize) -> usize + Sync,
) {
    for round in 0..rounds {
        let r = &make();
        let start = &std::sync::Barrier::new(threads);
        std::thread::scope(|scope| {
            for t in 0..threads {
                let size = &size;
                scope.spawn(move || {
                    let mut blocks = Vec::with_capacity(hold);
                    start.wait();
                    for i in 0..hold {
                        let l = layout(size(t, i)).unwrap();
                        match r.allocate(StreamRef::HOST, l) {
                            Ok(p) => blocks.push((p, l)),
                            Err(e) => panic!("round {round}, thread {t}, block {i}: {e}"),
                        }
                    }
                    for (p, l) in blocks {
                        // SAFETY: allocated above with `l` on the host stream.
                        unsafe { r.deallocate(StreamRef::HOST, p, l) };
                    }
                });
            }
        });
    }
}

/// A pool over an upstream that refuses single requests above 1 MiB (but never runs out),
/// threads mixing 1 MiB and smaller requests.
#[test]
fn pool_growth_hands_the_grower_its_block() {
    let faulty = Faulty::new(Fault::Above(1 << 20));
    for threads in [4, 8] {
        let make = || Pool::new(&faulty, PoolConfig::new()).unwrap();
        hammer(make, threads, 300, 16, |t, i| {
            if (t + i) % 5 == 0 {
                1 << 20
            } else {
                1000 * (1 + (t * 31 + i * 7) % 200)
            }
        });
        assert_eq!(faulty.live_bytes(), 0);
    }
}

/// FixedSize with one block per chunk: every growth adds exactly one block, which any
/// thread on the stream could otherwise take. Blocks of 2 MiB go through the thread
/// caches, blocks of 8 MiB straight to the stream's lists.
#[test]
fn fixed_size_growth_hands_the_grower_its_block() {
    let faulty = Faulty::new(Fault::Never);
    for block in [2 << 20, 8 << 20] {
        for threads in [4, 8] {
            let make = || FixedSize::with_block_size(&faulty, block, 1).unwrap();
            hammer(make, threads, 300, 16, |_, _| block);
            assert_eq!(faulty.live_bytes(), 0);
        }
    }
}
