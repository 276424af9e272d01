//! Sleep and wake of the virtual pool over host pages: what goes back, what comes back
//! (at the same addresses), and every misuse the issue lists answered with an error that
//! leaves the pool usable.

use std::alloc::Layout;
use std::ptr::NonNull;

use crate::error::Error;
use crate::resource::{Resource, layout};
use crate::stream::StreamRef;
use crate::suballoc::{SleepMode, VirtualPool, VirtualPoolConfig};
use crate::upstream::HostVirtual;
use crate::upstream::virtual_memory::{CHUNK, faults, registration};

const GRANULE: usize = 64 << 10;

fn pool() -> VirtualPool<HostVirtual> {
    HostVirtual::new(1 << 30, GRANULE)
        .and_then(|v| v.virtual_pool(VirtualPoolConfig::new()))
        .unwrap()
}

/// Blocks of several sizes on three host streams, each filled with its own byte.
fn fill(pool: &VirtualPool<HostVirtual>) -> Vec<(NonNull<u8>, Layout, StreamRef<'static>, u8)> {
    (0..40u8)
        .map(|i| {
            let l = layout(1000 + usize::from(i) * 37_000).unwrap();
            let s = StreamRef::host(u32::from(i % 3));
            let p = pool.allocate(s, l).unwrap();
            // SAFETY: a fresh block of `l.size()` bytes of host memory.
            unsafe { p.as_ptr().write_bytes(i, l.size()) };
            (p, l, s, i)
        })
        .collect()
}

fn holds(p: NonNull<u8>, l: Layout, byte: u8) -> bool {
    // SAFETY: a live block of `l.size()` bytes, mapped (the pool is awake).
    unsafe { std::slice::from_raw_parts(p.as_ptr(), l.size()) }
        .iter()
        .all(|&b| b == byte)
}

fn free_all(
    pool: &VirtualPool<HostVirtual>,
    blocks: Vec<(NonNull<u8>, Layout, StreamRef<'static>, u8)>,
) {
    for (p, l, s, _) in blocks {
        // SAFETY: allocated by `fill` with `l` on `s`; not used afterwards.
        unsafe { pool.deallocate(s, p, l) };
    }
}

#[test]
fn offload_gives_every_granule_back_and_restores_the_contents_where_they_were() {
    let pool = pool();
    let blocks = fill(&pool);
    // A freed block in the middle: its granules may go back, its neighbours stay.
    let (p, l, s, _) = blocks[20];
    // SAFETY: allocated by `fill`; not used afterwards.
    unsafe { pool.deallocate(s, p, l) };
    let before = pool.segments();
    // SAFETY: nothing touches the blocks until the pool wakes.
    let released = unsafe { pool.sleep(SleepMode::Offload) }.unwrap();
    let held = before.iter().map(|&(_, n)| n).sum::<usize>();
    assert!(released > 0 && released <= held, "{released} of {held}");
    assert_eq!(pool.upstream().mapped_bytes(), 0, "every granule went back");
    assert!(pool.is_asleep());
    let asleep = pool.stats();
    assert_eq!((asleep.pool_size, asleep.asleep_bytes), (0, released));
    assert!(pool.segments().is_empty());
    assert_eq!(pool.wake().unwrap(), released);
    assert!(!pool.is_asleep());
    assert_eq!(pool.upstream().mapped_bytes(), released);
    assert_eq!(pool.stats().pool_size, released);
    for (i, &(p, l, _, byte)) in blocks.iter().enumerate() {
        if i != 20 {
            assert!(holds(p, l, byte), "block {i} restored at its address");
        }
    }
    let mut blocks = blocks;
    blocks.remove(20);
    // The pool serves as before.
    let more = fill(&pool);
    free_all(&pool, more);
    free_all(&pool, blocks);
    pool.trim().unwrap();
    assert_eq!(pool.upstream().mapped_bytes(), 0);
}

#[test]
fn discard_gives_the_memory_back_and_wake_maps_it_at_the_same_addresses() {
    let pool = pool();
    let blocks = fill(&pool);
    let held = pool.stats().pool_size;
    // SAFETY: nothing touches the blocks until the pool wakes.
    let released = unsafe { pool.sleep(SleepMode::Discard) }.unwrap();
    assert_eq!(
        released, held,
        "every block was live: nothing trimmed first"
    );
    assert_eq!(pool.upstream().mapped_bytes(), 0);
    pool.wake().unwrap();
    for &(p, l, _, _) in &blocks {
        // The contents are gone (fresh pages read zero); the block is writable where it
        // was.
        assert!(holds(p, l, 0));
        // SAFETY: a live block, mapped again.
        unsafe { p.as_ptr().write_bytes(9, l.size()) };
    }
    free_all(&pool, blocks);
    pool.trim().unwrap();
    assert_eq!(pool.upstream().mapped_bytes(), 0);
}

#[test]
fn a_sleeping_pool_refuses_allocations_takes_frees_and_trims_and_stays_exact() {
    let pool = pool();
    let mut blocks = fill(&pool);
    // A free block on stream 0's list, which the fast path would hand out.
    let (p, l, s, _) = blocks.pop().unwrap();
    // SAFETY: allocated by `fill`; not used afterwards.
    unsafe { pool.deallocate(s, p, l) };
    // SAFETY: nothing touches the blocks until the pool wakes.
    unsafe { pool.sleep(SleepMode::Offload) }.unwrap();
    for size in [l.size(), 100, 64 << 20] {
        for stream in [s, StreamRef::host(9)] {
            assert_eq!(
                pool.allocate(stream, layout(size).unwrap()),
                Err(Error::Asleep),
                "{size} bytes on {stream:?}"
            );
        }
    }
    // A free while asleep is taken: the block is free once the pool wakes.
    let (p, l, s, _) = blocks.pop().unwrap();
    // SAFETY: allocated by `fill`; not used afterwards.
    unsafe { pool.deallocate(s, p, l) };
    assert_eq!(pool.trim(), Ok(0), "nothing to give back while asleep");
    assert_eq!(pool.upstream().mapped_bytes(), 0);
    let live = blocks.iter().map(|&(_, l, _, _)| l.size()).sum::<usize>();
    pool.wake().unwrap();
    let stats = pool.stats();
    assert!(stats.live_bytes() >= live && stats.live_bytes() < live + 40 * 512);
    for &(p, l, _, byte) in &blocks {
        assert!(holds(p, l, byte));
    }
    free_all(&pool, blocks);
    pool.trim().unwrap();
    assert_eq!(pool.upstream().mapped_bytes(), 0);
    assert_eq!(pool.stats().free_bytes, 0);
}

#[test]
fn waking_an_awake_pool_and_sleeping_twice_are_errors_that_change_nothing() {
    let pool = pool();
    assert!(matches!(pool.wake(), Err(Error::InvalidArgument(_))));
    let blocks = fill(&pool);
    // SAFETY: nothing touches the blocks until the pool wakes.
    let released = unsafe { pool.sleep(SleepMode::Offload) }.unwrap();
    // SAFETY: as above.
    let again = unsafe { pool.sleep(SleepMode::Discard) };
    assert!(matches!(again, Err(Error::InvalidArgument(_))), "{again:?}");
    assert_eq!(
        pool.wake(),
        Ok(released),
        "the first sleep's copies are kept"
    );
    assert!(matches!(pool.wake(), Err(Error::InvalidArgument(_))));
    for &(p, l, _, byte) in &blocks {
        assert!(holds(p, l, byte));
    }
    free_all(&pool, blocks);
}

#[test]
fn offload_without_host_memory_fails_and_leaves_the_pool_awake_with_its_contents() {
    let pool = pool();
    let blocks = fill(&pool);
    // Copies of the upper half fail: those of the lower half are made, then dropped.
    let (base, len) = crate::upstream::GrowInPlace::reservation(pool.upstream());
    let held = pool.stats().pool_size;
    assert!(held > 8 * (256 << 10), "several pieces");
    faults::fail_saves(base + held / 2, base + len, true);
    // SAFETY: nothing touches the blocks while the call runs.
    let slept = unsafe { pool.sleep(SleepMode::Offload) };
    faults::fail_saves(base + held / 2, base + len, false);
    assert!(matches!(slept, Err(Error::OutOfMemory { .. })), "{slept:?}");
    assert!(!pool.is_asleep());
    for &(p, l, _, byte) in &blocks {
        assert!(holds(p, l, byte), "nothing lost");
    }
    let extra = pool
        .allocate(StreamRef::HOST, layout(1 << 20).unwrap())
        .unwrap();
    // SAFETY: allocated just above; not used afterwards.
    unsafe { pool.deallocate(StreamRef::HOST, extra, layout(1 << 20).unwrap()) };
    free_all(&pool, blocks);
}

/// An offloading sleep of `pool` whose last piece's copies fail once the leaf has
/// unmapped half the pool (the pieces copied before were unmapped as their copies were
/// done): what it returned, and the bytes the pool held.
fn sleep_failing_once_half_unmapped(
    pool: &VirtualPool<HostVirtual>,
) -> (Result<usize, Error>, usize) {
    let (base, len) = crate::upstream::GrowInPlace::reservation(pool.upstream());
    let held = pool.stats().pool_size;
    let piece = 256 << 10; // the tests' `PIECE`
    assert!(held >= 8 * piece, "several pieces");
    let last = base + (held - 1) / piece * piece;
    let half_unmapped = faults::unmapped_bytes(base) + held / 2;
    faults::fail_saves_once_unmapped(last, base + len, base, half_unmapped, true);
    // SAFETY: nothing touches the pool's blocks while the call runs.
    let slept = unsafe { pool.sleep(SleepMode::Offload) };
    faults::fail_saves_once_unmapped(last, base + len, base, half_unmapped, false);
    assert!(matches!(slept, Err(Error::OutOfMemory { .. })), "{slept:?}");
    assert!(
        faults::unmapped_bytes(base) >= half_unmapped,
        "pieces were unmapped before the failure (not after the 10 s the fault waits)"
    );
    (slept, held)
}

#[test]
fn a_sleep_that_fails_after_unmapping_pieces_maps_them_back_with_their_contents() {
    let pool = pool();
    let blocks = fill(&pool);
    let (_, held) = sleep_failing_once_half_unmapped(&pool);
    assert!(!pool.is_asleep());
    assert_eq!(pool.upstream().mapped_bytes(), held, "all mapped again");
    for &(p, l, _, byte) in &blocks {
        assert!(holds(p, l, byte), "nothing lost");
    }
    // SAFETY: nothing touches the blocks until the pool wakes.
    assert_eq!(unsafe { pool.sleep(SleepMode::Offload) }, Ok(held));
    assert_eq!(pool.upstream().mapped_bytes(), 0);
    pool.wake().unwrap();
    for &(p, l, _, byte) in &blocks {
        assert!(holds(p, l, byte));
    }
    free_all(&pool, blocks);
}

/// The documented loss: a failed sleep whose map-back fails too (every map fails: as a
/// broken driver would) returns the first error, leaves the pool awake, and the pieces
/// it could not map back unmapped (their blocks are not touched again here).
#[test]
fn a_sleep_whose_map_back_fails_too_returns_its_error_and_stays_awake_without_those_pieces() {
    let pool = pool();
    let blocks = fill(&pool);
    let base = crate::upstream::GrowInPlace::reservation(pool.upstream()).0;
    faults::fail_every(base, 1);
    let (_, held) = sleep_failing_once_half_unmapped(&pool);
    faults::fail_every(base, 0);
    assert!(!pool.is_asleep());
    let mapped = pool.upstream().mapped_bytes();
    assert!(
        mapped < held && mapped > 0,
        "{mapped} of {held}: some pieces lost"
    );
    // Their memory is gone: the blocks are dropped untouched.
    drop(blocks);
}

#[test]
fn a_wake_the_device_cannot_back_fails_keeps_the_pool_asleep_and_can_be_tried_again() {
    let pool = pool();
    let mut blocks = fill(&pool);
    // A freed block of whole granules in the middle: the pool holds two runs when it
    // sleeps.
    let (p, l, s, _) = blocks.remove(30);
    // SAFETY: allocated by `fill`; not used afterwards.
    unsafe { pool.deallocate(s, p, l) };
    // SAFETY: nothing touches the blocks until the pool wakes.
    let released = unsafe { pool.sleep(SleepMode::Offload) }.unwrap();
    assert_eq!(pool.stats().asleep_bytes, released);
    // The second map fails: another process took the memory.
    faults::fail_every(
        crate::upstream::GrowInPlace::reservation(pool.upstream()).0,
        2,
    );
    assert!(matches!(pool.wake(), Err(Error::OutOfMemory { .. })));
    faults::fail_every(
        crate::upstream::GrowInPlace::reservation(pool.upstream()).0,
        0,
    );
    assert!(pool.is_asleep());
    assert_eq!(
        pool.upstream().mapped_bytes(),
        0,
        "what the failed wake mapped went back"
    );
    assert_eq!(pool.wake(), Ok(released));
    assert_eq!(
        pool.segments().len(),
        2,
        "two runs: the first map of the failed wake held"
    );
    for &(p, l, _, byte) in &blocks {
        assert!(holds(p, l, byte));
    }
    free_all(&pool, blocks);
}

/// (A chunked pool asked to sleep does not compile: `ui-tests/chunked_pool_cannot_sleep.rs`.)
#[test]
fn a_pool_dropped_asleep() {
    let pool = pool();
    let blocks = fill(&pool);
    // SAFETY: the blocks are never touched again (the pool goes away asleep).
    unsafe { pool.sleep(SleepMode::Offload) }.unwrap();
    drop(blocks);
    drop(pool);
}

/// Threads allocate and free (without touching the memory) while the main thread puts
/// the pool to sleep and wakes it again and again: every allocation is served or refused
/// with `Asleep`, nothing hangs, nothing is mapped while the pool sleeps, and at the end
/// everything goes back.
#[test]
fn sleep_and_wake_beside_threads_that_allocate() {
    let pool = pool();
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|scope| {
        for t in 0..4u32 {
            let (pool, stop) = (&pool, &stop);
            scope.spawn(move || {
                let mut live = Vec::new();
                let mut i = 0usize;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    i += 1;
                    let l = layout(256 + (i * 7919 + t as usize * 104_729) % (3 << 20)).unwrap();
                    let s = StreamRef::host(t);
                    match pool.allocate(s, l) {
                        Ok(p) => live.push((p, l)),
                        Err(Error::Asleep) => {}
                        Err(e) => panic!("{e}"),
                    }
                    if live.len() > 16 {
                        let (p, l) = live.swap_remove(i % live.len());
                        // SAFETY: allocated above with `l` on `s`; never touched.
                        unsafe { pool.deallocate(s, p, l) };
                    }
                }
                for (p, l) in live {
                    // SAFETY: as above.
                    unsafe { pool.deallocate(StreamRef::host(t), p, l) };
                }
            });
        }
        for round in 0..200 {
            let mode = if round % 2 == 0 {
                SleepMode::Offload
            } else {
                SleepMode::Discard
            };
            // SAFETY: the threads never touch the memory they get.
            unsafe { pool.sleep(mode) }.unwrap();
            assert_eq!(
                pool.upstream().mapped_bytes(),
                0,
                "nothing maps while asleep"
            );
            let expected = pool.stats().asleep_bytes;
            assert_eq!(pool.wake(), Ok(expected));
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    pool.trim().unwrap();
    assert_eq!(pool.upstream().mapped_bytes(), 0);
}

/// The staging buffers among the pool's host memory, besides `copies` bytes of copies:
/// a whole number of `CHUNK`s, two a thread at most (4 threads in the tests; how many a
/// sleep makes depends on how many threads got chunks).
fn staging_bytes(pool: &VirtualPool<HostVirtual>, copies: usize) -> usize {
    let held = pool.stats().host_copy_bytes;
    let staging = held.checked_sub(copies).expect("the copies are held");
    assert!(
        staging.is_multiple_of(CHUNK) && staging <= 8 * CHUNK,
        "{staging} bytes of staging buffers"
    );
    staging
}

#[test]
fn a_wake_keeps_the_host_copies_for_the_next_sleep_until_trim() {
    let pool = pool();
    let blocks = fill(&pool);
    // Unregistered copies, so that the sleeps stage (a copy registered as it is copied
    // into needs no staging buffer: `register_tests.rs`).
    let (base, len) = crate::upstream::GrowInPlace::reservation(pool.upstream());
    registration::fail_registration(base, Some(0));
    // SAFETY: nothing touches the blocks until the pool wakes (each round).
    let released = unsafe { pool.sleep(SleepMode::Offload) }.unwrap();
    // The copies and the staging buffers, while asleep.
    assert!(staging_bytes(&pool, released) > 0);
    pool.wake().unwrap();
    staging_bytes(&pool, released);
    // The next sleeps use the copies again: no more memory for copies, the same contents
    // back.
    for round in 0..3 {
        // SAFETY: as above.
        assert_eq!(unsafe { pool.sleep(SleepMode::Offload) }, Ok(released));
        staging_bytes(&pool, released);
        pool.wake().unwrap();
        staging_bytes(&pool, released);
        for &(p, l, _, byte) in &blocks {
            assert!(holds(p, l, byte), "round {round}");
        }
    }
    // A failed sleep keeps them too (they go back to the spares).
    faults::fail_saves(base + released / 2, base + len, true);
    // SAFETY: as above.
    let failed = unsafe { pool.sleep(SleepMode::Offload) };
    faults::fail_saves(base + released / 2, base + len, false);
    assert!(
        matches!(failed, Err(Error::OutOfMemory { .. })),
        "{failed:?}"
    );
    staging_bytes(&pool, released);
    free_all(&pool, blocks);
    pool.trim().unwrap();
    assert_eq!(pool.stats().host_copy_bytes, 0, "trim frees them");
    registration::fail_registration(base, None);
}

#[test]
fn a_first_sleep_whose_staging_buffers_run_out_midway_fails_and_leaves_the_pool_awake() {
    let pool = pool();
    let blocks = fill(&pool);
    let (base, _) = crate::upstream::GrowInPlace::reservation(pool.upstream());
    // Unregistered copies, so that the sleep stages (see above).
    registration::fail_registration(base, Some(0));
    // One buffer can be had (pinned), the next not: the first chunk is copied, then
    // whichever thread asks for a second buffer (for the second chunk, whoever takes it)
    // fails.
    faults::fail_staging(base, Some(1));
    // SAFETY: nothing touches the blocks while the call runs.
    let slept = unsafe { pool.sleep(SleepMode::Offload) };
    faults::fail_staging(base, None);
    assert!(matches!(slept, Err(Error::OutOfMemory { .. })), "{slept:?}");
    assert!(!pool.is_asleep());
    let held = pool.stats().pool_size;
    assert_eq!(pool.upstream().mapped_bytes(), held, "nothing unmapped");
    for &(p, l, _, byte) in &blocks {
        assert!(holds(p, l, byte), "nothing lost");
    }
    // Nothing leaked: the copies made (one a piece, all made before any chunk) and the
    // buffer are kept for the next sleep.
    assert_eq!(staging_bytes(&pool, held), CHUNK);
    // The next sleep uses them and makes the buffers it lacks.
    // SAFETY: nothing touches the blocks until the pool wakes.
    assert_eq!(unsafe { pool.sleep(SleepMode::Offload) }, Ok(held));
    staging_bytes(&pool, held);
    pool.wake().unwrap();
    for &(p, l, _, byte) in &blocks {
        assert!(holds(p, l, byte), "restored");
    }
    free_all(&pool, blocks);
    pool.trim().unwrap();
    assert_eq!(pool.stats().host_copy_bytes, 0);
    assert_eq!(pool.upstream().mapped_bytes(), 0);
    registration::fail_registration(base, None);
}

#[test]
fn a_sleep_whose_lanes_cannot_be_waited_for_leaks_its_copies_and_leaves_the_pool_awake() {
    let pool = pool();
    let blocks = fill(&pool);
    let (base, _) = crate::upstream::GrowInPlace::reservation(pool.upstream());
    let abandoned =
        crate::upstream::virtual_memory::ABANDONED.load(std::sync::atomic::Ordering::Relaxed);
    faults::fail_finish(base, true);
    // SAFETY: nothing touches the blocks while the call runs.
    let slept = unsafe { pool.sleep(SleepMode::Offload) };
    faults::fail_finish(base, false);
    assert!(matches!(slept, Err(Error::InvalidArgument(_))), "{slept:?}");
    assert!(!pool.is_asleep());
    // The device might still write into the copies: they were leaked, not kept as spares
    // (nor freed).
    let leaked =
        crate::upstream::virtual_memory::ABANDONED.load(std::sync::atomic::Ordering::Relaxed);
    assert!(leaked > abandoned, "the copies were leaked");
    staging_bytes(&pool, 0); // only staging buffers held: no copy kept
    for &(p, l, _, byte) in &blocks {
        assert!(holds(p, l, byte), "nothing lost");
    }
    // With the device working again, the pool sleeps and wakes as ever.
    let held = pool.stats().pool_size;
    // SAFETY: nothing touches the blocks until the pool wakes.
    assert_eq!(unsafe { pool.sleep(SleepMode::Offload) }, Ok(held));
    pool.wake().unwrap();
    for &(p, l, _, byte) in &blocks {
        assert!(holds(p, l, byte), "restored");
    }
    free_all(&pool, blocks);
    pool.trim().unwrap();
}

#[test]
fn a_wake_whose_copy_fails_midway_unmaps_what_it_mapped_and_can_be_tried_again() {
    let pool = pool();
    let blocks = fill(&pool);
    // SAFETY: nothing touches the blocks until the pool wakes.
    let released = unsafe { pool.sleep(SleepMode::Offload) }.unwrap();
    let (base, len) = crate::upstream::GrowInPlace::reservation(pool.upstream());
    // Copies back into the upper half fail: the lower half is mapped and copied first.
    faults::fail_saves(base + released / 2, base + len, true);
    let woken = pool.wake();
    faults::fail_saves(base + released / 2, base + len, false);
    assert!(matches!(woken, Err(Error::OutOfMemory { .. })), "{woken:?}");
    assert!(pool.is_asleep());
    assert_eq!(
        pool.upstream().mapped_bytes(),
        0,
        "what it mapped went back"
    );
    assert_eq!(pool.stats().asleep_bytes, released);
    staging_bytes(&pool, released); // and the copies, all kept
    assert_eq!(pool.wake(), Ok(released));
    for &(p, l, _, byte) in &blocks {
        assert!(holds(p, l, byte), "restored by the second wake");
    }
    free_all(&pool, blocks);
}

/// A 5 MiB block of a fresh pool, filled with a pattern, slept (offloaded) and woken
/// twice, every byte checked after each wake: the copies registered as they are copied
/// into unless `registrations` says how many may be (`Some(0)`: all staged), and held
/// until their lanes are waited for with `deferred` (`faults::defer_copies`).
fn two_rounds_restore_every_byte(registrations: Option<usize>, deferred: bool) {
    let pool = pool();
    let (base, _) = crate::upstream::GrowInPlace::reservation(pool.upstream());
    registration::fail_registration(base, registrations);
    faults::defer_copies(base, deferred);
    let l = layout(5 << 20).unwrap();
    let p = pool.allocate(StreamRef::HOST, l).unwrap();
    let pattern = |i: usize| (i.wrapping_mul(2_654_435_761) >> 7) as u8;
    // SAFETY: a fresh block of `l.size()` bytes of host memory.
    let bytes = unsafe { std::slice::from_raw_parts_mut(p.as_ptr(), l.size()) };
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = pattern(i);
    }
    for round in 0..2 {
        // SAFETY: nothing touches the block until the pool wakes.
        unsafe { pool.sleep(SleepMode::Offload) }.unwrap();
        assert_eq!(pool.upstream().mapped_bytes(), 0);
        pool.wake().unwrap();
        // SAFETY: the block is mapped again.
        let bytes = unsafe { std::slice::from_raw_parts(p.as_ptr(), l.size()) };
        let wrong = bytes.iter().enumerate().position(|(i, &b)| b != pattern(i));
        assert_eq!(wrong, None, "round {round}, {registrations:?}, {deferred}");
    }
    faults::defer_copies(base, false);
    registration::fail_registration(base, None);
    // SAFETY: allocated above with `l`; not used afterwards.
    unsafe { pool.deallocate(StreamRef::HOST, p, l) };
}

#[test]
fn offload_restores_every_byte_of_pieces_cut_into_chunks_of_another_size() {
    // Pieces of 256 KiB, chunks of 96 KiB: each piece ends in a short chunk, and the four
    // threads take chunks of different pieces at once. The copies registered as they are
    // copied into (64 KiB a registration: chunks straddle their ends), staged (every
    // registration fails), and both (the sixth fails: some copies are registered partly,
    // the rest of them staged).
    for registrations in [None, Some(0), Some(5)] {
        two_rounds_restore_every_byte(registrations, false);
    }
}

/// Copies made only when their lane is waited for, as a GPU's (the host's are made at
/// once): a sleep that unmapped a piece, or read a staging buffer, before the wait for the
/// lanes that copy it would read unmapped pages (a fault) or stale bytes, and a wake that
/// called the pool awake before its copies were waited for would show stale bytes.
/// Staged and registered copies.
#[test]
fn sleep_and_wake_wait_for_each_lane_before_they_use_what_it_copied() {
    for registrations in [None, Some(0)] {
        two_rounds_restore_every_byte(registrations, true);
    }
}

#[test]
fn a_leaf_refuses_copies_of_unmapped_ranges_and_restores_too_long_for_their_copy() {
    use crate::resource::SyncResource;
    use crate::upstream::GrowInPlace;

    let leaf = HostVirtual::new(1 << 20, GRANULE).unwrap();
    let l = layout(GRANULE).unwrap();
    let p = leaf.allocate_sync(l).unwrap();
    let addr = p.as_ptr() as usize;
    let mut spare = Vec::new();
    // SAFETY: the range asked for is refused before any byte is read.
    let unmapped = unsafe { leaf.save_at(&[(addr + GRANULE, GRANULE)], &mut spare) };
    assert!(
        matches!(unmapped, Err(Error::InvalidArgument(_))),
        "{unmapped:?}"
    );
    // SAFETY: half a granule: refused before any byte is read.
    let partial = unsafe { leaf.save_at(&[(addr, GRANULE / 2)], &mut spare) };
    assert!(
        matches!(partial, Err(Error::InvalidArgument(_))),
        "{partial:?}"
    );
    let free = addr + GRANULE;
    let half = crate::upstream::HostCopy::pages(GRANULE / 2).unwrap();
    // SAFETY: refused before anything is mapped: the copy holds half a granule.
    let long = unsafe { leaf.wake_at(&[(free, GRANULE)], std::slice::from_ref(&half), &mut spare) };
    assert!(matches!(long, Err(Error::InvalidArgument(_))), "{long:?}");
    // SAFETY: refused before anything is mapped: one copy for two ranges.
    let short = unsafe {
        leaf.wake_at(
            &[(free, GRANULE), (free + GRANULE, GRANULE)],
            std::slice::from_ref(&half),
            &mut spare,
        )
    };
    assert!(matches!(short, Err(Error::InvalidArgument(_))), "{short:?}");
    let full = crate::upstream::HostCopy::pages(GRANULE).unwrap();
    // SAFETY: refused by `map_at`: the granule is mapped already; nothing is copied.
    let mapped =
        unsafe { leaf.wake_at(&[(addr, GRANULE)], std::slice::from_ref(&full), &mut spare) };
    assert!(
        matches!(mapped, Err(Error::InvalidArgument(_))),
        "{mapped:?}"
    );
    assert_eq!(leaf.mapped_bytes(), GRANULE, "nothing mapped or unmapped");
    assert!(spare.is_empty(), "nothing was staged");
    // SAFETY: allocated above with `l`.
    unsafe { leaf.deallocate_sync(p, l) };
}

#[test]
fn host_memory_made_ahead_is_what_the_first_sleep_uses() {
    let pool = pool();
    assert_eq!(
        pool.prepare_offload(),
        Ok(0),
        "nothing mapped, nothing made"
    );
    let blocks = fill(&pool);
    // What a sleep would copy: the pool less its free granules (the sleep trims first).
    pool.trim().unwrap();
    let held = pool.stats().pool_size;
    let made = pool.prepare_offload().unwrap();
    assert_eq!(made, held, "copies of all it holds");
    assert_eq!(
        staging_bytes(&pool, held),
        0,
        "and no staging buffers: a sleep into registered copies stages nothing"
    );
    assert_eq!(pool.prepare_offload(), Ok(0), "made already");
    // SAFETY: nothing touches the blocks until the pool wakes.
    assert_eq!(unsafe { pool.sleep(SleepMode::Offload) }, Ok(held));
    assert!(
        pool.stats().host_copy_bytes <= held + 8 * CHUNK,
        "the sleep made no more copies"
    );
    assert!(matches!(
        pool.prepare_offload(),
        Err(Error::InvalidArgument(_))
    ));
    pool.wake().unwrap();
    for &(p, l, _, byte) in &blocks {
        assert!(holds(p, l, byte));
    }
    // Memory mapped later gets its own when the pool sleeps: prepared now too.
    let l = layout(3 << 20).unwrap();
    let extra = pool.allocate(StreamRef::HOST, l).unwrap();
    let grown = pool.stats().pool_size - held;
    assert!(grown >= 3 << 20);
    assert_eq!(pool.prepare_offload().map(|m| m >= grown), Ok(true));
    // SAFETY: allocated above with `l`; not used afterwards.
    unsafe { pool.deallocate(StreamRef::HOST, extra, l) };
    free_all(&pool, blocks);
    pool.trim().unwrap();
    assert_eq!(pool.stats().host_copy_bytes, 0, "trim frees it");
}

/// A wake maps its pieces on several threads (and a sleep unmaps them so): whichever map
/// fails, on whichever thread, the wake fails with nothing left mapped, the pool asleep
/// with its copies, and the next wake restores everything; in both modes (a discarding
/// wake maps with no copying threads).
#[test]
fn a_wake_whose_maps_fail_anywhere_leaves_nothing_mapped_in_either_mode() {
    for mode in [SleepMode::Offload, SleepMode::Discard] {
        for every in [1, 2, 3, 7, 40] {
            let pool = pool();
            let blocks = fill(&pool);
            let base = crate::upstream::GrowInPlace::reservation(pool.upstream()).0;
            // SAFETY: nothing touches the blocks until the pool wakes.
            let released = unsafe { pool.sleep(mode) }.unwrap();
            assert!(
                released / (256 << 10) > 40,
                "more pieces than the faults' period"
            );
            let peak = pool.upstream().peak_mapped_bytes();
            faults::fail_every(base, every);
            let woken = pool.wake();
            faults::fail_every(base, 0);
            assert!(
                matches!(woken, Err(Error::OutOfMemory { .. })),
                "{mode:?}, every {every}: {woken:?}"
            );
            assert!(pool.is_asleep());
            assert_eq!(
                pool.upstream().mapped_bytes(),
                0,
                "{mode:?}, every {every}: what the failed wake mapped went back"
            );
            assert_eq!(
                pool.upstream().peak_mapped_bytes(),
                peak,
                "no more mapped at once than before it slept"
            );
            assert_eq!(pool.wake(), Ok(released));
            assert_eq!(pool.upstream().mapped_bytes(), released);
            if mode == SleepMode::Offload {
                for &(p, l, _, byte) in &blocks {
                    assert!(holds(p, l, byte), "{every}: block {byte}");
                }
            }
            free_all(&pool, blocks);
        }
    }
}

/// The leaf maps outside its lock (so that a wake's threads map at once), having claimed
/// the granules under it: threads racing for more granules than its limit allows get
/// exactly the limit, the counts stay exact, and a failed map gives its claim back
/// without counting in the peak.
#[test]
fn a_leaf_mapping_on_many_threads_keeps_its_limit_and_counts_exact() {
    use crate::upstream::GrowInPlace;

    let leaf = HostVirtual::with_limit(16 * GRANULE, GRANULE, 8 * GRANULE).unwrap();
    let leaf = &leaf;
    let (base, _) = leaf.reservation();
    let ranges: Vec<(usize, usize)> = (0..16).map(|i| (base + i * GRANULE, GRANULE)).collect();
    let mapped: Vec<(usize, usize)> = std::thread::scope(|scope| {
        let threads: Vec<_> = ranges
            .iter()
            .map(|&(addr, len)| scope.spawn(move || leaf.map_at(addr, len).map(|()| (addr, len))))
            .collect();
        threads
            .into_iter()
            .filter_map(|t| t.join().unwrap().ok())
            .collect()
    });
    assert_eq!(mapped.len(), 8, "exactly the limit");
    assert_eq!(leaf.mapped_bytes(), 8 * GRANULE);
    assert_eq!(leaf.peak_mapped_bytes(), 8 * GRANULE);
    for &(addr, _) in &mapped {
        // SAFETY: mapped just above, host memory of a granule.
        unsafe { std::ptr::with_exposed_provenance_mut::<u8>(addr).write(1) };
    }
    // SAFETY: mapped above by this leaf, apart from each other; nothing uses them.
    unsafe { leaf.unmap_ranges_at(&mapped) };
    assert_eq!(leaf.mapped_bytes(), 0);
    faults::fail_every(base, 1);
    let failed = leaf.map_at(base, 4 * GRANULE);
    faults::fail_every(base, 0);
    assert!(
        matches!(failed, Err(Error::OutOfMemory { .. })),
        "{failed:?}"
    );
    assert_eq!(leaf.mapped_bytes(), 0);
    assert_eq!(leaf.peak_mapped_bytes(), 8 * GRANULE);
    assert_eq!(
        leaf.map_at(base, 8 * GRANULE),
        Ok(()),
        "the failed map's claim went back"
    );
    // SAFETY: mapped just above; nothing uses it.
    unsafe { leaf.unmap_ranges_at(&[(base, 8 * GRANULE)]) };
    assert_eq!(leaf.mapped_bytes(), 0);
}
