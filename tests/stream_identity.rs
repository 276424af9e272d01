//! Stream identity: a pool keys its free lists by stream handle. A stream destroyed with
//! work still pending on memory it freed to the pool could, in principle, hand its
//! handle to a new stream, which would then take that memory at once, without waiting.
//! These tests provoke exactly that and check that the new stream's writes win. They
//! need a GPU: CI skips them (`#[ignore]`), the GPU bundle's `run.sh` runs them.

use cudarc::driver::sys::{self, CUresult, CUstream};
use memres::suballoc::{Pool, PoolConfig};
use memres::{Cuda, Resource, StreamRef, layout};

const N: usize = 64 << 20;

fn ok(r: CUresult) {
    assert_eq!(r, CUresult::CUDA_SUCCESS);
}

fn create() -> CUstream {
    let mut s = std::ptr::null_mut();
    let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
    // SAFETY: a context is current (the pool made it so); `s` is a valid place.
    ok(unsafe { sys::cuStreamCreate(&mut s, flags) });
    s
}

fn set(p: *mut u8, value: u8, stream: CUstream, times: usize) {
    for _ in 0..times {
        // SAFETY: `p` holds `N` device bytes, valid in order on `stream`.
        ok(unsafe { sys::cuMemsetD8Async(p as u64, value, N, stream) });
    }
}

fn first_byte_and_last(p: *mut u8) -> (u8, u8) {
    let (mut a, mut b) = (0u8, 0u8);
    // SAFETY: `p` holds `N` device bytes, idle (the device was synchronised).
    unsafe {
        ok(sys::cuMemcpyDtoH_v2(
            (&mut a as *mut u8).cast(),
            p as u64,
            1,
        ));
        ok(sys::cuMemcpyDtoH_v2(
            (&mut b as *mut u8).cast(),
            p as u64 + N as u64 - 1,
            1,
        ));
    }
    (a, b)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_recycled_stream_handle_does_not_reuse_memory_before_the_old_work_is_done() {
    let pool = Pool::new(Cuda::new().unwrap(), PoolConfig::new().initial_size(N)).unwrap();
    let l = layout(N).unwrap();
    let (mut recycled, mut inherited, mut busy) = (0, 0, 0);
    let mut destroy_us = 0;
    for round in 0..20 {
        let a = create();
        // SAFETY: `a` lives until destroyed below, after its last use as a handle.
        let on_a = unsafe { StreamRef::from_raw(a) };
        let p = pool.allocate(on_a, l).unwrap();
        set(p.as_ptr(), 0xAA, a, 100); // long work on A
        // SAFETY: allocated above on `a`; its work is on `a`.
        unsafe { pool.deallocate(on_a, p, l) };
        // SAFETY: a live stream.
        if unsafe { sys::cuStreamQuery(a) } == CUresult::CUDA_ERROR_NOT_READY {
            busy += 1;
        }
        // Destroyed with the work pending, as dropping a cudarc stream does.
        let started = std::time::Instant::now();
        // SAFETY: ours; the driver finishes its work before releasing it.
        ok(unsafe { sys::cuStreamDestroy_v2(a) });
        destroy_us = destroy_us.max(started.elapsed().as_micros());
        // New streams until one has A's handle (kept alive meanwhile, so each is new).
        let mut others = Vec::new();
        let mut b = None;
        for _ in 0..64 {
            let s = create();
            if s == a {
                b = Some(s);
                break;
            }
            others.push(s);
        }
        if let Some(b) = b {
            recycled += 1;
            // SAFETY: a live stream.
            if unsafe { sys::cuStreamQuery(b) } == CUresult::CUDA_ERROR_NOT_READY {
                inherited += 1;
            }
            // SAFETY: `b` lives until destroyed below.
            let on_b = unsafe { StreamRef::from_raw(b) };
            let q = pool.allocate(on_b, l).unwrap();
            set(q.as_ptr(), 0xBB, b, 1);
            // SAFETY: the whole device is idle after this.
            ok(unsafe { sys::cuCtxSynchronize() });
            assert_eq!(
                first_byte_and_last(q.as_ptr()),
                (0xBB, 0xBB),
                "round {round}: B's write was overtaken by A's pending work"
            );
            // SAFETY: allocated above on `b`.
            unsafe { pool.deallocate(on_b, q, l) };
            others.push(b);
        }
        for s in others {
            // SAFETY: ours, not used any more.
            ok(unsafe { sys::cuStreamDestroy_v2(s) });
        }
        // SAFETY: the whole device is idle after this.
        ok(unsafe { sys::cuCtxSynchronize() });
    }
    println!(
        "the stream was busy when destroyed in {busy} of 20 rounds; its handle came back to a \
         new stream in {recycled}; in {inherited} of those the new stream still had the old \
         one's work pending; the longest cuStreamDestroy took {destroy_us} us"
    );
}
