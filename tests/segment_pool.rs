//! `SegmentPool` on host memory: best fit, splits and merges, segments per stream,
//! `no_split` and medium segments, lending free blocks only, its table listed and
//! restored, and every segment back upstream on a release or a drop.

use std::ptr::NonNull;

use memres::adaptor::Statistics;
use memres::suballoc::{BlockEntry, SegmentPool, SegmentPoolConfig};
use memres::{Error, HostHeap, Resource, StreamRef, layout, resource::layout_with_alignment};

const MIB: usize = 1 << 20;
const S1: StreamRef<'static> = StreamRef::host(1);
const S2: StreamRef<'static> = StreamRef::host(2);

fn pool(config: SegmentPoolConfig) -> SegmentPool<Statistics<HostHeap>> {
    SegmentPool::new(Statistics::new(HostHeap::new()), config).unwrap()
}

fn at(ptr: NonNull<u8>) -> usize {
    ptr.as_ptr() as usize
}

fn alloc(p: &SegmentPool<Statistics<HostHeap>>, s: StreamRef<'_>, size: usize) -> NonNull<u8> {
    p.allocate(s, layout(size).unwrap()).unwrap()
}

fn free(p: &SegmentPool<Statistics<HostHeap>>, s: StreamRef<'_>, ptr: NonNull<u8>, size: usize) {
    // SAFETY: host memory from `p` with this size, unused.
    unsafe { p.deallocate(s, ptr, layout(size).unwrap()) };
}

/// (offset, size, allocated) of every block.
fn shape(p: &SegmentPool<Statistics<HostHeap>>) -> Vec<(usize, usize, bool)> {
    p.blocks()
        .iter()
        .map(|b| (b.offset, b.size, b.allocated))
        .collect()
}

#[test]
fn blocks_are_split_best_fit_and_merge_when_freed() {
    let p = pool(SegmentPoolConfig::new());
    let a = alloc(&p, S1, 1000);
    let b = alloc(&p, S1, 5000);
    let c = alloc(&p, S1, 1000);
    assert_eq!(p.segments().len(), 1);
    assert_eq!(p.segments()[0].1, 2 * MIB);
    assert_eq!(at(b) - at(a), 1024, "blocks rounded to 512 bytes, in order");
    assert_eq!(at(c) - at(b), 5120);
    free(&p, S1, b, 5000);
    // The best fit for 2000 bytes is b's 5120-byte hole, not the free rest of the segment.
    let d = alloc(&p, S1, 2000);
    assert_eq!(at(d), at(b));
    assert_eq!(
        shape(&p),
        [
            (0, 1024, true),
            (1024, 2048, true),
            (3072, 3072, false),
            (6144, 1024, true),
            (7168, 2 * MIB - 7168, false)
        ]
    );
    free(&p, S1, a, 1000);
    free(&p, S1, c, 1000);
    free(&p, S1, d, 2000);
    assert_eq!(shape(&p), [(0, 2 * MIB, false)], "every free merged");
    assert_eq!(p.live_blocks(), 0);
}

#[test]
fn the_smallest_hole_that_fits_is_taken_not_the_first() {
    let p = pool(SegmentPoolConfig::new());
    let a = alloc(&p, S1, 4000);
    let b = alloc(&p, S1, 1000);
    let c = alloc(&p, S1, 1000);
    let d = alloc(&p, S1, 1000);
    free(&p, S1, a, 4000); // a 4096-byte hole first
    free(&p, S1, c, 1000); // a 1024-byte hole after it
    let e = alloc(&p, S1, 1000);
    assert_eq!(at(e), at(c), "best fit: c's hole, not a's");
    for (ptr, size) in [(b, 1000), (d, 1000), (e, 1000)] {
        free(&p, S1, ptr, size);
    }
}

#[test]
fn a_stream_takes_blocks_of_its_own_segments_only() {
    let p = pool(SegmentPoolConfig::new());
    let a = alloc(&p, S1, 1000);
    free(&p, S1, a, 1000);
    let b = alloc(&p, S2, 1000);
    assert_eq!(p.segments().len(), 2, "S2 gets a segment of its own");
    assert!(p.segment_of(at(b)).unwrap().0 != p.segment_of(at(a)).unwrap().0);
    let again = alloc(&p, S1, 1000);
    assert_eq!(at(again), at(a), "S1 reuses its own block");
    free(&p, S1, again, 1000);
    free(&p, S2, b, 1000);
}

#[test]
fn no_split_hands_out_whole_segments() {
    let p = pool(SegmentPoolConfig::new().no_split(true));
    let a = alloc(&p, S1, 1000);
    let b = alloc(&p, S1, 1000);
    assert_eq!(p.segments(), [(at(a), 1024), (at(b), 1024)]);
    free(&p, S1, a, 1000);
    // A smaller request takes a's segment whole (never split).
    let c = alloc(&p, S1, 100);
    assert_eq!(at(c), at(a));
    assert_eq!(shape(&p), [(0, 1024, true), (0, 1024, true)]);
    // A larger one cannot fit there: a new segment.
    free(&p, S1, c, 100);
    let d = alloc(&p, S1, 4000);
    assert_eq!(p.segments().len(), 3);
    free(&p, S1, b, 1000);
    free(&p, S1, d, 4000);
}

#[test]
fn medium_requests_share_medium_segments() {
    let p = pool(SegmentPoolConfig::new().medium_segments(MIB, 10 * MIB, 20 * MIB));
    let a = alloc(&p, S1, 3 * MIB);
    let b = alloc(&p, S1, 3 * MIB);
    assert_eq!(p.segments().len(), 1);
    assert_eq!(p.segments()[0].1, 20 * MIB);
    let big = alloc(&p, S1, 15 * MIB);
    assert_eq!(
        p.segments()[1].1,
        16 * MIB,
        "above the medium range: 2 MiB steps"
    );
    free(&p, S1, a, 3 * MIB);
    free(&p, S1, b, 3 * MIB);
    free(&p, S1, big, 15 * MIB);
}

#[test]
fn lending_free_blocks_never_grows_the_pool() {
    let p = pool(SegmentPoolConfig::new());
    let l = layout(1000).unwrap();
    assert!(matches!(
        p.allocate_from_free(S1, l),
        Err(Error::OutOfMemory {
            requested: 1024,
            ..
        })
    ));
    assert!(p.segments().is_empty());
    let a = alloc(&p, S1, 1000);
    let lent = p.allocate_from_free(S1, l).unwrap();
    assert_eq!(p.segments().len(), 1);
    free(&p, S1, a, 1000);
    free(&p, S1, lent, 1000);
}

#[test]
fn releasing_what_is_not_a_live_block_is_refused_and_changes_nothing() {
    let p = pool(SegmentPoolConfig::new());
    let a = alloc(&p, S1, 1000);
    let before = p.blocks();
    // SAFETY: refused without a change: nothing is freed.
    unsafe {
        let inside = NonNull::new(a.as_ptr().add(512)).unwrap();
        assert!(matches!(p.release(inside), Err(Error::InvalidArgument(_))));
        let outside = NonNull::new(a.as_ptr().add(4 * MIB)).unwrap();
        assert!(matches!(p.release(outside), Err(Error::InvalidArgument(_))));
        assert_eq!(p.release(a).unwrap(), 1024);
        assert!(
            matches!(p.release(a), Err(Error::InvalidArgument(_))),
            "twice"
        );
    }
    assert_eq!(before.len(), 2);
    assert_eq!(shape(&p), [(0, 2 * MIB, false)]);
}

#[test]
fn a_saved_table_is_restored_in_place() {
    let p = pool(SegmentPoolConfig::new());
    let a = alloc(&p, S1, 1000);
    let b = alloc(&p, S1, 1000);
    let saved = p.blocks();
    free(&p, S1, a, 1000);
    let c = alloc(&p, S1, 300_000);
    // SAFETY: b and c are not used after this; a and b are live again as saved.
    let restored = unsafe { p.restore(&saved).unwrap() };
    let mut freed = restored.freed.clone();
    freed.sort_unstable();
    assert_eq!(freed, [at(b), at(c)]);
    assert_eq!(restored.allocated, [at(a), at(b)]);
    assert_eq!(p.blocks(), saved);
    assert_eq!(p.live_blocks(), 2);
    // The restored blocks free as any other.
    free(&p, S1, a, 1000);
    free(&p, S1, b, 1000);
    assert_eq!(shape(&p), [(0, 2 * MIB, false)]);
}

#[test]
fn a_table_that_does_not_fit_the_pool_is_refused_and_changes_nothing() {
    let p = pool(SegmentPoolConfig::new());
    let a = alloc(&p, S1, 1000);
    let now = p.blocks();
    let mut gap = now.clone();
    gap[1].offset += 512; // a hole between the blocks
    let mut foreign = now.clone();
    for entry in &mut foreign {
        entry.segment += 64 * MIB; // no segment of the pool's
    }
    let short = vec![BlockEntry {
        size: 1024,
        ..now[0]
    }];
    // Sizes that wrap around to the segment's size, and a block off the 512-byte grid.
    let wrapping = vec![
        BlockEntry {
            size: 4 * MIB,
            ..now[0]
        },
        BlockEntry {
            offset: 4 * MIB,
            size: 0usize.wrapping_sub(2 * MIB),
            allocated: false,
            ..now[0]
        },
    ];
    let off_grid = vec![
        BlockEntry {
            size: 100,
            ..now[0]
        },
        BlockEntry {
            offset: 100,
            size: 2 * MIB - 100,
            allocated: false,
            ..now[0]
        },
    ];
    for table in [gap, foreign, short, wrapping, off_grid] {
        // SAFETY: refused, nothing changes.
        let refused = unsafe { p.restore(&table) };
        assert!(
            matches!(refused, Err(Error::InvalidArgument(_))),
            "{table:?}"
        );
        assert_eq!(p.blocks(), now);
    }
    free(&p, S1, a, 1000);
}

#[test]
fn free_segments_go_back_upstream_on_release_and_every_segment_on_drop() {
    let p = pool(SegmentPoolConfig::new());
    let a = alloc(&p, S1, 1000);
    let b = alloc(&p, S2, 1000);
    assert_eq!(p.upstream().bytes().current as usize, 4 * MIB);
    free(&p, S1, a, 1000);
    // SAFETY: host memory: its work is always complete.
    assert_eq!(unsafe { p.release_free_segments(S1) }, 2 * MIB);
    assert_eq!(p.upstream().bytes().current as usize, 2 * MIB);
    assert_eq!(p.segments().len(), 1);
    let stats = Statistics::new(HostHeap::new());
    {
        let q = SegmentPool::new(&stats, SegmentPoolConfig::new()).unwrap();
        q.allocate(S1, layout(10 * MIB).unwrap()).unwrap();
        assert_eq!(stats.bytes().current as usize, 10 * MIB);
    }
    assert_eq!(
        stats.bytes().current as usize,
        0,
        "the drop gave the segment back"
    );
    free(&p, S2, b, 1000);
}

#[test]
fn bad_configs_and_alignments_are_invalid_arguments() {
    for config in [
        SegmentPoolConfig::new().block_rounding(3),
        SegmentPoolConfig::new().segment_rounding(1000),
        SegmentPoolConfig::new().medium_segments(1, 2, 1000),
        SegmentPoolConfig::new().segment_alignment(3 << 20),
        SegmentPoolConfig::new().segment_alignment(128),
    ] {
        assert!(matches!(
            SegmentPool::new(HostHeap::new(), config),
            Err(Error::InvalidArgument(_))
        ));
    }
    let p = pool(SegmentPoolConfig::new());
    assert!(matches!(
        p.allocate(S1, layout_with_alignment(100, 4096).unwrap()),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        p.allocate(S1, layout(1 << 60).unwrap()),
        Err(Error::OutOfMemory { .. })
    ));
    assert!(p.segments().is_empty());
}

#[test]
fn a_block_used_on_other_streams_is_held_until_their_work_is_done() {
    let p = pool(SegmentPoolConfig::new());
    let a = alloc(&p, S1, 1000);
    let b = alloc(&p, S1, 1000);
    // SAFETY: host streams (always valid); the blocks are unused when freed.
    unsafe {
        // The segment's own stream adds nothing: the free is at once.
        p.record_stream(a, S1).unwrap();
        assert_eq!(p.free_used(a, false).unwrap(), 1024);
        assert_eq!(
            p.blocks()[0],
            BlockEntry {
                allocated: false,
                ..p.blocks()[0]
            }
        );
        // Another stream holds the block while a capture is underway (no event then).
        p.record_stream(b, S2).unwrap();
        assert!(
            matches!(p.record_stream(a, S2), Err(Error::InvalidArgument(_))),
            "a is free"
        );
        p.free_used(b, true).unwrap();
        let held = p.blocks();
        assert!(held.iter().any(|e| e.allocated && e.held), "{held:?}");
        assert!(
            matches!(p.free_used(b, false), Err(Error::InvalidArgument(_))),
            "twice"
        );
        assert!(matches!(
            p.record_stream(b, S2),
            Err(Error::InvalidArgument(_))
        ));
        // Outside the capture: a host stream's work is complete, so the block is free.
        p.settle(memres::suballoc::Settle::Poll);
        assert_eq!(shape(&p), [(0, 2 * MIB, false)]);
    }
}

#[test]
fn held_blocks_are_waited_for_or_forgotten_as_asked() {
    let p = pool(SegmentPoolConfig::new());
    let a = alloc(&p, S1, 1000);
    let b = alloc(&p, S1, 1000);
    // SAFETY: host streams; the blocks are unused when freed.
    unsafe {
        p.record_stream(a, S2).unwrap();
        p.record_stream(b, S2).unwrap();
        p.free_used(a, true).unwrap();
        p.settle(memres::suballoc::Settle::Wait);
        assert!(!p.blocks()[0].allocated, "waited for and freed");
        p.free_used(b, true).unwrap();
        let saved = vec![BlockEntry {
            offset: 0,
            size: 2 * MIB,
            allocated: false,
            held: false,
            ..p.blocks()[0]
        }];
        // Forgotten: still allocated in the table, until a restore replaces it.
        p.settle(memres::suballoc::Settle::Forget);
        assert!(p.blocks().iter().any(|e| e.allocated && !e.held));
        p.restore(&saved).unwrap();
    }
    assert_eq!(shape(&p), [(0, 2 * MIB, false)]);
    assert_eq!(p.live_blocks(), 0);
}

#[test]
fn a_block_freed_through_the_resource_trait_waits_for_its_recorded_streams() {
    let p = pool(SegmentPoolConfig::new());
    let a = alloc(&p, S1, 1000);
    // SAFETY: host streams; `a` is unused when freed.
    unsafe { p.record_stream(a, S2).unwrap() };
    free(&p, S1, a, 1000);
    assert_eq!(
        shape(&p),
        [(0, 2 * MIB, false)],
        "host work is complete: freed at once"
    );
    let b = p
        .allocate_ordered(S1, layout(1000).unwrap(), true, false)
        .unwrap();
    assert_eq!(at(b), at(a));
    free(&p, S1, b, 1000);
}

/// Blocks are found by address across many segments, before and after some segments go
/// back upstream (the segments are indexed by address, issue 47): frees and lookups of
/// the segments kept still find their blocks, and each listed entry names its stream.
#[test]
fn blocks_are_found_by_address_after_segments_go_back() {
    let p = pool(SegmentPoolConfig::new().no_split(true));
    let blocks: Vec<_> = (0..64).map(|_| alloc(&p, S1, 4096)).collect();
    assert_eq!(p.segments().len(), 64);
    assert!(
        p.blocks().iter().all(|b| b.stream.is_none()),
        "host streams"
    );
    // Every other segment goes back.
    for &b in blocks.iter().step_by(2) {
        free(&p, S1, b, 4096);
    }
    // SAFETY: the freed blocks are unused (host memory, nothing in flight).
    assert_eq!(unsafe { p.release_free_segments(S1) }, 32 * 4096);
    for (i, &b) in blocks.iter().enumerate() {
        let found = p
            .segment_of(at(b) + 100)
            .map(|(base, size, _)| (base, size));
        assert_eq!(found, (i % 2 == 1).then_some((at(b), 4096)), "block {i}");
    }
    for &b in blocks.iter().skip(1).step_by(2) {
        // SAFETY: unused host memory of `p`.
        assert_eq!(unsafe { p.release(b) }, Ok(4096));
    }
    assert_eq!(p.live_blocks(), 0);
}

/// `segment_alignment`: a segment whose size is a multiple of it is taken aligned to it
/// (the C ABI gives its in-place pool's granule, so a segment covers whole granules);
/// one whose size is not, as before.
#[test]
fn segments_of_whole_granules_are_taken_aligned_to_them() {
    let split = pool(SegmentPoolConfig::new().segment_alignment(2 * MIB));
    let whole = pool(
        SegmentPoolConfig::new()
            .segment_alignment(2 * MIB)
            .no_split(true),
    );
    for _ in 0..4 {
        let a = alloc(&split, S1, 512);
        let b = alloc(&whole, S1, 4 * MIB);
        let c = alloc(&whole, S1, 1000);
        assert_eq!(at(a) % (2 * MIB), 0, "a 2 MiB segment's first block");
        assert_eq!(at(b) % (2 * MIB), 0, "a 4 MiB segment");
        assert_eq!(
            whole.segments().iter().map(|s| s.1).collect::<Vec<_>>(),
            [4 * MIB, 1024]
        );
        free(&split, S1, a, 512);
        free(&whole, S1, b, 4 * MIB);
        free(&whole, S1, c, 1000);
        // SAFETY: host memory: its work is always complete.
        unsafe {
            split.release_free_segments(S1);
            whole.release_free_segments(S1);
        }
    }
    assert_eq!(split.upstream().bytes().current, 0);
    assert_eq!(whole.upstream().bytes().current, 0);
}

/// Over an in-place pool, segments aligned to its granule cover whole granules, so the
/// pool's own blocks made before and after a segment share the granule below it
/// (PyTorch's `test_mempool_ctx_multithread`: a snapshot then draws them in one
/// segment, as torch's does); aligned as before, the segment takes the free end of that
/// granule and the second block lands above the segment.
#[test]
fn aligned_segments_leave_an_in_place_pools_own_blocks_together() {
    use memres::suballoc::{VirtualPool, VirtualPoolConfig};
    use memres::upstream::HostVirtual;
    use std::sync::Arc;
    const G: usize = 64 << 10;
    for (alignment, together) in [(G, true), (256, false)] {
        let leaf = HostVirtual::new(1 << 30, G).unwrap();
        let pool: Arc<VirtualPool<HostVirtual>> =
            Arc::new(leaf.virtual_pool(VirtualPoolConfig::new()).unwrap());
        let config = SegmentPoolConfig::new()
            .segment_rounding(G)
            .segment_alignment(alignment);
        let segments = SegmentPool::new(Arc::clone(&pool), config).unwrap();
        let half = layout(G / 2).unwrap();
        let a = pool.allocate(S1, half).unwrap();
        let s = segments.allocate(S1, half).unwrap();
        let b = pool.allocate(S1, half).unwrap();
        assert_eq!(at(a) / G == at(b) / G, together, "alignment {alignment}");
        assert_eq!(at(s).is_multiple_of(G), together, "alignment {alignment}");
        // SAFETY: host memory from these pools with these layouts, unused.
        unsafe {
            pool.deallocate(S1, a, half);
            pool.deallocate(S1, b, half);
            segments.deallocate(S1, s, half);
        }
    }
}
