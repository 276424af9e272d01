//! Reliability under thread and stream patterns that once went wrong (issue 33): each test
//! would hang, grow without bound or fail before its fix. Tests that could hang run their
//! work on other threads under a watchdog, so a hang fails the test instead of CI.

use std::sync::mpsc;
use std::time::Duration;

mod common;

use common::CoalescingPool;
use memres::adaptor::Limiting;
use memres::suballoc::{
    Arena, Binning, FixedSize, Pool, PoolConfig, VirtualPool, VirtualPoolConfig,
};
use memres::{HostHeap, Resource, StreamRef, layout, upstream::HostVirtual};

/// Runs `work` on a thread of its own and fails if it has not finished in `limit`. (A
/// hung thread is left behind; the test binary still exits.)
fn within<F: FnOnce() + Send + 'static>(limit: Duration, what: &str, work: F) {
    let (done, finished) = mpsc::channel();
    let worker = std::thread::spawn(move || {
        work();
        let _ = done.send(());
    });
    match finished.recv_timeout(limit) {
        Ok(()) => worker.join().expect("the work panicked"),
        Err(mpsc::RecvTimeoutError::Disconnected) => {
            std::panic::resume_unwind(worker.join().expect_err("the worker ended early"))
        }
        Err(mpsc::RecvTimeoutError::Timeout) => {
            panic!("{what}: still running after {limit:?} (hung)")
        }
    }
}

/// Eight threads, each on its own host stream, allocating and freeing 64 KiB blocks past
/// a release threshold of 1 MiB.
fn threads_free_past_a_threshold<P: CoalescingPool + Send + 'static>(pool: std::sync::Arc<P>) {
    let l = layout(64 << 10).unwrap();
    std::thread::scope(|s| {
        for t in 1..=8u32 {
            let pool = &pool;
            s.spawn(move || {
                let stream = StreamRef::host(t);
                let mut live = Vec::new();
                for i in 0..4_000 {
                    if i % 3 == 2 || live.len() > 32 {
                        while let Some(p) = live.pop() {
                            // SAFETY: allocated below with `l` on `stream`; unused since.
                            unsafe { pool.deallocate(stream, p, l) };
                        }
                    } else {
                        live.push(pool.allocate(stream, l).expect("a 64 KiB block"));
                    }
                }
                for p in live {
                    // SAFETY: as above.
                    unsafe { pool.deallocate(stream, p, l) };
                }
            });
        }
    });
}

#[test]
fn a_release_threshold_with_many_threads_does_not_deadlock_the_chunked_pool() {
    let pool = std::sync::Arc::new(
        Pool::new(
            HostHeap::new(),
            PoolConfig::new().release_threshold(1 << 20),
        )
        .unwrap(),
    );
    let p = pool.clone();
    within(Duration::from_secs(30), "chunked pool", move || {
        threads_free_past_a_threshold(p)
    });
    assert_eq!(pool.stats().free_bytes, pool.stats().pool_size);
}

#[test]
fn a_release_threshold_with_many_threads_does_not_deadlock_the_virtual_pool() {
    let leaf = HostVirtual::new(1 << 30, 64 << 10).unwrap();
    let pool = std::sync::Arc::new(
        VirtualPool::new(leaf, VirtualPoolConfig::new().release_threshold(1 << 20)).unwrap(),
    );
    let p = pool.clone();
    within(Duration::from_secs(30), "virtual pool", move || {
        threads_free_past_a_threshold(p)
    });
    assert!(pool.stats().pool_size <= 2 << 20, "{:?}", pool.stats());
}

/// One thread reads `stats()` in a loop (it takes the growth lock) while another frees
/// past a threshold of 0, so its releases are often left pending to the reader.
#[test]
fn stats_in_a_loop_beside_frees_past_a_zero_threshold_does_not_deadlock() {
    for in_place in [false, true] {
        let config = PoolConfig::new().release_threshold(0);
        let virtual_config = VirtualPoolConfig::new().release_threshold(0);
        within(Duration::from_secs(30), "stats beside frees", move || {
            if in_place {
                let leaf = HostVirtual::new(1 << 30, 64 << 10).unwrap();
                stats_beside_frees(&VirtualPool::new(leaf, virtual_config).unwrap());
            } else {
                stats_beside_frees(&Pool::new(HostHeap::new(), config).unwrap());
            }
        });
    }
}

fn stats_beside_frees<P: CoalescingPool>(pool: &P) {
    let stop = std::sync::atomic::AtomicBool::new(false);
    let l = layout(256 << 10).unwrap();
    std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                std::hint::black_box(pool.stats());
            }
        });
        s.spawn(|| {
            let stream = StreamRef::host(7);
            for _ in 0..20_000 {
                let p = pool.allocate(stream, l).expect("a block");
                // SAFETY: allocated just above with `l` on `stream`.
                unsafe { pool.deallocate(stream, p, l) };
            }
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
        });
    });
}

/// A producer thread allocates blocks on its per-thread stream; a consumer frees them
/// on its own (about 34 live at a time), checking the first and last byte of each.
fn producer_consumer<R: Resource + Sync>(resource: &R, size: usize, blocks: usize) {
    let l = layout(size).unwrap();
    let (send, receive) = mpsc::sync_channel::<usize>(32);
    std::thread::scope(|s| {
        s.spawn(move || {
            for i in 0..blocks {
                let p = resource
                    .allocate(StreamRef::PER_THREAD, l)
                    .unwrap_or_else(|e| panic!("block {i}: {e}"));
                // SAFETY: the block is `size` bytes, ours until the consumer frees it.
                unsafe {
                    (
                        p.as_ptr().write(i as u8),
                        p.as_ptr().add(size - 1).write(i as u8),
                    )
                };
                send.send(p.as_ptr() as usize).unwrap();
            }
        });
        s.spawn(move || {
            let mut i = 0u8;
            for addr in receive {
                let p = std::ptr::NonNull::new(addr as *mut u8).unwrap();
                // SAFETY: written by the producer before it sent the address.
                let (first, last) = unsafe { (*p.as_ptr(), *p.as_ptr().add(size - 1)) };
                assert_eq!(
                    (first, last),
                    (i, i),
                    "a block's contents changed while live"
                );
                i = i.wrapping_add(1);
                // SAFETY: allocated by the producer with `l`; unused from here on.
                unsafe { resource.deallocate(StreamRef::PER_THREAD, p, l) };
            }
        });
    });
}

#[test]
fn fixed_size_reuses_blocks_freed_on_another_stream_before_growing() {
    let fixed = FixedSize::with_block_size(HostHeap::new(), 64 << 10, 128).unwrap();
    producer_consumer(&fixed, 64 << 10, 20_000);
    // About 34 blocks live, under one chunk of 128; the consumer's thread cache holds up
    // to 64 more. Before the fix: one chunk per 128 blocks, 79 after 10,000.
    assert!(
        fixed.upstream_allocations() <= 3,
        "{} chunks of 8 MiB for about 34 live blocks of 64 KiB",
        fixed.upstream_allocations()
    );
}

#[test]
fn binning_reuses_blocks_freed_on_another_stream_before_growing() {
    let pool = std::sync::Arc::new(Pool::new(HostHeap::new(), PoolConfig::new()).unwrap());
    // Bins of 4 KiB .. 1 MiB, 128 blocks a chunk, each made with its first chunk.
    let bins = Binning::new(pool.clone(), 12, 20).unwrap();
    let made = pool.stats().pool_size;
    for size in [4 << 10, 64 << 10, 1 << 20] {
        producer_consumer(&bins, size, 10_000);
    }
    // About 34 live blocks fit each bin's first chunk; allow one more chunk of the
    // largest bin (128 MiB). Before the fix: about 1 chunk per 128 blocks produced.
    let held = pool.stats().pool_size;
    assert!(
        held <= made + (128 << 20),
        "{} MiB held, {} MiB when made",
        held >> 20,
        made >> 20
    );
}

/// Over a limit: cross-stream frees must not fill it.
#[test]
fn fixed_size_under_a_limit_serves_cross_stream_frees_without_running_out() {
    let limited = Limiting::new(HostHeap::new(), 64 << 20);
    let fixed = FixedSize::with_block_size(&limited, 64 << 10, 128).unwrap();
    producer_consumer(&fixed, 64 << 10, 20_000);
    assert!(
        limited.allocated_bytes() <= 3 * (8 << 20),
        "{} MiB",
        limited.allocated_bytes() >> 20
    );
}

/// splitmix64, for the stress test's choices.
fn next(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// 16 threads, four to each of four host streams (so they share streams through lanes),
/// allocating blocks of 256 B to 1 MiB, writing their own stamp at both ends, checking
/// it before each free, and freeing a third of the blocks on another stream than the one
/// they were allocated on; one thread trims and reads the statistics as it goes. Within a
/// watchdog: no hang, no block handed out twice (a stamp overwritten), everything free
/// at the end. (loom cannot model lanes: a thread's lane is a std thread-local.)
fn stress<R: Resource + Sync>(r: &R, trim: &(dyn Fn() + Sync), ops: usize) {
    stress_on(r, trim, ops, 4, usize::MAX);
}

/// [`stress`] over `streams` host streams, each thread moving to the next stream every
/// `switch` operations (streams come and go, so trims free their lists).
fn stress_on<R: Resource + Sync>(
    r: &R,
    trim: &(dyn Fn() + Sync),
    ops: usize,
    streams: u32,
    switch: usize,
) {
    std::thread::scope(|s| {
        let mut threads = Vec::new();
        for t in 0..16u64 {
            threads.push(s.spawn(move || {
                let mut rng = 0x5EED ^ t;
                let mut own = StreamRef::host(1 + t as u32 % streams);
                let mut live: Vec<(std::ptr::NonNull<u8>, std::alloc::Layout, u64)> = Vec::new();
                for i in 0..ops {
                    if i % switch == switch - 1 {
                        let moved = (t as usize + i / switch) as u32 % streams;
                        own = StreamRef::host(1 + moved);
                    }
                    let r1 = next(&mut rng);
                    if live.len() < 32 && (live.is_empty() || r1.is_multiple_of(2)) {
                        let size = 256 << ((r1 >> 8) % 13); // 256 B .. 1 MiB
                        let l = layout(size).unwrap();
                        let p = r
                            .allocate(own, l)
                            .unwrap_or_else(|e| panic!("thread {t}: {e}"));
                        let stamp = t << 48 | i as u64;
                        // SAFETY: the block holds `size` >= 256 bytes; 8-byte writes at
                        // both ends, unaligned-safe.
                        unsafe {
                            p.as_ptr().cast::<u64>().write_unaligned(stamp);
                            p.as_ptr()
                                .add(size - 8)
                                .cast::<u64>()
                                .write_unaligned(stamp);
                        }
                        live.push((p, l, stamp));
                    } else {
                        let (p, l, stamp) = live.swap_remove((r1 >> 16) as usize % live.len());
                        // SAFETY: written above; still ours.
                        let ends = unsafe {
                            (
                                p.as_ptr().cast::<u64>().read_unaligned(),
                                p.as_ptr().add(l.size() - 8).cast::<u64>().read_unaligned(),
                            )
                        };
                        assert_eq!(ends, (stamp, stamp), "thread {t}: a live block was reused");
                        let on = if r1.is_multiple_of(3) {
                            StreamRef::host(1 + (t as u32 + 1) % streams)
                        } else {
                            own
                        };
                        // SAFETY: allocated with `l`; host streams are always complete, so
                        // it may be freed on any of them.
                        unsafe { r.deallocate(on, p, l) };
                    }
                    if t == 0 && i % 2_000 == 1_999 {
                        trim();
                    }
                }
                for (p, l, _) in live {
                    // SAFETY: as above.
                    unsafe { r.deallocate(own, p, l) };
                }
            }));
        }
        // (Each thread's cached blocks are back when it has exited.)
        common::join_exited(threads);
    });
}

const STRESS_OPS: usize = 20_000;

#[test]
#[cfg_attr(
    debug_assertions,
    ignore = "a release-mode stress test: .ci/run runs it with --release"
)]
fn lanes_thresholds_trims_and_cross_stream_frees_under_16_threads() {
    for (name, threshold) in [("no threshold", None), ("threshold 4 MiB", Some(4 << 20))] {
        let (config, virtual_config) = match threshold {
            Some(t) => (
                PoolConfig::new().release_threshold(t),
                VirtualPoolConfig::new().release_threshold(t),
            ),
            None => (PoolConfig::new(), VirtualPoolConfig::new()),
        };
        within(Duration::from_secs(120), name, move || {
            let chunked = Pool::new(HostHeap::new(), config).unwrap();
            stress(&chunked, &|| drop(chunked.trim()), STRESS_OPS);
            let s = common::settled_stats(&chunked);
            assert_eq!(s.free_bytes, s.pool_size, "chunked, {name}: {s:?}");
            let leaf = HostVirtual::new(8 << 30, 64 << 10).unwrap();
            let in_place = VirtualPool::new(leaf, virtual_config).unwrap();
            stress(&in_place, &|| drop(in_place.trim()), STRESS_OPS);
            let s = in_place.stats();
            assert_eq!(s.free_bytes, s.pool_size, "in place, {name}: {s:?}");
            in_place.trim().unwrap();
            assert_eq!(in_place.stats().pool_size, 0, "in place, {name}");
        });
    }
    within(Duration::from_secs(120), "binning", || {
        let pool = std::sync::Arc::new(Pool::new(HostHeap::new(), PoolConfig::new()).unwrap());
        let bins = Binning::new(pool.clone(), 8, 18).unwrap();
        stress(&bins, &|| drop(pool.trim()), STRESS_OPS);
    });
}

/// Streams come and go (each of 16 threads moves to another of 256 host streams every
/// 100 operations) while a 17th thread trims in a loop, each trim freeing the lists of
/// the streams it finds empty (issue 33, finding 4) while the others use theirs: stamps
/// checked, no hang, everything free at the end.
#[test]
#[cfg_attr(
    debug_assertions,
    ignore = "a release-mode stress test: .ci/run runs it with --release"
)]
fn trims_free_stream_lists_while_16_threads_use_streams_that_come_and_go() {
    within(Duration::from_secs(120), "lists freed under use", || {
        let chunked = Pool::new(HostHeap::new(), PoolConfig::new()).unwrap();
        lists_freed_under_use("chunked", &chunked);
        let leaf = HostVirtual::new(8 << 30, 64 << 10).unwrap();
        let in_place = VirtualPool::new(leaf, VirtualPoolConfig::new()).unwrap();
        lists_freed_under_use("in place", &in_place);
        arena_lists_freed_under_use();
        let fixed = FixedSize::with_block_size(HostHeap::new(), 1 << 20, 16).unwrap();
        trimmed_under_use("fixed size", &fixed, &|| fixed.trim().unwrap());
        assert_eq!(fixed.free_blocks(), 16 * fixed.upstream_allocations());
        let bins = Binning::new(
            Pool::new(HostHeap::new(), PoolConfig::new()).unwrap(),
            8,
            20,
        )
        .unwrap();
        trimmed_under_use("binning", &bins, &|| {
            bins.trim().unwrap();
            bins.upstream().trim().unwrap();
        });
    });
}

/// `trim` (of a `FixedSize`, whose thread caches keep lists across calls, or of a
/// `Binning`'s bins and pool) on a thread of its own beside the 16 of [`stress_on`]:
/// contents kept, no false out-of-memory, no list freed under a thread or a cache.
fn trimmed_under_use<R: Resource + Sync>(name: &str, r: &R, trim: &(dyn Fn() + Sync)) {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
    let (done, trims) = (AtomicBool::new(false), AtomicUsize::new(0));
    std::thread::scope(|s| {
        s.spawn(|| {
            while !done.load(Relaxed) {
                trim();
                trims.fetch_add(1, Relaxed);
            }
        });
        for _ in 0..8 {
            stress_on(r, &|| {}, STRESS_OPS, 256, 100);
            if trims.load(Relaxed) >= 50 {
                break;
            }
        }
        done.store(true, Relaxed);
    });
    trim();
    println!("{name}: {} trims beside the threads", trims.into_inner());
}

/// The arena's `trim` beside 16 threads (each at most 32 blocks of up to 1 MiB live):
/// contents kept, no false out-of-memory, every superblock back at the end.
fn arena_lists_freed_under_use() {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
    let arena = Arena::with_size(HostHeap::new(), 2 << 30).unwrap();
    let (done, trims) = (AtomicBool::new(false), AtomicUsize::new(0));
    std::thread::scope(|s| {
        s.spawn(|| {
            while !done.load(Relaxed) {
                arena.trim().unwrap();
                trims.fetch_add(1, Relaxed);
            }
        });
        // Rounds until the trimming thread has run often enough to meet the others.
        for _ in 0..8 {
            stress_on(&arena, &|| {}, STRESS_OPS, 256, 100);
            if trims.load(Relaxed) >= 50 {
                break;
            }
        }
        done.store(true, Relaxed);
    });
    assert_eq!(arena.free_bytes(), arena.size(), "arena: everything free");
    arena.trim().unwrap();
    assert_eq!(
        arena.superblocks(),
        0,
        "arena: every superblock back after trim"
    );
    println!("arena: {} trims beside the threads", trims.into_inner());
}

fn lists_freed_under_use<P: CoalescingPool>(name: &str, pool: &P) {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
    let done = AtomicBool::new(false);
    let trims = AtomicUsize::new(0);
    std::thread::scope(|s| {
        s.spawn(|| {
            while !done.load(Relaxed) {
                pool.trim().unwrap();
                trims.fetch_add(1, Relaxed);
            }
        });
        stress_on(pool, &|| {}, STRESS_OPS, 256, 100);
        done.store(true, Relaxed);
    });
    let s = common::settled_stats(pool);
    assert_eq!(
        s.free_bytes, s.pool_size,
        "{name}: everything free at the end"
    );
    pool.trim().unwrap();
    println!(
        "{name}: {} trims beside the threads; {} lists at the end, {} after a last trim",
        trims.into_inner(),
        s.stream_lists,
        pool.stats().stream_lists
    );
}

/// A free that crosses the release threshold while another thread holds the growth lock
/// leaves the release to that thread, which runs it as it unlocks: here the lock is held
/// by a growth whose upstream call waits until the free has happened.
#[test]
fn a_release_left_pending_runs_when_the_growth_lock_is_released() {
    within(
        Duration::from_secs(30),
        "a release left pending",
        release_left_pending,
    );
}

fn release_left_pending() {
    use memres::Host;
    use memres::upstream::Callback;
    use std::sync::atomic::{AtomicUsize, Ordering};

    let calls = AtomicUsize::new(0);
    let (entered, growing) = mpsc::channel::<()>();
    let (go, wait) = mpsc::channel::<()>();
    let gate = std::sync::Mutex::new((entered, wait));
    let allocate = |l: std::alloc::Layout, _: StreamRef<'_>| {
        if calls.fetch_add(1, Ordering::SeqCst) == 1 {
            // The second chunk: hold the growth lock until the main thread has freed.
            let gate = gate.lock().unwrap();
            gate.0.send(()).unwrap();
            gate.1.recv().unwrap();
        }
        memres::SyncResource::allocate_sync(&HostHeap::new(), l)
    };
    let deallocate = |p: std::ptr::NonNull<u8>, l: std::alloc::Layout, _: StreamRef<'_>| {
        // SAFETY: the block came from the heap with `l` (the closure above).
        unsafe { memres::SyncResource::deallocate_sync(&HostHeap::new(), p, l) }
    };
    // SAFETY: the closures hand out and take back heap blocks, host memory, used at once.
    let upstream = unsafe { Callback::<Host>::new(allocate, deallocate) };
    let pool = Pool::new(upstream, PoolConfig::new().release_threshold(0)).unwrap();
    let small = layout(1 << 20).unwrap();
    let a = pool.allocate(StreamRef::host(1), small).unwrap(); // the first chunk
    let big = layout(8 << 20).unwrap();
    let b = grow_while_freeing(&pool, &growing, &go, a, small, big);
    let stats = pool.stats();
    assert_eq!(
        stats.upstream_allocations, 1,
        "the first chunk, entirely free, went back once the growth unlocked: {stats:?}"
    );
    // SAFETY: allocated by the grower with `big` on host stream 2; unused.
    unsafe { pool.deallocate(StreamRef::host(2), b, big) };
}

/// One thread grows the pool for `big` (its upstream call waits for `go`) while this one
/// frees `a` past the threshold; returns the grower's block.
fn grow_while_freeing<R: Resource + Sync>(
    pool: &Pool<R>,
    growing: &mpsc::Receiver<()>,
    go: &mpsc::Sender<()>,
    a: std::ptr::NonNull<u8>,
    small: std::alloc::Layout,
    big: std::alloc::Layout,
) -> std::ptr::NonNull<u8> {
    std::thread::scope(|s| {
        let grower = s.spawn(|| pool.allocate(StreamRef::host(2), big).unwrap().as_ptr() as usize);
        growing
            .recv_timeout(Duration::from_secs(30))
            .expect("the growth began");
        // SAFETY: allocated on host stream 1 with `small`; unused since.
        unsafe { pool.deallocate(StreamRef::host(1), a, small) };
        go.send(()).unwrap();
        std::ptr::NonNull::new(grower.join().unwrap() as *mut u8).unwrap()
    })
}

/// Blocks of [`trim_beside_threads`]: 256 KiB, at most 62 live (15.5 MiB).
const BLOCK: usize = 256 << 10;
const BUDGET: usize = 62;

/// Issue 49: eight threads on their per-thread streams share a budget of [`BUDGET`]
/// blocks (a thread takes one before it allocates and gives it back after it frees) in
/// a pool that holds two blocks more from the start, as one piece it never gives back
/// while any block is live. Each thread in turn frees a few of its blocks and allocates
/// a few, so memory moves between their lists (by merges), while a ninth thread trims in
/// a loop (each trim merges every list into one and retires the lists it left empty,
/// the threads' own among them). Every request then finds at least two free blocks in
/// the pool, so none may fail: memory freed or merged into a list that a trim is
/// retiring must stay within reach of the allocation path. Runs for `run` (or until the
/// first failure) and returns the failures, the operations, the trims and what the first
/// failure saw.
fn trim_beside_threads<P: CoalescingPool>(
    pool: &P,
    run: Duration,
    trim: bool,
) -> (u64, u64, u64, Option<String>) {
    use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
    let l = layout(BLOCK).unwrap();
    let (done, failures, total) = (AtomicBool::new(false), AtomicU64::new(0), AtomicU64::new(0));
    let (budget, trims) = (AtomicUsize::new(BUDGET), AtomicU64::new(0));
    let first = std::sync::Mutex::new(None);
    let started = std::time::Instant::now();
    std::thread::scope(|s| {
        if trim {
            s.spawn(|| {
                while !done.load(Relaxed) {
                    pool.trim().unwrap();
                    trims.fetch_add(1, Relaxed);
                }
            });
        }
        let threads: Vec<_> = (0..8u64)
            .map(|t| {
                let (done, failures, total, first, budget) =
                    (&done, &failures, &total, &first, &budget);
                s.spawn(move || {
                    let own = StreamRef::PER_THREAD;
                    let mut rng = 0x49 ^ t;
                    let mut live = Vec::new();
                    let mut ops = 0;
                    while !done.load(Relaxed) && failures.load(Relaxed) == 0 {
                        for _ in 0..64 {
                            let r = next(&mut rng);
                            let n = 1 + (r >> 8) as usize % 4;
                            if !live.is_empty() && r.is_multiple_of(2) {
                                for _ in 0..n.min(live.len()) {
                                    let p = live.swap_remove((r >> 16) as usize % live.len());
                                    // SAFETY: allocated below with `l` on `own`; unused
                                    // since.
                                    unsafe { pool.deallocate(own, p, l) };
                                    budget.fetch_add(1, Relaxed);
                                    ops += 1;
                                }
                                continue;
                            }
                            for _ in 0..n {
                                if budget
                                    .fetch_update(Relaxed, Relaxed, |b| b.checked_sub(1))
                                    .is_err()
                                {
                                    break;
                                }
                                ops += 1;
                                match pool.allocate(own, l) {
                                    Ok(p) => live.push(p),
                                    Err(e) => {
                                        let held = BUDGET - budget.fetch_add(1, Relaxed);
                                        failures.fetch_add(1, Relaxed);
                                        first.lock().unwrap().get_or_insert_with(|| {
                                            format!(
                                                "{e}, with {held} blocks live (this one \
                                                 counted) of the {} the pool holds: {:?}",
                                                pool.stats().pool_size / BLOCK,
                                                pool.stats()
                                            )
                                        });
                                        break;
                                    }
                                }
                            }
                        }
                        if started.elapsed() > run {
                            break;
                        }
                    }
                    for p in live {
                        // SAFETY: as above.
                        unsafe { pool.deallocate(own, p, l) };
                    }
                    total.fetch_add(ops, Relaxed);
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        done.store(true, Relaxed);
    });
    let first = first.into_inner().unwrap();
    (
        failures.into_inner(),
        total.into_inner(),
        trims.into_inner(),
        first,
    )
}

#[test]
#[cfg_attr(
    debug_assertions,
    ignore = "a release-mode stress test: .ci/run runs it with --release"
)]
fn a_trim_beside_allocating_threads_makes_none_run_out_of_memory() {
    // One piece of 64 blocks: the chunked pool's first chunk, the virtual pool's eight
    // granules of 2 MiB (a granule goes back only when all of its 8 blocks are free).
    let held = (BUDGET + 2) * BLOCK;
    let config = PoolConfig::new().initial_size(held).maximum_size(held);
    let virtual_config = VirtualPoolConfig::new()
        .initial_size(held)
        .maximum_size(held);
    within(Duration::from_secs(60), "trim beside threads", move || {
        // Without trims (a shorter run: the control), then with them.
        for (trim, run) in [(false, 300), (true, 2_000)] {
            let run = Duration::from_millis(run);
            let chunked = Pool::new(HostHeap::new(), config).unwrap();
            let leaf = HostVirtual::new(held, 2 << 20).unwrap();
            let in_place = VirtualPool::new(leaf, virtual_config).unwrap();
            let results = [
                ("chunked", trim_beside_threads(&chunked, run, trim)),
                ("in place", trim_beside_threads(&in_place, run, trim)),
            ];
            for (name, (failed, ops, trims, first)) in &results {
                println!("{name}: {failed} out-of-memory in {ops} operations, {trims} trims");
                if let Some(first) = first {
                    println!("  the first: {first}");
                }
            }
            for (name, (failed, _, trims, _)) in &results {
                assert_eq!(*failed, 0, "{name}, {trims} trims beside");
                assert_eq!(*trims > 0, trim, "{name}: trims ran beside the threads");
            }
            let s = common::settled_stats(&chunked);
            assert_eq!(
                s.free_bytes, s.pool_size,
                "chunked: everything free at the end"
            );
            let s = in_place.stats();
            assert_eq!(
                s.free_bytes, s.pool_size,
                "in place: everything free at the end"
            );
        }
    });
}
