//! The guard adaptor: the conformance suite through it, overruns and underruns found on
//! host memory here and on device memory on a GPU (those tests are `#[ignore]`d; the GPU
//! bundle's `run.sh` runs them).

#[macro_use]
mod conformance;

use std::alloc::Layout;

use conformance::Caps;
use memres::adaptor::{Guard, Overrun, Side};
use memres::suballoc::{Pool, PoolConfig};
use memres::{Error, HostHeap, Resource, ResourceExt, StreamRef, SyncResource, layout};

conformance_tests!(guard, Guard::new(HostHeap::new()), Caps::host());
conformance_tests!(
    guard_over_pool,
    Guard::with_pad(Pool::new(HostHeap::new(), PoolConfig::new()).unwrap(), 8).unwrap(),
    Caps::host()
);

/// Allocates `size` bytes, writes `value` at `offset` from the block's start (negative:
/// below it), frees; returns what the guard found.
fn write_and_free<R: SyncResource>(guard: &Guard<R>, size: usize, offset: isize) -> Vec<Overrun> {
    let before = guard.reports().len();
    let l = layout(size).unwrap();
    let p = guard.allocate_sync(l).unwrap();
    // SAFETY: the block has `size` bytes and the guard's pads around it: every offset the
    // tests use lies in the upstream block (it is the bug under test, not a real one).
    unsafe { p.as_ptr().offset(offset).write(0x5A) };
    // SAFETY: allocated above with `l`.
    unsafe { guard.deallocate_sync(p, l) };
    guard.reports()[before..].to_vec()
}

#[test]
fn a_one_byte_overrun_and_underrun_on_the_host_are_reported() {
    let guard = Guard::new(HostHeap::new());
    let over = write_and_free(&guard, 100, 100);
    assert_eq!(over.len(), 1);
    let r = &over[0];
    assert_eq!(
        (r.side, r.offset, r.damaged, r.size),
        (Side::After, 0, 1, 100)
    );
    assert!(r.to_string().contains("overrun"), "{r}");

    let under = write_and_free(&guard, 100, -1);
    assert_eq!(under.len(), 1);
    assert_eq!((under[0].side, under[0].offset), (Side::Before, 0));
    assert_ne!(under[0].address, 0);
    assert_eq!(guard.found(), 2);
}

#[test]
fn writes_inside_the_block_are_not_reported() {
    let guard = Guard::new(HostHeap::new());
    for size in [1, 255, 256, 4097] {
        for offset in [0, size as isize - 1] {
            assert!(write_and_free(&guard, size, offset).is_empty());
        }
    }
    assert_eq!(guard.found(), 0);
}

#[test]
fn far_writes_report_their_distance_and_edge_bytes_of_the_pad_count() {
    let guard = Guard::with_pad(HostHeap::new(), 64).unwrap();
    let r = write_and_free(&guard, 1000, 1000 + 63);
    assert_eq!((r[0].side, r[0].offset), (Side::After, 63));
    let r = write_and_free(&guard, 1000, -64);
    assert_eq!((r[0].side, r[0].offset), (Side::Before, 63));
}

#[test]
fn an_overrun_into_the_next_pooled_block_is_caught() {
    // The pool hands out neighbouring blocks: without the guard a write past the first
    // lands silently in the second.
    let guard = Pool::new(HostHeap::new(), PoolConfig::new().initial_size(1 << 20))
        .unwrap()
        .with_guard();
    let l = layout(512).unwrap();
    let a = guard.allocate_sync(l).unwrap();
    let b = guard.allocate_sync(l).unwrap();
    // SAFETY: the 8 bytes past `a` lie in its back pad (the bug under test).
    unsafe { a.as_ptr().add(512).write_bytes(0, 8) };
    // SAFETY: both allocated above with `l`.
    unsafe {
        guard.deallocate_sync(b, l);
        guard.deallocate_sync(a, l);
    }
    assert_eq!(guard.found(), 1);
    let r = &guard.reports()[0];
    assert_eq!((r.address, r.damaged), (a.as_ptr() as usize, 8));
}

#[test]
fn blocks_keep_their_alignment_and_zero_bytes_pass_through() {
    let guard = Guard::with_pad(HostHeap::new(), 3).unwrap();
    for align in [1, 8, 256, 4096] {
        let l = Layout::from_size_align(10, align).unwrap();
        let p = guard.allocate_sync(l).unwrap();
        assert_eq!(p.as_ptr() as usize % align.max(256), 0);
        // SAFETY: allocated above with `l`.
        unsafe { guard.deallocate_sync(p, l) };
    }
    let l = layout(0).unwrap();
    let p = guard.allocate(StreamRef::HOST, l).unwrap();
    // SAFETY: allocated above with `l` on the host stream.
    unsafe { guard.deallocate(StreamRef::HOST, p, l) };
    assert_eq!(guard.found(), 0);
}

#[test]
fn reports_name_the_allocating_stack_when_asked_to() {
    let guard = Guard::new(HostHeap::new()).with_backtraces();
    let r = write_and_free(&guard, 64, 64);
    let trace = r[0].backtrace.as_deref().expect("a captured stack");
    // Binaries stripped of symbols (the GPU bundle's) show frames without names.
    assert!(
        trace.contains("write_and_free") || trace.contains("<unknown>"),
        "{trace}"
    );
    let plain = Guard::new(HostHeap::new());
    assert_eq!(write_and_free(&plain, 64, 64)[0].backtrace, None);
}

#[test]
fn bad_pads_are_invalid_arguments_and_huge_requests_are_out_of_memory() {
    assert!(matches!(
        Guard::with_pad(HostHeap::new(), 0),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        Guard::with_pad(HostHeap::new(), (1 << 20) + 1),
        Err(Error::InvalidArgument(_))
    ));
    let guard = Guard::new(HostHeap::new());
    let huge = Layout::from_size_align(isize::MAX as usize - 300, 1).unwrap();
    match guard.allocate_sync(huge) {
        Err(Error::OutOfMemory { requested, .. }) => assert_eq!(requested, huge.size()),
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
}

#[test]
fn only_the_first_reports_are_kept_but_all_are_counted() {
    let guard = Guard::with_pad(HostHeap::new(), 1).unwrap();
    for _ in 0..100 {
        write_and_free(&guard, 8, 8);
    }
    assert_eq!(guard.found(), 100);
    assert_eq!(guard.reports().len(), 64);
}

// Not in a HIP build: `set` writes through cudarc's CUDA call.
#[cfg(not(feature = "hip"))]
mod gpu {
    use super::*;
    use cudarc::driver::sys;
    use memres::Cuda;
    use memres::stream::{Stream, StreamFlags};

    fn set(p: *mut u8, n: usize, value: u8, stream: &Stream) {
        // SAFETY: the tests pass bytes inside the upstream block of a live guarded block,
        // valid in order on `stream`.
        let r = unsafe { sys::cuMemsetD8Async(p as u64, value, n, stream.raw().cast()) };
        assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    }

    /// Allocates on `stream`, has the device write one byte at `offset`, frees on the
    /// stream: the check is enqueued and made later.
    fn device_write<R: Resource>(guard: &Guard<R>, stream: &Stream, offset: isize) {
        let l = layout(1000).unwrap();
        let p = guard.allocate(stream.as_ref(), l).unwrap();
        set(p.as_ptr(), 1000, 1, stream);
        // SAFETY: within the pads (the bug under test).
        set(unsafe { p.as_ptr().offset(offset) }, 1, 0, stream);
        // SAFETY: allocated above with `l` on `stream`, its work enqueued there.
        unsafe { guard.deallocate(stream.as_ref(), p, l) };
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn a_one_byte_overrun_and_underrun_on_the_device_are_reported() {
        let stream = Stream::with_flags(StreamFlags::NonBlocking).unwrap();
        let pool = Pool::new(Cuda::new().unwrap(), PoolConfig::new()).unwrap();
        let guard = Guard::new(pool).with_backtraces();
        device_write(&guard, &stream, 1000);
        device_write(&guard, &stream, -1);
        device_write(&guard, &stream, 999); // inside: not reported
        assert_eq!(guard.check_pending().unwrap(), 2, "{:?}", guard.reports());
        let r = guard.reports();
        assert_eq!((r[0].side, r[0].offset, r[0].damaged), (Side::After, 0, 1));
        assert_eq!((r[1].side, r[1].offset), (Side::Before, 0));
        assert!(r[0].backtrace.is_some());
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn device_checks_made_later_and_on_drop_and_through_the_sync_api() {
        let stream = Stream::with_flags(StreamFlags::NonBlocking).unwrap();
        let guard = Guard::new(Cuda::new().unwrap());
        for _ in 0..50 {
            device_write(&guard, &stream, 1000);
        }
        stream.synchronize().unwrap();
        // One more free polls the completed checks without being asked to wait.
        device_write(&guard, &stream, 0);
        assert!(guard.found() >= 50, "found {}", guard.found());
        assert_eq!(guard.check_pending().unwrap(), 50);

        // The synchronous API on device memory: checked at once.
        let l = layout(4096).unwrap();
        let p = guard.allocate_sync(l).unwrap();
        let legacy = Stream::new().unwrap();
        set(p.as_ptr().wrapping_add(4096), 3, 7, &legacy);
        legacy.synchronize().unwrap();
        // SAFETY: allocated above with `l`; the write to it is complete.
        unsafe { guard.deallocate_sync(p, l) };
        assert_eq!(guard.found(), 51);
        assert_eq!(guard.reports()[50].damaged, 3);

        // Dropped with checks in flight: they are waited for, and nothing leaks.
        let guard = Guard::new(Cuda::new().unwrap());
        device_write(&guard, &stream, 1000);
        drop(guard);
    }

    conformance_tests!(
        #[ignore = "needs a CUDA GPU"]
        guard_over_cuda_pool,
        Guard::new(Pool::new(Cuda::new().unwrap(), PoolConfig::new()).unwrap()),
        Caps::gpu(usize::MAX)
    );
}
