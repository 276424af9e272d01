//! Stream capture (CUDA graphs): allocating and freeing through each stack while a stream
//! is captured in the global mode (the strictest) must work or fail cleanly, and never
//! invalidate the capture. They need a GPU: CI skips them (`#[ignore]`), the GPU bundle's
//! `run.sh` runs them.

// A HIP build (feature `hip`) leaves these out: they check results through cudarc's
// CUDA calls. docs/platforms.md says what runs on an AMD GPU instead.
#![cfg(not(feature = "hip"))]

use std::alloc::Layout;

use cudarc::driver::sys::{self, CUresult, CUstreamCaptureMode};
use memres::adaptor::{Guard, Statistics};
use memres::stream::{Stream, StreamFlags};
use memres::suballoc::{Arena, Binning, FixedSize, Pool, PoolConfig, VirtualPoolConfig};
use memres::upstream::CudaVirtual;
use memres::{
    Cuda, Error, Resource, StreamRef, layout,
    upstream::{CudaAsync, Managed, PinnedHost},
};

/// A capture in the global mode is broken by any other thread's wait or allocation:
/// these tests take turns (the bundle's `run.sh` runs a binary's tests in parallel).
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn ok(r: CUresult, what: &str) {
    assert_eq!(r, CUresult::CUDA_SUCCESS, "{what}");
}

/// Captures, on a fresh non-blocking stream, allocations of `sizes` (each set on the
/// stream), their frees, and the same allocations again; ends the capture (which fails
/// if anything invalidated it), launches the graph and waits. Returns how many
/// allocations were refused, and with which errors.
fn capture<R: Resource>(r: &R, what: &str, sizes: &[usize]) -> Vec<Error> {
    let s = Stream::with_flags(StreamFlags::NonBlocking).unwrap();
    let mode = CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL;
    // SAFETY: a live stream of the current context.
    ok(
        unsafe { sys::cuStreamBeginCapture_v2(s.raw().cast(), mode) },
        "begin",
    );
    assert!(s.as_ref().is_capturing().unwrap());
    let mut refused = Vec::new();
    for _ in 0..2 {
        let mut live: Vec<(std::ptr::NonNull<u8>, Layout)> = Vec::new();
        for &size in sizes {
            let l = layout(size).unwrap();
            match r.allocate(s.as_ref(), l) {
                Ok(p) => {
                    // SAFETY: `size` bytes of device-accessible memory, in order on `s`.
                    let set =
                        unsafe { sys::cuMemsetD8Async(p.as_ptr() as u64, 7, size, s.raw().cast()) };
                    ok(set, "captured set");
                    live.push((p, l));
                }
                Err(e) => refused.push(e),
            }
        }
        for (p, l) in live.into_iter().rev() {
            // SAFETY: allocated above on `s` with `l`; its work is on `s`.
            unsafe { r.deallocate(s.as_ref(), p, l) };
        }
    }
    let mut graph = std::ptr::null_mut();
    // SAFETY: `s` is capturing; `graph` is a valid place.
    let ended = unsafe { sys::cuStreamEndCapture(s.raw().cast(), &mut graph) };
    assert_eq!(
        ended,
        CUresult::CUDA_SUCCESS,
        "{what}: the capture was invalidated"
    );
    assert!(!s.as_ref().is_capturing().unwrap());
    let mut exec = std::ptr::null_mut();
    // SAFETY: `graph` is the captured graph; `exec` a valid place.
    ok(
        unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) },
        "instantiate",
    );
    // SAFETY: a live executable graph and stream; the graph's memory is still the
    // resource's (nothing was carried out since the capture ended).
    ok(
        unsafe { sys::cuGraphLaunch(exec, s.raw().cast()) },
        "launch",
    );
    s.synchronize().unwrap();
    // SAFETY: ours, no longer running.
    unsafe {
        ok(sys::cuGraphExecDestroy(exec), "destroy exec");
        ok(sys::cuGraphDestroy(graph), "destroy graph");
    }
    refused
}

const SIZES: [usize; 5] = [256, 4 << 10, 1 << 20, 8 << 20, 64 << 20];

/// After a capture, an ordinary call carries out the frees the capture deferred.
fn afterwards<R: Resource>(r: &R) {
    let l = layout(1 << 20).unwrap();
    let p = r.allocate(StreamRef::DEFAULT, l).unwrap();
    // SAFETY: allocated just above on the default stream.
    unsafe { r.deallocate(StreamRef::DEFAULT, p, l) };
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn synchronous_leaves_allocate_under_capture_and_defer_their_frees() {
    let _turn = serial();
    // A first capture sets up what graphs need in the context (it stays), so that the
    // free memory measured next moves only with what `Cuda` holds.
    assert!(capture(&Cuda::new().unwrap(), "Cuda (warm-up)", &SIZES).is_empty());
    afterwards(&Cuda::new().unwrap());
    let device = memres::device::DeviceId::current().unwrap();
    let free_before = device.memory_info().unwrap().free;
    assert!(capture(&Cuda::new().unwrap(), "Cuda", &SIZES).is_empty());
    afterwards(&Cuda::new().unwrap());
    let free_after = device.memory_info().unwrap().free;
    // The deferred frees were carried out: not 2 × 73 MiB left behind.
    assert!(
        free_after + (16 << 20) >= free_before,
        "{free_before} free before, {free_after} after"
    );
    // (Managed memory's first use makes the driver set up for it, which moves the free
    // figure by itself: these two only show that the capture survives.)
    assert!(capture(&Managed::new().unwrap(), "Managed", &SIZES).is_empty());
    assert!(capture(&PinnedHost::new().unwrap(), "PinnedHost", &SIZES[..4]).is_empty());
    afterwards(&Managed::new().unwrap());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_async_allocates_in_the_graph() {
    let _turn = serial();
    assert!(capture(&CudaAsync::new().unwrap(), "CudaAsync", &SIZES).is_empty());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn pools_grow_under_capture_without_waiting() {
    let _turn = serial();
    let pool = Pool::new(Cuda::new().unwrap(), PoolConfig::new()).unwrap();
    assert!(capture(&pool, "Pool<Cuda>", &SIZES).is_empty());
    assert!(pool.pool_size() > 0);
    afterwards(&pool);

    let in_place = CudaVirtual::new()
        .unwrap()
        .virtual_pool(VirtualPoolConfig::new())
        .unwrap();
    assert!(capture(&in_place, "VirtualPool", &SIZES).is_empty());

    let stats = Statistics::new(Pool::new(Cuda::new().unwrap(), PoolConfig::new()).unwrap());
    assert!(capture(&stats, "Statistics<Pool<Cuda>>", &SIZES).is_empty());
    assert_eq!(stats.snapshot().bytes.current, 0);

    // A pool with a release threshold: the release a capture's free would trigger waits
    // for the next free outside the capture.
    let releasing =
        Pool::new(Cuda::new().unwrap(), PoolConfig::new().release_threshold(0)).unwrap();
    assert!(capture(&releasing, "Pool with release threshold 0", &SIZES).is_empty());
    afterwards(&releasing);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_pool_growing_under_capture_leaves_deferred_frees_for_later() {
    let _turn = serial();
    // A free that one capture deferred...
    let s1 = Stream::with_flags(StreamFlags::NonBlocking).unwrap();
    let mode = CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL;
    // SAFETY: a live stream of the current context.
    ok(
        unsafe { sys::cuStreamBeginCapture_v2(s1.raw().cast(), mode) },
        "begin",
    );
    let cuda = Cuda::new().unwrap();
    let l = layout(1 << 20).unwrap();
    let p = cuda.allocate(s1.as_ref(), l).unwrap();
    // SAFETY: allocated just above on `s1`; nothing uses it.
    unsafe { cuda.deallocate(s1.as_ref(), p, l) };
    let mut graph = std::ptr::null_mut();
    // SAFETY: `s1` is capturing; `graph` is a valid place.
    ok(
        unsafe { sys::cuStreamEndCapture(s1.raw().cast(), &mut graph) },
        "end",
    );
    // SAFETY: the graph just made, never launched.
    ok(unsafe { sys::cuGraphDestroy(graph) }, "destroy");
    // ... is still pending when a pool over Cuda grows under another capture: the growth
    // calls the leaf, which must not carry the free out there (that waits for the device).
    let pool = Pool::new(Cuda::new().unwrap(), PoolConfig::new()).unwrap();
    assert!(capture(&pool, "Pool<Cuda> with a deferred free pending", &SIZES).is_empty());
    afterwards(&cuda);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_pool_that_would_have_to_wait_refuses_cleanly() {
    let _turn = serial();
    // 64 MiB of free memory sits in another stream's list: a capture may not wait for
    // that stream, and the pool may not grow: out of memory, with the capture intact.
    let pool = Pool::new(
        Cuda::new().unwrap(),
        PoolConfig::new().maximum_size(64 << 20),
    )
    .unwrap();
    let other = Stream::new().unwrap();
    let l = layout(64 << 20).unwrap();
    let p = pool.allocate(other.as_ref(), l).unwrap();
    // SAFETY: allocated just above on `other`.
    unsafe { pool.deallocate(other.as_ref(), p, l) };
    let refused = capture(&pool, "Pool at its maximum", &[64 << 20]);
    assert_eq!(refused.len(), 2);
    assert!(
        matches!(refused[0], Error::OutOfMemory { .. }),
        "{:?}",
        refused[0]
    );
    // Outside the capture the same request waits for `other` and succeeds.
    afterwards(&pool);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_other_suballocators_and_the_guard_keep_the_capture() {
    let _turn = serial();
    let arena = Arena::with_size(Cuda::new().unwrap(), 256 << 20).unwrap();
    assert!(capture(&arena, "Arena<Cuda>", &SIZES[..4]).is_empty());
    let fixed = FixedSize::with_block_size(Cuda::new().unwrap(), 1 << 20, 16).unwrap();
    assert!(capture(&fixed, "FixedSize<Cuda>", &[1 << 20, 1 << 20, 4096]).is_empty());
    let binning = Binning::new(
        Pool::new(Cuda::new().unwrap(), PoolConfig::new()).unwrap(),
        8,
        16,
    )
    .unwrap();
    assert!(capture(&binning, "Binning<Pool<Cuda>>", &SIZES).is_empty());
    let guard = Guard::new(Pool::new(Cuda::new().unwrap(), PoolConfig::new()).unwrap());
    assert!(capture(&guard, "Guard<Pool<Cuda>>", &SIZES).is_empty());
    assert_eq!(guard.check_pending().unwrap(), 0);
}

/// A pool at its maximum whose every block another (live, idle) thread freed into its
/// cache for the captured stream: under capture the pool may not wait or grow, and takes
/// those blocks back from the other thread's cache instead of running out of memory
/// (they were freed on the captured stream itself, so no wait is needed).
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_pool_under_capture_takes_back_what_another_thread_cached_for_its_stream() {
    let _turn = serial();
    let pool = Pool::new(
        Cuda::new().unwrap(),
        PoolConfig::new().maximum_size(2 << 20),
    )
    .unwrap();
    let got = allocate_under_capture_while_another_thread_caches(&pool, || {
        assert_eq!(pool.pool_size(), 2 << 20);
    });
    got.expect("the other thread's cached block, not out-of-memory");
    assert_eq!(pool.pool_size(), 2 << 20, "not grown");
}

/// The arena's thread caches under capture: another thread holds the whole arena as small
/// blocks freed on the captured stream into its cache. The arena may not wait under
/// capture; it takes those blocks back from the other thread's cache instead of running
/// out of memory (they were freed on the captured stream itself, so no wait is needed).
#[test]
#[ignore = "needs a CUDA GPU"]
fn an_arena_under_capture_takes_back_what_another_thread_cached_for_its_stream() {
    let _turn = serial();
    let arena = Arena::with_size(Cuda::new().unwrap(), 2 << 20).unwrap();
    let got = allocate_under_capture_while_another_thread_caches(&arena, || {
        assert_eq!(arena.superblocks(), 2);
    });
    got.expect("the other thread's cached block, not out-of-memory");
}

/// Another thread takes all of `r` (2 MiB) as 64 KiB blocks on a new stream and frees
/// them there, into its cache, and stays; then (after `check`) this thread allocates one
/// such block on that stream under capture (freeing it in the capture), and the capture
/// must end cleanly. Returns what the allocation returned.
fn allocate_under_capture_while_another_thread_caches<R: Resource + Sync>(
    r: &R,
    check: impl FnOnce(),
) -> Result<(), memres::Error> {
    let s = Stream::with_flags(StreamFlags::NonBlocking).unwrap();
    let l = layout(64 << 10).unwrap();
    let (cached, wait_cached) = std::sync::mpsc::channel::<()>();
    let (done, wait_done) = std::sync::mpsc::channel::<()>();
    std::thread::scope(|scope| {
        let s = &s;
        scope.spawn(move || {
            // The whole resource, in 64 KiB blocks, freed on `s` into this thread's cache.
            let blocks: Vec<_> = (0..32)
                .map(|_| r.allocate(s.as_ref(), l).unwrap())
                .collect();
            for p in blocks {
                // SAFETY: allocated above on `s` with `l`; nothing uses it.
                unsafe { r.deallocate(s.as_ref(), p, l) };
            }
            cached.send(()).unwrap();
            wait_done.recv().unwrap();
        });
        wait_cached.recv().unwrap();
        check();
        let mode = CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL;
        // SAFETY: a live stream of the current context.
        ok(
            unsafe { sys::cuStreamBeginCapture_v2(s.raw().cast(), mode) },
            "begin",
        );
        let got = r.allocate(s.as_ref(), l);
        if let Ok(p) = got {
            // SAFETY: allocated just above on `s` with `l`; its work is on `s`.
            unsafe { r.deallocate(s.as_ref(), p, l) };
        }
        let mut graph = std::ptr::null_mut();
        // SAFETY: `s` is capturing; `graph` is a valid place.
        let ended = unsafe { sys::cuStreamEndCapture(s.raw().cast(), &mut graph) };
        assert_eq!(ended, CUresult::CUDA_SUCCESS, "the capture was invalidated");
        // SAFETY: the graph just made, never launched.
        ok(unsafe { sys::cuGraphDestroy(graph) }, "destroy");
        done.send(()).unwrap();
        got.map(drop)
    })
}
