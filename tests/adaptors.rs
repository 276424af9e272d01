//! The adaptors: the conformance suite over each, and RMM's adaptor cases, adapted.

#[macro_use]
mod conformance;

use std::alloc::Layout;
use std::cell::Cell;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};

use conformance::Caps;
use memres::adaptor::{
    Aligned, Counter, FailureRetry, Limiting, Member, Route, Router, Statistics, ThreadSafe,
    Tracking,
};
use memres::{
    AnyResource, Error, Has, Host, HostAccessible, HostHeap, Resource, StreamRef, SyncResource,
    layout,
    upstream::{Callback, PinnedHost},
};

conformance_tests!(statistics, Statistics::new(HostHeap::new()), Caps::host());
conformance_tests!(
    limiting,
    Limiting::new(HostHeap::new(), 1 << 40),
    Caps::host()
);
conformance_tests!(
    failure_retry,
    FailureRetry::new(HostHeap::new(), give_up),
    Caps::host()
);
conformance_tests!(thread_safe, ThreadSafe::new(HostHeap::new()), Caps::host());
conformance_tests!(tracking, Tracking::new(HostHeap::new()), Caps::host());
conformance_tests!(
    aligned,
    Aligned::new(HostHeap::new(), 4096, 0).unwrap(),
    Caps::host()
);
conformance_tests!(
    stacked,
    Statistics::new(Limiting::new(ThreadSafe::new(HostHeap::new()), 1 << 40)),
    Caps::host()
);

/// A router's route for the conformance suite: requests of 64 KiB and more go to member
/// 1, those of 4 KiB and more to member 2, the rest to the default member; member 1 is a
/// virtual pool over host memory (a range), member 2 the heap (its blocks recorded).
struct BySize;

/// Member 1's pool or member 2's heap.
type Either = memres::AnyResource<Host>;

impl Route for BySize {
    type Member = Either;

    fn choose(&self, layout: Layout) -> Option<usize> {
        match layout.size() {
            n if n >= 64 << 10 => Some(1),
            n if n >= 4 << 10 => Some(2),
            _ => None,
        }
    }

    fn make(&self, key: usize) -> Result<Member<Either>, Error> {
        if key == 2 {
            return Ok(Member::recorded(memres::AnyResource::new(HostHeap::new())));
        }
        let pool = memres::VirtualPool::new(
            memres::upstream::HostVirtual::new(4 << 30, 64 << 10)?,
            memres::VirtualPoolConfig::new(),
        )?;
        let (base, len) = memres::upstream::GrowInPlace::reservation(pool.upstream());
        // SAFETY: the pool's blocks lie in its reservation, which no other member's do.
        Ok(unsafe { Member::in_range(memres::AnyResource::new(pool), base, len) })
    }
}

conformance_tests!(
    router,
    Router::new(memres::AnyResource::<Host>::new(HostHeap::new()), BySize),
    Caps::host()
);

/// A failure callback that never retries (a fn item, so every instance has one type).
fn give_up(_: usize) -> bool {
    false
}

// Adaptors keep their upstream's properties, whatever they are.
static_assertions::assert_impl_all!(Statistics<PinnedHost>: Has<HostAccessible>, Has<memres::HostDevice>);
static_assertions::assert_impl_all!(Limiting<Statistics<PinnedHost>>: Has<memres::HostDevice>);
static_assertions::assert_not_impl_any!(Statistics<memres::Cuda>: Has<HostAccessible>);

fn alloc<R: SyncResource>(r: &R, size: usize) -> (NonNull<u8>, Layout) {
    let l = layout(size).unwrap();
    (r.allocate_sync(l).unwrap(), l)
}

fn free<R: SyncResource>(r: &R, (p, l): (NonNull<u8>, Layout)) {
    // SAFETY: every block the tests free came from `alloc` on the same resource.
    unsafe { r.deallocate_sync(p, l) }
}

fn counter(current: i64, peak: i64, total: i64) -> Counter {
    Counter {
        current,
        peak,
        total,
    }
}

#[test]
fn statistics_all_freed() {
    let s = Statistics::new(HostHeap::new());
    let blocks: Vec<_> = (1..=10).map(|i| alloc(&s, i * 100)).collect();
    assert_eq!(s.bytes(), counter(5500, 5500, 5500));
    assert_eq!(s.allocations(), counter(10, 10, 10));
    blocks.into_iter().for_each(|b| free(&s, b));
    assert_eq!(s.bytes(), counter(0, 5500, 5500));
    assert_eq!(s.allocations(), counter(0, 10, 10));
}

#[test]
fn statistics_peak_after_freeing_half_then_allocating_more() {
    let s = Statistics::new(HostHeap::new());
    let mut blocks: Vec<_> = (0..10).map(|_| alloc(&s, 1000)).collect();
    for b in blocks.drain(..5) {
        free(&s, b);
    }
    assert_eq!(s.bytes(), counter(5000, 10_000, 10_000));
    blocks.extend((0..3).map(|_| alloc(&s, 1000)));
    assert_eq!(s.bytes(), counter(8000, 10_000, 13_000));
    blocks.extend((0..4).map(|_| alloc(&s, 1000)));
    assert_eq!(s.bytes(), counter(12_000, 12_000, 17_000));
    blocks.into_iter().for_each(|b| free(&s, b));
}

#[test]
fn statistics_nested_frames_propagate_the_peak() {
    let s = Statistics::new(HostHeap::new());
    let outer = alloc(&s, 1000);
    let below = s.push_counters();
    assert_eq!(below.bytes, counter(1000, 1000, 1000));
    let inner: Vec<_> = (0..3).map(|_| alloc(&s, 500)).collect();
    assert_eq!(s.bytes(), counter(1500, 1500, 1500));
    inner.into_iter().for_each(|b| free(&s, b));
    let popped = s.pop_counters().unwrap();
    assert_eq!(popped.bytes, counter(0, 1500, 1500));
    assert_eq!(popped.allocations, counter(0, 3, 3));
    // parent.peak = max(parent.peak, parent.current + child.peak) = max(1000, 2500)
    assert_eq!(s.bytes(), counter(1000, 2500, 2500));
    assert_eq!(s.allocations(), counter(1, 4, 4));
    free(&s, outer);
    assert!(matches!(s.pop_counters(), Err(Error::InvalidArgument(_))));
}

#[test]
fn statistics_inner_counters_go_negative_when_older_memory_is_freed() {
    let s = Statistics::new(HostHeap::new());
    let old = alloc(&s, 2048);
    s.push_counters();
    free(&s, old);
    assert_eq!(s.bytes(), counter(-2048, 0, 0));
    assert_eq!(s.allocations().current, -1);
    s.pop_counters().unwrap();
    assert_eq!(s.bytes(), counter(0, 2048, 2048));
}

#[test]
fn statistics_count_zero_bytes_and_not_failures() {
    let s = Statistics::new(HostHeap::new());
    let z = alloc(&s, 0);
    assert_eq!(s.allocations(), counter(1, 1, 1));
    assert_eq!(s.bytes(), counter(0, 0, 0));
    free(&s, z);
    // `black_box`: an allocation whose pointer is never used may be elided by the
    // optimiser, and with it the failure (the adaptor inlines whole into this caller).
    let huge = std::hint::black_box(s.allocate_sync(layout(1 << 50).unwrap()));
    assert!(huge.is_err());
    assert_eq!(s.allocations(), counter(0, 1, 1));
}

#[test]
fn statistics_totals_from_many_threads() {
    let s = Statistics::new(HostHeap::new());
    std::thread::scope(|scope| {
        for t in 0..8 {
            let s = &s;
            scope.spawn(move || {
                for i in 0..1000 {
                    let b = alloc(s, 256 * (1 + (t + i) % 4));
                    free(s, b);
                }
            });
        }
    });
    let bytes = s.bytes();
    assert_eq!(bytes.current, 0);
    assert_eq!(bytes.total, 8 * (256 * (1 + 2 + 3 + 4) * 250));
    assert!(bytes.peak >= 256 && bytes.peak <= 8 * 1024, "{bytes:?}");
    assert_eq!(
        s.allocations(),
        Counter {
            current: 0,
            total: 8000,
            ..s.allocations()
        }
    );
}

/// Threads that run one after another (each beyond the 64 operations after which a
/// thread publishes its counts, and each gone before the next starts) give an exact peak.
#[test]
fn statistics_threads_one_after_another_give_the_exact_peak() {
    let s = Statistics::new(HostHeap::new());
    let s = std::sync::Arc::new(s);
    for t in 0..4usize {
        let s = s.clone();
        // Joined (not scoped): a thread publishes its last counts as it exits, which
        // `join` waits for.
        std::thread::spawn(move || {
            let blocks: Vec<_> = (0..100)
                .map(|i| alloc(&*s, 256 * (1 + (i + t) % 3)))
                .collect();
            blocks.into_iter().for_each(|b| free(&*s, b));
        })
        .join()
        .unwrap();
    }
    let bytes = s.bytes();
    // Each thread's 100 blocks: 34 + 33 + 33 of 256, 512 and 768 bytes in some order.
    let peaks: Vec<i64> = (0..4usize)
        .map(|t| (0..100).map(|i| 256 * (1 + (i + t) % 3) as i64).sum())
        .collect();
    assert_eq!(bytes.current, 0);
    assert_eq!(bytes.peak, *peaks.iter().max().unwrap());
    assert_eq!(bytes.total, peaks.iter().sum::<i64>());
    assert_eq!(s.allocations(), counter(0, 100, 400));
}

/// Memory allocated on one thread and freed on another (a thread's own count goes up
/// for ever, another's down for ever) still balances, with the peak of what was live, as
/// soon as the scope that ran the threads ends, although a scoped thread's own exit (which
/// folds its counts into the shared ones) may still be under way then (rust-lang/rust
/// issue 116179). A thousand times, with two more threads spinning to vary the timing.
#[test]
fn statistics_count_memory_freed_by_another_thread() {
    use std::sync::atomic::{AtomicBool, Ordering};
    /// Stops the spinning threads when the checking loop ends, also by a failed assertion
    /// (else the scope would wait for them for ever).
    struct Stop<'a>(&'a AtomicBool);
    impl Drop for Stop<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Relaxed);
        }
    }
    let stop = AtomicBool::new(false);
    std::thread::scope(|outer| {
        for _ in 0..2 {
            outer.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    std::thread::yield_now();
                }
            });
        }
        let _stop = Stop(&stop);
        for round in 0..1000 {
            let s = Statistics::new(HostHeap::new());
            let (tx, rx) = std::sync::mpsc::sync_channel::<(usize, usize)>(1);
            std::thread::scope(|scope| {
                scope.spawn(|| {
                    for _ in 0..100 {
                        let (p, l) = alloc(&s, 1024);
                        tx.send((p.as_ptr() as usize, l.size())).unwrap();
                    }
                    drop(tx);
                });
                scope.spawn(|| {
                    for (p, size) in rx {
                        let p = NonNull::new(p as *mut u8).unwrap();
                        free(&s, (p, layout(size).unwrap()));
                    }
                });
            });
            let bytes = s.bytes();
            assert_eq!(
                (bytes.current, bytes.total),
                (0, 100 * 1024),
                "round {round}"
            );
            // At most the channel's one slot, one block in each thread's hands and what
            // the threads had not published when they met (fewer than 64 allocations,
            // and up to 126 frees, each) were live at once.
            assert!(
                bytes.peak >= 1024 && bytes.peak <= 1024 * (3 + 2 * 64),
                "round {round}: {bytes:?}"
            );
            assert_eq!(s.allocations().current, 0, "round {round}");
            assert_eq!(s.allocations().total, 100, "round {round}");
        }
    });
}

/// `Limiting`'s count is exact once scoped threads are joined, whether or not their exit
/// (which gives their reserves back) is still under way.
#[test]
fn limiting_counts_exactly_after_a_scope_ends() {
    for round in 0..1000 {
        let lim = Limiting::new(HostHeap::new(), 64 << 20);
        let kept = std::sync::Mutex::new(Vec::new());
        std::thread::scope(|scope| {
            for t in 0..4 {
                let (lim, kept) = (&lim, &kept);
                scope.spawn(move || {
                    let (p, l) = alloc(lim, 4096 * (t + 1));
                    free(lim, alloc(lim, 1000));
                    kept.lock().unwrap().push((p.as_ptr() as usize, l));
                });
            }
        });
        // Read as the threads exit: each read must see every thread's block exactly once.
        for _ in 0..20 {
            assert_eq!(
                lim.allocated_bytes(),
                4096 * (1 + 2 + 3 + 4),
                "round {round}"
            );
        }
        for (p, l) in kept.into_inner().unwrap() {
            free(&lim, (NonNull::new(p as *mut u8).unwrap(), l));
        }
        assert_eq!(lim.allocated_bytes(), 0, "round {round}");
    }
}

/// A thread that used many adaptors, since dropped, keeps working with new ones (its
/// list of slots drops those of adaptors that are gone); valgrind in CI checks that
/// nothing leaks.
#[test]
fn statistics_many_short_lived_adaptors_on_one_thread() {
    for i in 0..100 {
        let s = Statistics::new(HostHeap::new());
        let b = alloc(&s, 100 + i);
        assert_eq!(
            s.bytes(),
            counter(100 + i as i64, 100 + i as i64, 100 + i as i64)
        );
        free(&s, b);
    }
}

#[test]
fn limiting_limit_plus_one_fails_and_changes_nothing() {
    let lim = Limiting::new(HostHeap::new(), 4096);
    let a = alloc(&lim, 4096);
    assert_eq!(lim.allocated_bytes(), 4096);
    match lim.allocate_sync(layout(1).unwrap()) {
        Err(e @ Error::OutOfMemory { .. }) => {
            assert_eq!(e, Error::over_limit(1, 4096));
            assert!(e.to_string().contains("limit of 4.0 KiB"), "{e}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(lim.allocated_bytes(), 4096);
    free(&lim, a);
    let exact = alloc(&lim, 4096);
    assert_eq!(lim.allocated_bytes(), 4096, "an exact fit after frees");
    free(&lim, exact);
    assert_eq!(lim.allocated_bytes(), 0);
    assert!(matches!(
        Limiting::new(HostHeap::new(), 4096).allocate_sync(layout(4097).unwrap()),
        Err(Error::OutOfMemory {
            limit: Some(4096),
            ..
        })
    ));
}

/// Threads that use a `Limiting` one after another leave nothing reserved behind (each
/// gives its reserve back as it exits), so the whole limit is free again.
#[test]
fn limiting_threads_one_after_another_give_their_reserves_back() {
    let lim = std::sync::Arc::new(Limiting::new(HostHeap::new(), 1 << 30));
    for t in 0..4usize {
        let lim = lim.clone();
        std::thread::spawn(move || {
            let blocks: Vec<_> = (0..50).map(|i| alloc(&*lim, 1000 * (1 + i + t))).collect();
            assert!(lim.allocated_bytes() > 0);
            blocks.into_iter().for_each(|b| free(&*lim, b));
        })
        .join()
        .unwrap();
    }
    assert_eq!(lim.allocated_bytes(), 0);
    let all = alloc(&*lim, 1 << 30);
    assert_eq!(lim.allocated_bytes(), 1 << 30);
    free(&*lim, all);
}

/// Under concurrency the limit is never exceeded: what the threads hold at once (counted
/// after each allocation succeeds and before each free) stays within it.
#[test]
fn limiting_many_threads_never_pass_the_limit() {
    const LIMIT: usize = 64 << 20;
    let lim = Limiting::new(HostHeap::new(), LIMIT);
    let held = AtomicUsize::new(0);
    let refused = AtomicUsize::new(0);
    std::thread::scope(|scope| {
        for t in 0..4u64 {
            let (lim, held, refused) = (&lim, &held, &refused);
            scope.spawn(move || {
                let mut state = t;
                let mut live = Vec::new();
                for _ in 0..2000 {
                    let r = splitmix(&mut state);
                    if r.is_multiple_of(2) || live.is_empty() {
                        let size = 256 + (r >> 8) as usize % (8 << 20);
                        match lim.allocate_sync(layout(size).unwrap()) {
                            Ok(p) => {
                                let now =
                                    held.fetch_add(size.next_multiple_of(256), Ordering::SeqCst);
                                assert!(now + size <= LIMIT, "{now} + {size} held");
                                live.push((p, layout(size).unwrap()));
                            }
                            Err(Error::OutOfMemory { .. }) => {
                                refused.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(e) => panic!("{e}"),
                        }
                    } else {
                        let (p, l) = live.swap_remove((r >> 8) as usize % live.len());
                        held.fetch_sub(l.size().next_multiple_of(256), Ordering::SeqCst);
                        free(lim, (p, l));
                    }
                }
                for (p, l) in live {
                    held.fetch_sub(l.size().next_multiple_of(256), Ordering::SeqCst);
                    free(lim, (p, l));
                }
            });
        }
    });
    assert!(refused.load(Ordering::Relaxed) > 0, "the limit was reached");
    assert_eq!(held.load(Ordering::Relaxed), 0);
}

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[test]
fn limiting_rounds_like_rmm() {
    let lim = Limiting::new(HostHeap::new(), 1 << 20);
    let a = alloc(&lim, 1);
    assert_eq!(lim.allocated_bytes(), 256);
    let l = memres::resource::layout_with_alignment(10, 4096).unwrap();
    let b = lim.allocate_sync(l).unwrap();
    assert_eq!(lim.allocated_bytes(), 256 + 4096);
    free(&lim, a);
    free(&lim, (b, l));
    assert_eq!(lim.allocated_bytes(), 0);
}

#[test]
fn limiting_an_inner_limit_under_an_outer_one() {
    let both = Limiting::new(Limiting::new(HostHeap::new(), 1024), 4096);
    let a = alloc(&both, 1024);
    assert!(matches!(
        both.allocate_sync(layout(512).unwrap()),
        Err(Error::OutOfMemory {
            limit: Some(1024),
            ..
        })
    ));
    assert_eq!(both.allocated_bytes(), 1024, "the outer count rolled back");
    assert_eq!(both.upstream().allocated_bytes(), 1024);
    free(&both, a);
    assert_eq!(
        (both.allocated_bytes(), both.upstream().allocated_bytes()),
        (0, 0)
    );
}

#[test]
fn limiting_rolls_back_when_the_upstream_fails() {
    let allocate = |_: Layout, _: StreamRef<'_>| Err(Error::out_of_memory(1));
    // SAFETY: it never hands out memory.
    let failing = unsafe { Callback::<Host>::new(allocate, |_, _, _| {}) };
    let lim = Limiting::new(failing, 1 << 20);
    assert!(lim.allocate_sync(layout(1000).unwrap()).is_err());
    assert_eq!(lim.allocated_bytes(), 0);
}

#[test]
fn failure_retry_retries_then_gives_up_and_passes_other_errors() {
    let calls = AtomicUsize::new(0);
    let retry = FailureRetry::new(Limiting::new(HostHeap::new(), 1024), |bytes| {
        assert_eq!(bytes, 2048);
        calls.fetch_add(1, Ordering::Relaxed) == 0
    });
    assert!(matches!(
        retry.allocate(StreamRef::HOST, layout(2048).unwrap()),
        Err(Error::OutOfMemory { .. })
    ));
    assert_eq!(
        calls.load(Ordering::Relaxed),
        2,
        "one retry, then the error"
    );

    // A retry that frees what blocks the request succeeds.
    let lim = Limiting::new(HostHeap::new(), 1024);
    let held = std::sync::Mutex::new(Some(alloc(&lim, 1024)));
    let retry = FailureRetry::new(&lim, |_| match held.lock().unwrap().take() {
        Some(b) => {
            free(&lim, b);
            true
        }
        None => false,
    });
    let got = alloc(&retry, 512);
    free(&retry, got);

    // Other errors are not retried.
    let asked = AtomicUsize::new(0);
    let allocate = |_: Layout, _: StreamRef<'_>| Err(Error::invalid_argument("no"));
    // SAFETY: it never hands out memory.
    let refusing = unsafe { Callback::<Host>::new(allocate, |_, _, _| {}) };
    let retry = FailureRetry::new(refusing, |_| {
        asked.fetch_add(1, Ordering::Relaxed);
        true
    });
    assert!(matches!(
        retry.allocate_sync(layout(8).unwrap()),
        Err(Error::InvalidArgument(_))
    ));
    assert_eq!(asked.load(Ordering::Relaxed), 0);
}

/// Counts in a `Cell`: `Send` but not `Sync`.
#[derive(PartialEq)]
struct CellCounting {
    calls: Cell<usize>,
}

// SAFETY: blocks come from the heap unchanged.
unsafe impl SyncResource for CellCounting {
    type Properties = Host;
    fn allocate_sync(&self, l: Layout) -> Result<NonNull<u8>, Error> {
        self.calls.set(self.calls.get() + 1);
        HostHeap.allocate_sync(l)
    }
    unsafe fn deallocate_sync(&self, p: NonNull<u8>, l: Layout) {
        // SAFETY: forwards the caller's promise.
        unsafe { HostHeap.deallocate_sync(p, l) }
    }
}

// SAFETY: as above.
unsafe impl Resource for CellCounting {
    fn allocate(&self, _: StreamRef<'_>, l: Layout) -> Result<NonNull<u8>, Error> {
        self.allocate_sync(l)
    }
    unsafe fn deallocate(&self, _: StreamRef<'_>, p: NonNull<u8>, l: Layout) {
        // SAFETY: forwards the caller's promise.
        unsafe { self.deallocate_sync(p, l) }
    }
}

static_assertions::assert_not_impl_any!(CellCounting: Sync);
static_assertions::assert_impl_all!(ThreadSafe<CellCounting>: Sync, Send);

#[test]
fn thread_safe_shares_a_resource_that_is_not_sync() {
    let shared = ThreadSafe::new(CellCounting {
        calls: Cell::new(0),
    });
    conformance::four_threads(&shared, Caps::host());
    conformance::cross_thread_free(&shared, Caps::host());
    assert!(shared.lock().calls.get() > 1000);
    let any: AnyResource<Host> = AnyResource::new(shared);
    let b = alloc(&any, 100);
    free(&any, b);
    let (a, b) = (
        ThreadSafe::new(HostHeap::new()),
        ThreadSafe::new(HostHeap::new()),
    );
    // Two threads comparing in opposite orders at once must not deadlock.
    std::thread::scope(|s| {
        s.spawn(|| (0..10_000).for_each(|_| assert!(a == b)));
        s.spawn(|| (0..10_000).for_each(|_| assert!(b == a)));
    });
}

#[test]
fn aligned_rejects_bad_alignments_and_passes_small_requests_through() {
    for bad in [0, 100, 128, 3000] {
        assert!(matches!(
            Aligned::new(HostHeap::new(), bad, 0),
            Err(Error::InvalidArgument(_))
        ));
    }
    let seen = std::sync::Mutex::new(Vec::new());
    let allocate = |l: Layout, _: StreamRef<'_>| {
        seen.lock().unwrap().push((l.size(), l.align()));
        HostHeap.allocate_sync(l)
    };
    // SAFETY: `Callback` passes back only blocks from `allocate`, from the heap.
    let deallocate =
        |p: NonNull<u8>, l: Layout, _: StreamRef<'_>| unsafe { HostHeap.deallocate_sync(p, l) };
    // SAFETY: heap memory, usable at once on any stream.
    let up = unsafe { Callback::<Host>::new(allocate, deallocate) };
    let a = Aligned::new(&up, 4096, 1 << 16).unwrap();
    let small = alloc(&a, 1000); // below the threshold: straight through
    let big = alloc(&a, 1 << 16); // at the threshold: realigned
    assert_eq!((big.0.as_ptr() as usize) % 4096, 0);
    assert_eq!(
        *seen.lock().unwrap(),
        [(1000, 256), ((1 << 16) + 4096 - 256, 256)]
    );
    free(&a, small);
    free(&a, big);
    // At the default alignment nothing is padded, whatever the size.
    let plain = Aligned::new(&up, 256, 0).unwrap();
    let b = alloc(&plain, 1 << 20);
    free(&plain, b);
    assert_eq!(seen.lock().unwrap().last(), Some(&(1 << 20, 256)));
}

#[test]
fn aligned_realigns_a_crafted_upstream_address_and_frees_the_original() {
    // An upstream that hands out blocks 256-aligned but never 4096-aligned.
    let freed = std::sync::Mutex::new(Vec::new());
    let allocate = |l: Layout, _: StreamRef<'_>| {
        let wide = Layout::from_size_align(l.size() + 4096, 4096).unwrap();
        let p = HostHeap.allocate_sync(wide)?;
        // SAFETY: `wide` has 4096 more bytes than `l`, so `p + 256` is in bounds.
        Ok(unsafe { p.add(256) })
    };
    let deallocate = |p: NonNull<u8>, l: Layout, _: StreamRef<'_>| {
        freed.lock().unwrap().push(p.as_ptr() as usize);
        let wide = Layout::from_size_align(l.size() + 4096, 4096).unwrap();
        // SAFETY: undoes `allocate`: `p - 256` came from the heap with `wide`.
        unsafe { HostHeap.deallocate_sync(p.sub(256), wide) }
    };
    // SAFETY: heap memory, usable at once on any stream; blocks stay inside their
    // heap allocation.
    let odd = unsafe { Callback::<Host>::new(allocate, deallocate) };
    let a = Aligned::new(&odd, 4096, 0).unwrap();
    let l = layout(5000).unwrap();
    let p = a.allocate(StreamRef::HOST, l).unwrap();
    assert_eq!(p.as_ptr() as usize % 4096, 0, "realigned");
    // Honoured, too: a per-call alignment above the adaptor's own.
    let l2 = memres::resource::layout_with_alignment(10, 1 << 14).unwrap();
    let q = a.allocate_sync(l2).unwrap();
    assert_eq!(q.as_ptr() as usize % (1 << 14), 0);
    // SAFETY: both allocated above with their layouts.
    unsafe {
        a.deallocate(StreamRef::HOST, p, l);
        a.deallocate_sync(q, l2);
    }
    let freed = freed.lock().unwrap();
    assert_eq!(freed.len(), 2);
    assert!(
        freed.iter().all(|&f| f % 4096 == 256),
        "the originals went back: {freed:?}"
    );
}

#[test]
fn tracking_reports_what_is_left_with_and_without_stacks() {
    let t = Tracking::new(HostHeap::new());
    let a = alloc(&t, 1000);
    let b = alloc(&t, 24);
    let z = alloc(&t, 0);
    let left = t.outstanding();
    assert_eq!(left.len(), 2, "zero-byte allocations are not tracked");
    assert_eq!(t.allocated_bytes(), 1024);
    assert!(left.iter().all(|o| o.stack.is_none()));
    let report = t.report();
    assert!(
        report.contains(&format!("{:#x}: 1000 B", a.0.as_ptr() as usize)),
        "{report}"
    );
    assert!(
        report.contains(&format!("{:#x}: 24 B", b.0.as_ptr() as usize)),
        "{report}"
    );
    free(&t, a);
    free(&t, b);
    free(&t, z);
    assert!(t.outstanding().is_empty() && t.report().is_empty());

    let s = Tracking::with_stacks(HostHeap::new());
    let c = alloc(&s, 64);
    let left = s.outstanding();
    let stack = left[0].stack.as_deref().expect("a captured stack");
    assert!(stack.lines().count() > 3, "a real call stack: {stack}");
    // Frame names need symbols, which the GPU bundle strips: check them where present.
    if !stack.contains("<unknown>") {
        assert!(stack.contains("tracking_reports_what_is_left"), "{stack}");
    }
    assert!(s.report().contains(stack));
    free(&s, c);
}

#[test]
fn tracking_refuses_a_double_free_and_frees_a_reused_address_normally() {
    let tracked = Tracking::new(Statistics::new(HostHeap::new()));
    let l = layout(4096).unwrap();
    let p = tracked.allocate_sync(l).unwrap();
    // SAFETY: allocated above with `l`. The second free is the bug under test: Tracking
    // must keep it from the heap (else this test would corrupt it).
    unsafe {
        tracked.deallocate_sync(p, l);
        tracked.deallocate_sync(p, l);
    }
    let counts = tracked.upstream().snapshot().allocations;
    assert_eq!(
        (counts.current, counts.total),
        (0, 1),
        "the upstream saw one free"
    );
    // Handed out again (the heap may reuse the address), the block frees as usual.
    let q = tracked.allocate_sync(l).unwrap();
    // SAFETY: allocated just above with `l`.
    unsafe { tracked.deallocate_sync(q, l) };
    let counts = tracked.upstream().snapshot().allocations;
    assert_eq!((counts.current, counts.total), (0, 2));
    assert!(tracked.outstanding().is_empty());
}

#[test]
fn tracking_survives_untracked_and_wrong_size_frees() {
    let t = Tracking::new(HostHeap::new());
    // Memory from before tracking (the heap is the same): reported, freed, no panic.
    let kept = alloc(&t, 64);
    let outside = alloc(&HostHeap, 512);
    free(&t, outside);
    assert_eq!(t.allocated_bytes(), 64, "the record is untouched");
    free(&t, kept);
    // A wrong size: the record is cleared and the allocated layout goes upstream.
    let freed = std::sync::Mutex::new(Vec::new());
    let allocate = |l: Layout, _: StreamRef<'_>| HostHeap.allocate_sync(l);
    let deallocate = |p: NonNull<u8>, l: Layout, _: StreamRef<'_>| {
        freed.lock().unwrap().push((l.size(), l.align()));
        // SAFETY: `Callback` passes back blocks from `allocate`; Tracking corrects the
        // layout to the allocated one, which the assertion below checks.
        unsafe { HostHeap.deallocate_sync(p, l) }
    };
    // SAFETY: heap memory, usable at once on any stream.
    let recording = unsafe { Callback::<Host>::new(allocate, deallocate) };
    let t = Tracking::new(&recording);
    let l = layout(2048).unwrap();
    let p = t.allocate_sync(l).unwrap();
    // SAFETY: `p` came from `t`; the size is wrong on purpose, and Tracking corrects it.
    unsafe { t.deallocate_sync(p, layout(100).unwrap()) };
    assert_eq!(
        *freed.lock().unwrap(),
        [(2048, 256)],
        "the allocated layout went upstream"
    );
    assert_eq!(t.allocated_bytes(), 0);
    // A tracked block freed as zero bytes does not leak either.
    let p = t.allocate_sync(l).unwrap();
    // SAFETY: as above.
    unsafe { t.deallocate_sync(p, Layout::from_size_align(0, 256).unwrap()) };
    assert_eq!(freed.lock().unwrap().last(), Some(&(2048, 256)));
    assert!(t.outstanding().is_empty());
}

/// Threads allocating and freeing at once (the record is sharded by address): every
/// block freed leaves the record, every block kept is in it once, with its size, and the
/// snapshot is sorted by address.
#[test]
fn tracking_from_many_threads_keeps_exactly_the_live_blocks() {
    let t = Tracking::new(HostHeap::new());
    let kept: Vec<Vec<(usize, usize)>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..8)
            .map(|thread| {
                let t = &t;
                scope.spawn(move || {
                    let mut kept = Vec::new();
                    for i in 0..500 {
                        let size = 64 + 8 * (thread * 500 + i);
                        let block = alloc(t, size);
                        if i % 2 == 0 {
                            free(t, block);
                        } else {
                            kept.push((block.0.as_ptr() as usize, size));
                        }
                    }
                    kept
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut expected: Vec<(usize, usize)> = kept.into_iter().flatten().collect();
    expected.sort();
    let outstanding = t.outstanding();
    let got: Vec<(usize, usize)> = outstanding.iter().map(|o| (o.address, o.size)).collect();
    assert_eq!(got, expected);
    assert_eq!(
        t.allocated_bytes(),
        expected.iter().map(|&(_, size)| size).sum::<usize>()
    );
    for (address, size) in expected {
        let p = NonNull::new(address as *mut u8).unwrap();
        free(&t, (p, layout(size).unwrap()));
    }
    assert!(t.outstanding().is_empty());
}

#[test]
fn the_builder_reads_top_down_and_builds_the_nested_types() {
    use memres::ResourceExt;
    let stack: Statistics<Limiting<Tracking<HostHeap>>> = HostHeap::new()
        .with_tracking(false)
        .with_limiting(1 << 20)
        .with_statistics();
    let b = alloc(&stack, 1000);
    assert_eq!(stack.bytes().current, 1000);
    assert_eq!(stack.upstream().allocated_bytes(), 1024);
    assert_eq!(stack.upstream().upstream().outstanding().len(), 1);
    free(&stack, b);
    let other = HostHeap::new()
        .with_aligned(4096, 0)
        .unwrap()
        .with_failure_retry(give_up)
        .with_thread_safe();
    let c = alloc(&other, 10);
    assert_eq!(c.0.as_ptr() as usize % 4096, 0);
    free(&other, c);
}

#[test]
fn limiting_a_free_through_an_equal_adaptor_does_not_wrap_the_count() {
    let (a, b) = (
        Limiting::new(HostHeap::new(), 4096),
        Limiting::new(HostHeap::new(), 4096),
    );
    assert!(a == b, "equal upstreams: each may free the other's memory");
    let block = alloc(&a, 1024);
    free(&b, block);
    assert_eq!(
        b.allocated_bytes(),
        0,
        "saturates at zero instead of wrapping"
    );
    assert_eq!(
        a.allocated_bytes(),
        1024,
        "the allocating adaptor still counts it"
    );
    let again = alloc(&b, 4096);
    free(&b, again);
}

/// A recipe of shipped layers is a value applied to several stacks: each gets the
/// adaptors in order (the limit below the statistics), the same types the builder
/// methods give, and the adaptors work (the limit refuses, the statistics count).
#[test]
fn a_recipe_of_layers_builds_the_same_stack_each_time() {
    use memres::adaptor::{Guard, Limiting, Statistics, Tracking};
    use memres::layer::{GuardLayer, LimitingLayer, StatisticsLayer, TrackingLayer};
    use memres::{HostHeap, ResourceExt, SyncResource, layout};

    let recipe = (LimitingLayer::new(4096), StatisticsLayer);
    for _ in 0..2 {
        let stack: Statistics<Limiting<HostHeap>> = HostHeap::new().with(recipe);
        let l = layout(3000).unwrap();
        let p = stack.allocate_sync(l).unwrap();
        assert!(
            matches!(
                stack.allocate_sync(l),
                Err(memres::Error::OutOfMemory { .. })
            ),
            "the limit is below the statistics"
        );
        assert_eq!(stack.bytes().current, 3000);
        // SAFETY: allocated above with `l`, unused.
        unsafe { stack.deallocate_sync(p, l) };
        assert_eq!(stack.bytes().current, 0);
    }
    let _: Guard<Tracking<HostHeap>> = HostHeap::new().with((TrackingLayer::new(), GuardLayer));
}
