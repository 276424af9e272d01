//! Fault injection: every sub-allocator and adaptor stack over host memory, fed random
//! allocate/free/trim sequences by an upstream that fails at random calls (out of memory,
//! or a refused call). Every failure must come back as an `Err` (never a panic or an
//! abort), the stack must stay usable once the upstream recovers, the counters of
//! `Statistics`, `Limiting` and `Tracking` must stay exact across failures, and after the
//! stack drops the upstream must hold nothing.

mod common;

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::Arc;

use common::faulty::{Fault, Faulty};
use common::{Step, step};
use memres::adaptor::{Limiting, Statistics, Tracking};
use memres::suballoc::{Arena, Binning, FixedSize, Growth, Pool, PoolConfig};
use memres::{Error, Resource, StreamRef, layout, resource::layout_with_alignment};
use proptest::prelude::*;

/// A live block: where, its layout, the stream it was allocated on, and the byte stamped
/// at both its ends.
struct Live {
    ptr: NonNull<u8>,
    layout: Layout,
    stream: u32,
    stamp: u8,
}

/// What the runner needs from a stack besides allocating and freeing.
struct Hooks<'a, R> {
    /// Largest request the stack takes (FixedSize's block size).
    max_size: usize,
    /// Gives free memory back, where the stack can.
    trim: &'a dyn Fn(&R),
    /// Checks the stack's counters against what is live.
    counters: &'a dyn Fn(&R, &[Live]),
}

/// Runs `steps` on `r`, frees everything, then checks that it serves a request once the
/// upstream stops failing. Panics (a proptest failure) on any broken promise.
fn run<R: Resource>(r: &R, faulty: &Faulty, steps: &[Step], hooks: &Hooks<'_, R>) {
    let mut live: Vec<Live> = Vec::new();
    let mut stamp = 0u8;
    for s in steps {
        match *s {
            Step::Allocate {
                stream,
                size,
                align_shift,
            } => {
                let size = size.min(hooks.max_size);
                let l = layout_with_alignment(size, 1 << align_shift).unwrap();
                match r.allocate(StreamRef::host(stream), l) {
                    Ok(ptr) => {
                        assert!(ptr.as_ptr().addr().is_multiple_of(l.align()));
                        stamp = stamp.wrapping_add(1);
                        // SAFETY: a fresh block of `size` (> 0) bytes.
                        unsafe {
                            ptr.as_ptr().write(stamp);
                            ptr.as_ptr().add(size - 1).write(stamp);
                        }
                        live.push(Live {
                            ptr,
                            layout: l,
                            stream,
                            stamp,
                        });
                    }
                    Err(Error::OutOfMemory { requested, .. }) => assert_eq!(requested, size),
                    Err(Error::Unsupported(why)) => assert!(why.contains("injected"), "{why}"),
                    Err(e) => panic!("an upstream failure came back as {e:?}"),
                }
            }
            Step::Free { index, stream } => {
                if !live.is_empty() {
                    let b = live.swap_remove(index % live.len());
                    free(r, b, Some(stream));
                }
            }
            Step::Trim => (hooks.trim)(r),
        }
        (hooks.counters)(r, &live);
    }
    for b in live.drain(..) {
        free(r, b, None);
    }
    (hooks.counters)(r, &live);
    faulty.set_enabled(false);
    let l = layout(hooks.max_size.min(1000)).unwrap();
    let p = r
        .allocate(StreamRef::HOST, l)
        .expect("the stack serves requests again once its upstream does");
    // SAFETY: allocated just above with `l`.
    unsafe { r.deallocate(StreamRef::HOST, p, l) };
    faulty.set_enabled(true);
}

/// Checks `b`'s stamps (another block written over it would have changed them) and
/// frees it on `stream` (or the stream it came from).
fn free<R: Resource>(r: &R, b: Live, stream: Option<u32>) {
    let size = b.layout.size();
    // SAFETY: a live block of `size` bytes, stamped when it was allocated.
    let ends = unsafe { (b.ptr.as_ptr().read(), b.ptr.as_ptr().add(size - 1).read()) };
    assert_eq!(
        ends,
        (b.stamp, b.stamp),
        "a block was overwritten while live"
    );
    let s = StreamRef::host(stream.unwrap_or(b.stream));
    // SAFETY: allocated from `r` with this layout, freed once; the host stream frees
    // are in order with the host.
    unsafe { r.deallocate(s, b.ptr, b.layout) };
}

fn no_trim<R>(_: &R) {}
fn no_counters<R>(_: &R, _: &[Live]) {}

fn live_bytes(live: &[Live]) -> i64 {
    live.iter().map(|b| b.layout.size() as i64).sum()
}

/// Statistics count exactly what is live (failed calls count nothing).
fn statistics_exact<U: Resource>(s: &Statistics<U>, live: &[Live]) {
    assert_eq!(s.bytes().current, live_bytes(live));
    assert_eq!(s.allocations().current, live.len() as i64);
}

/// Limiting counts what is live, each block rounded up to 256 bytes.
fn limiting_exact<U: Resource>(l: &Limiting<U>, live: &[Live]) {
    let rounded: usize = live
        .iter()
        .map(|b| b.layout.size().next_multiple_of(256))
        .sum();
    assert_eq!(l.allocated_bytes(), rounded);
}

/// Tracking knows exactly the live blocks.
fn tracking_exact<U: Resource>(t: &Tracking<U>, live: &[Live]) {
    assert_eq!(t.allocated_bytes() as i64, live_bytes(live));
    assert_eq!(t.outstanding().len(), live.len());
}

fn random_fault() -> impl Strategy<Value = Fault> {
    (any::<u64>(), 2..8u64).prop_map(|(seed, one_in)| Fault::Random { seed, one_in })
}

fn steps() -> impl Strategy<Value = Vec<Step>> {
    prop::collection::vec(step(3, 9), 1..120)
}

const ANY: usize = usize::MAX;

/// Runs the steps on the stack `make` builds over `faulty` (building may fail too), then
/// drops it and checks that the upstream holds nothing.
fn check<R: Resource>(
    faulty: &Arc<Faulty>,
    make: impl FnOnce(&Arc<Faulty>) -> Result<R, Error>,
    steps: &[Step],
    hooks: &Hooks<'_, R>,
) {
    match make(faulty) {
        Ok(r) => run(&r, faulty, steps, hooks),
        Err(Error::OutOfMemory { .. } | Error::Unsupported(_)) => {}
        Err(e) => panic!("building the stack failed with {e:?}"),
    }
    assert_eq!(
        (faulty.live_bytes(), faulty.live_blocks()),
        (0, 0),
        "the stack leaked memory of its upstream"
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn pool(fault in random_fault(), steps in steps(), rmm in any::<bool>()) {
        let faulty = Arc::new(Faulty::new(fault));
        let growth = if rmm { Growth::Rmm } else { Growth::Eighth };
        let config = PoolConfig::new().initial_size(256 << 10).growth(growth);
        let make = |f: &Arc<Faulty>| Pool::new(Arc::clone(f), config);
        let trim = |p: &Pool<Arc<Faulty>>| { let _ = p.trim(); };
        check(&faulty, make, &steps, &Hooks { max_size: ANY, trim: &trim, counters: &no_counters });
    }

    #[test]
    fn capped_pool(fault in random_fault(), steps in steps(), rmm in any::<bool>()) {
        let faulty = Arc::new(Faulty::new(fault));
        let growth = if rmm { Growth::Rmm } else { Growth::Eighth };
        // 4 MiB: room for more than one chunk under either rule.
        let config = PoolConfig::new().maximum_size(4 << 20).growth(growth);
        let make = |f: &Arc<Faulty>| Pool::new(Arc::clone(f), config);
        check(&faulty, make, &steps, &Hooks { max_size: ANY, trim: &no_trim, counters: &no_counters });
    }

    #[test]
    fn arena(fault in random_fault(), steps in steps()) {
        let faulty = Arc::new(Faulty::new(fault));
        let make = |f: &Arc<Faulty>| Arena::with_size(Arc::clone(f), 8 << 20);
        check(&faulty, make, &steps, &Hooks { max_size: ANY, trim: &no_trim, counters: &no_counters });
    }

    #[test]
    fn fixed_size(fault in random_fault(), steps in steps()) {
        let faulty = Arc::new(Faulty::new(fault));
        let make = |f: &Arc<Faulty>| FixedSize::with_block_size(Arc::clone(f), 64 << 10, 4);
        check(&faulty, make, &steps, &Hooks { max_size: 64 << 10, trim: &no_trim, counters: &no_counters });
    }

    #[test]
    fn binning(fault in random_fault(), steps in steps()) {
        let faulty = Arc::new(Faulty::new(fault));
        // Bins of 256 B .. 64 KiB; larger requests go to the upstream directly.
        let make = |f: &Arc<Faulty>| Binning::new(Arc::clone(f), 8, 16);
        check(&faulty, make, &steps, &Hooks { max_size: ANY, trim: &no_trim, counters: &no_counters });
    }

    #[test]
    fn statistics_over_a_pool(fault in random_fault(), steps in steps()) {
        let faulty = Arc::new(Faulty::new(fault));
        let make = |f: &Arc<Faulty>| Pool::new(Arc::clone(f), PoolConfig::new()).map(Statistics::new);
        let trim = |s: &Statistics<Pool<Arc<Faulty>>>| { let _ = s.upstream().trim(); };
        check(&faulty, make, &steps, &Hooks { max_size: ANY, trim: &trim, counters: &statistics_exact });
    }

    #[test]
    fn adaptors_directly_over_the_failing_upstream(fault in random_fault(), steps in steps()) {
        let faulty = Arc::new(Faulty::new(fault));
        check(&faulty, |f| Ok(Statistics::new(Arc::clone(f))), &steps,
            &Hooks { max_size: ANY, trim: &no_trim, counters: &statistics_exact });
        check(&faulty, |f| Ok(Limiting::new(Arc::clone(f), 4 << 20)), &steps,
            &Hooks { max_size: ANY, trim: &no_trim, counters: &limiting_exact });
        check(&faulty, |f| Ok(Tracking::new(Arc::clone(f))), &steps,
            &Hooks { max_size: ANY, trim: &no_trim, counters: &tracking_exact });
    }

    #[test]
    fn limiting_and_tracking_over_a_pool(fault in random_fault(), steps in steps()) {
        let faulty = Arc::new(Faulty::new(fault));
        let make = |f: &Arc<Faulty>| {
            Pool::new(Arc::clone(f), PoolConfig::new()).map(|p| Tracking::new(Limiting::new(p, 3 << 20)))
        };
        let counters = |t: &Tracking<Limiting<Pool<Arc<Faulty>>>>, live: &[Live]| {
            tracking_exact(t, live);
            limiting_exact(t.upstream(), live);
        };
        check(&faulty, make, &steps, &Hooks { max_size: ANY, trim: &no_trim, counters: &counters });
    }
}

/// A failure at each call in turn, under either growth rule: the pool's growths, its
/// fallbacks and its growth after a trim each fail once, and the pool recovers each time.
#[test]
fn each_of_the_first_calls_failing_in_turn() {
    let steps: Vec<Step> = (0..40)
        .flat_map(|i| {
            let alloc = Step::Allocate {
                stream: i % 3,
                size: 1000 << (i % 13),
                align_shift: 8,
            };
            let free = Step::Free {
                index: i as usize * 7,
                stream: (i + 1) % 3,
            };
            if i % 10 == 9 {
                vec![alloc, free, Step::Trim]
            } else {
                vec![alloc.clone(), free, alloc]
            }
        })
        .collect();
    let trim = |s: &Statistics<Pool<Arc<Faulty>>>| {
        let _ = s.upstream().trim();
    };
    let hooks = Hooks {
        max_size: ANY,
        trim: &trim,
        counters: &statistics_exact,
    };
    for growth in [Growth::Eighth, Growth::Rmm] {
        let config = PoolConfig::new().growth(growth);
        let make = |f: &Arc<Faulty>| Pool::new(Arc::clone(f), config).map(Statistics::new);
        // How many calls the steps make when none fails.
        let clean = Arc::new(Faulty::new(Fault::Never));
        check(&clean, make, &steps, &hooks);
        let calls = clean.calls();
        assert!(calls >= 6, "{growth:?}: {calls} calls");
        for at in 1..=calls {
            let faulty = Arc::new(Faulty::new(Fault::At(at)));
            check(&faulty, make, &steps, &hooks);
            assert_eq!(faulty.failures(), 1, "{growth:?}: call {at} failed");
        }
    }
}
