//! What the per-stream lists of a pool or an arena cost on the heap, counted by a global
//! allocator of this test binary: a stream used once leaves a list behind; `trim()` frees
//! the lists (issue 33, item 4), or where Linux's `membarrier` is not offered (no grace
//! periods), gives back their heap memory.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};

mod common;

use common::CoalescingPool;
use memres::suballoc::{
    Arena, Binning, FixedSize, Pool, PoolConfig, VirtualPool, VirtualPoolConfig,
};
use memres::{HostHeap, Resource, StreamRef, layout, upstream::HostVirtual};

/// Bytes live on the heap of this process.
static HEAP: AtomicIsize = AtomicIsize::new(0);

struct Counting;

// SAFETY: forwards to `System`, counting sizes on the side.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        HEAP.fetch_add(l.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's promise, passed on.
        unsafe { System.alloc(l) }
    }

    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        HEAP.fetch_sub(l.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's promise, passed on.
        unsafe { System.dealloc(p, l) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const STREAMS: u32 = 20_000;

/// Whether this machine offers `membarrier`'s private expedited command (which
/// `Pool::trim` needs to free lists): its query, as memres asks it.
fn grace_periods_offered() -> bool {
    const QUERY: libc::c_long = 0;
    const PRIVATE_EXPEDITED: libc::c_long = 1 << 3;
    // SAFETY: the query command reads nothing and changes nothing.
    let offered = unsafe { libc::syscall(libc::SYS_membarrier, QUERY, 0, 0) };
    offered >= 0 && offered & PRIVATE_EXPEDITED != 0
}

/// Heap bytes per stream: after each of `STREAMS` streams allocated and freed a small and
/// a 64 KiB block, and after `trim()`.
fn per_stream<R: Resource>(pool: &R, trim: impl Fn(&R)) -> (isize, isize) {
    per_stream_of(pool, &[256, 64 << 10], trim)
}

/// [`per_stream`] with blocks of `sizes`.
fn per_stream_of<R: Resource>(pool: &R, sizes: &[usize], trim: impl Fn(&R)) -> (isize, isize) {
    let layouts: Vec<Layout> = sizes.iter().map(|&n| layout(n).unwrap()).collect();
    let before = HEAP.load(Ordering::Relaxed);
    for id in 1..=STREAMS {
        let s = StreamRef::host(id);
        let blocks: Vec<_> = layouts
            .iter()
            .map(|&l| (pool.allocate(s, l).unwrap(), l))
            .collect();
        for (p, l) in blocks {
            // SAFETY: allocated just above on `s`, unused.
            unsafe { pool.deallocate(s, p, l) };
        }
    }
    let used = HEAP.load(Ordering::Relaxed) - before;
    trim(pool);
    let trimmed = HEAP.load(Ordering::Relaxed) - before;
    let n = STREAMS as isize;
    (used / n, trimmed / n)
}

/// The bound on what a stream used once costs after `trim()`: nothing but rounding
/// where lists are freed; the list's inline fields and chunk table copy where not.
fn trimmed_bound() -> isize {
    if grace_periods_offered() { 16 } else { 1 << 10 }
}

fn check<P: CoalescingPool>(name: &str, pool: &P) {
    let trim = |p: &P| {
        p.trim().unwrap();
    };
    let (used, trimmed) = per_stream(pool, trim);
    println!("{name}: {used} B per stream in use, {trimmed} B after trim");
    assert!(
        used > 4 << 10,
        "the lists hold their caches while in use: {used} B"
    );
    assert!(
        trimmed <= trimmed_bound(),
        "{trimmed} B per stream after trim"
    );
    if grace_periods_offered() {
        // Only the host list the pool was made with is left.
        assert_eq!(pool.stats().stream_lists, 1, "lists after trim");
    }
    // The streams again: new lists, the same memory, and no more after another trim.
    let (again, trimmed_again) = per_stream(pool, trim);
    println!("{name}, the same streams again: {again} B, {trimmed_again} B after trim");
    assert!(trimmed_again <= trimmed_bound(), "{trimmed_again} B");
}

// One test: the counter is the whole process's, and tests run on threads side by side.
#[test]
fn trim_frees_the_lists_of_used_streams() {
    let chunked = Pool::new(HostHeap, PoolConfig::new().initial_size(1 << 20)).unwrap();
    check("chunked pool", &chunked);
    let leaf = HostVirtual::new(1 << 30, 64 << 10).unwrap();
    let in_place = leaf.virtual_pool(VirtualPoolConfig::new()).unwrap();
    check("virtual pool", &in_place);

    // An arena of 64 superblocks: most streams take one, and the arena defragments
    // (takes whole superblocks back from other streams' lists) when the global arena
    // runs dry.
    let arena = Arena::with_size(HostHeap, 64 << 20).unwrap();
    let trim = |a: &Arena<HostHeap>| a.trim().unwrap();
    for round in ["", ", the same streams again"] {
        let (used, trimmed) = per_stream(&arena, trim);
        println!("arena{round}: {used} B per stream in use, {trimmed} B after trim");
        assert!(
            used > 200,
            "the lists hold their tables while in use: {used} B"
        );
        assert!(
            trimmed <= trimmed_bound(),
            "{trimmed} B per stream after trim"
        );
        assert_eq!(
            arena.superblocks(),
            0,
            "every superblock back in the global arena"
        );
        assert_eq!(arena.free_bytes(), arena.size());
    }

    // Blocks of one size (with thread caches), and bins of them over a pool; their
    // chunks come from mapped memory (not the heap counted here). A host stream's list
    // keeps its last block until `trim` (so that over many streams each one's next
    // allocation does not take another's), which the second round then reuses.
    let chunks = HostVirtual::new(1 << 30, 64 << 10).unwrap();
    let fixed = FixedSize::with_block_size(&chunks, 4096, 64).unwrap();
    let trim = |f: &FixedSize<&HostVirtual>| f.trim().unwrap();
    let mut grown = Vec::new();
    for round in ["", ", the same streams again"] {
        let (used, trimmed) = per_stream_of(&fixed, &[4096], trim);
        println!("fixed size{round}: {used} B per stream in use, {trimmed} B after trim");
        assert!(used > 100, "the lists live while in use: {used} B");
        assert!(
            trimmed <= trimmed_bound(),
            "{trimmed} B per stream after trim"
        );
        assert_eq!(fixed.free_blocks(), 64 * fixed.upstream_allocations());
        grown.push(fixed.upstream_allocations());
    }
    assert_eq!(
        grown[0], grown[1],
        "the second round reuses the first's blocks"
    );
    let leaf = HostVirtual::new(1 << 30, 64 << 10).unwrap();
    let bins = Binning::new(leaf.virtual_pool(VirtualPoolConfig::new()).unwrap(), 8, 12).unwrap();
    let trim = |b: &Binning<VirtualPool<HostVirtual>>| {
        b.trim().unwrap();
        b.upstream().trim().unwrap();
    };
    for round in ["", ", the same streams again"] {
        let (used, trimmed) = per_stream_of(&bins, &[256, 4096], trim);
        println!("binning{round}: {used} B per stream in use, {trimmed} B after trim");
        assert!(used > 200, "the bins' lists live while in use: {used} B");
        // Beyond the lists: the pool's records of the bins' chunks, which the first
        // round grew (a host list keeps its last block) and the second reuses.
        assert!(
            trimmed <= 2 * trimmed_bound(),
            "{trimmed} B per stream after trim"
        );
    }
}
