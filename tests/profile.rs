//! The scope profiler (`memres::profile`) and the `Profiling` adaptor, on host memory.

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::{Mutex, MutexGuard, PoisonError};

use memres::adaptor::Profiling;
use memres::{HostHeap, ResourceExt, SyncResource, layout, profile};

/// Records and all-threads scopes are process-wide: the tests of this file run one at a
/// time (each also uses names of its own).
fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
}

fn mr() -> Profiling<HostHeap> {
    HostHeap::new().with_profiling()
}

fn alloc(mr: &Profiling<HostHeap>, size: usize) -> (NonNull<u8>, Layout) {
    let l = layout(size).unwrap();
    (mr.allocate_sync(l).unwrap(), l)
}

fn free(mr: &Profiling<HostHeap>, (p, l): (NonNull<u8>, Layout)) {
    // SAFETY: every block passed here came from `alloc` on the same resource.
    unsafe { mr.deallocate_sync(p, l) };
}

fn record(name: &str) -> profile::Record {
    profile::report()
        .get(name)
        .cloned()
        .unwrap_or_else(|| panic!("no record of {name}"))
}

#[test]
fn nested_scopes_count_into_every_enclosing_scope() {
    let _s = serial();
    let mr = mr();
    let kept = {
        let _outer = profile::scope("nest.outer");
        let a = alloc(&mr, 1000);
        let kept = {
            let _inner = profile::scope("nest.inner");
            let b = alloc(&mr, 3000);
            let c = alloc(&mr, 500);
            free(&mr, b);
            free(&mr, c);
            // Still live when both scopes close: retained by both.
            alloc(&mr, 200)
        };
        free(&mr, a);
        kept
    };
    free(&mr, kept);
    let inner = record("nest.inner");
    assert_eq!((inner.calls, inner.allocations, inner.bytes), (1, 3, 3700));
    assert_eq!((inner.peak_bytes, inner.retained_bytes), (3500, 200));
    let outer = record("nest.outer");
    assert_eq!((outer.calls, outer.allocations, outer.bytes), (1, 4, 4700));
    // 1000 live when the inner scope reached 3500.
    assert_eq!((outer.peak_bytes, outer.retained_bytes), (4500, 200));
}

#[test]
fn records_sum_calls_and_keep_the_highest_peak() {
    let _s = serial();
    let mr = mr();
    let mut kept = Vec::new();
    for size in [100, 700, 300] {
        let _s = profile::scope(format!("calls.{}", "step"));
        let a = alloc(&mr, size);
        kept.push(alloc(&mr, 10));
        free(&mr, a);
    }
    let r = record("calls.step");
    assert_eq!((r.calls, r.allocations, r.bytes), (3, 6, 1130));
    assert_eq!((r.peak_bytes, r.retained_bytes), (710, 30));
    kept.into_iter().for_each(|b| free(&mr, b));
}

#[test]
fn freeing_older_memory_takes_a_scope_below_zero() {
    let _s = serial();
    let mr = mr();
    let old = alloc(&mr, 4096);
    {
        let _s = profile::scope("older.free");
        free(&mr, old);
    }
    let r = record("older.free");
    assert_eq!((r.allocations, r.bytes, r.peak_bytes), (0, 0, 0));
    assert_eq!(r.retained_bytes, -4096);
}

#[test]
fn a_failed_allocation_counts_nothing() {
    let _s = serial();
    let mr = HostHeap::new().with_limiting(1024).with_profiling();
    {
        let _s = profile::scope("failed.alloc");
        assert!(mr.allocate_sync(layout(4096).unwrap()).is_err());
    }
    let r = record("failed.alloc");
    assert_eq!(
        (r.calls, r.allocations, r.bytes, r.peak_bytes),
        (1, 0, 0, 0)
    );
}

#[test]
fn a_thread_scope_counts_only_its_own_thread() {
    let _s = serial();
    let mr = mr();
    {
        let _s = profile::scope("thread.own");
        let mine = alloc(&mr, 100);
        std::thread::scope(|s| {
            s.spawn(|| free(&mr, alloc(&mr, 1 << 20)));
        });
        free(&mr, mine);
    }
    let r = record("thread.own");
    assert_eq!((r.allocations, r.bytes, r.peak_bytes), (1, 100, 100));
}

#[test]
fn an_all_threads_scope_counts_every_thread() {
    let _s = serial();
    let mr = mr();
    {
        let _all = profile::scope_all_threads("all.step");
        let mine = alloc(&mr, 100);
        std::thread::scope(|s| {
            s.spawn(|| {
                // Nested in a thread scope of the other thread: both count it.
                let _s = profile::scope("all.worker");
                free(&mr, alloc(&mr, 1 << 20));
            });
        });
        free(&mr, mine);
    }
    let all = record("all.step");
    assert_eq!((all.allocations, all.bytes), (2, 100 + (1 << 20)));
    assert_eq!((all.peak_bytes, all.retained_bytes), (100 + (1 << 20), 0));
    let worker = record("all.worker");
    assert_eq!((worker.allocations, worker.peak_bytes), (1, 1 << 20));
    // Closed: another thread's allocations no longer count.
    std::thread::scope(|s| {
        s.spawn(|| free(&mr, alloc(&mr, 1 << 20)));
    });
    assert_eq!(record("all.step").bytes, 100 + (1 << 20));
}

#[test]
fn scopes_may_close_in_any_order() {
    let _s = serial();
    let mr = mr();
    let first = profile::scope("order.first");
    let second = profile::scope("order.second");
    drop(first);
    // Only the second is open now.
    free(&mr, alloc(&mr, 64));
    drop(second);
    assert_eq!(record("order.first").allocations, 0);
    assert_eq!(record("order.second").allocations, 1);
}

#[test]
fn without_an_open_scope_nothing_is_counted() {
    let _s = serial();
    let mr = mr();
    {
        let _s = profile::scope("idle.before");
    }
    let before = profile::report();
    free(&mr, alloc(&mr, 1 << 16));
    assert_eq!(profile::report(), before);
}

#[test]
fn the_report_lists_the_highest_peak_first_and_prints_a_table() {
    let _s = serial();
    let mr = mr();
    for (name, size) in [
        ("sort.small", 10),
        ("sort.large", 30_000),
        ("sort.mid", 2_000),
    ] {
        let _s = profile::scope(name);
        free(&mr, alloc(&mr, size));
    }
    let report = profile::report();
    let names: Vec<&str> = report
        .records()
        .iter()
        .map(|r| r.name.as_str())
        .filter(|n| n.starts_with("sort."))
        .collect();
    assert_eq!(names, ["sort.large", "sort.mid", "sort.small"]);
    assert!(
        report
            .records()
            .windows(2)
            .all(|w| w[0].peak_bytes >= w[1].peak_bytes)
    );
    let table = report.to_string();
    assert!(table.starts_with("scope"), "{table}");
    assert!(table.contains("sort.large"), "{table}");
}

#[test]
fn reset_forgets_the_records() {
    let _s = serial();
    {
        let _s = profile::scope("reset.me");
    }
    assert!(profile::report().get("reset.me").is_some());
    profile::reset();
    assert!(profile::report().records().is_empty());
}
