//! Stream identity: a pool keys its free lists by stream handle. A stream destroyed with
//! work still pending on memory it freed to the pool can hand its handle to a new stream,
//! which then takes that memory at once, without waiting. `StreamRef::from_raw`'s safety
//! rule forbids it (the stream's work must be complete before it is destroyed), and
//! memres's own `Stream` keeps the rule by synchronising on drop. The test checks that
//! path, round after round with the handle recycled, and measures what breaking the
//! rule does (on `nvidia-h100-x2` with both GPUs visible the old work overtakes the new
//! stream's write; on one GPU it did not in any round). It needs a GPU: CI skips it
//! (`#[ignore]`), the GPU bundle's `run.sh` runs it.

// A HIP build (feature `hip`) leaves these out: they check results through cudarc's
// CUDA calls. docs/platforms.md says what runs on an AMD GPU instead.
#![cfg(not(feature = "hip"))]

use cudarc::driver::sys::{self, CUresult, CUstream};
use memres::stream::{Stream, StreamFlags};
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

/// New streams until one has `handle` (those made meanwhile are kept alive, so each is
/// new), and the others to destroy afterwards.
fn stream_with_handle(handle: CUstream) -> (Option<CUstream>, Vec<CUstream>) {
    let mut others = Vec::new();
    for _ in 0..64 {
        let s = create();
        if s == handle {
            return (Some(s), others);
        }
        others.push(s);
    }
    (None, others)
}

/// One round: a stream (memres's `Stream` if `owned`, else a raw one destroyed without a
/// wait) takes the pool's block, queues 100 sets of 0xAA on it and frees it; it is
/// dropped; a new stream with its handle takes the block at once and sets 0xBB. Returns
/// whether the handle came back, and whether the new stream's write survived.
fn round(pool: &Pool<Cuda>, owned: bool) -> (bool, bool) {
    let l = layout(N).unwrap();
    let handle = if owned {
        let a = Stream::with_flags(StreamFlags::NonBlocking).unwrap();
        let p = pool.allocate(a.as_ref(), l).unwrap();
        set(p.as_ptr(), 0xAA, a.raw().cast(), 100);
        // SAFETY: allocated above on `a`; its work is on `a`.
        unsafe { pool.deallocate(a.as_ref(), p, l) };
        let handle = a.raw().cast();
        drop(a); // synchronises, then destroys
        handle
    } else {
        let a = create();
        // SAFETY: `a` lives until destroyed below, after its last use as a handle.
        let on_a = unsafe { StreamRef::from_raw(a.cast()) };
        let p = pool.allocate(on_a, l).unwrap();
        set(p.as_ptr(), 0xAA, a, 100);
        // SAFETY: allocated above on `a`; its work is on `a`.
        unsafe { pool.deallocate(on_a, p, l) };
        // Destroyed with the work pending: what `from_raw`'s rule forbids.
        // SAFETY: ours; the driver finishes its work before releasing it.
        ok(unsafe { sys::cuStreamDestroy_v2(a) });
        a
    };
    let (b, mut others) = stream_with_handle(handle);
    let mut survived = true;
    if let Some(b) = b {
        // SAFETY: `b` lives until destroyed below.
        let on_b = unsafe { StreamRef::from_raw(b.cast()) };
        let q = pool.allocate(on_b, l).unwrap();
        set(q.as_ptr(), 0xBB, b, 1);
        // SAFETY: the whole device is idle after this.
        ok(unsafe { sys::cuCtxSynchronize() });
        survived = first_byte_and_last(q.as_ptr()) == (0xBB, 0xBB);
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
    (b.is_some(), survived)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_recycled_stream_handle_does_not_reuse_memory_before_the_old_work_is_done() {
    let pool = Pool::new(Cuda::new().unwrap(), PoolConfig::new().initial_size(N)).unwrap();
    let mut recycled = 0;
    for r in 0..20 {
        let (came_back, survived) = round(&pool, true);
        recycled += usize::from(came_back);
        assert!(
            survived,
            "round {r}: the new stream's write was overtaken by the old work"
        );
    }
    // Breaking the rule: measured, not asserted (the driver decides).
    let (mut raw_recycled, mut overtaken) = (0, 0);
    for _ in 0..20 {
        let (came_back, survived) = round(&pool, false);
        raw_recycled += usize::from(came_back);
        overtaken += usize::from(!survived);
    }
    println!(
        "memres's Stream: its handle came back to a new stream in {recycled} of 20 rounds, \
         the new write survived in all; raw streams destroyed with work pending: handle \
         back in {raw_recycled}, the new write overtaken in {overtaken}"
    );
    if recycled == 0 {
        println!("memres-skip: the driver never handed a dropped stream's handle to a new one");
    }
}
