//! The registration of a virtual pool's host copies in the background (over host pages,
//! whose registrar only records the pieces): what is registered is copied directly, the
//! rest staged, a failed registration leaves the rest staged, and trim, the drop and a
//! failed wake leave nothing registered behind or the pool broken.

use std::alloc::Layout;
use std::ptr::NonNull;
use std::time::{Duration, Instant};

use crate::resource::{Resource, layout};
use crate::stream::StreamRef;
use crate::suballoc::{SleepMode, VirtualPool, VirtualPoolConfig};
use crate::upstream::virtual_memory::{REGISTER_PIECE, faults, registration};
use crate::upstream::{GrowInPlace, HostVirtual};

const GRANULE: usize = 64 << 10;

fn pool() -> VirtualPool<HostVirtual> {
    HostVirtual::new(1 << 30, GRANULE)
        .and_then(|v| v.virtual_pool(VirtualPoolConfig::new()))
        .unwrap()
}

/// The reservation's base: what the registration's counts go by.
fn base(pool: &VirtualPool<HostVirtual>) -> usize {
    pool.upstream().reservation().0
}

/// Blocks of 700 KiB (several pieces and chunks each), each filled with its own byte.
fn fill(pool: &VirtualPool<HostVirtual>, n: u8) -> Vec<(NonNull<u8>, Layout, u8)> {
    (1..=n)
        .map(|i| {
            let l = layout(700 << 10).unwrap();
            let p = pool.allocate(StreamRef::HOST, l).unwrap();
            // SAFETY: a fresh block of `l.size()` bytes of host memory.
            unsafe { p.as_ptr().write_bytes(i, l.size()) };
            (p, l, i)
        })
        .collect()
}

fn all_hold(blocks: &[(NonNull<u8>, Layout, u8)]) -> bool {
    blocks.iter().all(|&(p, l, byte)| {
        // SAFETY: a live block of `l.size()` bytes, mapped (the pool is awake).
        unsafe { std::slice::from_raw_parts(p.as_ptr(), l.size()) }
            .iter()
            .all(|&b| b == byte)
    })
}

fn free_all(pool: &VirtualPool<HostVirtual>, blocks: Vec<(NonNull<u8>, Layout, u8)>) {
    for (p, l, _) in blocks {
        // SAFETY: allocated by `fill` with `l` on the host stream; not used afterwards.
        unsafe { pool.deallocate(StreamRef::HOST, p, l) };
    }
}

/// Waits (at most 20 s) until the pool's registered bytes are `bytes`.
fn wait_registered(pool: &VirtualPool<HostVirtual>, bytes: usize) {
    let start = Instant::now();
    while pool.registered_host_bytes() != bytes {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "{} bytes registered, {bytes} awaited",
            pool.registered_host_bytes()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Pieces registered of copies of `bytes` of whole granules.
fn pieces(pool: &VirtualPool<HostVirtual>, bytes: usize) -> usize {
    // One copy a run or 256 KiB piece of it: count what each copy registers.
    let segments: Vec<usize> = pool.segments().iter().map(|&(_, n)| n).collect();
    let per_copy = |len: usize| {
        let whole = (len / (256 << 10)) * (256usize << 10).div_ceil(REGISTER_PIECE);
        whole + (len % (256 << 10)).div_ceil(REGISTER_PIECE)
    };
    let n = segments.iter().map(|&len| per_copy(len)).sum();
    assert_eq!(segments.iter().sum::<usize>(), bytes);
    n
}

#[test]
fn registered_copies_are_copied_directly_both_ways_and_trim_unregisters_them() {
    let pool = pool();
    let blocks = fill(&pool, 6);
    pool.trim().unwrap();
    let held = pool.stats().pool_size;
    let want = pieces(&pool, held);
    let base = base(&pool);
    registration::take_staged(base);
    // SAFETY: nothing touches the blocks until the pool wakes (each round).
    assert_eq!(unsafe { pool.sleep(SleepMode::Offload) }, Ok(held));
    assert_eq!(
        registration::take_staged(base),
        0,
        "a first sleep registers its fresh copies as it copies into them"
    );
    assert_eq!(
        pool.registered_host_bytes(),
        held,
        "all of it, by the sleep"
    );
    assert_eq!(registration::live_registrations(base), want);
    pool.wake().unwrap();
    assert_eq!(
        registration::take_staged(base),
        0,
        "every chunk of the wake went directly"
    );
    assert!(all_hold(&blocks));
    // The copies stay registered while the pool is awake, for the next sleep.
    assert_eq!(pool.registered_host_bytes(), held);
    for round in 0..2 {
        // SAFETY: as above.
        assert_eq!(unsafe { pool.sleep(SleepMode::Offload) }, Ok(held));
        pool.wake().unwrap();
        assert_eq!(registration::take_staged(base), 0, "round {round}");
        assert!(all_hold(&blocks), "round {round}");
    }
    assert_eq!(registration::live_registrations(base), want, "no more");
    pool.trim().unwrap();
    assert_eq!(pool.stats().host_copy_bytes, 0);
    assert_eq!(pool.registered_host_bytes(), 0);
    assert_eq!(
        registration::live_registrations(base),
        0,
        "trim unregisters every piece"
    );
    free_all(&pool, blocks);
}

#[test]
fn a_registration_that_fails_midway_leaves_the_rest_staged_and_the_contents_right() {
    let pool = pool();
    let blocks = fill(&pool, 6);
    pool.trim().unwrap();
    let held = pool.stats().pool_size;
    let base = base(&pool);
    registration::fail_registration(base, Some(3));
    // SAFETY: nothing touches the blocks until the pool wakes (each round).
    unsafe { pool.sleep(SleepMode::Offload) }.unwrap();
    assert!(
        registration::take_staged(base) > 0,
        "the sleep staged what it could not register"
    );
    // Each copy is registered from its start, a piece at a time, by the thread copying
    // into it: three pieces in all, of one copy or several.
    wait_registered(&pool, 3 * REGISTER_PIECE);
    pool.wake().unwrap();
    assert!(registration::take_staged(base) > 0, "the rest was staged");
    assert!(all_hold(&blocks));
    // The wake started another registration, which failed at once: still three.
    assert_eq!(pool.registered_host_bytes(), 3 * REGISTER_PIECE);
    // Once registrations work again, the next sleep registers the rest as it copies.
    registration::fail_registration(base, None);
    // SAFETY: as above.
    unsafe { pool.sleep(SleepMode::Offload) }.unwrap();
    assert_eq!(
        registration::take_staged(base),
        0,
        "the sleep registered what was not, and copied into it directly"
    );
    assert_eq!(pool.registered_host_bytes(), held);
    pool.wake().unwrap();
    assert_eq!(registration::take_staged(base), 0);
    assert!(all_hold(&blocks));
    free_all(&pool, blocks);
    pool.trim().unwrap();
    assert_eq!(registration::live_registrations(base), 0);
}

#[test]
fn a_failed_wake_keeps_the_registered_copies_and_the_next_wake_restores_them() {
    let pool = pool();
    let blocks = fill(&pool, 4);
    pool.trim().unwrap();
    let held = pool.stats().pool_size;
    let base = base(&pool);
    // SAFETY: nothing touches the blocks until the pool wakes.
    unsafe { pool.sleep(SleepMode::Offload) }.unwrap();
    wait_registered(&pool, held);
    faults::fail_every(base, 2);
    assert!(pool.wake().is_err(), "the second piece's map fails");
    faults::fail_every(base, 0);
    assert!(pool.is_asleep());
    assert_eq!(
        pool.upstream().mapped_bytes(),
        0,
        "what it mapped went back"
    );
    assert_eq!(
        pool.registered_host_bytes(),
        held,
        "the copies are as they were"
    );
    pool.wake().unwrap();
    assert!(all_hold(&blocks));
    free_all(&pool, blocks);
    drop(pool);
    assert_eq!(
        registration::live_registrations(base),
        0,
        "the drop unregisters"
    );
}

#[test]
fn a_pool_dropped_while_its_copies_are_registered_unregisters_them() {
    for wait in [false, true] {
        let pool = pool();
        fill(&pool, 8);
        pool.trim().unwrap();
        let held = pool.stats().pool_size;
        let base = base(&pool);
        // SAFETY: nothing touches the blocks until the pool wakes (never: it is dropped).
        unsafe { pool.sleep(SleepMode::Offload) }.unwrap();
        if wait {
            wait_registered(&pool, held);
        }
        drop(pool); // asleep, with its registration under way or done
        assert_eq!(registration::live_registrations(base), 0, "wait: {wait}");
    }
}

#[test]
fn host_memory_made_ahead_is_registered_and_the_first_sleep_copies_directly() {
    let pool = pool();
    let blocks = fill(&pool, 5);
    pool.trim().unwrap();
    let held = pool.stats().pool_size;
    let base = base(&pool);
    pool.prepare_offload().unwrap();
    wait_registered(&pool, held);
    registration::take_staged(base);
    // SAFETY: nothing touches the blocks until the pool wakes.
    assert_eq!(unsafe { pool.sleep(SleepMode::Offload) }, Ok(held));
    assert_eq!(registration::take_staged(base), 0, "into registered copies");
    pool.wake().unwrap();
    assert_eq!(registration::take_staged(base), 0);
    assert!(all_hold(&blocks));
    free_all(&pool, blocks);
    pool.trim().unwrap();
    assert_eq!(registration::live_registrations(base), 0);
}

#[test]
fn a_sleep_into_larger_unregistered_copies_registers_as_far_as_its_ranges_reach() {
    let pool = pool();
    let mut blocks = fill(&pool, 6);
    pool.trim().unwrap();
    let base = base(&pool);
    // A first sleep whose copies cannot be registered: staged, kept after the wake.
    registration::fail_registration(base, Some(0));
    // SAFETY: nothing touches the blocks until the pool wakes (each round).
    unsafe { pool.sleep(SleepMode::Offload) }.unwrap();
    pool.wake().unwrap();
    assert_eq!(pool.registered_host_bytes(), 0);
    registration::take_staged(base);
    // The pool shrinks: the next sleep gives the last block's granules back first, so its
    // ranges are fewer and shorter than the kept copies they go into.
    free_all(&pool, vec![blocks.pop().unwrap()]);
    registration::fail_registration(base, None);
    // SAFETY: as above.
    let held = unsafe { pool.sleep(SleepMode::Offload) }.unwrap();
    assert_eq!(
        registration::take_staged(base),
        0,
        "each range went directly into its copy, registered as far as the range reaches"
    );
    assert!(pool.registered_host_bytes() >= held);
    pool.wake().unwrap();
    assert!(all_hold(&blocks));
    free_all(&pool, blocks);
    pool.trim().unwrap();
    assert_eq!(registration::live_registrations(base), 0);
}

#[test]
fn a_sleep_whose_direct_copy_fails_stays_awake_and_keeps_its_registered_copies() {
    let pool = pool();
    let blocks = fill(&pool, 6);
    pool.trim().unwrap();
    let held = pool.stats().pool_size;
    let (base, len) = pool.upstream().reservation();
    // Copies out of the upper half fail: the lower half's ranges went straight into their
    // copies, registered as they went, before a thread's copy failed.
    faults::fail_saves(base + held / 2, base + len, true);
    // SAFETY: nothing touches the blocks while the call runs.
    let failed = unsafe { pool.sleep(SleepMode::Offload) };
    faults::fail_saves(base + held / 2, base + len, false);
    assert!(failed.is_err(), "{failed:?}");
    assert!(!pool.is_asleep());
    assert_eq!(pool.upstream().mapped_bytes(), held, "nothing unmapped");
    assert!(all_hold(&blocks), "nothing lost");
    assert!(
        pool.registered_host_bytes() > 0,
        "the copies registered so far are kept for the next sleep"
    );
    registration::take_staged(base);
    // SAFETY: nothing touches the blocks until the pool wakes.
    assert_eq!(unsafe { pool.sleep(SleepMode::Offload) }, Ok(held));
    assert_eq!(registration::take_staged(base), 0, "all of it directly");
    pool.wake().unwrap();
    assert!(all_hold(&blocks));
    free_all(&pool, blocks);
    pool.trim().unwrap();
    assert_eq!(
        registration::live_registrations(base),
        0,
        "trim unregisters them"
    );
}
