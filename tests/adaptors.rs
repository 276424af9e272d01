//! The adaptors: the conformance suite over each, and RMM's adaptor cases, adapted.

#[macro_use]
mod conformance;

use std::alloc::Layout;
use std::cell::Cell;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};

use conformance::Caps;
use memres::adaptor::{Counter, FailureRetry, Limiting, Statistics, ThreadSafe};
use memres::{
    AnyResource, Callback, Error, Has, Host, HostAccessible, HostHeap, PinnedHost, Resource,
    StreamRef, SyncResource, layout,
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
conformance_tests!(
    stacked,
    Statistics::new(Limiting::new(ThreadSafe::new(HostHeap::new()), 1 << 40)),
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
    assert!(s.allocate_sync(layout(1 << 50).unwrap()).is_err());
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

#[test]
fn limiting_rounds_like_rmm() {
    let lim = Limiting::new(HostHeap::new(), 1 << 20);
    let a = alloc(&lim, 1);
    assert_eq!(lim.allocated_bytes(), 256);
    let l = memres::layout_with_alignment(10, 4096).unwrap();
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
