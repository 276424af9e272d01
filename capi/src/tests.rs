//! The C ABI on the CPU: configuration, failures and messages, caught panics, frees of
//! null and zero-byte blocks, and the header kept in sync with this crate.

use std::ffi::{CStr, CString};
use std::mem::{offset_of, size_of};
use std::sync::Mutex;

use mr::spec::{Built, Target};

use super::*;
use crate::routed::Tags;
use crate::stack::{Pools, why_it_cannot_sleep};
use mr::adaptor::StreamUse;
use mr::{VirtualPool, VirtualPoolConfig};
use std::sync::Arc;

/// The configuration is process-wide: tests that change it take turns.
static SERIAL: Mutex<()> = Mutex::new(());

fn configure(spec: &str) -> c_int {
    let c = CString::new(spec).unwrap();
    // SAFETY: a NUL-terminated string.
    unsafe { memres_configure(c.as_ptr()) }
}

fn last_error() -> String {
    // SAFETY: `memres_last_error` returns a NUL-terminated string valid until the next
    // call on this thread.
    unsafe { CStr::from_ptr(memres_last_error()) }
        .to_string_lossy()
        .into_owned()
}

#[test]
fn configure_accepts_specs_and_can_be_called_twice() {
    let _turn = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    for spec in [
        "cuda",
        "cuda_async",
        "pool",
        "pool:initial=8GiB,max=60GiB",
        "arena:size=40GiB",
        "binning:min=10,max=22",
        "statistics(pool:initial=4GiB)",
        "logging(pool,file=/tmp/log.csv)",
        "limiting(pool,limit=10GiB)",
    ] {
        assert_eq!(configure(spec), MEMRES_OK, "{spec}: {}", last_error());
    }
    // The last one wins.
    assert_eq!(configure("statistics(virtual_pool)"), MEMRES_OK);
    let config = CONFIG.lock().unwrap();
    assert_eq!(
        config.spec,
        Some(Spec::Statistics(Box::new(Spec::default_spec())))
    );
}

#[test]
fn a_bad_spec_is_refused_with_a_message_and_changes_nothing() {
    let _turn = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    assert_eq!(configure("pool"), MEMRES_OK);
    let cases = [
        ("pooll", "unknown resource \"pooll\""),
        ("pool:size=1GiB", "unknown option \"size\" for pool"),
        ("limiting(pool)", "needs limit=SIZE"),
        ("statistics(pool", "unbalanced parentheses"),
        ("arena:size=big", "size: no number"),
    ];
    for (spec, want) in cases {
        assert_eq!(configure(spec), MEMRES_ERROR_INVALID_ARGUMENT, "{spec}");
        let message = last_error();
        assert!(message.contains(want), "{spec}: {message:?}");
        assert!(
            message.contains(spec),
            "{message:?} does not quote {spec:?}"
        );
    }
    assert_eq!(
        CONFIG.lock().unwrap().spec,
        Some(Spec::Pool {
            initial: None,
            max: None,
            growth: mr::suballoc::Growth::Eighth
        })
    );
    // SAFETY: null is allowed and refused.
    let code = unsafe { memres_configure(std::ptr::null()) };
    assert_eq!(code, MEMRES_ERROR_INVALID_ARGUMENT);
    assert!(last_error().contains("null"));
    let not_utf8 = [0xffu8, 0xfe, 0];
    // SAFETY: NUL-terminated.
    let code = unsafe { memres_configure(not_utf8.as_ptr().cast()) };
    assert_eq!(code, MEMRES_ERROR_INVALID_ARGUMENT);
    assert!(last_error().contains("UTF-8"));
}

/// A long spec (or tag name) is quoted cut, with its size: a 100 kB spec gave a 100 kB
/// message (issue 49).
#[test]
fn a_long_spec_gets_a_bounded_message() {
    let _turn = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    assert_eq!(configure("pool"), MEMRES_OK);
    for (spec, size) in [
        ("x".repeat(100_000), "100000 bytes"),
        (format!("statistics({})", "y".repeat(4000)), "4000 bytes"),
        (
            format!("pool:initial=1GiB,{}=1", "k".repeat(3000)),
            "3000 bytes",
        ),
    ] {
        assert_eq!(configure(&spec), MEMRES_ERROR_INVALID_ARGUMENT);
        let message = last_error();
        assert!(
            message.len() < 1000,
            "{} bytes: {message:.300}",
            message.len()
        );
        assert!(message.contains(size), "{message}");
    }
    assert!(matches!(
        CONFIG.lock().unwrap().spec,
        Some(Spec::Pool { .. })
    ));
    // Tag names: cut at a character, not inside one.
    let name = "é".repeat(300);
    let cut = quoted(&name);
    assert!(
        cut.len() < 500 && cut.ends_with("(600 bytes in all)"),
        "{cut}"
    );
    assert_eq!(quoted("weights"), "\"weights\"");
}

#[test]
fn panics_are_caught_and_reported() {
    let code = guarded(
        |code| code,
        || -> Result<c_int, Failure> { panic!("boom {}", 42) },
    );
    assert_eq!(code, MEMRES_ERROR_PANIC);
    assert!(
        last_error().contains("caught panic: boom 42"),
        "{}",
        last_error()
    );
    let null = guarded(
        |_| std::ptr::null_mut::<c_void>(),
        || -> Result<_, Failure> { panic!("static message") },
    );
    assert!(null.is_null());
    assert!(last_error().contains("static message"));
}

#[test]
fn null_and_zero_byte_frees_are_no_ops() {
    std::thread::spawn(|| {
        // SAFETY: null and zero-byte frees touch nothing.
        unsafe {
            memres_free(std::ptr::null_mut(), 0, 0, std::ptr::null_mut());
            memres_free(std::ptr::null_mut(), 1 << 20, 3, std::ptr::null_mut());
            memres_free(256 as *mut c_void, 0, 0, std::ptr::null_mut());
        }
        assert_eq!(last_error(), "", "no failure was reported");
    })
    .join()
    .unwrap();
}

#[test]
fn zero_byte_requests_return_null_and_are_not_failures() {
    std::thread::spawn(|| {
        // SAFETY: the stream is the legacy default stream (null); a zero-byte request
        // touches no device and no memory.
        let p = unsafe { memres_malloc(-1, 0, std::ptr::null_mut()) };
        assert!(p.is_null());
        assert!(!last_error().is_empty(), "a negative size is a failure");
        // Several live empty blocks at once (PyTorch keys its records by pointer): none
        // may share a non-null address, so each is null.
        let empties: Vec<_> = (0..4)
            // SAFETY: as above.
            .map(|_| unsafe { memres_malloc(0, 0, std::ptr::null_mut()) })
            .collect();
        assert!(empties.iter().all(|p| p.is_null()), "{empties:?}");
        assert_eq!(
            last_error(),
            "",
            "a zero-byte request clears the last error"
        );
        for p in empties {
            // SAFETY: freeing null is a no-op.
            unsafe { memres_free(p, 0, 0, std::ptr::null_mut()) };
        }
        assert_eq!(last_error(), "");
    })
    .join()
    .unwrap();
}

#[test]
fn bad_arguments_fail_without_crashing() {
    // SAFETY: the stream is the legacy default stream (null); no memory is touched.
    let p = unsafe { memres_malloc(-5, 0, std::ptr::null_mut()) };
    assert!(p.is_null());
    assert!(
        last_error().contains("negative size -5"),
        "{}",
        last_error()
    );

    // SAFETY: as above.
    let p = unsafe { memres_malloc(64, -1, std::ptr::null_mut()) };
    assert!(p.is_null());
    assert!(last_error().contains("device -1"), "{}", last_error());
    // SAFETY: as above.
    let p = unsafe { memres_malloc(64, 64, std::ptr::null_mut()) };
    assert!(p.is_null());
    assert!(last_error().contains("0 to 63"), "{}", last_error());

    // SAFETY: a pointer memres never handed out, on a device it never used: reported.
    unsafe { memres_free(4096 as *mut c_void, 64, 7, std::ptr::null_mut()) };
    assert!(
        last_error().contains("never allocated on device 7"),
        "{}",
        last_error()
    );
    // SAFETY: as above; a negative size is refused before anything is freed.
    unsafe { memres_free(4096 as *mut c_void, -1, 0, std::ptr::null_mut()) };
    assert!(last_error().contains("negative size"), "{}", last_error());

    // SAFETY: null `out` is allowed and refused.
    let code = unsafe { memres_stats(0, std::ptr::null_mut()) };
    assert_eq!(code, MEMRES_ERROR_INVALID_ARGUMENT);
    assert_eq!(memres_trim(-3), MEMRES_ERROR_INVALID_ARGUMENT);

    // SAFETY: refused before the stream is used.
    let code = unsafe { memres_record_stream(std::ptr::null_mut(), 0, std::ptr::null_mut()) };
    assert_eq!(code, MEMRES_ERROR_INVALID_ARGUMENT);
    assert!(last_error().contains("null"), "{}", last_error());
    // SAFETY: as above: memres never allocated on device 9.
    let code = unsafe { memres_record_stream(4096 as *mut c_void, 9, std::ptr::null_mut()) };
    assert_eq!(code, MEMRES_ERROR_INVALID_ARGUMENT);
    assert!(last_error().contains("device 9"), "{}", last_error());

    // The IPC calls refuse what they cannot use, before touching anything.
    let mut offset = 0;
    // SAFETY: a null pointer, refused.
    let code = unsafe {
        memres_ipc_export(
            std::ptr::null_mut(),
            64,
            0,
            std::ptr::null_mut(),
            0,
            &mut offset,
        )
    };
    assert_eq!(code, i64::from(MEMRES_ERROR_INVALID_ARGUMENT));
    // SAFETY: a size of 0, refused.
    let code = unsafe {
        memres_ipc_export(
            4096 as *mut c_void,
            0,
            0,
            std::ptr::null_mut(),
            0,
            &mut offset,
        )
    };
    assert_eq!(code, i64::from(MEMRES_ERROR_INVALID_ARGUMENT));
    assert!(last_error().contains("size 0"), "{}", last_error());
    // SAFETY: a device memres never allocated on, refused.
    let code = unsafe {
        memres_ipc_export(
            4096 as *mut c_void,
            64,
            9,
            std::ptr::null_mut(),
            0,
            &mut offset,
        )
    };
    assert_eq!(code, i64::from(MEMRES_ERROR_INVALID_ARGUMENT));
    assert!(last_error().contains("device 9"), "{}", last_error());
    let mut base = std::ptr::null_mut();
    // SAFETY: 5 readable bytes; `base` a valid place.
    let code = unsafe { memres_ipc_open(b"bogus".as_ptr().cast(), 5, 0, &mut base) };
    assert_eq!(code, MEMRES_ERROR_INVALID_ARGUMENT);
    assert!(last_error().contains("version 98"), "{}", last_error());
    // SAFETY: a null handle, refused.
    let code = unsafe { memres_ipc_open(std::ptr::null(), 64, 0, &mut base) };
    assert_eq!(code, MEMRES_ERROR_INVALID_ARGUMENT);
    assert_eq!(
        memres_ipc_close(4096 as *mut c_void),
        MEMRES_ERROR_INVALID_ARGUMENT
    );
}

#[test]
fn without_a_driver_malloc_returns_null_and_says_why() {
    if mr::driver::is_present() {
        // The GPU machine: `memres_malloc` really allocates there.
        println!("memres-skip: a CUDA driver is present (this test is for machines without one)");
        return;
    }
    // SAFETY: the legacy default stream.
    let p = unsafe { memres_malloc(1 << 20, 0, std::ptr::null_mut()) };
    assert!(p.is_null());
    assert!(last_error().contains("driver"), "{}", last_error());
    assert_eq!(memres_init_device(0), MEMRES_ERROR_CUDA);
    assert!(last_error().contains("driver"), "{}", last_error());
    // C and Python callers have no Rust host resource to turn to (issue 49).
    assert!(!last_error().contains("HostHeap"), "{}", last_error());
    assert_eq!(memres_init_device(-1), MEMRES_ERROR_INVALID_ARGUMENT);
    // Peer access needs the driver to say which devices there are; ordinals memres
    // keeps no table for are refused before.
    for (device, peer) in [(0, 0), (0, 1)] {
        assert_eq!(memres_enable_peer_access(device, peer), MEMRES_ERROR_CUDA);
        assert!(last_error().contains("driver"), "{}", last_error());
    }
    peer_ordinals_are_refused([(-1, 0), (0, 64)]);
    // Nothing was built, so the configuration may still change.
    let _turn = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    assert_eq!(configure("pool"), MEMRES_OK);
}

/// With a driver: a device and itself need no grant, and ordinals with no device are
/// refused by name (nothing is built).
#[test]
#[ignore = "needs a CUDA GPU"]
fn peer_access_ordinals_are_checked_against_the_devices() {
    let count = c_int::try_from(mr::device::DeviceId::count().unwrap()).unwrap();
    assert!(count > 0, "needs a CUDA GPU");
    assert_eq!(
        memres_enable_peer_access(0, 0),
        MEMRES_OK,
        "{}",
        last_error()
    );
    peer_ordinals_are_refused([(0, count), (count, 0)]);
}

/// `memres_enable_peer_access` refuses each `(device, peer)` as ordinals memres does not
/// serve.
fn peer_ordinals_are_refused(pairs: [(c_int, c_int); 2]) {
    for (device, peer) in pairs {
        assert_eq!(
            memres_enable_peer_access(device, peer),
            MEMRES_ERROR_INVALID_ARGUMENT
        );
        assert!(
            last_error().contains("not a device ordinal"),
            "{}",
            last_error()
        );
    }
}

fn stats(device: c_int) -> memres_stats_t {
    let mut out = memres_stats_t::default();
    // SAFETY: `out` is valid for one write.
    assert_eq!(unsafe { memres_stats(device, &mut out) }, MEMRES_OK);
    out
}

/// Runs the GPU test `test` (a `tests::..._child` of this binary, which does its work
/// only where `env` is set) in a child process: allocating builds the stack and freezes
/// the configuration, which the configuration tests of this process must still change.
/// The child must succeed and print `says`.
fn gpu_child(test: &str, env: &str, says: &str) {
    assert!(
        mr::driver::is_present() && mr::device::DeviceId::count().unwrap_or(0) > 0,
        "needs a CUDA GPU (`memres_malloc` allocates device memory)"
    );
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--nocapture"])
        .env(env, "1")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains(says),
        "the child failed:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Runs in a child process of this test binary (allocating builds the stack and freezes
/// the configuration, which the configuration tests of this process must still change).
#[test]
#[ignore = "needs a CUDA GPU"]
fn live_bytes_are_exact_when_another_thread_frees() {
    gpu_child(
        "tests::live_bytes_child",
        "MEMRES_CAPI_LIVE_CHILD",
        "live bytes: exact",
    );
}

/// A `fallback(..)` stack: a block its next tier (pinned host memory) served lies outside
/// the first tier's reservation, and its free is taken, not refused as foreign
/// (found on the H200: 2 GiB of tensors stayed live under PyTorch). In a child process,
/// as the test above.
#[test]
#[ignore = "needs a CUDA GPU"]
fn blocks_of_a_fallback_tier_are_freed() {
    gpu_child(
        "tests::fallback_child",
        "MEMRES_CAPI_FALLBACK_CHILD",
        "fallback: freed",
    );
}

/// The body of the test above, run only in its child process.
#[test]
fn fallback_child() {
    if std::env::var_os("MEMRES_CAPI_FALLBACK_CHILD").is_none() {
        return; // not the child
    }
    assert_eq!(
        configure("fallback(virtual_pool:max=64MiB, pinned_pool)"),
        MEMRES_OK,
        "{}",
        last_error()
    );
    const SIZE: isize = 48 << 20;
    // SAFETY: the legacy default stream.
    let blocks: Vec<*mut c_void> = (0..3)
        .map(|_| unsafe { memres_malloc(SIZE, 0, std::ptr::null_mut()) })
        .collect();
    assert!(blocks.iter().all(|p| !p.is_null()), "{}", last_error());
    assert_eq!(
        stats(0).live_bytes,
        3 * SIZE as i64,
        "two of them past the first tier"
    );
    let mut tiers = [memres_stats_t::default(); 2];
    // SAFETY: `tiers` holds two entries.
    assert_eq!(unsafe { memres_tier_stats(0, tiers.as_mut_ptr(), 2) }, 2);
    assert_eq!(
        (tiers[0].current_bytes, tiers[1].current_bytes),
        (SIZE as i64, 2 * SIZE as i64),
        "one block from the device, two from pinned memory"
    );
    // Both tiers' pools count and are listed (issue 49: the pinned pool was neither).
    let held = stats(0);
    assert!(held.pool_size >= 3 * SIZE as u64, "{held:?}");
    let mut segments = [0u64; 2 * 64];
    // SAFETY: room for 64 pairs.
    let n = unsafe { memres_segments(0, segments.as_mut_ptr(), 64) };
    assert!((1..=64).contains(&n), "{n}: {}", last_error());
    let listed = &segments[..2 * n as usize];
    for &p in &blocks {
        assert!(
            listed
                .chunks(2)
                .any(|s| (p as u64).wrapping_sub(s[0]) < s[1]),
            "{p:?} in no segment: {listed:x?}"
        );
    }
    // The device tier sleeps; the pinned tier stays as it is, its blocks usable.
    let default = c("default");
    // SAFETY: nothing uses the first tier's block until the wake.
    let released = unsafe { memres_sleep(0, default.as_ptr(), MEMRES_SLEEP_DISCARD) };
    assert!(released >= SIZE as i64, "{released}: {}", last_error());
    // SAFETY: a NUL-terminated string.
    assert_eq!(unsafe { memres_is_asleep(0, default.as_ptr()) }, 1);
    // SAFETY: a block of the pinned tier: host memory, mapped.
    unsafe { blocks[1].cast::<u8>().write_bytes(1, SIZE as usize) };
    // SAFETY: a NUL-terminated string.
    assert_eq!(unsafe { memres_wake(0, default.as_ptr()) }, released);
    for p in blocks {
        // SAFETY: from `memres_malloc(SIZE, 0, ..)` above, unused, legacy stream.
        unsafe { memres_free(p, SIZE, 0, std::ptr::null_mut()) };
    }
    assert_eq!(
        stats(0).live_bytes,
        0,
        "every block freed: {}",
        last_error()
    );
    assert_eq!(memres_trim(0), MEMRES_OK, "{}", last_error());
    assert_eq!(stats(0).pool_size, 0, "both tiers trimmed");
    println!("fallback: freed");
}

/// `virtual_pool:granule=32MiB` reaches the default stack's pool and the tags' pools
/// (they take the spec's granule): a small block in each maps 32 MiB. In a child
/// process, as the tests above.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_specs_granule_reaches_the_tags_pools() {
    gpu_child(
        "tests::granule_child",
        "MEMRES_CAPI_GRANULE_CHILD",
        "granule: 32 MiB each",
    );
}

/// Without `granule=` the default stack's pool and the tags' pools map the C ABI's
/// default granule (`routed::DEFAULT_GRANULE`, 2 MiB). In a child process.
#[test]
#[ignore = "needs a CUDA GPU"]
fn the_default_granule_reaches_the_tags_pools() {
    gpu_child(
        "tests::default_granule_child",
        "MEMRES_CAPI_GRANULE_CHILD",
        "granule: 2 MiB each",
    );
}

/// The body of `a_specs_granule_reaches_the_tags_pools`, run only in its child process.
#[test]
fn granule_child() {
    if std::env::var_os("MEMRES_CAPI_GRANULE_CHILD").is_none() {
        return; // not the child
    }
    one_granule_in_each_pool("virtual_pool:granule=32MiB", 32 << 20);
}

/// The body of `the_default_granule_reaches_the_tags_pools`, run only in its child
/// process.
#[test]
fn default_granule_child() {
    if std::env::var_os("MEMRES_CAPI_GRANULE_CHILD").is_none() {
        return; // not the child
    }
    one_granule_in_each_pool("virtual_pool", crate::routed::DEFAULT_GRANULE as u64);
}

/// Stacks `spec`, then a small block untagged and one under a tag: each pool maps one
/// granule of `granule` bytes; prints "granule: N MiB each".
fn one_granule_in_each_pool(spec: &str, granule: u64) {
    assert_eq!(configure(spec), MEMRES_OK, "{}", last_error());
    // SAFETY: NUL-terminated strings, the legacy default stream; each block freed once,
    // as it was allocated, and not used.
    unsafe {
        let untagged = memres_malloc(4096, 0, std::ptr::null_mut());
        assert!(!untagged.is_null(), "{}", last_error());
        assert_eq!(
            stats(0).pool_size,
            granule,
            "the default pool maps one granule"
        );
        assert_eq!(memres_set_tag(c("weights").as_ptr()), MEMRES_OK);
        let weights = memres_malloc(4096, 0, std::ptr::null_mut());
        assert_eq!(memres_set_tag(std::ptr::null()), MEMRES_OK);
        assert!(!weights.is_null(), "{}", last_error());
        assert_eq!(
            stats(0).pool_size,
            2 * granule,
            "the tag's pool maps one granule too"
        );
        memres_free(weights, 4096, 0, std::ptr::null_mut());
        memres_free(untagged, 4096, 0, std::ptr::null_mut());
    }
    assert_eq!(memres_trim(0), MEMRES_OK, "{}", last_error());
    println!("granule: {} MiB each", granule >> 20);
}

/// A `fallback(..)` of two in-place pools sleeps and wakes as one through the C ABI
/// (issue 49: only the tier kept last slept). In a child process, as the tests above.
#[test]
#[ignore = "needs a CUDA GPU"]
fn both_in_place_tiers_of_a_fallback_sleep() {
    gpu_child(
        "tests::two_tiers_sleep_child",
        "MEMRES_CAPI_TWO_TIERS_CHILD",
        "two tiers: woken",
    );
}

/// The body of the test above, run only in its child process.
#[test]
fn two_tiers_sleep_child() {
    if std::env::var_os("MEMRES_CAPI_TWO_TIERS_CHILD").is_none() {
        return; // not the child
    }
    assert_eq!(
        configure("fallback(virtual_pool:max=64MiB, virtual_pool)"),
        MEMRES_OK,
        "{}",
        last_error()
    );
    const SIZE: isize = 48 << 20;
    // SAFETY: the legacy default stream.
    let blocks: Vec<*mut c_void> = (0..3)
        .map(|_| unsafe { memres_malloc(SIZE, 0, std::ptr::null_mut()) })
        .collect();
    assert!(blocks.iter().all(|p| !p.is_null()), "{}", last_error());
    let held = stats(0).pool_size;
    assert!(held >= 3 * SIZE as u64, "both tiers counted: {held}");
    let default = c("default");
    // SAFETY: nothing uses the blocks until the wake; NUL-terminated strings.
    unsafe {
        let released = memres_sleep(0, default.as_ptr(), MEMRES_SLEEP_DISCARD);
        assert!(released >= 3 * SIZE as i64, "{released}: {}", last_error());
        assert_eq!(stats(0).pool_size, 0, "both tiers asleep");
        assert!(memres_malloc(4096, 0, std::ptr::null_mut()).is_null());
        assert!(last_error().contains("asleep"), "{}", last_error());
        assert_eq!(memres_wake(0, default.as_ptr()), released);
        assert_eq!(
            memres_wake(0, default.as_ptr()),
            i64::from(MEMRES_ERROR_INVALID_ARGUMENT),
            "awake already"
        );
        for p in blocks {
            memres_free(p, SIZE, 0, std::ptr::null_mut());
        }
    }
    assert_eq!(memres_trim(0), MEMRES_OK, "{}", last_error());
    assert_eq!(stats(0).pool_size, 0, "both tiers trimmed");
    println!("two tiers: woken");
}

/// The body of `live_bytes_are_exact_when_another_thread_frees`, run only in its child
/// process.
#[test]
fn live_bytes_child() {
    if std::env::var_os("MEMRES_CAPI_LIVE_CHILD").is_none() {
        return; // not the child
    }
    const SIZES: [isize; 3] = [1 << 20, 3 << 20, 4096];
    // Build the stack, then free a pointer memres never handed out: refused, nothing
    // counted, no crash.
    // SAFETY: the legacy default stream.
    let first = unsafe { memres_malloc(256, 0, std::ptr::null_mut()) };
    assert!(!first.is_null(), "{}", last_error());
    assert_eq!(
        stats(0).pool_size,
        crate::routed::DEFAULT_GRANULE as u64,
        "the default stack's first block maps one granule of the C ABI's default"
    );
    let before = stats(0).live_bytes;
    let mut not_ours = [0u8; 64];
    // SAFETY: the pointer is not memres's: the call under test must refuse it.
    unsafe { memres_free(not_ours.as_mut_ptr().cast(), 64, 0, std::ptr::null_mut()) };
    assert!(
        last_error().contains("is not memory of device 0's pool"),
        "{}",
        last_error()
    );
    assert_eq!(stats(0).live_bytes, before);
    // SAFETY: from `memres_malloc(256, 0, ..)` above, unused, legacy stream.
    unsafe { memres_free(first, 256, 0, std::ptr::null_mut()) };
    let before = stats(0).live_bytes;
    let scope = push("capi.child", true);
    let blocks: Vec<usize> = SIZES
        .iter()
        // SAFETY: the legacy default stream.
        .map(|&n| unsafe { memres_malloc(n, 0, std::ptr::null_mut()) } as usize)
        .collect();
    assert!(blocks.iter().all(|&p| p != 0), "{}", last_error());
    let total: isize = SIZES.iter().sum();
    let during = stats(0);
    assert_eq!(during.live_bytes, before + total as i64);
    assert!(during.peak_live_bytes >= during.live_bytes);
    // Freed on another thread, as PyTorch's autograd thread does.
    std::thread::spawn(move || {
        for (p, n) in blocks.into_iter().zip(SIZES) {
            // SAFETY: from `memres_malloc(n, 0, ..)` above, unused, legacy stream.
            unsafe { memres_free(p as *mut c_void, n, 0, std::ptr::null_mut()) };
        }
    })
    .join()
    .unwrap();
    assert_eq!(memres_profile_pop(scope), MEMRES_OK);
    let total_u = total as u64;
    // An all-threads scope: the other thread's frees count too.
    let child = report_lines()
        .into_iter()
        .find(|l| l[0] == "capi.child")
        .unwrap();
    assert_eq!(
        child[1..],
        ["1", "3", &total_u.to_string(), &total_u.to_string(), "0"]
    );
    let after = stats(0);
    assert_eq!(after.live_bytes, before);
    assert!(after.peak_live_bytes >= before + total as i64);
    assert_eq!(memres_reset_peak(0), MEMRES_OK);
    assert_eq!(stats(0).peak_live_bytes, before);
    println!("live bytes: exact");

    // A pointer memres never handed out is refused by memres_record_stream as by free.
    // SAFETY: refused before the stream is used.
    let code =
        unsafe { memres_record_stream(not_ours.as_mut_ptr().cast(), 0, std::ptr::null_mut()) };
    assert_eq!(code, MEMRES_ERROR_INVALID_ARGUMENT);
    assert!(
        last_error().contains("is not memory of device 0's pool"),
        "{}",
        last_error()
    );
    let mut pairs = [0u64; 2 * 64];
    // SAFETY: `pairs` holds 64 pairs.
    let n = unsafe { memres_segments(0, pairs.as_mut_ptr(), 64) };
    assert!((1..=64).contains(&n), "{n}: {}", last_error());
    let held: u64 = pairs.chunks(2).take(n as usize).map(|p| p[1]).sum();
    assert_eq!(
        held,
        stats(0).pool_size,
        "the segments are what the pool holds"
    );
    ipc_in_one_process();
    println!("ipc: the same bytes through the imported range");
}

/// Exports a block of the default pool and maps the handle in this same process (the
/// granules' descriptors taken with `pidfd_getfd` from our own pid): the bytes written
/// through the block read back through the second mapping.
fn ipc_in_one_process() {
    use cudarc::driver::sys;
    const N: usize = 20 << 20; // spans two granules (of 2 MiB, or of 16) at least
    // SAFETY: the legacy default stream.
    let block = unsafe { memres_malloc(N as isize, 0, std::ptr::null_mut()) };
    assert!(!block.is_null(), "{}", last_error());
    // SAFETY: `out` null asks for the length only.
    let len = unsafe {
        memres_ipc_export(
            block,
            N as isize,
            0,
            std::ptr::null_mut(),
            0,
            std::ptr::null_mut(),
        )
    };
    assert!(
        len > 0 && len != 64,
        "a granules handle: {len} ({})",
        last_error()
    );
    assert!(
        len as usize >= crate::ipc::Handle::granules_len(2),
        "the block lies in two granules at least: {len}"
    );
    let mut handle = vec![0u8; len as usize];
    let mut offset = usize::MAX;
    // SAFETY: a buffer one byte too small: refused, nothing written or exported.
    let short = unsafe {
        memres_ipc_export(
            block,
            N as isize,
            0,
            handle.as_mut_ptr().cast(),
            handle.len() - 1,
            &mut offset,
        )
    };
    assert_eq!(short, i64::from(MEMRES_ERROR_INVALID_ARGUMENT));
    assert!(last_error().contains("buffer"), "{}", last_error());
    // SAFETY: `handle` has `len` bytes; `offset` is a valid place.
    let written = unsafe {
        memres_ipc_export(
            block,
            N as isize,
            0,
            handle.as_mut_ptr().cast(),
            handle.len(),
            &mut offset,
        )
    };
    assert_eq!(written, len, "{}", last_error());
    let pattern: Vec<u8> = (0..N).map(|i| (i * 7 % 251) as u8).collect();
    // SAFETY: `block` is N device bytes; the host slice N bytes.
    let r = unsafe { sys::cuMemcpyHtoD_v2(block as sys::CUdeviceptr, pattern.as_ptr().cast(), N) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    let mut base = std::ptr::null_mut();
    // SAFETY: `handle` is `len` bytes; `base` a valid place.
    let code = unsafe { memres_ipc_open(handle.as_ptr().cast(), handle.len(), 0, &mut base) };
    assert_eq!(code, MEMRES_OK, "{}", last_error());
    assert_ne!(base as usize + offset, block as usize, "a second mapping");
    let mut back = vec![0u8; N];
    // SAFETY: the imported range holds the block at `offset`, N bytes.
    let r = unsafe {
        sys::cuMemcpyDtoH_v2(
            back.as_mut_ptr().cast(),
            (base as usize + offset) as sys::CUdeviceptr,
            N,
        )
    };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    assert!(
        back == pattern,
        "the imported range shows the block's bytes"
    );
    // Opening the same handle again shares the mapping; two closes unmap it; a third
    // is refused.
    let mut again = std::ptr::null_mut();
    // SAFETY: as above.
    let code = unsafe { memres_ipc_open(handle.as_ptr().cast(), handle.len(), 0, &mut again) };
    assert_eq!((code, again), (MEMRES_OK, base));
    assert_eq!(memres_ipc_close(base), MEMRES_OK);
    assert_eq!(memres_ipc_close(base), MEMRES_OK, "{}", last_error());
    assert_eq!(memres_ipc_close(base), MEMRES_ERROR_INVALID_ARGUMENT);
    assert!(last_error().contains("closed twice"), "{}", last_error());
    // A malformed handle is refused with a message.
    // SAFETY: 10 readable bytes.
    let code = unsafe { memres_ipc_open(b"\x02e-garbage".as_ptr().cast(), 10, 0, &mut base) };
    assert_eq!(code, MEMRES_ERROR_INVALID_ARGUMENT);
    assert!(
        last_error().contains("shorter than its header"),
        "{}",
        last_error()
    );
    // SAFETY: 10 readable bytes.
    let code = unsafe { memres_ipc_open(b"\x02x-garbage".as_ptr().cast(), 10, 0, &mut base) };
    assert_eq!(code, MEMRES_ERROR_INVALID_ARGUMENT);
    assert!(
        last_error().contains("neither a CUDA IPC handle nor an expandable segment's"),
        "{}",
        last_error()
    );
    // SAFETY: from `memres_malloc(N, 0, ..)` above; the copies are complete (synchronous).
    unsafe { memres_free(block, N as isize, 0, std::ptr::null_mut()) };
}

/// `MEMRES_RESOURCE` is read at the first allocation, in a child process of its own
/// (the variable is read once per process): a malformed one, and one that parses but
/// cannot be built, make `memres_malloc` return NULL with a message, without a crash.
#[test]
fn a_bad_memres_resource_fails_the_first_allocation_with_a_message() {
    for (spec, want) in [
        (
            "poool",
            "MEMRES_RESOURCE: invalid resource spec \"poool\": unknown resource",
        ),
        ("pool:initial=1000", "256"),
    ] {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "tests::bad_memres_resource_child", "--nocapture"])
            .env("MEMRES_RESOURCE", spec)
            .env("MEMRES_CAPI_BAD_ENV_CHILD", want)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && text.contains("refused with a message"),
            "{spec}: the child failed:\n{text}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// The body of the test above, run only in its child processes.
#[test]
fn bad_memres_resource_child() {
    let Some(want) = std::env::var_os("MEMRES_CAPI_BAD_ENV_CHILD") else {
        return; // not a child
    };
    let want = want.into_string().unwrap();
    for _ in 0..2 {
        // SAFETY: the legacy default stream.
        let p = unsafe { memres_malloc(1024, 0, std::ptr::null_mut()) };
        assert!(p.is_null());
        let message = last_error();
        // Without a driver a stack that parses cannot be built at all: that is the
        // message then.
        let no_driver = !mr::driver::is_present() && want == "256";
        assert!(
            message.contains(&want) || (no_driver && !message.is_empty()),
            "{message:?} lacks {want:?}"
        );
    }
    println!("refused with a message");
}

fn push(name: &str, all_threads: bool) -> i64 {
    let c = CString::new(name).unwrap();
    // SAFETY: a NUL-terminated string.
    unsafe { profile::memres_profile_push(c.as_ptr(), all_threads.into()) }
}

/// The report, each line split at tabs (names unescaped are not needed here).
fn report_lines() -> Vec<Vec<String>> {
    // SAFETY: a null buffer of length 0 asks for the length only.
    let n = unsafe { profile::memres_profile_report(std::ptr::null_mut(), 0) };
    assert!(n >= 0, "{}", last_error());
    let mut buf = vec![0u8; n as usize + 1];
    // SAFETY: `buf` is valid for its length.
    let m = unsafe { profile::memres_profile_report(buf.as_mut_ptr().cast(), buf.len()) };
    assert!(m >= n, "the report shrank");
    let text = CStr::from_bytes_until_nul(&buf).unwrap().to_str().unwrap();
    text.lines()
        .map(|l| l.split('\t').map(str::to_owned).collect())
        .collect()
}

#[test]
fn profiler_scopes_open_close_and_report_through_the_abi() {
    let id = push("capi.scope", false);
    assert!(id > 0, "{}", last_error());
    let inner = push("capi.inner\ta\\b\n", true);
    assert!(inner > id);
    // Another thread cannot close this thread's scope.
    let other = std::thread::spawn(move || (memres_profile_pop(inner), last_error()))
        .join()
        .unwrap();
    assert_eq!(other.0, MEMRES_ERROR_INVALID_ARGUMENT);
    assert!(
        other.1.contains("not open") || other.1.contains("no scope"),
        "{}",
        other.1
    );
    assert_eq!(memres_profile_pop(inner), MEMRES_OK);
    assert_eq!(
        memres_profile_pop(inner),
        MEMRES_ERROR_INVALID_ARGUMENT,
        "closed twice"
    );
    assert_eq!(memres_profile_pop(id), MEMRES_OK);
    let lines = report_lines();
    let scope = lines.iter().find(|l| l[0] == "capi.scope").unwrap();
    assert_eq!(scope[1..], ["1", "0", "0", "0", "0"]);
    // Tab, backslash and newline in a name are escaped, so each record is one line.
    assert!(
        lines.iter().any(|l| l[0] == "capi.inner\\ta\\\\b\\n"),
        "{lines:?}"
    );
    // A short buffer gets a truncated, NUL-terminated prefix and the full length.
    let mut small = [0x55u8; 4];
    // SAFETY: `small` is valid for 4 bytes.
    let n = unsafe { profile::memres_profile_report(small.as_mut_ptr().cast(), 4) };
    assert!(n > 4);
    assert_eq!(small[3], 0);
    // SAFETY: a null name is refused, not read.
    let null_name = unsafe { profile::memres_profile_push(std::ptr::null(), 0) };
    assert_eq!(null_name, -1);
    // SAFETY: a null buffer with a length is refused, not written.
    let null_buf = unsafe { profile::memres_profile_report(std::ptr::null_mut(), 8) };
    assert_eq!(null_buf, -1);
}

#[test]
fn stats_and_trim_of_an_unused_device_are_zero() {
    // SAFETY: a null buffer with no room.
    assert_eq!(unsafe { memres_tier_stats(5, std::ptr::null_mut(), 0) }, 0);
    let mut out = memres_stats_t {
        has_pool: 7,
        ..memres_stats_t::default()
    };
    // SAFETY: `out` is valid for one write.
    assert_eq!(unsafe { memres_stats(5, &mut out) }, MEMRES_OK);
    assert_eq!(out, memres_stats_t::default());
    assert_eq!(memres_trim(5), MEMRES_OK);
    assert_eq!(memres_reset_peak(5), MEMRES_OK);
    assert_eq!(memres_reset_peak(-1), MEMRES_ERROR_INVALID_ARGUMENT);
}

// The header

// Embedded, so the test binary runs anywhere (the GPU bundle has no source tree).
const HEADER: &str = include_str!("../include/memres.h");

fn header() -> String {
    HEADER.to_owned()
}

fn source() -> String {
    [
        include_str!("lib.rs"),
        include_str!("profile.rs"),
        include_str!("ipc.rs"),
        include_str!("tags.rs"),
        include_str!("segment_pools.rs"),
    ]
    .concat()
}

/// `name(params) -> ret` of every `extern "C" fn memres_*` in the source, in C types.
fn rust_prototypes() -> Vec<String> {
    let source = source();
    let c_type = |rust: &str| -> String {
        match rust.trim() {
            "isize" => "ssize_t",
            "c_int" => "int",
            "i64" => "int64_t",
            "usize" => "size_t",
            "*mut c_char" => "char*",
            "*mut c_void" => "void*",
            "*const c_char" => "const char*",
            "*const c_void" => "const void*",
            "*mut usize" => "size_t*",
            "*mut u64" => "uint64_t*",
            "*mut *mut c_void" => "void**",
            "*mut memres_stats_t" => "memres_stats_t*",
            "*mut SegmentPoolHandle" => "memres_segment_pool_t*",
            "*mut memres_block_t" => "memres_block_t*",
            "*const memres_block_t" => "const memres_block_t*",
            "memres_segment_alloc_fn" => "memres_segment_alloc_fn",
            "memres_segment_free_fn" => "memres_segment_free_fn",
            "" => "void",
            other => panic!("no C type for the Rust type {other:?}"),
        }
        .to_owned()
    };
    let mut out = Vec::new();
    // The exported functions: each follows `#[unsafe(no_mangle)]`.
    for exported in source.split("#[unsafe(no_mangle)]").skip(1) {
        let Some((_, chunk)) = exported.split_once("extern \"C\" fn ") else {
            continue;
        };
        let (name, rest) = chunk.split_once('(').unwrap();
        let (params, rest) = rest.split_once(')').unwrap();
        let ret = rest
            .split('{')
            .next()
            .unwrap()
            .trim()
            .trim_start_matches("->");
        let params: Vec<String> = params
            .split(',')
            .filter(|p| !p.trim().is_empty())
            .map(|p| c_type(p.split_once(':').unwrap().1))
            .collect();
        let params = if params.is_empty() {
            "void".to_owned()
        } else {
            params.join(", ")
        };
        out.push(format!("{} {name}({params})", c_type(ret)));
    }
    out.sort();
    out
}

/// The same from the header's prototypes, parameter names dropped.
fn header_prototypes() -> Vec<String> {
    let mut out = Vec::new();
    for line in header().lines().map(str::trim) {
        if line.starts_with("typedef") {
            continue; // a function pointer's type, not a prototype
        }
        let Some((head, params)) = line.strip_suffix(");").and_then(|l| l.split_once('(')) else {
            continue;
        };
        let (ret, name) = head.rsplit_once(char::is_whitespace).unwrap();
        let params: Vec<String> = params
            .split(',')
            .map(|p| {
                let p = p.trim();
                match p.rsplit_once(char::is_whitespace) {
                    Some((ty, _name)) if p != "void" => ty.trim().to_owned(),
                    _ => p.to_owned(),
                }
            })
            .collect();
        out.push(format!("{} {name}({})", ret.trim(), params.join(", ")));
    }
    out.sort();
    out
}

#[test]
fn the_header_declares_exactly_the_exported_functions() {
    let (rust, c) = (rust_prototypes(), header_prototypes());
    assert_eq!(rust.len(), 37, "{rust:#?}");
    assert_eq!(rust, c, "capi/include/memres.h is out of date");
}

#[test]
fn the_header_has_the_codes_and_the_struct_layout() {
    let header = header();
    for (name, value) in [
        ("MEMRES_OK", MEMRES_OK),
        (
            "MEMRES_ERROR_INVALID_ARGUMENT",
            MEMRES_ERROR_INVALID_ARGUMENT,
        ),
        ("MEMRES_ERROR_IN_USE", MEMRES_ERROR_IN_USE),
        ("MEMRES_ERROR_CUDA", MEMRES_ERROR_CUDA),
        ("MEMRES_ERROR_PANIC", MEMRES_ERROR_PANIC),
        ("MEMRES_ERROR_OUT_OF_MEMORY", MEMRES_ERROR_OUT_OF_MEMORY),
        ("MEMRES_ERROR_ASLEEP", MEMRES_ERROR_ASLEEP),
        ("MEMRES_SLEEP_DISCARD", MEMRES_SLEEP_DISCARD),
        ("MEMRES_SLEEP_OFFLOAD", MEMRES_SLEEP_OFFLOAD),
        ("MEMRES_SEGMENTS_NO_SPLIT", MEMRES_SEGMENTS_NO_SPLIT),
        ("MEMRES_SEGMENTS_MEDIUM", MEMRES_SEGMENTS_MEDIUM),
        ("MEMRES_SETTLE_POLL", MEMRES_SETTLE_POLL),
        ("MEMRES_SETTLE_WAIT", MEMRES_SETTLE_WAIT),
        ("MEMRES_SETTLE_FORGET", MEMRES_SETTLE_FORGET),
    ] {
        let written = if value < 0 {
            format!("({value})")
        } else {
            value.to_string()
        };
        assert!(
            header.contains(&format!("#define {name} {written}")),
            "the header lacks #define {name} {written}"
        );
    }
    // Compile the header with static assertions of the Rust layout, where a C compiler
    // exists (it does wherever Rust links).
    let fields = [
        ("has_statistics", offset_of!(memres_stats_t, has_statistics)),
        ("has_pool", offset_of!(memres_stats_t, has_pool)),
        ("current_bytes", offset_of!(memres_stats_t, current_bytes)),
        ("peak_bytes", offset_of!(memres_stats_t, peak_bytes)),
        ("total_bytes", offset_of!(memres_stats_t, total_bytes)),
        (
            "current_allocations",
            offset_of!(memres_stats_t, current_allocations),
        ),
        (
            "peak_allocations",
            offset_of!(memres_stats_t, peak_allocations),
        ),
        (
            "total_allocations",
            offset_of!(memres_stats_t, total_allocations),
        ),
        ("pool_size", offset_of!(memres_stats_t, pool_size)),
        (
            "pool_free_bytes",
            offset_of!(memres_stats_t, pool_free_bytes),
        ),
        (
            "pool_largest_free_block",
            offset_of!(memres_stats_t, pool_largest_free_block),
        ),
        ("live_bytes", offset_of!(memres_stats_t, live_bytes)),
        (
            "peak_live_bytes",
            offset_of!(memres_stats_t, peak_live_bytes),
        ),
        (
            "allocated_bytes",
            offset_of!(memres_stats_t, allocated_bytes),
        ),
        (
            "live_allocations",
            offset_of!(memres_stats_t, live_allocations),
        ),
        (
            "peak_live_allocations",
            offset_of!(memres_stats_t, peak_live_allocations),
        ),
        ("allocations", offset_of!(memres_stats_t, allocations)),
        ("out_of_memory", offset_of!(memres_stats_t, out_of_memory)),
        ("pool_peak_size", offset_of!(memres_stats_t, pool_peak_size)),
        (
            "pool_host_copy_bytes",
            offset_of!(memres_stats_t, pool_host_copy_bytes),
        ),
        (
            "pool_alloc_calls",
            offset_of!(memres_stats_t, pool_alloc_calls),
        ),
        (
            "pool_free_calls",
            offset_of!(memres_stats_t, pool_free_calls),
        ),
    ];
    let mut c = String::from("#include <stddef.h>\n#include \"memres.h\"\n");
    c += &format!(
        "_Static_assert(sizeof(memres_stats_t) == {}, \"size\");\n",
        size_of::<memres_stats_t>()
    );
    for (field, offset) in fields {
        c += &format!(
            "_Static_assert(offsetof(memres_stats_t, {field}) == {offset}, \"{field}\");\n"
        );
    }
    c += &format!(
        "_Static_assert(sizeof(memres_block_t) == {}, \"block size\");\n",
        size_of::<memres_block_t>()
    );
    for (field, offset) in [
        ("segment", offset_of!(memres_block_t, segment)),
        ("segment_size", offset_of!(memres_block_t, segment_size)),
        ("offset", offset_of!(memres_block_t, offset)),
        ("size", offset_of!(memres_block_t, size)),
        ("stream", offset_of!(memres_block_t, stream)),
        ("allocated", offset_of!(memres_block_t, allocated)),
        ("held", offset_of!(memres_block_t, held)),
    ] {
        c += &format!(
            "_Static_assert(offsetof(memres_block_t, {field}) == {offset}, \"{field}\");\n"
        );
    }
    let dir = std::env::temp_dir().join(format!("memres-header-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("layout.c");
    std::fs::write(&file, c).unwrap();
    std::fs::write(dir.join("memres.h"), HEADER).unwrap();
    let include = dir.to_str().unwrap();
    match std::process::Command::new("cc")
        .args([
            "-std=c11",
            "-Wall",
            "-Werror",
            "-fsyntax-only",
            "-I",
            include,
        ])
        .arg(&file)
        .output()
    {
        Ok(out) => assert!(
            out.status.success(),
            "the header's memres_stats_t differs from the Rust one:\n{}",
            String::from_utf8_lossy(&out.stderr)
        ),
        Err(e) => println!("memres-skip: (in part) the C layout check: no C compiler ({e})"),
    }
    let _ = std::fs::remove_dir_all(dir);
}

fn c(text: &str) -> CString {
    CString::new(text).unwrap()
}

#[test]
fn tags_and_sleep_answer_bad_arguments_and_a_missing_driver_with_messages() {
    let _turn = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    // SAFETY: NUL-terminated strings or null.
    unsafe {
        assert_eq!(memres_set_tag(c("weights").as_ptr()), MEMRES_OK);
        assert!(routed::current() > 0);
        assert_eq!(memres_set_tag(std::ptr::null()), MEMRES_OK);
        assert_eq!(routed::current(), 0);
        assert_eq!(memres_set_tag(c("default").as_ptr()), MEMRES_OK);
        assert_eq!(routed::current(), 0);
        assert_eq!(
            memres_sleep(0, std::ptr::null(), 7),
            i64::from(MEMRES_ERROR_INVALID_ARGUMENT)
        );
        assert!(last_error().contains("mode 7"), "{}", last_error());
        assert_eq!(
            memres_sleep(-1, std::ptr::null(), MEMRES_SLEEP_DISCARD),
            i64::from(MEMRES_ERROR_INVALID_ARGUMENT)
        );
        assert!(last_error().contains("device -1"), "{}", last_error());
        assert_eq!(
            memres_is_asleep(0, std::ptr::null()),
            MEMRES_ERROR_INVALID_ARGUMENT
        );
    }
    if !mr::driver::is_present() {
        // SAFETY: as above.
        let code = unsafe { memres_wake(0, std::ptr::null()) };
        assert_eq!(code, i64::from(MEMRES_ERROR_CUDA));
        assert!(last_error().contains("no CUDA driver"), "{}", last_error());
    }
}

/// Tags, sleep and wake through the C ABI on a GPU, in a child process (as the tests
/// above): a tagged block keeps its bytes across an offload, the untagged pool discards,
/// allocations while asleep fail with `MEMRES_ERROR_ASLEEP`, and every misuse is an error.
#[test]
#[ignore = "needs a CUDA GPU"]
fn tagged_pools_sleep_and_wake() {
    gpu_child(
        "tests::sleep_child",
        "MEMRES_CAPI_SLEEP_CHILD",
        "sleep: woken",
    );
}

/// The body of the test above, run only in its child process.
#[test]
fn sleep_child() {
    use cudarc::driver::sys;
    if std::env::var_os("MEMRES_CAPI_SLEEP_CHILD").is_none() {
        return; // not the child
    }
    const SIZE: usize = 48 << 20;
    let pattern: Vec<u8> = (0..SIZE).map(|i| (i * 7 % 251) as u8).collect();
    // SAFETY: NUL-terminated strings, the legacy default stream, blocks of `SIZE` bytes
    // from `memres_malloc` written and read by synchronous copies while the pools wake.
    unsafe {
        let untagged = memres_malloc(SIZE as isize, 0, std::ptr::null_mut());
        assert!(!untagged.is_null(), "{}", last_error());
        assert_eq!(memres_set_tag(c("weights").as_ptr()), MEMRES_OK);
        let weights = memres_malloc(SIZE as isize, 0, std::ptr::null_mut());
        assert_eq!(memres_set_tag(std::ptr::null()), MEMRES_OK);
        assert!(!weights.is_null(), "{}", last_error());
        assert_eq!(
            sys::cuMemcpyHtoD_v2(weights as u64, pattern.as_ptr().cast(), SIZE),
            sys::CUresult::CUDA_SUCCESS
        );
        let held = stats(0).pool_size;
        let offloaded = memres_sleep(0, c("weights").as_ptr(), MEMRES_SLEEP_OFFLOAD);
        assert!(offloaded >= SIZE as i64, "{offloaded}: {}", last_error());
        // The copies: the block's granules (the sleep gave back free ones uncopied), and
        // the pinned staging buffers they went through (at most 128 MiB).
        let copies = stats(0).pool_host_copy_bytes;
        let most = offloaded as u64 + (128 << 20);
        assert!(
            (SIZE as u64..=most).contains(&copies),
            "{copies} B of copies and buffers, {offloaded} B given back"
        );
        assert_eq!(
            memres_sleep(0, c("weights").as_ptr(), MEMRES_SLEEP_OFFLOAD),
            i64::from(MEMRES_ERROR_INVALID_ARGUMENT),
            "twice"
        );
        assert_eq!(
            memres_sleep(0, c("kv_cache").as_ptr(), MEMRES_SLEEP_OFFLOAD),
            i64::from(MEMRES_ERROR_INVALID_ARGUMENT),
            "a tag never set"
        );
        // The rest (the default stack) discards; NULL skips the sleeping tag.
        let discarded = memres_sleep(0, std::ptr::null(), MEMRES_SLEEP_DISCARD);
        assert!(discarded >= SIZE as i64, "{discarded}: {}", last_error());
        assert_eq!(stats(0).pool_size, 0, "held {held} before, nothing now");
        assert_eq!(memres_is_asleep(0, c("weights").as_ptr()), 1);
        assert_eq!(memres_is_asleep(0, c("default").as_ptr()), 1);
        assert!(memres_malloc(4096, 0, std::ptr::null_mut()).is_null());
        assert!(last_error().contains("asleep"), "{}", last_error());
        // Staged: the weights first.
        assert_eq!(memres_wake(0, c("weights").as_ptr()), offloaded);
        let mut back = vec![0u8; SIZE];
        assert_eq!(
            sys::cuMemcpyDtoH_v2(back.as_mut_ptr().cast(), weights as u64, SIZE),
            sys::CUresult::CUDA_SUCCESS
        );
        assert!(back == pattern, "the weights' bytes came back");
        // Kept for the next sleep (the wake may have made staging buffers the sleep did
        // not: how many a thread uses depends on the threads' timing).
        let kept = stats(0).pool_host_copy_bytes;
        assert!((copies..=most).contains(&kept), "{kept} B kept");
        assert_eq!(memres_is_asleep(0, c("weights").as_ptr()), 0);
        assert_eq!(memres_wake(0, std::ptr::null()), discarded);
        assert_eq!(
            memres_wake(0, c("default").as_ptr()),
            i64::from(MEMRES_ERROR_INVALID_ARGUMENT),
            "awake already"
        );
        memres_free(weights, SIZE as isize, 0, std::ptr::null_mut());
        memres_free(untagged, SIZE as isize, 0, std::ptr::null_mut());
        assert_eq!(stats(0).live_bytes, 0, "{}", last_error());
        assert_eq!(memres_trim(0), MEMRES_OK, "{}", last_error());
        assert_eq!(stats(0).pool_host_copy_bytes, 0, "trim frees the copies");

        // A block shared with another process keeps its memory there: its pool may not
        // sleep until it is freed.
        assert_eq!(memres_set_tag(c("shared").as_ptr()), MEMRES_OK);
        let shared = memres_malloc(SIZE as isize, 0, std::ptr::null_mut());
        assert_eq!(memres_set_tag(std::ptr::null()), MEMRES_OK);
        assert!(!shared.is_null(), "{}", last_error());
        let mut offset = 0usize;
        let len = memres_ipc_export(
            shared,
            SIZE as isize,
            0,
            std::ptr::null_mut(),
            0,
            &mut offset,
        );
        assert!(len > 0, "{}", last_error());
        let mut handle = vec![0u8; len as usize];
        let written = memres_ipc_export(
            shared,
            SIZE as isize,
            0,
            handle.as_mut_ptr().cast(),
            handle.len(),
            &mut offset,
        );
        assert_eq!(written, len, "{}", last_error());
        assert_eq!(
            memres_sleep(0, c("shared").as_ptr(), MEMRES_SLEEP_DISCARD),
            i64::from(MEMRES_ERROR_INVALID_ARGUMENT)
        );
        assert!(
            last_error().contains("shared with other processes"),
            "{}",
            last_error()
        );
        memres_free(shared, SIZE as isize, 0, std::ptr::null_mut());
        assert!(
            memres_sleep(0, c("shared").as_ptr(), MEMRES_SLEEP_DISCARD) >= 0,
            "{}",
            last_error()
        );
        assert!(
            memres_wake(0, c("shared").as_ptr()) >= 0,
            "{}",
            last_error()
        );
    }
    println!("sleep: woken");
}

/// A `binning` stack keeps blocks of its pool in its bins: its untagged memory cannot
/// sleep (the bins would hand the blocks out unmapped). In a child process, as above.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_binning_stack_refuses_to_sleep() {
    gpu_child(
        "tests::binning_sleep_child",
        "MEMRES_CAPI_BINNING_CHILD",
        "binning: refused",
    );
}

/// The body of the test above, run only in its child process.
#[test]
fn binning_sleep_child() {
    if std::env::var_os("MEMRES_CAPI_BINNING_CHILD").is_none() {
        return; // not the child
    }
    assert_eq!(configure("binning"), MEMRES_OK, "{}", last_error());
    // SAFETY: the legacy default stream; NUL-terminated strings.
    unsafe {
        let p = memres_malloc(4096, 0, std::ptr::null_mut());
        assert!(!p.is_null(), "{}", last_error());
        assert_eq!(
            memres_sleep(0, c("default").as_ptr(), MEMRES_SLEEP_DISCARD),
            i64::from(MEMRES_ERROR_INVALID_ARGUMENT)
        );
        assert!(last_error().contains("binning"), "{}", last_error());
        // NULL (every pool that can) skips it: nothing sleeps.
        assert_eq!(memres_sleep(0, std::ptr::null(), MEMRES_SLEEP_DISCARD), 0);
        let q = memres_malloc(4096, 0, std::ptr::null_mut());
        assert!(!q.is_null(), "still serving: {}", last_error());
        memres_free(p, 4096, 0, std::ptr::null_mut());
        memres_free(q, 4096, 0, std::ptr::null_mut());
    }
    println!("binning: refused");
}

// Every pool of a stack, on the host: the C ABI's `Pools` over stacks of host memory
// built by `Spec::build` (the C ABI's own target needs a GPU).

/// Heap bytes this thread has allocated and not freed (counted by the global allocator of
/// this test binary, per thread: tests run side by side).
mod thread_heap {
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::cell::Cell;

    thread_local! {
        static LIVE: Cell<isize> = const { Cell::new(0) };
    }

    fn add(bytes: isize) {
        // No destructor and a constant start: there at every point of a thread's life.
        let _ = LIVE.try_with(|live| live.set(live.get() + bytes));
    }

    /// Heap bytes live from this thread's allocations and frees.
    pub(super) fn live() -> isize {
        LIVE.with(Cell::get)
    }

    struct Counting;

    // SAFETY: forwards every call to `System`, counting sizes on the side.
    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, l: Layout) -> *mut u8 {
            add(l.size() as isize);
            // SAFETY: the caller's promise, passed on.
            unsafe { System.alloc(l) }
        }

        unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
            add(l.size() as isize);
            // SAFETY: the caller's promise, passed on.
            unsafe { System.alloc_zeroed(l) }
        }

        unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
            add(-(l.size() as isize));
            // SAFETY: the caller's promise, passed on.
            unsafe { System.dealloc(p, l) }
        }

        unsafe fn realloc(&self, p: *mut u8, l: Layout, new_size: usize) -> *mut u8 {
            // SAFETY: the caller's promise, passed on.
            let moved = unsafe { System.realloc(p, l, new_size) };
            if !moved.is_null() {
                add(new_size as isize - l.size() as isize);
            }
            moved
        }
    }

    #[global_allocator]
    static GLOBAL: Counting = Counting;
}

/// The items every host [`Target`] of these tests shares: host properties, heap blocks
/// and heap pages, 256 MiB reservations of 64 KiB granules (or the spec's size) for
/// in-place pools, and 16 MiB arenas.
macro_rules! host_leaves {
    () => {
        type Properties = mr::Host;
        type Memory = mr::HostHeap;
        type Backend = mr::upstream::HostPages;

        fn memory(&mut self) -> Result<mr::HostHeap, Error> {
            Ok(mr::HostHeap)
        }
        fn virtual_leaf(
            &mut self,
            leaf: &mr::spec::LeafOptions,
        ) -> Result<mr::upstream::HostVirtual, Error> {
            mr::upstream::HostVirtual::new(
                leaf.reserve.unwrap_or(256 << 20),
                leaf.granule.unwrap_or(64 << 10),
            )
        }
        fn arena_size(&mut self) -> Result<usize, Error> {
            Ok(16 << 20)
        }
    };
}

/// Host memory for specs: heap blocks for `pool`, `arena` and `fixed_size`, heap memory
/// standing in for pinned host memory, and 256 MiB reservations of 64 KiB granules for
/// in-place pools; it keeps the pools it is shown, as the C ABI's target does.
#[derive(Default)]
struct OnTheHost {
    pools: Pools<OnTheHost>,
}

impl Target for OnTheHost {
    host_leaves!();
    fn pinned(&mut self) -> Result<mr::AnyResource<mr::Host>, Error> {
        Ok(mr::AnyResource::new(mr::HostHeap))
    }
    fn built(&mut self, layer: Built<'_, Self>) {
        self.pools.keep(&layer);
    }
}

/// `text` built over host memory, with the pools the build showed.
fn on_the_host(text: &str) -> (mr::AnyResource<mr::Host>, Pools<OnTheHost>) {
    let mut target = OnTheHost::default();
    let top = Spec::parse(text)
        .unwrap()
        .build(&mut target)
        .unwrap_or_else(|e| panic!("{text}: {e}"));
    (top, target.pools)
}

/// Allocates `bytes` from `top` on the host stream and writes them.
fn host_block(top: &mr::AnyResource<mr::Host>, bytes: usize) -> NonNull<u8> {
    let p = top
        .allocate(StreamRef::HOST, mr::layout(bytes).unwrap())
        .unwrap();
    // SAFETY: a fresh block of `bytes` bytes of host memory.
    unsafe { p.as_ptr().write_bytes(0x5a, bytes) };
    p
}

/// Frees a block of `host_block`.
fn free_host_block(top: &mr::AnyResource<mr::Host>, p: NonNull<u8>, bytes: usize) {
    // SAFETY: from `host_block(top, bytes)`, not used afterwards.
    unsafe { top.deallocate(StreamRef::HOST, p, mr::layout(bytes).unwrap()) };
}

/// A `fallback(..)` keeps every tier's pool: the figures are both tiers' summed, the
/// segments list both tiers' memory, and a trim gives back what either holds free (the
/// C ABI kept one handle, overwritten by each tier: only the second was seen).
#[test]
fn every_tier_of_a_fallback_is_counted_listed_and_trimmed() {
    for (text, second) in [
        ("fallback(limiting(virtual_pool, limit=1MiB), pool)", "pool"),
        (
            "fallback(limiting(pool, limit=1MiB), virtual_pool)",
            "virtual_pool",
        ),
        (
            "statistics(fallback(limiting(virtual_pool, limit=1MiB), pinned_pool))",
            "pinned_pool",
        ),
        (
            "fallback(limiting(virtual_pool, limit=1MiB), virtual_pool:reserve=64MiB)",
            "virtual_pool",
        ),
    ] {
        let (top, pools) = on_the_host(text);
        assert_eq!(pools.figures().unwrap().map(|f| f.size), Some(0), "{text}");
        // 512 KiB from the first tier, 4 MiB past its limit from the second.
        let (small, large) = (512 << 10, 4 << 20);
        let first = host_block(&top, small);
        let then = host_block(&top, large);
        let held = pools.figures().unwrap().expect("pools");
        assert!(
            held.size >= (small + large) as u64,
            "{text}: both tiers' memory counted, {held:?}"
        );
        let segments = pools.segments();
        let held_at = |p: NonNull<u8>| {
            let a = p.as_ptr() as usize;
            segments
                .iter()
                .any(|&(base, len)| a.wrapping_sub(base) < len)
        };
        assert!(
            held_at(first) && held_at(then),
            "{text}: a segment holds each tier's block: {segments:x?}"
        );
        assert_eq!(
            segments.iter().map(|&(_, n)| n as u64).sum::<u64>(),
            held.size,
            "{text}: the segments are what the pools hold"
        );
        // One growth a tier, the pinned pool's not counted (torch's num_device_alloc
        // counts device memory).
        let device_calls = if second == "pinned_pool" { 1 } else { 2 };
        assert_eq!(
            (held.upstream_alloc_calls, held.upstream_free_calls),
            (device_calls, 0),
            "{text}: {held:?}"
        );
        free_host_block(&top, first, small);
        free_host_block(&top, then, large);
        let released = pools.trim().unwrap();
        let after = pools.figures().unwrap().expect("pools");
        assert_eq!(after.size, 0, "{text}: {second} trimmed too: {after:?}");
        assert_eq!(released, held.size, "{text}");
        assert_eq!(
            (after.upstream_alloc_calls, after.upstream_free_calls),
            (device_calls, device_calls),
            "{text}: each tier gave its memory back in one call"
        );
        assert!(pools.segments().is_empty(), "{text}");
        // The peaks of both start again from nothing.
        pools.reset_peaks().unwrap();
        assert_eq!(pools.figures().unwrap().unwrap().peak_size, 0, "{text}");
    }
}

/// `memres_trim` reaches a `binning` stack's bins: they give back the lists of the
/// streams they served (before, only the pool under them was trimmed, and each stream
/// used once kept a list in every bin it used until the stack went).
#[test]
fn a_trim_reaches_the_bins() {
    let (top, pools) = on_the_host("binning:min=8,max=12");
    const STREAMS: u32 = 2_000;
    let l = mr::layout(256).unwrap();
    let before = thread_heap::live();
    for id in 1..=STREAMS {
        let s = StreamRef::host(id);
        let p = top.allocate(s, l).unwrap();
        // SAFETY: allocated just above on `s`, unused.
        unsafe { top.deallocate(s, p, l) };
    }
    let used = (thread_heap::live() - before) / STREAMS as isize;
    pools.trim().unwrap();
    let trimmed = (thread_heap::live() - before) / STREAMS as isize;
    println!("binning: {used} B per stream in use, {trimmed} B after memres_trim's trim");
    assert!(used > 100, "the bins keep a list per stream: {used} B");
    if grace_periods_offered() {
        assert!(trimmed <= 32, "{trimmed} B per stream after the trim");
    } else {
        // Without `membarrier` lists are emptied, not freed.
        println!("memres-skip: no membarrier here: lists are emptied, not freed");
    }
}

/// Whether this machine offers `membarrier`'s private expedited command (which trims
/// need to free lists), asked as memres asks.
fn grace_periods_offered() -> bool {
    const QUERY: libc::c_long = 0;
    const PRIVATE_EXPEDITED: libc::c_long = 1 << 3;
    // SAFETY: the query command reads nothing and changes nothing.
    let offered = unsafe { libc::syscall(libc::SYS_membarrier, QUERY, 0, 0) };
    offered >= 0 && offered & PRIVATE_EXPEDITED != 0
}

/// The stack's own memory sleeps as one: every in-place pool on every tier (the C ABI
/// slept only the pool it kept last); pinned host memory beside them stays as it is and
/// usable; a stack with any other part that holds memory is refused, naming the part.
#[test]
fn every_in_place_tier_sleeps_and_other_memory_is_refused_by_name() {
    // Two in-place tiers: both sleep, nothing stays held, both wake.
    let text = "fallback(limiting(virtual_pool, limit=1MiB), virtual_pool:reserve=64MiB)";
    let (top, pools) = on_the_host(text);
    let first = host_block(&top, 512 << 10);
    let then = host_block(&top, 4 << 20);
    let sleepers = pools.sleepable(why_it_cannot_sleep(&Spec::parse(text).unwrap()).as_deref());
    let sleepers = sleepers.unwrap();
    assert_eq!(sleepers.len(), 2, "both tiers");
    for pool in &sleepers {
        // SAFETY: nothing touches the blocks until the pools wake.
        unsafe { pool.sleep(mr::suballoc::SleepMode::Offload) }.unwrap();
    }
    assert_eq!(pools.figures().unwrap().unwrap().size, 0, "nothing mapped");
    assert!(pools.segments().is_empty());
    assert!(matches!(
        top.allocate(StreamRef::HOST, mr::layout(4096).unwrap()),
        Err(Error::Asleep)
    ));
    for pool in &sleepers {
        pool.wake().unwrap();
    }
    // SAFETY: the blocks are mapped again, with their contents.
    assert_eq!(unsafe { then.as_ptr().add((4 << 20) - 1).read() }, 0x5a);
    free_host_block(&top, first, 512 << 10);
    free_host_block(&top, then, 4 << 20);

    // Pinned host memory as the next tier: only the in-place pool sleeps, and a block of
    // the pinned tier stays usable.
    let text = "fallback(limiting(virtual_pool, limit=1MiB), pinned_pool)";
    let (top, pools) = on_the_host(text);
    let pinned = host_block(&top, 4 << 20);
    let sleepers = pools
        .sleepable(why_it_cannot_sleep(&Spec::parse(text).unwrap()).as_deref())
        .unwrap();
    assert_eq!(sleepers.len(), 1);
    // SAFETY: nothing touches the in-place pool's blocks (there are none) until it wakes.
    unsafe { sleepers[0].sleep(mr::suballoc::SleepMode::Discard) }.unwrap();
    // SAFETY: the pinned tier's block, still mapped.
    unsafe { pinned.as_ptr().write_bytes(1, 4 << 20) };
    sleepers[0].wake().unwrap();
    free_host_block(&top, pinned, 4 << 20);

    // Parts that hold memory and cannot sleep: refused, each named.
    for (text, part) in [
        ("fallback(virtual_pool, pool)", "`pool`"),
        ("fallback(pool, virtual_pool)", "`pool`"),
        (
            "statistics(fallback(virtual_pool, arena:size=4MiB))",
            "`arena`",
        ),
        (
            "fallback(virtual_pool, statistics(fixed_size:block=4KiB,blocks=4))",
            "`fixed_size`",
        ),
        ("fallback(virtual_pool, cuda)", "`cuda`"),
        ("binning:min=8,max=12", "`binning`"),
        (
            "fallback(virtual_pool, limiting(binning:min=8,max=12, limit=1GiB))",
            "`binning`",
        ),
    ] {
        let spec = Spec::parse(text).unwrap();
        let why = why_it_cannot_sleep(&spec);
        let (_top, pools) = on_the_host(text);
        match pools.sleepable(why.as_deref()) {
            Err(Error::Unsupported(message)) => {
                assert!(message.contains(part), "{text}: {message}")
            }
            other => panic!("{text}: {:?}", other.map(|p| p.len())),
        }
    }
    // No in-place pool at all: nothing to sleep (the C ABI says so by name).
    let (_top, pools) = on_the_host("statistics(pool)");
    assert!(
        pools
            .sleepable(why_it_cannot_sleep(&Spec::parse("pool").unwrap()).as_deref())
            .unwrap()
            .is_empty()
    );
    for text in [
        "virtual_pool",
        "fallback(virtual_pool, pinned)",
        "logging(virtual_pool, file=/dev/null)",
    ] {
        assert_eq!(
            why_it_cannot_sleep(&Spec::parse(text).unwrap()),
            None,
            "{text}"
        );
    }
}

/// An arena's and a `fixed_size`'s figures are counted with the rest, and a trim runs
/// on both (they keep their memory: one allocation, and chunks until the stack goes).
#[test]
fn arenas_and_fixed_size_are_counted_and_trimmed() {
    let (top, pools) = on_the_host(
        "fallback(limiting(arena:size=4MiB, limit=1MiB), statistics(fixed_size:block=64KiB,blocks=64))",
    );
    let held = pools.figures().unwrap().unwrap();
    assert_eq!(held.size, 2 * (4 << 20), "{held:?}");
    assert_eq!(held.free, held.size, "nothing handed out");
    // The arena's limit, then a block past it from the fixed-size tier.
    let arena_block = host_block(&top, 1 << 20);
    let fixed_block = host_block(&top, 64 << 10);
    let now = pools.figures().unwrap().unwrap();
    assert_eq!(now.size, held.size);
    assert!(
        held.free - now.free >= (1 << 20) + (64 << 10),
        "{held:?} then {now:?}"
    );
    assert!(now.largest_free_block >= 64 << 10, "{now:?}");
    free_host_block(&top, arena_block, 1 << 20);
    free_host_block(&top, fixed_block, 64 << 10);
    assert_eq!(pools.trim().unwrap(), 0, "neither gives memory back");
    let after = pools.figures().unwrap().unwrap();
    assert_eq!((after.size, after.free), (held.size, held.size));
}

/// `memres_set_limit` (PyTorch's memory fraction) bounds every device-memory pool of a
/// stack: a request that would grow one past the bound is out of memory, lifting the
/// bound lets it grow; pinned host pools are left unbounded.
#[test]
fn a_limit_bounds_every_device_pool_of_the_stack() {
    for text in [
        "virtual_pool",
        "pool",
        "fallback(virtual_pool, pool)",
        "binning:min=8,max=12",
    ] {
        let (top, pools) = on_the_host(text);
        pools.set_limit(Some(8 << 20));
        let l = mr::layout(16 << 20).unwrap();
        assert!(
            matches!(
                top.allocate(StreamRef::HOST, l),
                Err(Error::OutOfMemory { .. })
            ),
            "{text}: 16 MiB under a bound of 8"
        );
        let fits = host_block(&top, 6 << 20);
        assert!(pools.figures().unwrap().unwrap().size <= 8 << 20, "{text}");
        pools.set_limit(None);
        let large = host_block(&top, 16 << 20);
        free_host_block(&top, large, 16 << 20);
        free_host_block(&top, fits, 6 << 20);
    }
    let (top, pools) = on_the_host("pinned_pool");
    pools.set_limit(Some(1 << 20));
    let pinned = host_block(&top, 4 << 20);
    free_host_block(&top, pinned, 4 << 20);
}

// `memres_record_stream` takes only the start of a live block (issue 49): the library's
// `StreamUse` layer that the C ABI keeps over each device's memory (`memory()`), here
// over the default stack's pool and a tag's pool of host memory.

/// A block of `bytes` from `memory`, as `memres_malloc` takes one.
fn malloc_into<R: Resource>(memory: &StreamUse<R>, bytes: usize) -> NonNull<u8> {
    memory
        .allocate(StreamRef::HOST, mr::layout(bytes).unwrap())
        .unwrap()
}

/// Frees a block of `malloc_into` as `memres_free` does.
fn free_from<R: Resource>(memory: &StreamUse<R>, p: NonNull<u8>, bytes: usize) {
    // SAFETY: from `malloc_into(memory, bytes)`, not used afterwards; the host stream.
    unsafe { memory.deallocate(StreamRef::HOST, p, mr::layout(bytes).unwrap()) };
}

/// `memres_record_stream`'s record of host stream `stream` for `address`.
fn record<R: Resource>(memory: &StreamUse<R>, address: usize, stream: u32) -> Result<(), Error> {
    let p = NonNull::new(address as *mut u8).unwrap();
    // SAFETY: host streams live for the whole program.
    unsafe { memory.record_stream(p, StreamRef::host(stream)) }
}

/// Asserts that a record for `address` is refused with a message naming it, as
/// `memres_record_stream` refuses it (`not_a_live_block` then speaks for the C ABI).
fn assert_refused<R: Resource>(memory: &StreamUse<R>, address: usize, what: &str) {
    match record(memory, address, 7) {
        Err(e @ Error::InvalidArgument(_)) => assert!(
            e.to_string()
                .contains(&format!("{address:#x} is not the start of a live block")),
            "{what}: {e}"
        ),
        other => panic!("{what}: {other:?}"),
    }
    let failure = not_a_live_block(address, 0);
    assert_eq!(failure.code, MEMRES_ERROR_INVALID_ARGUMENT);
    assert!(failure.message.contains(&format!("{address:#x}")));
}

/// The C ABI's tags' route over pools of host memory, in a router with no default member.
type HostTags = mr::adaptor::Router<
    (),
    Arc<VirtualPool<mr::upstream::HostVirtual>>,
    Tags<VirtualPool<mr::upstream::HostVirtual>>,
>;

fn host_tags() -> HostTags {
    mr::adaptor::Router::new(
        (),
        Tags::new(|| {
            VirtualPool::new(
                mr::upstream::HostVirtual::new(64 << 20, 64 << 10)?,
                VirtualPoolConfig::new(),
            )
        }),
    )
}

/// A tag's pool over host memory, made through the C ABI's tags' route.
fn host_tag_pool(tags: &HostTags) -> Arc<VirtualPool<mr::upstream::HostVirtual>> {
    Arc::clone(tags.member(1).unwrap())
}

/// An address inside a live block, of a freed block and one never handed out are
/// refused with a message naming the address; a live block's start still takes its
/// record, which its free consumes (before, each was accepted, and a record for a freed
/// or inner address waited for whatever block started there later).
#[test]
fn record_stream_refuses_what_is_not_a_live_blocks_start() {
    let (top, _pools) = on_the_host("virtual_pool");
    let top = StreamUse::new(top);
    let tags = host_tags();
    let tagged = StreamUse::new(host_tag_pool(&tags));
    let block = malloc_into(&top, 1 << 20);
    let tag_block = malloc_into(&tagged, 1 << 20);
    for (p, which) in [(block, "default pool"), (tag_block, "tag's pool")] {
        let memory_of = |p: NonNull<u8>| p == block;
        let start = p.as_ptr() as usize;
        let check = |address: usize, what: &str| {
            if memory_of(p) {
                assert_refused(&top, address, what)
            } else {
                assert_refused(&tagged, address, what)
            }
        };
        check(start + 256, &format!("inside a block of the {which}"));
        check(start + (1 << 20) - 1, &format!("its last byte ({which})"));
        let recorded = if memory_of(p) {
            (record(&top, start, 7), record(&top, start, 9))
        } else {
            (record(&tagged, start, 7), record(&tagged, start, 9))
        };
        assert!(
            recorded.0.is_ok() && recorded.1.is_ok(),
            "{which}: {recorded:?}"
        );
    }
    // Never handed out: in the pool's reservation, and nowhere memres allocates.
    let base = mr::upstream::GrowInPlace::reservation(tagged.upstream().upstream()).0;
    assert_refused(
        &tagged,
        base + (32 << 20),
        "never handed out, in the tag's range",
    );
    assert_refused(&top, 0x1000, "never handed out");

    free_from(&top, block, 1 << 20);
    free_from(&tagged, tag_block, 1 << 20);

    // A freed block: refused; the next block at its address starts with no stream.
    let freed = block.as_ptr() as usize;
    assert_refused(&top, freed, "freed");
    let again = malloc_into(&top, 1 << 20);
    assert_eq!(
        again.as_ptr() as usize,
        freed,
        "the pool hands the freed address out again"
    );
    assert!(top.is_live(again));
    free_from(&top, again, 1 << 20);
    assert!(!top.is_live(again));
}

/// What the table of live blocks costs `memres_malloc` and `memres_free` together (an
/// insert and a removal), beside a pool's own allocation and free on the host stream:
/// `cargo test --release -p memres-capi --lib live_blocks_cost -- --ignored --nocapture`.
#[test]
#[ignore = "a timing, for the figure in the library's stream_use.rs"]
fn live_blocks_cost() {
    use std::time::Instant;
    const N: usize = 2_000_000;
    let (top, _pools) = on_the_host("virtual_pool");
    let l = mr::layout(4096).unwrap();
    let memory = StreamUse::new(&top);
    // 1,024 blocks live throughout, as a program keeps some.
    let kept: Vec<_> = (0..1024).map(|_| malloc_into(&memory, 4096)).collect();
    for round in 0..3 {
        let t = Instant::now();
        for _ in 0..N {
            let p = top.allocate(StreamRef::HOST, l).unwrap();
            // SAFETY: allocated just above, unused.
            unsafe { top.deallocate(StreamRef::HOST, std::hint::black_box(p), l) };
        }
        let pool = t.elapsed().as_nanos() as f64 / N as f64;
        let t = Instant::now();
        for _ in 0..N {
            let p = memory.allocate(StreamRef::HOST, l).unwrap();
            // SAFETY: allocated just above, unused.
            unsafe { memory.deallocate(StreamRef::HOST, std::hint::black_box(p), l) };
        }
        let layered = t.elapsed().as_nanos() as f64 / N as f64;
        println!("round {round}: pool allocate+free {pool:.1} ns, under StreamUse {layered:.1} ns");
    }
    for p in kept {
        free_from(&memory, p, 4096);
    }
}

/// `memres_record_stream` through the C ABI on the GPU: inner, freed and never handed
/// out addresses of the default pool and of a tag's pool refused, a block's start taken
/// (a stream recorded, the free waiting for it). In a child process, as the tests above.
#[test]
#[ignore = "needs a CUDA GPU"]
fn record_stream_refuses_what_is_not_a_live_block_on_the_gpu() {
    gpu_child(
        "tests::record_stream_child",
        "MEMRES_CAPI_RECORD_CHILD",
        "record_stream: only live blocks",
    );
}

/// The body of the test above, run only in its child process.
#[test]
fn record_stream_child() {
    if std::env::var_os("MEMRES_CAPI_RECORD_CHILD").is_none() {
        return; // not the child
    }
    const SIZE: isize = 1 << 20;
    // `CU_STREAM_PER_THREAD`: live while this thread is.
    let per_thread = 2usize as *mut c_void;
    let refused = |p: usize, what: &str| {
        // SAFETY: refused before the stream is used.
        let code = unsafe { memres_record_stream(p as *mut c_void, 0, per_thread) };
        assert_eq!(
            code,
            MEMRES_ERROR_INVALID_ARGUMENT,
            "{what}: {}",
            last_error()
        );
        assert!(
            last_error().contains(&format!("{p:#x}")),
            "{what}: {}",
            last_error()
        );
    };
    let weights = c("records");
    for tag in [None, Some(&weights)] {
        // SAFETY: null or a NUL-terminated string.
        let code = unsafe { memres_set_tag(tag.map_or(std::ptr::null(), |t| t.as_ptr())) };
        assert_eq!(code, MEMRES_OK);
        // SAFETY: the legacy default stream.
        let p = unsafe { memres_malloc(SIZE, 0, std::ptr::null_mut()) };
        assert!(!p.is_null(), "{}", last_error());
        let start = p as usize;
        refused(start + 256, "inside the block");
        // SAFETY: a live block; the per-thread stream outlives it.
        let code = unsafe { memres_record_stream(p, 0, per_thread) };
        assert_eq!(code, MEMRES_OK, "{}", last_error());
        // SAFETY: from `memres_malloc(SIZE, 0, ..)`; its uses on the per-thread stream
        // (none) were enqueued before; the legacy default stream.
        unsafe { memres_free(p, SIZE, 0, std::ptr::null_mut()) };
        refused(start, "freed");
        refused(start + (3 << 20), "never handed out");
    }
    // SAFETY: null: back to the device's own stack.
    assert_eq!(unsafe { memres_set_tag(std::ptr::null()) }, MEMRES_OK);
    assert_eq!(stats(0).live_allocations, 0);
    println!("record_stream: only live blocks");
}

// Segment pools (over another allocator's functions: host memory, no GPU needed)

/// Segments the host test's `alloc` handed out and `free` took back, by size.
static SEGMENT_LOG: Mutex<Vec<(bool, usize)>> = Mutex::new(Vec::new());

/// A new segment pool on device 0 with `flags`, its segments from `alloc` and back to
/// `free` (no context); a failure to make it fails the test with memres's message.
///
/// # Safety
/// As `memres_segment_pool_new`'s: `alloc` and `free` may be called from any thread while
/// the pool lives, `free` taking back what `alloc` gave.
unsafe fn segment_pool(
    flags: c_int,
    alloc: unsafe extern "C" fn(*mut c_void, usize, *mut c_void) -> *mut c_void,
    free: unsafe extern "C" fn(*mut c_void, *mut c_void, usize),
) -> *mut SegmentPoolHandle {
    // SAFETY: the caller's promise; the context is null (these tests' functions ignore it).
    let pool =
        unsafe { memres_segment_pool_new(0, flags, Some(alloc), Some(free), std::ptr::null_mut()) };
    assert!(!pool.is_null(), "{}", last_error());
    pool
}

unsafe extern "C" fn host_segment_alloc(
    _ctx: *mut c_void,
    size: usize,
    _stream: *mut c_void,
) -> *mut c_void {
    SEGMENT_LOG.lock().unwrap().push((true, size));
    let layout = std::alloc::Layout::from_size_align(size, 256).unwrap();
    // SAFETY: a layout of nonzero size.
    unsafe { std::alloc::alloc(layout).cast() }
}

unsafe extern "C" fn host_segment_free(_ctx: *mut c_void, ptr: *mut c_void, size: usize) {
    SEGMENT_LOG.lock().unwrap().push((false, size));
    let layout = std::alloc::Layout::from_size_align(size, 256).unwrap();
    // SAFETY: from `host_segment_alloc` with this size.
    unsafe { std::alloc::dealloc(ptr.cast(), layout) };
}

/// The pool's table as (offset, size, allocated).
fn table(pool: *mut SegmentPoolHandle) -> Vec<memres_block_t> {
    // SAFETY: a live pool; `out` has room for `n` entries.
    unsafe {
        let n = memres_segment_pool_blocks(pool, std::ptr::null_mut(), 0);
        let mut out = vec![std::mem::zeroed::<memres_block_t>(); n as usize];
        assert_eq!(
            memres_segment_pool_blocks(pool, out.as_mut_ptr(), out.len()),
            n
        );
        out
    }
}

#[test]
fn segment_pools_over_another_allocator_split_restore_and_give_back() {
    let _turn = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    SEGMENT_LOG.lock().unwrap().clear();
    let s = std::ptr::null_mut();
    // SAFETY: the functions handle host memory from any thread; every block is unused
    // when freed (nothing runs on a GPU here).
    unsafe {
        let pool = segment_pool(
            MEMRES_SEGMENTS_MEDIUM,
            host_segment_alloc,
            host_segment_free,
        );
        let a = memres_segment_pool_malloc(pool, 3 << 20, s, 1, 0);
        let b = memres_segment_pool_malloc(pool, 1000, s, 1, 0);
        assert_eq!(b as usize - a as usize, 3 << 20);
        let (mut base, mut size, mut stream) = (0u64, 0u64, std::ptr::dangling_mut());
        assert_eq!(
            memres_segment_pool_segment_of(pool, b, &mut base, &mut size, &mut stream),
            1
        );
        assert_eq!(
            (base, size, stream),
            (a as u64, 20 << 20, std::ptr::null_mut())
        );
        let outside = (a as usize + (20 << 20)) as *const c_void;
        assert_eq!(
            memres_segment_pool_segment_of(pool, outside, &mut base, &mut size, &mut stream),
            0
        );
        assert_eq!(
            *SEGMENT_LOG.lock().unwrap(),
            [(true, 20 << 20)],
            "one medium segment"
        );
        let saved = table(pool);
        assert_eq!(saved.len(), 3);
        assert_eq!(
            (saved[1].offset, saved[1].size, saved[1].allocated),
            (3 << 20, 1024, 1)
        );
        // Lending only: no growth for what does not fit.
        assert!(memres_segment_pool_malloc(pool, 64 << 20, s, 0, 0).is_null());
        assert!(last_error().contains("out of memory"), "{}", last_error());
        assert_eq!(memres_segment_pool_free(pool, b, 0), MEMRES_OK);
        assert_eq!(
            memres_segment_pool_free(pool, b, 0),
            MEMRES_ERROR_INVALID_ARGUMENT
        );
        assert!(
            last_error().contains("not the start of a live block"),
            "{}",
            last_error()
        );
        assert_eq!(
            memres_segment_pool_restore(pool, saved.as_ptr(), saved.len()),
            MEMRES_OK
        );
        assert_eq!(table(pool), saved, "b is live again where it was");
        let mut bad = saved.clone();
        bad[0].segment += 4096;
        assert_eq!(
            memres_segment_pool_restore(pool, bad.as_ptr(), bad.len()),
            MEMRES_ERROR_INVALID_ARGUMENT
        );
        assert_eq!(table(pool), saved, "a refused table changes nothing");
        assert_eq!(
            memres_segment_pool_release_free(pool, s),
            0,
            "the segment is in use"
        );
        assert_eq!(memres_segment_pool_free(pool, a, 0), MEMRES_OK);
        assert_eq!(memres_segment_pool_free(pool, b, 0), MEMRES_OK);
        assert_eq!(memres_segment_pool_release_free(pool, s), 20 << 20);
        let c = memres_segment_pool_malloc(pool, 100, s, 1, 0);
        assert!(!c.is_null());
        memres_segment_pool_destroy(pool);
        assert_eq!(
            *SEGMENT_LOG.lock().unwrap(),
            [
                (true, 20 << 20),
                (false, 20 << 20),
                (true, 2 << 20),
                (false, 2 << 20)
            ],
            "every segment back to the allocator it came from"
        );
    }
}

#[test]
fn segment_pools_refuse_bad_arguments_with_messages() {
    let _turn = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    // SAFETY: null pools and tables are what is checked; the pool made is destroyed.
    unsafe {
        let free: memres_segment_free_fn = Some(host_segment_free);
        assert!(memres_segment_pool_new(0, 4, None, None, std::ptr::null_mut()).is_null());
        assert!(last_error().contains("unknown flags"), "{}", last_error());
        assert!(memres_segment_pool_new(0, 0, None, free, std::ptr::null_mut()).is_null());
        assert!(last_error().contains("both"), "{}", last_error());
        let null = std::ptr::null_mut();
        assert!(memres_segment_pool_malloc(null, 10, null.cast(), 1, 0).is_null());
        assert!(
            last_error().contains("the pool is null"),
            "{}",
            last_error()
        );
        assert_eq!(
            memres_segment_pool_free(null, null.cast(), 0),
            MEMRES_ERROR_INVALID_ARGUMENT
        );
        assert_eq!(
            memres_segment_pool_blocks(null, std::ptr::null_mut(), 0),
            -1
        );
        memres_segment_pool_destroy(null);
        let pool = memres_segment_pool_new(
            0,
            MEMRES_SEGMENTS_NO_SPLIT,
            Some(host_segment_alloc),
            free,
            std::ptr::null_mut(),
        );
        assert_eq!(
            memres_segment_pool_settle(pool, 7),
            MEMRES_ERROR_INVALID_ARGUMENT
        );
        assert!(last_error().contains("unknown mode 7"), "{}", last_error());
        assert_eq!(
            memres_segment_pool_settle(pool, MEMRES_SETTLE_WAIT),
            MEMRES_OK
        );
        let block = memres_segment_pool_malloc(pool, 100, null.cast(), 1, 0);
        // Its own segment's stream: nothing to record; the free is at once.
        assert_eq!(
            memres_segment_pool_record_stream(pool, block, null.cast()),
            MEMRES_OK
        );
        assert_eq!(memres_segment_pool_free(pool, block, 0), MEMRES_OK);
        assert_eq!(
            memres_segment_pool_record_stream(pool, block, null.cast()),
            MEMRES_ERROR_INVALID_ARGUMENT
        );
        assert!(memres_segment_pool_malloc(pool, 0, null.cast(), 1, 0).is_null());
        assert!(last_error().contains("a size of 0"), "{}", last_error());
        assert_eq!(
            memres_segment_pool_restore(pool, std::ptr::null(), 3),
            MEMRES_ERROR_INVALID_ARGUMENT
        );
        assert_eq!(
            memres_segment_pool_free(pool, null.cast(), 0),
            MEMRES_ERROR_INVALID_ARGUMENT
        );
        memres_segment_pool_destroy(pool);
    }
}

unsafe extern "C" fn plain_segment_alloc(
    _ctx: *mut c_void,
    size: usize,
    _stream: *mut c_void,
) -> *mut c_void {
    let layout = std::alloc::Layout::from_size_align(size, 256).unwrap();
    // SAFETY: a layout of nonzero size.
    unsafe { std::alloc::alloc(layout).cast() }
}

unsafe extern "C" fn plain_segment_free(_ctx: *mut c_void, ptr: *mut c_void, size: usize) {
    let layout = std::alloc::Layout::from_size_align(size, 256).unwrap();
    // SAFETY: from `plain_segment_alloc` with this size.
    unsafe { std::alloc::dealloc(ptr.cast(), layout) };
}

/// Each entry of `memres_segment_pool_blocks` names its segment's stream, segments of
/// two streams told apart in one listing, and the listing is the table (issue 47: the
/// streams came from a lookup per segment).
#[test]
fn a_segment_pools_listing_names_each_segments_stream() {
    // Segment pools' tests take turns: a freed segment's memory may be another's next.
    let _turn = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    // `CU_STREAM_PER_THREAD`'s handle, never used on a GPU here (no driver call reaches
    // it: the segments come from host memory).
    let other = 2usize as *mut c_void;
    // SAFETY: the functions handle host memory from any thread; every block is unused
    // when freed.
    unsafe {
        let pool = segment_pool(
            MEMRES_SEGMENTS_NO_SPLIT,
            plain_segment_alloc,
            plain_segment_free,
        );
        let mut blocks = Vec::new();
        for i in 0..6 {
            let stream = if i % 2 == 0 {
                std::ptr::null_mut()
            } else {
                other
            };
            let p = memres_segment_pool_malloc(pool, 4096, stream, 1, 0);
            assert!(!p.is_null(), "{}", last_error());
            blocks.push((p as u64, stream));
        }
        let listed = table(pool);
        assert_eq!(listed.len(), 6, "no_split: a segment per block");
        for (entry, &(p, stream)) in listed.iter().zip(&blocks) {
            assert_eq!((entry.segment, entry.stream), (p, stream));
        }
        for (p, _) in blocks {
            assert_eq!(
                memres_segment_pool_free(pool, p as *mut c_void, 0),
                MEMRES_OK
            );
        }
        memres_segment_pool_destroy(pool);
    }
}

/// An unsplit segment pool over `plain_segment_alloc` holding `n` blocks of 512 bytes on
/// the legacy stream (a segment each), and the blocks, for the timings below.
fn pool_of_blocks(n: usize) -> (*mut SegmentPoolHandle, Vec<*mut c_void>) {
    // SAFETY: the plain functions handle host memory from any thread.
    let pool = unsafe {
        segment_pool(
            MEMRES_SEGMENTS_NO_SPLIT,
            plain_segment_alloc,
            plain_segment_free,
        )
    };
    let blocks = (0..n)
        // SAFETY: `pool` is live; the legacy stream is never used on a GPU here.
        .map(|_| unsafe { memres_segment_pool_malloc(pool, 512, std::ptr::null_mut(), 1, 0) })
        .collect();
    (pool, blocks)
}

/// Frees `blocks` of `pool`, each of which must free, then destroys the pool.
///
/// # Safety
/// `pool` is live and `blocks` are its blocks, unused; neither is used afterwards.
unsafe fn free_and_destroy(pool: *mut SegmentPoolHandle, blocks: Vec<*mut c_void>) {
    for p in blocks {
        // SAFETY: the caller's promise: a block of `pool`, unused.
        assert_eq!(unsafe { memres_segment_pool_free(pool, p, 0) }, MEMRES_OK);
    }
    // SAFETY: the caller's promise: `pool` is not used afterwards.
    unsafe { memres_segment_pool_destroy(pool) };
}

/// What listing a segment pool's table costs per entry, for tables of 1,000 to 16,000
/// segments: flat when the listing is linear (it grew with the segments when each
/// segment's stream was looked up by a scan):
/// `cargo test --release -p memres-capi --lib segment_pool_blocks_cost -- --ignored --nocapture`.
#[test]
#[ignore = "a timing, for the figure in the CHANGELOG"]
fn segment_pool_blocks_cost() {
    use std::time::Instant;
    for n in [1_000, 4_000, 16_000] {
        // SAFETY: as in the test above.
        unsafe {
            let (pool, blocks) = pool_of_blocks(n);
            let mut out = vec![std::mem::zeroed::<memres_block_t>(); n];
            let rounds = 20;
            let t = Instant::now();
            for _ in 0..rounds {
                let listed = memres_segment_pool_blocks(pool, out.as_mut_ptr(), out.len());
                assert_eq!(listed, n as i64);
            }
            let per_entry = t.elapsed().as_nanos() as f64 / (rounds * n) as f64;
            println!("{n} segments: {per_entry:.1} ns per listed entry");
            free_and_destroy(pool, blocks);
        }
    }
}

/// The C ABI's router of tags' pools over host memory, as `routed::under_wrappers`
/// builds it for a device.
type HostRouted = routed::TagRouter<mr::Host, VirtualPool<mr::upstream::HostVirtual>>;

/// Host memory for specs, as [`OnTheHost`], with the C ABI's router of tags' pools put
/// under the spec's outermost wrappers as the device's stack puts it
/// (`routed::under_wrappers`); it keeps the router and the outermost statistics layer.
#[derive(Default)]
struct TaggedOnTheHost {
    statistics: Option<Arc<mr::adaptor::Statistics<mr::AnyResource<mr::Host>>>>,
    logs: Vec<Arc<mr::adaptor::Logging<mr::AnyResource<mr::Host>>>>,
    router: Option<Arc<HostRouted>>,
}

impl Target for TaggedOnTheHost {
    host_leaves!();
    fn built(&mut self, layer: Built<'_, Self>) {
        match layer {
            Built::WithStatistics(counted) => self.statistics = Some(Arc::clone(counted)),
            Built::Logged(logged) => self.logs.push(Arc::clone(logged)),
            _ => {}
        }
    }
    fn base(
        &mut self,
        base: mr::AnyResource<mr::Host>,
    ) -> Result<mr::AnyResource<mr::Host>, Error> {
        let tags = Tags::new(|| {
            VirtualPool::new(
                mr::upstream::HostVirtual::new(64 << 20, 64 << 10)?,
                VirtualPoolConfig::new(),
            )
        });
        let (router, erased) = routed::under_wrappers(base, tags);
        self.router = Some(router);
        Ok(erased)
    }
}

/// A spec's `statistics(..)` counts a tag's blocks, its `limiting(..)` bounds them with
/// the rest and its `logging(..)` logs them (issue 47: the tags' pools sat beside the
/// spec's wrappers, so `memres_stats`, a limit and a log never saw their blocks),
/// through the router the device's stack puts under its wrappers, here over host memory.
#[test]
fn the_specs_statistics_and_limit_see_a_tags_blocks() {
    let _turn = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    let log = std::env::temp_dir().join(format!("memres-tags-{}.csv", std::process::id()));
    for text in [
        "statistics(limiting(virtual_pool, limit=8MiB))".to_owned(),
        "statistics(limiting(fallback(limiting(virtual_pool, limit=1MiB), pool), limit=8MiB))"
            .to_owned(),
        format!(
            "statistics(logging(limiting(virtual_pool, limit=8MiB), file={}))",
            log.display()
        ),
    ] {
        let text = text.as_str();
        let mut target = TaggedOnTheHost::default();
        let top = Spec::parse(text).unwrap().build(&mut target).unwrap();
        let counted = target.statistics.clone().expect("a statistics layer");
        let router = target.router.clone().expect("a router under the wrappers");
        // Under a tag: its pool serves the block.
        routed::set_current(7);
        let tagged = top.allocate(StreamRef::HOST, mr::layout(4 << 20).unwrap());
        routed::set_current(0);
        let tagged = tagged.unwrap();
        assert!(
            router.holding(tagged.as_ptr() as usize).is_some(),
            "{text}: in the tag's pool"
        );
        assert_eq!(counted.bytes().current, 4 << 20, "{text}: counted");
        assert_eq!(counted.allocations().current, 1, "{text}");
        // 6 MiB more of the base's would pass the 8 MiB bound with the tag's 4.
        assert!(
            matches!(
                top.allocate(StreamRef::HOST, mr::layout(6 << 20).unwrap()),
                Err(Error::OutOfMemory { .. })
            ),
            "{text}: the limit counts the tag's block"
        );
        let fits = host_block(&top, 2 << 20);
        assert_eq!(counted.bytes().current, 6 << 20, "{text}");
        free_host_block(&top, fits, 2 << 20);
        free_host_block(&top, tagged, 4 << 20);
        assert_eq!(counted.bytes().current, 0, "{text}: the tag's free counted");
        let (_, pool) = router.members().next().expect("the tag's pool");
        assert_eq!(
            pool.stats().pool_size,
            4 << 20,
            "{text}: it keeps its memory"
        );
        // Freed by address into the tag's pool: the base's 8 MiB fits again.
        let whole = host_block(&top, 8 << 20);
        free_host_block(&top, whole, 8 << 20);
        for logged in &target.logs {
            logged.flush().unwrap();
            let rows = std::fs::read_to_string(&log).unwrap();
            let at = format!("{:#x},", tagged.as_ptr() as usize);
            let of_the_tag = rows.lines().filter(|row| row.contains(&at)).count();
            assert_eq!(
                of_the_tag, 2,
                "{text}: its allocation and free logged\n{rows}"
            );
        }
    }
    let _ = std::fs::remove_file(log);
}

/// `memres_segment_pool_holding` names the pool whose segment holds an address (any
/// address of it, blocks live or free), none for memory outside every segment, and
/// forgets a segment once it is given back and a pool once it is destroyed (issue 47:
/// the PyTorch backend kept its own table of pool blocks for this).
#[test]
fn the_pool_holding_an_address_is_found_by_its_segments() {
    // Segment pools' tests take turns: a freed segment's memory may be another's next.
    let _turn = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    let null = std::ptr::null_mut();
    // SAFETY: the functions handle host memory from any thread; every block is unused
    // when freed.
    unsafe {
        let new = |flags| segment_pool(flags, plain_segment_alloc, plain_segment_free);
        let (split, whole) = (new(0), new(MEMRES_SEGMENTS_NO_SPLIT));
        let a = memres_segment_pool_malloc(split, 4096, null, 1, 0);
        let b = memres_segment_pool_malloc(whole, 4096, null, 1, 0);
        let c = memres_segment_pool_malloc(whole, 8192, null, 1, 0);
        assert!(
            !a.is_null() && !b.is_null() && !c.is_null(),
            "{}",
            last_error()
        );
        let at = |p: *mut c_void, offset: usize| p.cast::<u8>().wrapping_add(offset).cast();
        assert_eq!(memres_segment_pool_holding(a), split);
        assert_eq!(
            memres_segment_pool_holding(at(a, (2 << 20) - 1)),
            split,
            "the free rest of a's 2 MiB segment"
        );
        assert_eq!(memres_segment_pool_holding(at(b, 4095)), whole);
        assert_eq!(memres_segment_pool_holding(c), whole);
        let outside = Box::new(0u64);
        assert!(memres_segment_pool_holding(std::ptr::from_ref(&*outside).cast()).is_null());
        assert!(memres_segment_pool_holding(std::ptr::null()).is_null());
        // b's segment goes back: its addresses are no pool's (c's stays).
        assert_eq!(memres_segment_pool_free(whole, b, 0), MEMRES_OK);
        assert_eq!(memres_segment_pool_release_free(whole, null), 4096);
        assert!(memres_segment_pool_holding(b).is_null());
        assert_eq!(memres_segment_pool_holding(c), whole);
        assert_eq!(memres_segment_pool_free(whole, c, 0), MEMRES_OK);
        memres_segment_pool_destroy(whole);
        assert!(memres_segment_pool_holding(c).is_null(), "the pool is gone");
        assert_eq!(memres_segment_pool_holding(a), split);
        assert_eq!(memres_segment_pool_free(split, a, 0), MEMRES_OK);
        memres_segment_pool_destroy(split);
        assert!(memres_segment_pool_holding(a).is_null());
    }
}

/// What `memres_segment_pool_holding` costs the PyTorch backend's frees: with no segment
/// listed in the process (its first look, one load), and with pools of 1,000 and 16,000
/// segments listed (a search under a lock):
/// `cargo test --release -p memres-capi --lib segment_pool_holding_cost -- --ignored --nocapture`
/// (alone: other tests' pools would be listed too).
#[test]
#[ignore = "a timing, for the figure in the CHANGELOG"]
fn segment_pool_holding_cost() {
    use std::time::Instant;
    const N: usize = 2_000_000;
    let outside = Box::new(0u64);
    let outside: *const c_void = std::ptr::from_ref(&*outside).cast();
    // The best of three rounds (the machine is shared).
    let time = |what: &str, ptr: *const c_void| {
        let best = (0..3)
            .map(|_| {
                let t = Instant::now();
                for _ in 0..N {
                    std::hint::black_box(memres_segment_pool_holding(std::hint::black_box(ptr)));
                }
                t.elapsed().as_nanos() as f64 / N as f64
            })
            .fold(f64::INFINITY, f64::min);
        println!("{what}: {best:.1} ns a lookup");
    };
    time("no segment listed", outside);
    for n in [1_000, 16_000] {
        // SAFETY: as in `segment_pool_blocks_cost`.
        unsafe {
            let (pool, blocks) = pool_of_blocks(n);
            time(&format!("{n} segments, a block of one"), blocks[n / 2]);
            time(&format!("{n} segments, other memory"), outside);
            free_and_destroy(pool, blocks);
        }
    }
}

/// One 4 MiB region, handed out by `same_region_alloc` for every segment (a broken
/// allocator), and how many times it was given back.
static SAME_REGION: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
static SAME_REGION_FREES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

unsafe extern "C" fn same_region_alloc(
    _ctx: *mut c_void,
    size: usize,
    _stream: *mut c_void,
) -> *mut c_void {
    assert!(size <= 4 << 20);
    let region = *SAME_REGION.get_or_init(|| {
        let layout = std::alloc::Layout::from_size_align(4 << 20, 256).unwrap();
        // SAFETY: a layout of nonzero size; kept for the whole test run.
        unsafe { std::alloc::alloc(layout) }.expose_provenance()
    });
    std::ptr::with_exposed_provenance_mut(region)
}

unsafe extern "C" fn same_region_free(_ctx: *mut c_void, _ptr: *mut c_void, _size: usize) {
    SAME_REGION_FREES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

/// An allocator that hands a second pool memory a first pool's segment holds: the
/// second pool's allocation is refused with a message naming the overlap, and the
/// memory goes back to the allocator, never handed out twice.
#[test]
fn a_segment_another_pool_holds_is_refused_and_given_back() {
    // Segment pools' tests take turns: a freed segment's memory may be another's next.
    let _turn = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    let null = std::ptr::null_mut();
    // SAFETY: the functions are callable from any thread; nothing uses the blocks.
    unsafe {
        let new = || {
            memres_segment_pool_new(
                0,
                0,
                Some(same_region_alloc),
                Some(same_region_free),
                std::ptr::null_mut(),
            )
        };
        let (first, second) = (new(), new());
        let a = memres_segment_pool_malloc(first, 4096, null, 1, 0);
        assert!(!a.is_null(), "{}", last_error());
        assert!(memres_segment_pool_malloc(second, 4096, null, 1, 0).is_null());
        assert!(last_error().contains("overlap"), "{}", last_error());
        assert_eq!(
            SAME_REGION_FREES.load(std::sync::atomic::Ordering::Relaxed),
            1,
            "the refused segment given back"
        );
        assert_eq!(memres_segment_pool_holding(a), first);
        assert_eq!(memres_segment_pool_free(first, a, 0), MEMRES_OK);
        memres_segment_pool_destroy(second);
        memres_segment_pool_destroy(first);
        assert_eq!(
            SAME_REGION_FREES.load(std::sync::atomic::Ordering::Relaxed),
            2
        );
        assert!(memres_segment_pool_holding(a).is_null());
    }
}
