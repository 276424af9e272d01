//! The sub-allocators on a GPU: stream-ordered reuse under real concurrent work, streams
//! destroyed after freeing, per-thread default streams, pinned-host pools running out.
//! They need a GPU: CI skips them (`#[ignore]`), the GPU bundle's `run.sh` runs them.

// A HIP build (feature `hip`) leaves these out: they check results through cudarc's
// CUDA calls. docs/platforms.md says what runs on an AMD GPU instead.
#![cfg(not(feature = "hip"))]

use cudarc::driver::sys;
use memres::adaptor::Limiting;
use memres::stream::{Stream, StreamFlags};
use memres::suballoc::{Arena, FixedSize, Pool, PoolConfig};
use memres::{Cuda, Error, Resource, StreamRef, SyncResource, layout, upstream::PinnedHost};

const N: usize = 256 << 20;

fn check(r: sys::CUresult) {
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
}

/// Fills `n` bytes at `p` with `value` on `stream`, `times` times over (long work).
fn fill(p: *mut u8, n: usize, value: u8, stream: &Stream, times: usize) {
    for _ in 0..times {
        // SAFETY: `p` holds `n` device bytes, valid on `stream` for the enqueued work.
        check(unsafe { sys::cuMemsetD8Async(p as u64, value, n, stream.raw().cast()) });
    }
}

/// Allocates on A, writes the block on A for a long while, frees on A; allocates the
/// same size on B (the resource cannot grow, so it must hand out A's block) and writes it
/// once on B. Once both streams are done, the block holds B's bytes, never A's.
fn race<R: Resource>(r: &R, what: &str) {
    let a = Stream::with_flags(StreamFlags::NonBlocking).unwrap();
    let b = Stream::with_flags(StreamFlags::NonBlocking).unwrap();
    let l = layout(N).unwrap();
    let p = r.allocate(a.as_ref(), l).unwrap();
    fill(p.as_ptr(), N, 0xAA, &a, 200);
    // SAFETY: allocated on `a` with `l`; all work on it is enqueued on `a`.
    unsafe { r.deallocate(a.as_ref(), p, l) };
    let q = r.allocate(b.as_ref(), l).unwrap();
    assert_eq!(p, q, "{what}: B should get A's block back");
    fill(q.as_ptr(), N, 0xBB, &b, 1);
    a.synchronize().unwrap();
    b.synchronize().unwrap();
    let mut host = vec![0u8; N];
    // SAFETY: `q` holds N device bytes; `host` holds N bytes; both streams are done.
    check(unsafe { sys::cuMemcpyDtoH_v2(host.as_mut_ptr().cast(), q.as_ptr() as u64, N) });
    let wrong = host.iter().filter(|&&x| x != 0xBB).count();
    assert_eq!(wrong, 0, "{what}: {wrong} bytes are not B's");
    // SAFETY: allocated on `b` with `l`; its work is done.
    unsafe { r.deallocate(b.as_ref(), q, l) };
}

/// Allocates on A, writes the block on A for a long while, frees on A, then trims: the
/// trim moves the block to the host list, which serves any stream at once, so it must
/// have waited for A's work. Then the block is taken on the host stream and written
/// synchronously (on the legacy default stream, which does not wait for the non-blocking
/// A): once A is done, the block holds the host's bytes, never A's.
fn trim_then_reuse<R: Resource>(r: &R, trim: impl Fn(), what: &str) {
    let a = Stream::with_flags(StreamFlags::NonBlocking).unwrap();
    let l = layout(N).unwrap();
    let p = r.allocate(a.as_ref(), l).unwrap();
    fill(p.as_ptr(), N, 0xAA, &a, 200);
    // SAFETY: allocated on `a` with `l`; all work on it is enqueued on `a`.
    unsafe { r.deallocate(a.as_ref(), p, l) };
    trim();
    let q = r.allocate(StreamRef::HOST, l).unwrap();
    assert_eq!(p, q, "{what}: the host stream should get A's block back");
    // SAFETY: `q` holds N device bytes, handed to the host stream: usable at once.
    check(unsafe { sys::cuMemsetD8_v2(q.as_ptr() as u64, 0xBB, N) });
    a.synchronize().unwrap();
    let mut host = vec![0u8; N];
    // SAFETY: `q` holds N device bytes; `host` holds N bytes; all work is done.
    check(unsafe { sys::cuMemcpyDtoH_v2(host.as_mut_ptr().cast(), q.as_ptr() as u64, N) });
    let wrong = host.iter().filter(|&&x| x != 0xBB).count();
    assert_eq!(
        wrong, 0,
        "{what}: {wrong} bytes are A's, written after the trim"
    );
    // SAFETY: allocated on the host stream with `l`; its work is done.
    unsafe { r.deallocate(StreamRef::HOST, q, l) };
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn arena_trim_waits_for_the_streams_of_what_it_moves() {
    let arena = Arena::with_size(Cuda::new().unwrap(), N).unwrap();
    trim_then_reuse(&arena, || arena.trim().unwrap(), "Arena");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fixed_size_trim_waits_for_the_streams_of_what_it_moves() {
    let upstream = Limiting::new(Cuda::new().unwrap(), N);
    let fixed = FixedSize::with_block_size(upstream, N, 1).unwrap();
    trim_then_reuse(&fixed, || fixed.trim().unwrap(), "FixedSize");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn pool_reuse_across_streams_waits_for_the_first() {
    let pool = Pool::new(
        Cuda::new().unwrap(),
        PoolConfig::new().initial_size(N).maximum_size(N),
    )
    .unwrap();
    race(&pool, "Pool");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn arena_reuse_across_streams_waits_for_the_first() {
    let arena = Arena::with_size(Cuda::new().unwrap(), N).unwrap();
    race(&arena, "Arena");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fixed_size_reuse_across_streams_waits_for_the_first() {
    // One chunk of one block, and an upstream that refuses a second.
    let upstream = Limiting::new(Cuda::new().unwrap(), N);
    let fixed = FixedSize::with_block_size(upstream, N, 1).unwrap();
    race(&fixed, "FixedSize");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_stream_destroyed_after_freeing_on_it() {
    let pool = Pool::new(
        Cuda::new().unwrap(),
        PoolConfig::new().initial_size(N).maximum_size(N),
    )
    .unwrap();
    let l = layout(N).unwrap();
    {
        let s = Stream::with_flags(StreamFlags::NonBlocking).unwrap();
        let p = pool.allocate(s.as_ref(), l).unwrap();
        fill(p.as_ptr(), N, 1, &s, 20);
        // SAFETY: allocated on `s` with `l`; its work is on `s`.
        unsafe { pool.deallocate(s.as_ref(), p, l) };
        // `s` is destroyed here, with work still running on it.
    }
    let other = Stream::new().unwrap();
    let p = pool.allocate(other.as_ref(), l).unwrap();
    // SAFETY: as above.
    unsafe { pool.deallocate(other.as_ref(), p, l) };
    assert_eq!(pool.trim().unwrap(), N);
    drop(pool);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn per_thread_default_streams_get_lists_of_their_own() {
    let pool = Pool::new(
        Cuda::new().unwrap(),
        PoolConfig::new().initial_size(64 << 20),
    )
    .unwrap();
    let l = layout(1 << 20).unwrap();
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                let _on = memres::device::DeviceGuard::new(memres::device::DeviceId::new(0));
                for _ in 0..1000 {
                    let p = pool.allocate(StreamRef::PER_THREAD, l).unwrap();
                    // SAFETY: allocated just above on this thread's per-thread stream.
                    unsafe { pool.deallocate(StreamRef::PER_THREAD, p, l) };
                }
            });
        }
    });
    let stats = pool.stats();
    assert_eq!(stats.free_bytes, stats.pool_size);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_pinned_host_pool_runs_out_cleanly() {
    let pool = Pool::new(
        PinnedHost::new().unwrap(),
        PoolConfig::new()
            .initial_size(1 << 20)
            .maximum_size(4 << 20),
    )
    .unwrap();
    let three = layout(3 << 20).unwrap();
    let p = pool.allocate_sync(three).unwrap();
    match pool.allocate_sync(layout(2 << 20).unwrap()) {
        Err(Error::OutOfMemory {
            requested, limit, ..
        }) => assert_eq!((requested, limit), (2 << 20, Some(4 << 20))),
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    // The memory is host memory: the host may write it.
    // SAFETY: `p` holds 3 MiB of pinned host memory, unused by any stream.
    unsafe { p.as_ptr().write_bytes(7, 3 << 20) };
    // SAFETY: allocated above with `three`.
    unsafe { pool.deallocate_sync(p, three) };
}

/// A thread writes a block on its per-thread default stream for a long while, frees it
/// there and exits; a new thread (which takes over the exited thread's list, or merges
/// it after a wait) gets the same block and writes it once on its own per-thread stream.
/// The new thread's bytes must win: taking over a list waits for the old thread's work.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_new_thread_reusing_an_exited_threads_list_waits_for_its_work() {
    let pool = Pool::new(
        Cuda::new().unwrap(),
        PoolConfig::new().initial_size(N).maximum_size(N),
    )
    .unwrap();
    let l = layout(N).unwrap();
    // CUDA's per-thread default stream handle (`CU_STREAM_PER_THREAD`).
    let per_thread = || 0x2usize as sys::CUstream;
    let fill_here = |p: *mut u8, value: u8, times: usize| {
        for _ in 0..times {
            // SAFETY: `p` holds N device bytes, valid on this thread's per-thread stream.
            check(unsafe { sys::cuMemsetD8Async(p as u64, value, N, per_thread()) });
        }
    };
    let on_device = || memres::device::DeviceGuard::new(memres::device::DeviceId::new(0));
    let first = std::thread::scope(|s| {
        s.spawn(|| {
            let _on = on_device();
            let p = pool.allocate(StreamRef::PER_THREAD, l).unwrap();
            fill_here(p.as_ptr(), 0xAA, 200);
            // SAFETY: allocated on this thread's per-thread stream; its work is there.
            unsafe { pool.deallocate(StreamRef::PER_THREAD, p, l) };
            p.as_ptr() as usize
        })
        .join()
        .unwrap()
    });
    std::thread::scope(|s| {
        s.spawn(|| {
            let _on = on_device();
            let q = pool.allocate(StreamRef::PER_THREAD, l).unwrap();
            assert_eq!(q.as_ptr() as usize, first, "the pool holds one block");
            fill_here(q.as_ptr(), 0xBB, 1);
            // SAFETY: waits for this thread's per-thread stream.
            check(unsafe { sys::cuStreamSynchronize(per_thread()) });
            // SAFETY: waits for all work of the context (the first thread's too).
            check(unsafe { sys::cuCtxSynchronize() });
            let mut host = vec![0u8; N];
            // SAFETY: `q` holds N device bytes; `host` N bytes; all work is done.
            check(unsafe { sys::cuMemcpyDtoH_v2(host.as_mut_ptr().cast(), q.as_ptr() as u64, N) });
            let wrong = host.iter().filter(|&&x| x != 0xBB).count();
            assert_eq!(wrong, 0, "{wrong} bytes are the exited thread's");
            // SAFETY: allocated on this thread's per-thread stream; its work is done.
            unsafe { pool.deallocate(StreamRef::PER_THREAD, q, l) };
        })
        .join()
        .unwrap();
    });
}
