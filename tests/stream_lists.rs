//! What a pool's per-stream lists cost on the heap, counted by a global allocator of
//! this test binary: a stream used once leaves a list behind; `trim()` gives back the
//! list's heap memory (issue 33, item 4).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};

use memres::suballoc::{Pool, PoolConfig};
use memres::{HostHeap, HostVirtual, Resource, StreamRef, layout};

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

/// Heap bytes per stream: after each of `STREAMS` streams allocated and freed a small and
/// a 64 KiB block, and after `trim()`.
fn per_stream<U: Resource>(pool: &Pool<U>) -> (isize, isize) {
    let small = layout(256).unwrap();
    let mid = layout(64 << 10).unwrap();
    let before = HEAP.load(Ordering::Relaxed);
    for id in 1..=STREAMS {
        let s = StreamRef::host(id);
        let a = pool.allocate(s, small).unwrap();
        let b = pool.allocate(s, mid).unwrap();
        // SAFETY: allocated just above on `s`, unused.
        unsafe {
            pool.deallocate(s, a, small);
            pool.deallocate(s, b, mid);
        }
    }
    let used = HEAP.load(Ordering::Relaxed) - before;
    pool.trim().unwrap();
    let trimmed = HEAP.load(Ordering::Relaxed) - before;
    let n = STREAMS as isize;
    (used / n, trimmed / n)
}

// One test: the counter is the whole process's, and tests run on threads side by side.
#[test]
fn trim_gives_back_what_the_lists_of_used_streams_hold() {
    let chunked = Pool::new(HostHeap, PoolConfig::new().initial_size(1 << 20)).unwrap();
    let (used, trimmed) = per_stream(&chunked);
    println!("chunked pool: {used} B per stream in use, {trimmed} B after trim");
    assert!(
        used > 4 << 10,
        "the lists hold their caches while in use: {used} B"
    );
    assert!(trimmed <= 1 << 10, "{trimmed} B per stream after trim");

    let leaf = HostVirtual::new(1 << 30, 64 << 10).unwrap();
    let in_place = leaf.pool(PoolConfig::new()).unwrap();
    let (used, trimmed) = per_stream(&in_place);
    println!("in-place pool: {used} B per stream in use, {trimmed} B after trim");
    assert!(used > 4 << 10, "{used} B");
    assert!(trimmed <= 1 << 10, "{trimmed} B per stream after trim");
}
