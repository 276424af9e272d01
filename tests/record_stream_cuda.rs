//! `Resource::deallocate_used_on` (PyTorch's `record_stream`) on a GPU: a block written on
//! a main stream is read on a side stream after long work there, freed on the main stream
//! with the side stream named, and a block of the same size is written at once on the
//! main stream. The side stream must read the first block's bytes, for every resource.
//! The control shows the hazard is real: freed with a plain `deallocate`, the block is
//! handed out again and the side stream reads the new bytes. Needs a GPU: CI skips
//! these (`#[ignore]`), the GPU bundle's `run.sh` runs them.

// A HIP build (feature `hip`) leaves these out: they check results through cudarc's
// CUDA calls. docs/platforms.md says what runs on an AMD GPU instead.
#![cfg(not(feature = "hip"))]

use cudarc::driver::sys;
use memres::adaptor::Statistics;
use memres::stream::{Stream, StreamFlags};
use memres::suballoc::{
    Arena, Binning, FixedSize, Pool, PoolConfig, SegmentPool, SegmentPoolConfig, VirtualPool,
    VirtualPoolConfig,
};
use memres::{AnyResource, Cuda, CudaVirtual, Device, Resource, layout, upstream::CudaAsync};

/// The block's size: 64 MiB.
const N: usize = 64 << 20;
/// Bytes the side stream sets before it reads: 256 MiB, 100 times (a few ms).
const BUSY: usize = 256 << 20;

fn check(r: sys::CUresult) {
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
}

fn fill(p: u64, n: usize, value: u8, stream: &Stream) {
    // SAFETY: `p` holds `n` device bytes, valid on `stream` for the enqueued work.
    check(unsafe { sys::cuMemsetD8Async(p, value, n, stream.raw().cast()) });
}

/// How many of the bytes the side stream read are not the first block's; whether the
/// second block was the first one's memory.
fn hazard<R: Resource>(r: &R, record: bool) -> (usize, bool) {
    let main = Stream::with_flags(StreamFlags::NonBlocking).unwrap();
    let side = Stream::with_flags(StreamFlags::NonBlocking).unwrap();
    let cuda = Cuda::new().unwrap();
    let (busy, seen) = (layout(BUSY).unwrap(), layout(N).unwrap());
    let busy_p = cuda.allocate(side.as_ref(), busy).unwrap();
    let seen_p = cuda.allocate(side.as_ref(), seen).unwrap();
    let l = layout(N).unwrap();
    let x = r.allocate(main.as_ref(), l).unwrap();
    fill(x.as_ptr() as u64, N, 0x11, &main);
    side.as_ref().wait_for_stream(main.as_ref()).unwrap();
    for _ in 0..100 {
        fill(busy_p.as_ptr() as u64, BUSY, 0, &side);
    }
    // SAFETY: both blocks hold N bytes, used on `side` in its order.
    check(unsafe {
        sys::cuMemcpyDtoDAsync_v2(
            seen_p.as_ptr() as u64,
            x.as_ptr() as u64,
            N,
            side.raw().cast(),
        )
    });
    // SAFETY: allocated above with `l`; its last uses are on `main` and `side`, both
    // enqueued before this free; with `record` the side stream is named.
    unsafe {
        if record {
            r.deallocate_used_on(main.as_ref(), x, l, &[side.as_ref()]);
        } else {
            r.deallocate(main.as_ref(), x, l);
        }
    }
    let y = r.allocate(main.as_ref(), l).unwrap();
    fill(y.as_ptr() as u64, N, 0x22, &main);
    main.synchronize().unwrap();
    side.synchronize().unwrap();
    let mut host = vec![0u8; N];
    // SAFETY: `seen_p` holds N device bytes; both streams are done.
    check(unsafe { sys::cuMemcpyDtoH_v2(host.as_mut_ptr().cast(), seen_p.as_ptr() as u64, N) });
    let wrong = host.iter().filter(|&&b| b != 0x11).count();
    let reused = x == y;
    // SAFETY: each allocated above with its layout; both streams are done.
    unsafe {
        r.deallocate(main.as_ref(), y, l);
        cuda.deallocate(side.as_ref(), busy_p, busy);
        cuda.deallocate(side.as_ref(), seen_p, seen);
    }
    (wrong, reused)
}

/// Ten trials with the side stream named: none reads a byte of the second block.
fn safe<R: Resource>(r: &R, what: &str) {
    for trial in 0..10 {
        let (wrong, _) = hazard(r, true);
        assert_eq!(wrong, 0, "{what}, trial {trial}: {wrong} bytes overwritten");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn without_naming_the_side_stream_the_pool_hands_the_block_out_again() {
    let pool = Pool::new(Cuda::new().unwrap(), PoolConfig::new()).unwrap();
    let (wrong, reused) = hazard(&pool, false);
    assert!(
        reused,
        "the pool reuses a block freed on the same stream at once"
    );
    assert!(
        wrong > 0,
        "the hazard did not show: the side stream read the old bytes"
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn pool() {
    safe(
        &Pool::new(Cuda::new().unwrap(), PoolConfig::new()).unwrap(),
        "Pool",
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn virtual_pool() {
    let pool = VirtualPool::new(CudaVirtual::new().unwrap(), VirtualPoolConfig::new()).unwrap();
    safe(&pool, "VirtualPool");
}

/// Held blocks of PyTorch's graph-pool shape: events recorded at the free, the block
/// back once they complete.
#[test]
#[ignore = "needs a CUDA GPU"]
fn segment_pool() {
    let pool = SegmentPool::new(Cuda::new().unwrap(), SegmentPoolConfig::new()).unwrap();
    safe(&pool, "SegmentPool");
    pool.settle(memres::suballoc::Settle::Wait);
    assert_eq!(pool.live_blocks(), 0);
    assert!(pool.blocks().iter().all(|b| !b.allocated));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn arena() {
    safe(
        &Arena::with_size(Cuda::new().unwrap(), 1 << 30).unwrap(),
        "Arena",
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fixed_size() {
    safe(
        &FixedSize::with_block_size(Cuda::new().unwrap(), N, 4).unwrap(),
        "FixedSize",
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn binning() {
    let mut bins =
        Binning::without_bins(Pool::new(Cuda::new().unwrap(), PoolConfig::new()).unwrap());
    bins.add_fixed_bin(N).unwrap();
    safe(&bins, "Binning");
}

/// The leaves get the trait's default: the freeing stream waits for the side stream.
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_async_and_cuda() {
    safe(&CudaAsync::new().unwrap(), "CudaAsync");
    safe(&Cuda::new().unwrap(), "Cuda");
}

/// Through an adaptor and erasure to the pool's own hold.
#[test]
#[ignore = "needs a CUDA GPU"]
fn statistics_over_an_erased_pool() {
    let pool = Pool::new(Cuda::new().unwrap(), PoolConfig::new()).unwrap();
    let stack = Statistics::new(AnyResource::<Device>::new(pool));
    safe(&stack, "Statistics<AnyResource<Pool>>");
    assert_eq!(stack.snapshot().bytes.current, 0);
}

/// A pool capped at one block: the held block comes back after a wait instead of an
/// out-of-memory (the failure path waits for the held blocks' streams).
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_capped_pool_waits_for_held_blocks_before_running_out() {
    let pool = Pool::new(
        Cuda::new().unwrap(),
        PoolConfig::new().initial_size(N).maximum_size(N),
    )
    .unwrap();
    for trial in 0..5 {
        let (wrong, reused) = hazard(&pool, true);
        assert!(reused, "only one block fits");
        assert_eq!(wrong, 0, "trial {trial}");
    }
    assert_eq!(pool.stats().waiting_bytes, 0);
}
