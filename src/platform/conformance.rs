//! The seam's conformance cases, generic over the platform: each runs for CUDA, and for
//! HIP in a build with the `hip` feature. Where a platform's library is absent (this
//! machine has neither), a case checks that it says so ([`Error::NoDriver`]) and skips
//! the device work with a `memres-skip` line; on a machine with that vendor's GPU it
//! drives every group of operations once and checks what comes back.

use super::{Attribute, Location, Platform, PoolAttribute};
use crate::error::Error;

/// Initialises `P`, or says why the device cases are skipped.
fn ready<P: Platform>() -> bool {
    if !P::is_present() {
        assert_eq!(P::init(), Err(Error::NoDriver), "{}", P::NAME);
        println!("memres-skip: no {} library on this machine", P::NAME);
        return false;
    }
    match P::init().and_then(|()| P::device_count()) {
        Ok(n) if n > 0 => true,
        other => {
            println!("memres-skip: {} has no device here ({other:?})", P::NAME);
            false
        }
    }
}

/// Makes device 0's primary context current.
fn on_device_0<P: Platform>() -> i32 {
    let dev = P::device_get(0).expect("device 0");
    let ctx = P::primary_context(dev).expect("its primary context");
    // SAFETY: a primary context, retained above for the life of the process.
    unsafe { P::set_current_context(ctx) }.expect("made current");
    assert_eq!(P::current_context().expect("current"), ctx);
    assert_eq!(P::current_device().expect("its device"), 0);
    assert!(!P::device_name(dev).expect("a name").is_empty());
    let (free, total) = P::memory_info().expect("memory info");
    assert!(free <= total && total > 0, "{free} of {total}");
    dev
}

fn without_a_library_init_says_no_driver<P: Platform>() {
    if P::is_present() {
        println!("memres-skip: {} is present", P::NAME);
        return;
    }
    assert_eq!(P::init(), Err(Error::NoDriver));
}

/// Streams, events, device memory, pinned host memory, copies and fills: 0xAB set on the
/// device comes back on the host.
fn bytes_round_trip<P: Platform>() {
    if !ready::<P>() {
        return;
    }
    on_device_0::<P>();
    const N: usize = 1 << 20;
    let stream = P::stream_create(true).expect("a stream");
    let event = P::event_create().expect("an event");
    let device = P::mem_alloc(N).expect("device memory");
    let host = P::host_alloc(N, N).expect("pinned host memory");
    // SAFETY: both blocks are ours and `N` bytes long; the stream and event are live; the
    // host block is read only after the event says the copy is done.
    unsafe {
        P::fill_async(device, 0xAB, N, stream).expect("fill");
        P::copy_async(host, device, N, stream).expect("copy back");
        P::event_record(event, stream).expect("record");
        P::stream_wait_event(0, event).expect("the legacy stream waits");
        P::event_synchronize(event).expect("wait");
        assert!(P::event_query(event).expect("query"));
        assert!(!P::stream_is_capturing(stream).expect("capture status"));
        let bytes = std::slice::from_raw_parts(host as *const u8, N);
        assert!(bytes.iter().all(|&b| b == 0xAB));
        assert!(!P::pointer_is_managed(device).expect("attribute"));
        assert_eq!(P::pointer_device(device).expect("its device"), 0);
        let (base, len) = P::address_range(device + 10).expect("its range");
        assert_eq!((base, len), (device, N));
        P::mem_free(device).expect("free");
        P::host_free(host).expect("free host");
        P::event_destroy(event).expect("destroy event");
        P::stream_synchronize(stream).expect("sync");
        P::stream_destroy(stream).expect("destroy stream");
    }
    assert!(P::host_alloc(1 << 50, 7).is_err_and(|e| e == Error::out_of_memory(7)));
}

/// A driver pool: allocate, read its counters, free, trim, destroy.
fn pools<P: Platform>() {
    if !ready::<P>() {
        return;
    }
    let dev = on_device_0::<P>();
    if P::device_attribute(dev, Attribute::MemoryPools).expect("attribute") == 0 {
        println!("memres-skip: {} device 0 has no driver pools", P::NAME);
        return;
    }
    let pool = P::pool_create(0, false).expect("a pool");
    // SAFETY: the pool is ours; blocks go back on the legacy stream, which is then
    // synchronised before the pool is trimmed and destroyed.
    unsafe {
        P::pool_set(pool, PoolAttribute::ReleaseThreshold, u64::MAX).expect("threshold");
        assert_eq!(
            P::pool_get(pool, PoolAttribute::ReleaseThreshold).expect("read back"),
            u64::MAX
        );
        let a = P::pool_alloc_async(pool, 1 << 20, 0).expect("from the pool");
        assert!(P::pool_get(pool, PoolAttribute::UsedCurrent).expect("used") >= 1 << 20);
        P::free_async(a, 0).expect("free");
        P::stream_synchronize(0).expect("sync");
        P::pool_trim_to(pool, 0).expect("trim");
        P::pool_destroy(pool).expect("destroy");
    }
}

/// Virtual memory: reserve, create, map, grant access, fill, unmap, release, free.
fn virtual_memory<P: Platform>() {
    if !ready::<P>() {
        return;
    }
    let dev = on_device_0::<P>();
    if P::device_attribute(dev, Attribute::VirtualMemoryManagement).expect("attribute") == 0 {
        println!(
            "memres-skip: {} device 0 has no virtual memory management",
            P::NAME
        );
        return;
    }
    let g = P::vm_granularity(0, false).expect("granularity");
    let base = P::vm_reserve(4 * g, g).expect("a reservation");
    let handle = P::vm_create(g, 0, false, g).expect("a granule");
    // SAFETY: `base..base + g` is unmapped space of our reservation; the granule is
    // mapped, used on the legacy stream (synchronised), unmapped, then the range freed.
    unsafe {
        P::vm_map(base, g, handle, g).expect("map");
        P::vm_release(handle).expect("release our reference");
        P::vm_set_access(base, g, &[0], g).expect("access");
        P::fill_async(base, 1, g, 0).expect("fill");
        P::stream_synchronize(0).expect("sync");
        let retained = P::vm_retain(base).expect("retain");
        P::vm_release(retained).expect("release");
        P::vm_unmap(base, g).expect("unmap");
        P::vm_free(base, 4 * g).expect("free");
    }
}

/// Advice and prefetches of managed memory, where the device has concurrent access.
fn managed<P: Platform>() {
    if !ready::<P>() {
        return;
    }
    let dev = on_device_0::<P>();
    let p = P::mem_alloc_managed(1 << 20).expect("managed memory");
    assert!(P::pointer_is_managed(p).expect("attribute"));
    if P::device_attribute(dev, Attribute::ConcurrentManagedAccess).expect("attribute") != 0 {
        // SAFETY: `p` is live managed memory of 1 MiB; the legacy stream is waited for.
        unsafe {
            P::advise_preferred(p, 1 << 20, Location::Device(0)).expect("advise");
            P::prefetch(p, 1 << 20, Location::Device(0), 0).expect("prefetch");
            P::stream_synchronize(0).expect("sync");
        }
    }
    // SAFETY: ours, nothing uses it (the stream was synchronised).
    unsafe { P::mem_free(p) }.expect("free");
}

macro_rules! conformance {
    ($module:ident, $platform:ty) => {
        mod $module {
            conformance!(@cases $platform; without_a_library_init_says_no_driver,
                bytes_round_trip, pools, virtual_memory, managed);
        }
    };
    (@cases $platform:ty; $($case:ident),*) => {
        $(
            #[test]
            fn $case() {
                super::$case::<$platform>();
            }
        )*
    };
}

conformance!(cuda, crate::platform::cuda::Cuda);
#[cfg(feature = "hip")]
conformance!(hip, crate::platform::hip::Hip);

/// Without ROCm, every HIP operation is `NoDriver` (never a panic or a link error), and
/// `memres::driver` reports HIP as the build's platform.
#[cfg(feature = "hip")]
#[test]
fn without_rocm_every_hip_operation_is_no_driver() {
    use super::hip::Hip;
    if Hip::is_present() {
        println!("memres-skip: libamdhip64 is present");
        return;
    }
    assert_eq!(crate::driver::platform(), "HIP");
    assert!(!crate::driver::is_present());
    assert_eq!(Hip::device_count(), Err(Error::NoDriver));
    assert_eq!(Hip::mem_alloc(256), Err(Error::NoDriver));
    assert_eq!(Hip::stream_create(false), Err(Error::NoDriver));
    assert_eq!(Hip::vm_reserve(1 << 21, 1 << 21), Err(Error::NoDriver));
    assert_eq!(crate::device::DeviceId::count(), Err(Error::NoDriver));
    assert_eq!(crate::device::DeviceId::new(0).to_string(), "hip:0");
    assert!(crate::Cuda::new().is_err_and(|e| e == Error::NoDriver));
    assert!(Error::NoDriver.to_string().contains("libamdhip64"));
}
