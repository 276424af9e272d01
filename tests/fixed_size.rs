//! `FixedSize` and `Binning` on host memory: sizes, and the per-thread caches giving their
//! blocks back when a thread exits (or not touching a resource that is gone).

use std::sync::{Arc, mpsc};

use memres::adaptor::Limiting;
use memres::suballoc::{Binning, FixedSize, Pool, PoolConfig};
use memres::{Error, HostHeap, Resource, StreamRef, SyncResource, layout};

#[test]
fn requests_above_the_block_size_name_both_sizes() {
    let fixed = FixedSize::with_block_size(HostHeap::new(), 1000, 4).unwrap();
    assert_eq!(fixed.block_size(), 1024);
    match fixed.allocate_sync(layout(2000).unwrap()) {
        Err(Error::InvalidArgument(m)) => {
            assert!(m.contains("2000") && m.contains("1024"), "{m}");
        }
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    assert!(FixedSize::with_block_size(HostHeap::new(), 256, 0).is_err());
    assert!(FixedSize::with_block_size(HostHeap::new(), usize::MAX / 2, 4).is_err());
}

#[test]
fn it_grows_by_chunks() {
    let fixed = FixedSize::with_block_size(HostHeap::new(), 256, 8).unwrap();
    let l = layout(200).unwrap();
    let blocks: Vec<_> = (0..20).map(|_| fixed.allocate_sync(l).unwrap()).collect();
    assert_eq!(fixed.upstream_allocations(), 3);
    for p in blocks {
        // SAFETY: allocated above with `l`.
        unsafe { fixed.deallocate_sync(p, l) };
    }
    assert_eq!(fixed.free_blocks(), 24);
}

#[test]
fn a_thread_that_exits_gives_its_cached_blocks_back() {
    let fixed = Arc::new(FixedSize::with_block_size(HostHeap::new(), 4096, 64).unwrap());
    let l = layout(4096).unwrap();
    let theirs = Arc::clone(&fixed);
    // `join` (unlike the end of a thread scope) waits for the thread's exit, cache
    // destructors included.
    std::thread::spawn(move || {
        let blocks: Vec<_> = (0..40)
            .map(|_| theirs.allocate(StreamRef::host(1), l).unwrap())
            .collect();
        for p in blocks {
            // SAFETY: allocated above with `l` on host stream 1.
            unsafe { theirs.deallocate(StreamRef::host(1), p, l) };
        }
    })
    .join()
    .unwrap();
    // The thread is gone; every block is back in a list this thread can count.
    assert_eq!(fixed.free_blocks(), 64);
    // And host stream 1's blocks serve other streams, all but the last, which stays in
    // its list for its own stream (else many streams holding one block each would take
    // each other's at every allocation); the 64th request grows.
    let mut blocks: Vec<_> = (0..63)
        .map(|_| fixed.allocate(StreamRef::host(2), l).unwrap())
        .collect();
    assert_eq!(fixed.upstream_allocations(), 1);
    blocks.push(fixed.allocate(StreamRef::host(2), l).unwrap());
    assert_eq!(fixed.upstream_allocations(), 2);
    for p in blocks {
        // SAFETY: as above, on host stream 2.
        unsafe { fixed.deallocate(StreamRef::host(2), p, l) };
    }
}

#[test]
fn a_thread_outliving_the_resource_leaves_it_alone() {
    let (cached, main_waits) = mpsc::channel::<()>();
    let (dropped, thread_waits) = mpsc::channel::<()>();
    let fixed = Arc::new(FixedSize::with_block_size(HostHeap::new(), 4096, 16).unwrap());
    let mine = Arc::clone(&fixed);
    let worker = std::thread::spawn(move || {
        let l = layout(100).unwrap();
        let p = mine.allocate_sync(l).unwrap();
        // SAFETY: allocated just above with `l`.
        unsafe { mine.deallocate_sync(p, l) };
        drop(mine);
        // The block sits in this thread's cache while the resource goes away.
        cached.send(()).unwrap();
        thread_waits.recv().unwrap();
        // Exiting now must not touch the dropped resource (valgrind checks this in CI).
    });
    main_waits.recv().unwrap();
    drop(Arc::try_unwrap(fixed).expect("the last handle"));
    dropped.send(()).unwrap();
    worker.join().unwrap();
}

#[test]
fn binning_bins_cannot_change_once_used() {
    let mut binning = Binning::new(
        Pool::new(HostHeap::new(), PoolConfig::new()).unwrap(),
        8,
        12,
    )
    .unwrap();
    assert_eq!(
        binning.bin_sizes().collect::<Vec<_>>(),
        [256, 512, 1024, 2048, 4096]
    );
    binning.add_fixed_bin(8192).unwrap();
    let l = layout(10_000).unwrap();
    let p = binning.allocate_sync(l).unwrap();
    // SAFETY: allocated just above with `l`.
    unsafe { binning.deallocate_sync(p, l) };
    let e = binning.add_fixed_bin(16384).unwrap_err();
    assert!(e.to_string().contains("handed out memory"), "{e}");
    assert!(Binning::new(HostHeap::new(), 12, 8).is_err());
}

/// Sizes that overflow when rounded up to 256 bytes (or when multiplied into a chunk) are
/// refused with `InvalidArgument`, not a panic or a bin of size 0.
#[test]
fn huge_block_and_bin_sizes_are_invalid_arguments() {
    for (block, per_chunk) in [
        (usize::MAX, 1),
        (usize::MAX - 255, 1),
        (isize::MAX as usize, 2),
        (1 << 20, usize::MAX),
    ] {
        match FixedSize::with_block_size(HostHeap::new(), block, per_chunk) {
            Err(Error::InvalidArgument(why)) => assert!(why.contains("blocks of"), "{why}"),
            other => panic!("{block} x {per_chunk}: {other:?}"),
        }
    }
    for size in [usize::MAX, usize::MAX - 255, isize::MAX as usize + 1] {
        let mut binning = Binning::without_bins(HostHeap::new());
        match binning.add_fixed_bin(size) {
            Err(Error::InvalidArgument(why)) => assert!(why.contains("bytes"), "{why}"),
            other => panic!("{size}: {other:?}"),
        }
        assert_eq!(binning.bin_sizes().count(), 0);
    }
}

/// A FixedSize whose upstream holds exactly one chunk of 16 blocks of 4 KiB.
fn one_chunk() -> Arc<FixedSize<Limiting<HostHeap>>> {
    let upstream = Limiting::new(HostHeap::new(), 16 * 4096);
    Arc::new(FixedSize::with_block_size(upstream, 4096, 16).unwrap())
}

/// Another thread takes every block of the only chunk and frees them into its cache.
fn cache_every_block(fixed: &FixedSize<Limiting<HostHeap>>) {
    let l = layout(4096).unwrap();
    let blocks: Vec<_> = (0..16).map(|_| fixed.allocate_sync(l).unwrap()).collect();
    for p in blocks {
        // SAFETY: allocated above with `l`.
        unsafe { fixed.deallocate_sync(p, l) };
    }
    assert_eq!(fixed.free_blocks(), 16, "all in this thread's cache");
}

/// Before reporting out-of-memory, a FixedSize asks the threads that cache its blocks to
/// give them back: a thread still calling the resource answers at its next call, and the
/// starving thread gets a block instead of `OutOfMemory`.
#[test]
fn a_starving_thread_gets_blocks_another_live_thread_had_cached() {
    let fixed = one_chunk();
    let l = layout(4096).unwrap();
    let (cached, main_waits) = mpsc::channel::<()>();
    let (done, worker_waits) = mpsc::channel::<()>();
    let theirs = Arc::clone(&fixed);
    let worker = std::thread::spawn(move || {
        cache_every_block(&theirs);
        cached.send(()).unwrap();
        // Keeps calling the resource (as a busy thread does) until told to stop.
        let small = layout(1).unwrap();
        while matches!(worker_waits.try_recv(), Err(mpsc::TryRecvError::Empty)) {
            if let Ok(p) = theirs.allocate_sync(small) {
                // SAFETY: allocated just above with `small`.
                unsafe { theirs.deallocate_sync(p, small) };
            }
            std::thread::sleep(std::time::Duration::from_micros(20));
        }
    });
    main_waits.recv().unwrap();
    assert_eq!(
        fixed.free_blocks(),
        0,
        "none in a list or in this thread's cache"
    );
    // Tries for up to a second (the worker may be slow to answer on a loaded machine or
    // under valgrind; only the first failure waits for it): what must not happen is a
    // failure every time.
    let got = (0..1000).find_map(|_| {
        let got = fixed.allocate_sync(l).ok();
        if got.is_none() {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        got
    });
    done.send(()).unwrap();
    worker.join().unwrap();
    let p = got.expect("the worker's cached blocks came back");
    assert_eq!(fixed.upstream_allocations(), 1, "no growth");
    // SAFETY: allocated above with `l`.
    unsafe { fixed.deallocate_sync(p, l) };
}

/// Whether the kernel offers `membarrier`'s private expedited command, with which a
/// reclaim takes an idle thread's cached blocks (else it can only ask).
fn membarrier_offered() -> bool {
    // SAFETY: `membarrier(MEMBARRIER_CMD_QUERY, 0, 0)` only returns a mask.
    let mask = unsafe { libc::syscall(libc::SYS_membarrier, 0 as libc::c_long, 0, 0) };
    mask >= 0 && mask & (1 << 3) != 0
}

/// A thread that caches blocks and then makes no call: a thread that runs out takes the
/// cached blocks from it (issue 33, finding 8: it used to get `OutOfMemory` until the
/// idle thread's next call), without the resource growing; the block the idle thread
/// still holds comes back when it frees it.
#[test]
fn an_idle_threads_cached_blocks_are_taken_before_out_of_memory() {
    if !membarrier_offered() {
        println!("memres-skip: no membarrier here: an idle thread's cache can only be asked");
        return;
    }
    let fixed = one_chunk();
    let l = layout(4096).unwrap();
    let (cached, main_waits) = mpsc::channel::<()>();
    let (touch, worker_waits) = mpsc::channel::<()>();
    let (touched, main_waits_again) = mpsc::channel::<()>();
    let theirs = Arc::clone(&fixed);
    let worker = std::thread::spawn(move || {
        // Every block, all but one freed into this thread's cache.
        let mut blocks: Vec<_> = (0..16).map(|_| theirs.allocate_sync(l).unwrap()).collect();
        let kept = blocks.pop().unwrap();
        for p in blocks {
            // SAFETY: allocated above with `l`.
            unsafe { theirs.deallocate_sync(p, l) };
        }
        cached.send(()).unwrap();
        worker_waits.recv().unwrap();
        // SAFETY: allocated above with `l`; freeing on host stream 7 means "unused now".
        unsafe { theirs.deallocate(StreamRef::host(7), kept, l) };
        touched.send(()).unwrap();
        worker_waits.recv().unwrap();
    });
    main_waits.recv().unwrap();
    let mut blocks: Vec<_> = (0..15)
        .map(|_| {
            fixed
                .allocate_sync(l)
                .expect("taken from the idle thread's cache")
        })
        .collect();
    assert_eq!(fixed.upstream_allocations(), 1, "no growth");
    assert!(matches!(
        fixed.allocate_sync(l),
        Err(Error::OutOfMemory { .. })
    ));
    touch.send(()).unwrap();
    main_waits_again.recv().unwrap();
    blocks.push(fixed.allocate_sync(l).expect("the block freed last"));
    touch.send(()).unwrap();
    worker.join().unwrap();
    for p in blocks {
        // SAFETY: allocated above with `l`.
        unsafe { fixed.deallocate_sync(p, l) };
    }
}

/// Threads sharing one stream have lists of their own ("lanes"); blocks one of them
/// freed serve another without the resource growing.
#[test]
fn threads_sharing_a_stream_reuse_each_others_blocks_without_growing() {
    // Blocks of 8 MiB are not cached per thread (a cache's blocks come back only at its
    // next call or after its thread's exit, which a scope's join does not wait for): the
    // frees go straight to the freeing thread's lane.
    let fixed = FixedSize::with_block_size(HostHeap::new(), 8 << 20, 16).unwrap();
    let (l, s) = (layout(8 << 20).unwrap(), StreamRef::DEFAULT);
    // Addresses, to cross to the other thread.
    let blocks: Vec<usize> = (0..16)
        .map(|_| fixed.allocate(s, l).unwrap().as_ptr().expose_provenance())
        .collect();
    std::thread::scope(|scope| {
        scope.spawn(|| {
            memres::suballoc::own_lane();
            for a in blocks {
                let p = std::ptr::NonNull::new(std::ptr::with_exposed_provenance_mut(a));
                // SAFETY: allocated above with `l` on `s`; nothing uses them.
                unsafe { fixed.deallocate(s, p.unwrap(), l) };
            }
        });
    });
    let again: Vec<_> = (0..16).map(|_| fixed.allocate(s, l).unwrap()).collect();
    assert_eq!(
        fixed.upstream_allocations(),
        1,
        "no growth: the other lane's blocks"
    );
    for p in again {
        // SAFETY: as above.
        unsafe { fixed.deallocate(s, p, l) };
    }
}
