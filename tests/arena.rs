//! `Arena` on host memory: sizes, superblocks, the global arena, defragmentation, and a
//! property test of its invariants.

use std::alloc::Layout;
use std::ptr::NonNull;

use memres::suballoc::{Arena, SUPERBLOCK_SIZE};
use memres::{Error, HostHeap, Resource, StreamRef, layout, resource::layout_with_alignment};
use proptest::prelude::*;

mod common;

const MIB: usize = 1 << 20;

#[test]
fn an_arena_smaller_than_a_superblock_is_rejected() {
    let e = Arena::with_size(HostHeap::new(), MIB - 256).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
    assert!(e.to_string().contains("superblock"), "{e}");
}

#[test]
fn the_default_size_needs_a_gpu() {
    if !memres::driver::is_present() {
        assert!(matches!(Arena::new(HostHeap::new()), Err(Error::NoDriver)));
    }
}

#[test]
fn small_requests_share_superblocks_large_ones_get_their_own() {
    let arena = Arena::with_size(HostHeap::new(), 16 * MIB).unwrap();
    let s = StreamRef::host(1);
    let small = layout(1000).unwrap();
    let p = arena.allocate(s, small).unwrap();
    assert_eq!(arena.superblocks(), 1);
    let p2 = arena.allocate(s, small).unwrap();
    assert_eq!(arena.superblocks(), 1);
    let large = layout(3 * MIB).unwrap();
    let q = arena.allocate(s, large).unwrap();
    assert_eq!(arena.superblocks(), 2);
    assert_eq!(arena.free_bytes(), 16 * MIB - 2048 - 3 * MIB);
    // SAFETY: allocated above with these layouts on `s`.
    unsafe {
        arena.deallocate(s, q, large);
        arena.deallocate(s, p, small);
        arena.deallocate(s, p2, small);
    }
    assert_eq!(arena.free_bytes(), 16 * MIB);
}

/// A block freed on another stream than the one it was taken on goes to that stream's
/// list, so a superblock's pieces may end up in several: defragmenting gathers them, and
/// the whole arena can be taken at once again.
#[test]
fn pieces_of_a_superblock_freed_on_several_streams_come_back_whole() {
    let arena = Arena::with_size(HostHeap::new(), 8 * MIB).unwrap();
    let s = StreamRef::host(1);
    let large = layout(3 * MIB / 2).unwrap();
    let q = arena.allocate(s, large).unwrap();
    let small = layout(100 << 10).unwrap();
    let ps: Vec<_> = (0..4).map(|_| arena.allocate(s, small).unwrap()).collect();
    assert_eq!(arena.superblocks(), 2);
    assert_eq!(arena.free_bytes(), 8 * MIB - 3 * MIB / 2 - 4 * (100 << 10));
    // Half of the small ones freed on stream 2, half on stream 3.
    for (i, p) in ps.into_iter().enumerate() {
        // SAFETY: allocated above with `small`; host streams are always done.
        unsafe { arena.deallocate(StreamRef::host(2 + i as u32 % 2), p, small) };
    }
    // SAFETY: allocated above with `large` on `s`.
    unsafe { arena.deallocate(s, q, large) };
    assert_eq!(arena.free_bytes(), 8 * MIB);
    let all = layout(8 * MIB).unwrap();
    let p = arena.allocate(StreamRef::host(4), all).unwrap();
    assert_eq!(arena.superblocks(), 1);
    // SAFETY: allocated just above with `all`.
    unsafe { arena.deallocate(StreamRef::host(4), p, all) };
}

#[test]
fn empty_superblocks_go_back_but_one_stays() {
    let arena = Arena::with_size(HostHeap::new(), 16 * MIB).unwrap();
    let s = StreamRef::host(1);
    // 300 KiB blocks, three to a superblock: twelve take four superblocks.
    let l = layout(300 << 10).unwrap();
    let blocks: Vec<_> = (0..12).map(|_| arena.allocate(s, l).unwrap()).collect();
    assert_eq!(arena.superblocks(), 4);
    for p in blocks {
        // SAFETY: allocated above with `l` on `s`.
        unsafe { arena.deallocate(s, p, l) };
    }
    assert_eq!(arena.superblocks(), 1);
    assert_eq!(arena.free_bytes(), 16 * MIB);
}

#[test]
fn out_of_memory_defragments_then_fails_cleanly() {
    let arena = Arena::with_size(HostHeap::new(), 4 * MIB)
        .unwrap()
        .dump_on_failure(true);
    let whole = layout(SUPERBLOCK_SIZE).unwrap();
    // Stream 1 takes all four superblocks and frees them; it keeps one.
    let blocks: Vec<_> = (0..4)
        .map(|_| arena.allocate(StreamRef::host(1), whole).unwrap())
        .collect();
    for p in blocks {
        // SAFETY: allocated above with `whole` on host stream 1.
        unsafe { arena.deallocate(StreamRef::host(1), p, whole) };
    }
    assert!(arena.superblocks() >= 1);
    // All 4 MiB at once, from the global arena: the kept superblock must come back.
    let all = layout(4 * MIB).unwrap();
    let p = arena.allocate(StreamRef::host(2), all).unwrap();
    // Stream 2's own superblock of 4 MiB is the only one left.
    assert_eq!(arena.superblocks(), 1);
    match arena.allocate(StreamRef::host(3), layout(1000).unwrap()) {
        Err(Error::OutOfMemory { requested, .. }) => assert_eq!(requested, 1000),
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    assert!(
        arena.dump().starts_with("arena of 4194304 bytes"),
        "{}",
        arena.dump()
    );
    // SAFETY: allocated above with `all`.
    unsafe { arena.deallocate(StreamRef::host(2), p, all) };
    assert_eq!(arena.free_bytes(), 4 * MIB);
}

#[derive(Debug, Clone)]
enum Step {
    Allocate {
        stream: u32,
        size: usize,
        align_shift: u32,
    },
    Free {
        index: usize,
        stream: u32,
    },
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        (0..3u32, 1..3_000_000usize, 0..13u32).prop_map(|(stream, size, align_shift)| {
            Step::Allocate {
                stream,
                size,
                align_shift,
            }
        }),
        (any::<usize>(), 0..3u32).prop_map(|(index, stream)| Step::Free { index, stream }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Random allocations and frees on three host streams: live blocks never overlap and
    /// are aligned, free + live = the arena's size throughout, and once all is freed the
    /// whole arena can be taken at once.
    #[test]
    fn arena_invariants(steps in proptest::collection::vec(step(), 1..200)) {
        let arena = Arena::with_size(HostHeap::new(), 32 * MIB).unwrap();
        let mut live: Vec<(NonNull<u8>, Layout)> = Vec::new();
        for step in steps {
            match step {
                Step::Allocate { stream, size, align_shift } => {
                    let l = layout_with_alignment(size, 1 << align_shift).unwrap();
                    match arena.allocate(StreamRef::host(stream), l) {
                        Ok(p) => {
                            prop_assert_eq!(p.as_ptr() as usize % l.align(), 0);
                            live.push((p, l));
                        }
                        Err(Error::OutOfMemory { .. }) => {}
                        Err(e) => prop_assert!(false, "{:?}: {}", l, e),
                    }
                }
                Step::Free { index, stream } if !live.is_empty() => {
                    let (p, l) = live.swap_remove(index % live.len());
                    // SAFETY: allocated by this arena with `l`; host streams are done.
                    unsafe { arena.deallocate(StreamRef::host(stream), p, l) };
                }
                Step::Free { .. } => {}
            }
            let live_bytes: usize =
                live.iter().map(|(_, l)| l.size().next_multiple_of(256)).sum();
            prop_assert_eq!(arena.free_bytes() + live_bytes, 32 * MIB);
            let mut ranges: Vec<(usize, usize)> = live
                .iter()
                .map(|(p, l)| (p.as_ptr() as usize, p.as_ptr() as usize + l.size()))
                .collect();
            ranges.sort_unstable();
            for w in ranges.windows(2) {
                prop_assert!(w[0].1 <= w[1].0, "live blocks overlap: {:?}", w);
            }
        }
        for (p, l) in live.drain(..) {
            // SAFETY: as above.
            unsafe { arena.deallocate(StreamRef::host(0), p, l) };
        }
        prop_assert_eq!(arena.free_bytes(), 32 * MIB);
        // Whatever streams the pieces were freed on, the arena is one block again.
        let all = layout(32 * MIB).unwrap();
        let p = arena.allocate(StreamRef::host(1), all);
        prop_assert!(p.is_ok(), "{:?}\n{}", p, arena.dump());
        // SAFETY: allocated just above with `all`.
        unsafe { arena.deallocate(StreamRef::host(1), p.unwrap(), all) };
    }
}

#[test]
fn an_arena_of_every_byte_is_an_invalid_argument() {
    for size in [usize::MAX, isize::MAX as usize + 1] {
        match Arena::with_size(HostHeap::new(), size) {
            Err(Error::InvalidArgument(why)) => assert!(why.contains("too large"), "{why}"),
            other => panic!("{size}: expected InvalidArgument, got {other:?}"),
        }
    }
}

/// A producer thread allocates on one stream and a consumer thread frees on the same
/// stream: the blocks land in the consumer's lane, and the producer's slow path takes them
/// back. (300 KiB blocks leave a piece of each 1 MiB superblock in the producer's lane, so
/// without that no superblock would ever be whole in one lane again, and the arena would
/// run out.) A made-up
/// CUDA handle, so only on a machine without a driver.
#[test]
fn a_producer_and_a_consumer_on_one_stream_do_not_run_the_arena_out() {
    if memres::driver::is_present() {
        println!("memres-skip: uses a made-up CUDA stream handle (for machines without a driver)");
        return;
    }
    let arena = Arena::with_size(HostHeap::new(), 8 * MIB).unwrap();
    // SAFETY: the handle is never given to a driver (there is none here).
    let stream = unsafe { StreamRef::from_raw(0x3000 as _) };
    let (tx, rx) = std::sync::mpsc::sync_channel::<usize>(4);
    std::thread::scope(|s| {
        let arena = &arena;
        s.spawn(move || {
            memres::suballoc::own_lane();
            for p in rx {
                let p = NonNull::new(p as *mut u8).unwrap();
                // SAFETY: allocated by the producer with this layout on `stream`.
                unsafe { arena.deallocate(stream, p, layout(300 << 10).unwrap()) };
            }
        });
        for _ in 0..2000 {
            let p = arena
                .allocate(stream, layout(300 << 10).unwrap())
                .expect("the consumer's lane gives memory back");
            tx.send(p.as_ptr() as usize).unwrap();
        }
        drop(tx);
    });
    // From lane to lane, with no defragmentation (which waits for the device).
    assert_eq!(arena.stream_merges(), 0);
}

/// Host stream 0 or a made-up CUDA stream (for machines without a driver).
fn stream_of(i: u32) -> StreamRef<'static> {
    match i {
        0 => StreamRef::host(0),
        // SAFETY: only used where there is no driver: the handle is never given to one.
        n => unsafe { StreamRef::from_raw((0x5000 * n as usize) as _) },
    }
}

/// Six threads allocate and free on three streams (a host one and two CUDA ones, so
/// lanes, superblocks waiting for their stream, and defragmenting all take part) in an
/// arena small enough to run out often, freeing each other's blocks on any stream. Every
/// block carries a token at its head and tail, checked when it is freed: no block is ever
/// handed out twice. At the end every byte is free and the whole arena can be taken at
/// once. (Made-up CUDA handles: only on a machine without a driver.)
#[test]
fn threads_on_several_streams_run_an_arena_dry_without_losing_a_byte() {
    if memres::driver::is_present() {
        println!("memres-skip: uses made-up CUDA stream handles (for machines without a driver)");
        return;
    }
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicU64, Ordering};
    let arena = Arena::with_size(HostHeap::new(), 24 * MIB).unwrap();
    let live: Mutex<Vec<(usize, Layout, u64)>> = Mutex::new(Vec::new());
    let token = AtomicU64::new(1);
    std::thread::scope(|s| {
        let mut threads = Vec::new();
        for t in 0..6u64 {
            let (arena, live, token) = (&arena, &live, &token);
            threads.push(s.spawn(move || {
                let mut rng = 0x9E37_79B9_7F4A_7C15u64.wrapping_mul(t + 1);
                let mut next = || {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    rng
                };
                for _ in 0..8_000 {
                    let r = next();
                    let stream = stream_of((r % 3) as u32);
                    if r % 5 < 3 {
                        let size = match (r >> 8) % 8 {
                            0 => 1 + (r >> 16) as usize % (3 * MIB),
                            1 | 2 => 1 + (r >> 16) as usize % (600 << 10),
                            _ => 1 + (r >> 16) as usize % 4096,
                        };
                        let l = layout_with_alignment(size.max(16), 1 << ((r >> 40) % 12)).unwrap();
                        if let Ok(p) = arena.allocate(stream, l) {
                            let tok = token.fetch_add(1, Ordering::Relaxed);
                            let a = p.as_ptr() as usize;
                            // SAFETY: the block is ours, at least 16 bytes long.
                            unsafe {
                                (a as *mut u64).write_unaligned(tok);
                                ((a + l.size() - 8) as *mut u64).write_unaligned(tok);
                            }
                            live.lock().unwrap().push((a, l, tok));
                        }
                    } else {
                        let item = {
                            let mut v = live.lock().unwrap();
                            let n = v.len();
                            (n > 0).then(|| v.swap_remove((r >> 20) as usize % n))
                        };
                        if let Some((a, l, tok)) = item {
                            // SAFETY: a live block of the arena with layout `l` (host
                            // memory; made-up streams have no work), ours alone now.
                            unsafe {
                                assert_eq!((a as *const u64).read_unaligned(), tok, "head");
                                let tail = ((a + l.size() - 8) as *const u64).read_unaligned();
                                assert_eq!(tail, tok, "tail");
                                arena.deallocate(stream, NonNull::new(a as *mut u8).unwrap(), l);
                            }
                        }
                    }
                }
            }));
        }
        // (Each thread's cached blocks are back when it has exited.)
        common::join_exited(threads);
    });
    for (a, l, tok) in live.into_inner().unwrap() {
        // SAFETY: as above.
        unsafe {
            assert_eq!((a as *const u64).read_unaligned(), tok);
            arena.deallocate(stream_of(0), NonNull::new(a as *mut u8).unwrap(), l);
        }
    }
    assert_eq!(arena.free_bytes(), 24 * MIB);
    let all = layout(24 * MIB).unwrap();
    let p = arena.allocate(stream_of(1), all);
    assert!(p.is_ok(), "{p:?}\n{}", arena.dump());
    // SAFETY: allocated just above with `all`.
    unsafe { arena.deallocate(stream_of(1), p.unwrap(), all) };
}

/// Small blocks freed by one thread wait in that thread's cache for the stream: its
/// `free_bytes` counts them, and once the thread has exited (its cache given back) every
/// thread's does, and a trim takes every superblock back.
#[test]
fn a_threads_cached_small_blocks_count_as_free_and_come_back_when_it_exits() {
    let arena = std::sync::Arc::new(Arena::with_size(HostHeap::new(), 4 * MIB).unwrap());
    let l = layout(4096).unwrap();
    let other = std::sync::Arc::clone(&arena);
    // `join` waits for the thread's exit, its caches' give-back included.
    std::thread::spawn(move || {
        let s = StreamRef::host(1);
        let blocks: Vec<_> = (0..16).map(|_| other.allocate(s, l).unwrap()).collect();
        for p in blocks {
            // SAFETY: allocated above with `l` on `s`; not used.
            unsafe { other.deallocate(s, p, l) };
        }
        assert_eq!(other.free_bytes(), 4 * MIB, "this thread counts its cache");
        // Handed out again from the cache, newest first.
        let p = other.allocate(s, l).unwrap();
        // SAFETY: as above.
        unsafe { other.deallocate(s, p, l) };
        assert_eq!(other.allocate(s, l).unwrap(), p, "from the thread's cache");
        // SAFETY: as above.
        unsafe { other.deallocate(s, p, l) };
    })
    .join()
    .unwrap();
    assert_eq!(arena.free_bytes(), 4 * MIB);
    arena.trim().unwrap();
    assert_eq!(arena.superblocks(), 0, "the superblock is whole again");
}

/// An arena whose every superblock is split by blocks waiting in another (live, idle)
/// thread's cache: a request for a superblock of its own takes them back before it
/// reports out-of-memory.
#[test]
fn a_full_arena_takes_back_blocks_an_idle_thread_cached() {
    use std::sync::{Arc, mpsc};
    let arena = Arc::new(Arena::with_size(HostHeap::new(), 2 * MIB).unwrap());
    let l = layout(64 << 10).unwrap();
    let (cached, wait_cached) = mpsc::channel::<()>();
    let (done, wait_done) = mpsc::channel::<()>();
    let other = Arc::clone(&arena);
    let idle = std::thread::spawn(move || {
        // Both superblocks, each on a stream of its own, split into cached blocks.
        for id in [1, 2] {
            let s = StreamRef::host(id);
            let blocks: Vec<_> = (0..16).map(|_| other.allocate(s, l).unwrap()).collect();
            for p in blocks {
                // SAFETY: allocated above with `l` on `s`; not used.
                unsafe { other.deallocate(s, p, l) };
            }
        }
        cached.send(()).unwrap();
        // Idle, holding the blocks in its cache, until the main thread is done.
        wait_done.recv().unwrap();
    });
    wait_cached.recv().unwrap();
    assert_eq!(arena.superblocks(), 2);
    let two = layout(2 * MIB).unwrap();
    let p = arena
        .allocate(StreamRef::host(3), two)
        .expect("the idle thread's blocks, merged back into superblocks");
    // SAFETY: allocated above with `two` on host stream 3; not used.
    unsafe { arena.deallocate(StreamRef::host(3), p, two) };
    done.send(()).unwrap();
    idle.join().unwrap();
    assert_eq!(arena.free_bytes(), 2 * MIB);
    // The reclaim turned the caches off; the superblock handed out since turned them
    // back on: a small block freed here waits in this thread's cache, which another
    // thread does not count.
    let small = layout(4096).unwrap();
    let q = arena.allocate(StreamRef::host(3), small).unwrap();
    // SAFETY: allocated just above with `small` on host stream 3; not used.
    unsafe { arena.deallocate(StreamRef::host(3), q, small) };
    std::thread::scope(|s| {
        s.spawn(|| assert_eq!(arena.free_bytes(), 2 * MIB - 4096, "cached again"));
    });
}

/// `trim` takes back the superblocks whose blocks wait in another live thread's cache,
/// and the caches work again after it.
#[test]
fn a_trim_takes_back_what_another_live_thread_cached() {
    let arena = std::sync::Arc::new(Arena::with_size(HostHeap::new(), 4 * MIB).unwrap());
    let l = layout(4096).unwrap();
    common::while_another_thread_caches(&arena, StreamRef::host(3), l, || {
        assert_eq!(arena.superblocks(), 1);
        arena.trim().unwrap();
        assert_eq!(
            arena.superblocks(),
            0,
            "the cached block's superblock went back"
        );
        let p = arena.allocate(StreamRef::HOST, l).unwrap();
        // SAFETY: allocated above with `l` on the host stream; not used.
        unsafe { arena.deallocate(StreamRef::HOST, p, l) };
        assert_eq!(
            arena.allocate(StreamRef::HOST, l).unwrap(),
            p,
            "handed out again"
        );
    });
}

/// With `thread_caches(false)`, a free reaches the stream's list at once: another thread
/// counts it free and takes the same block; with the caches on it would wait in the
/// freeing thread's cache.
#[test]
fn without_thread_caches_a_free_is_every_threads_at_once() {
    let arena = Arena::with_size(HostHeap::new(), 4 * MIB)
        .unwrap()
        .thread_caches(false);
    let l = layout(4096).unwrap();
    let s = StreamRef::host(1);
    let p = arena.allocate(s, l).unwrap();
    // SAFETY: allocated above with `l` on `s`; not used afterwards.
    unsafe { arena.deallocate(s, p, l) };
    let addr = p.as_ptr() as usize;
    std::thread::scope(|scope| {
        scope.spawn(|| {
            assert_eq!(arena.free_bytes(), 4 * MIB, "every free counted at once");
            let q = arena.allocate(s, l).unwrap();
            assert_eq!(q.as_ptr() as usize, addr, "the freed block, from the list");
            // SAFETY: allocated just above with `l` on `s`; not used afterwards.
            unsafe { arena.deallocate(s, q, l) };
        });
    });
}
