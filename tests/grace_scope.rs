//! Grace periods are scoped to the pool being trimmed (issue 49): `trim` frees the lists
//! of its own pool once no call in that pool can hold them, and never waits for a call
//! in another pool, which may itself be waiting for the trimming thread.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use memres::suballoc::{Pool, PoolConfig};
use memres::upstream::Callback;
use memres::{Host, HostHeap, Resource, StreamRef, SyncResource, layout};

/// A call in pool A waits (inside A's upstream) until the trim of pool B has returned:
/// the trim must not wait for it. Before issue 49 the trim's grace periods waited for
/// every thread inside any pool's call, so this never returned.
#[test]
fn a_call_in_one_pool_that_waits_for_the_trimming_thread_does_not_hold_up_another_pools_trim() {
    let (inside, entered) = mpsc::channel::<()>();
    let (go, gate) = mpsc::channel::<()>();
    let gate = std::sync::Mutex::new((inside, gate));
    let allocate = |l: std::alloc::Layout, _: StreamRef<'_>| {
        let gate = gate.lock().unwrap();
        gate.0.send(()).unwrap();
        // Until the trim of the other pool has returned (or the test gives up on it).
        let _ = gate.1.recv_timeout(Duration::from_secs(30));
        HostHeap::new().allocate_sync(l)
    };
    let deallocate = |p: std::ptr::NonNull<u8>, l: std::alloc::Layout, _: StreamRef<'_>| {
        // SAFETY: the block came from the heap with `l` (the closure above).
        unsafe { HostHeap::new().deallocate_sync(p, l) }
    };
    // SAFETY: the closures hand out and take back heap blocks, host memory, used at once.
    let upstream = unsafe { Callback::<Host>::new(allocate, deallocate) };
    let a = Pool::new(upstream, PoolConfig::new()).unwrap();
    let b = Pool::new(HostHeap::new(), PoolConfig::new()).unwrap();
    // A list in pool B for its trim to free (stream 5's, emptied by the trim's merge).
    let l = layout(4096).unwrap();
    let p = b.allocate(StreamRef::host(5), l).unwrap();
    // SAFETY: allocated just above with `l` on the same stream; unused.
    unsafe { b.deallocate(StreamRef::host(5), p, l) };
    assert_eq!(b.stats().stream_lists, 2);
    std::thread::scope(|s| {
        let caller = s.spawn(|| {
            let p = a.allocate(StreamRef::host(1), l).unwrap();
            // SAFETY: allocated just above with `l` on the same stream; unused.
            unsafe { a.deallocate(StreamRef::host(1), p, l) };
        });
        entered
            .recv_timeout(Duration::from_secs(30))
            .expect("the call in pool A reached its upstream");
        let (trimmed, done) = mpsc::channel();
        let b = &b;
        s.spawn(move || {
            let started = Instant::now();
            b.trim().unwrap();
            trimmed.send(started.elapsed()).unwrap();
        });
        let waited = done.recv_timeout(Duration::from_secs(5));
        go.send(()).unwrap(); // let the call in pool A go on either way
        caller.join().unwrap();
        let took = waited.expect("the trim of pool B waited for a call in pool A");
        println!("trim of pool B beside a call waiting in pool A: {took:?}");
    });
    assert_eq!(b.stats().stream_lists, 1, "the trim freed stream 5's list");
}

/// The same with a call in pool A that takes 20 ms (a slow upstream), over and over:
/// each trim of pool B returns without waiting for one to end (before issue 49 each
/// waited for up to two of them, 40 ms).
#[test]
fn a_slow_call_in_one_pool_does_not_delay_another_pools_trim() {
    let allocate = |l: std::alloc::Layout, _: StreamRef<'_>| {
        std::thread::sleep(Duration::from_millis(20));
        HostHeap::new().allocate_sync(l)
    };
    let deallocate = |p: std::ptr::NonNull<u8>, l: std::alloc::Layout, _: StreamRef<'_>| {
        // SAFETY: the block came from the heap with `l` (the closure above).
        unsafe { HostHeap::new().deallocate_sync(p, l) }
    };
    // SAFETY: the closures hand out and take back heap blocks, host memory, used at once.
    let upstream = unsafe { Callback::<Host>::new(allocate, deallocate) };
    let a = Pool::new(upstream, PoolConfig::new()).unwrap();
    let b = Pool::new(HostHeap::new(), PoolConfig::new()).unwrap();
    let l = layout(4096).unwrap();
    // The process's first grace period registers it for `membarrier` (~20 ms): before
    // the measured ones.
    b.trim().unwrap();
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            // Every allocation grows (and every trim of A below is not run: A only
            // grows), so this thread is inside a 20 ms call nearly all the time.
            let mut held = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                held.push(
                    a.allocate(StreamRef::host(1), layout(4 << 20).unwrap())
                        .unwrap(),
                );
            }
            for p in held {
                // SAFETY: allocated above with this layout on the same stream; unused.
                unsafe { a.deallocate(StreamRef::host(1), p, layout(4 << 20).unwrap()) };
            }
        });
        std::thread::sleep(Duration::from_millis(5));
        let mut times = Vec::new();
        for i in 0..20u32 {
            let p = b.allocate(StreamRef::host(5 + i), l).unwrap();
            // SAFETY: allocated just above with `l` on the same stream; unused.
            unsafe { b.deallocate(StreamRef::host(5 + i), p, l) };
            let started = Instant::now();
            b.trim().unwrap();
            times.push(started.elapsed());
            assert_eq!(
                b.stats().stream_lists,
                1,
                "the trim freed the stream's list"
            );
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        times.sort();
        println!(
            "20 trims of pool B beside 20 ms calls in pool A: median {:?}, slowest {:?}",
            times[10], times[19]
        );
        // A trim that waits for a call in A takes up to 20 ms per grace period (two:
        // up to 40 ms; this thread is inside one nearly all the time); one that does not
        // takes microseconds. A few slow ones may be this thread's scheduling on a loaded
        // machine.
        let slow = times
            .iter()
            .filter(|t| **t >= Duration::from_millis(15))
            .count();
        assert!(
            slow <= 2,
            "{slow} of 20 trims of pool B waited for calls in pool A: {times:?}"
        );
    });
}
