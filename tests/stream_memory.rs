//! What a stream costs a sub-allocator in heap memory before a trim, when 16 threads
//! (each in a lane of its own) and then one thread in the shared lane 0 each use it once:
//! 17 lists a stream (issue 49: 112.8 KiB a stream for a pool, each of its 16 lists
//! holding a 6 KiB table of cached block sizes for one 4 KiB block). Heap bytes are
//! counted by a global allocator of this test; the memory a resource holds from its
//! upstream (on the same heap for `HostHeap`) is taken off. The figures are sizes, not
//! times: the test checks what is held, whatever the machine. An `Arena`'s list keeps a
//! size-class index of the superblock pieces it holds, about 15 KiB; a list whose
//! superblock went back to the global arena (an idle stream's, taken for a busy one)
//! gives its index up, also when a defragmentation's scan of every list took the pieces
//! (a superblock split between lanes), so an arena with fewer superblocks than streams
//! is held to the same limit.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Mutex;
use std::sync::atomic::{AtomicIsize, Ordering};

use memres::{
    HostHeap, Pool, PoolConfig, Resource, StreamRef, VirtualPoolConfig,
    suballoc::{Arena, FixedSize},
    upstream::HostVirtual,
};

/// Live heap bytes of the process.
static LIVE: AtomicIsize = AtomicIsize::new(0);

struct Counting;

// SAFETY: every call is `System`'s, with the same arguments; the counter is only a figure.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's promise, passed on.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's promise, passed on.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's promise, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

/// The tests one at a time: the counter is the process's.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Threads, one per lane of their own of a stream.
const THREADS: u32 = 16;
/// Streams each thread uses once.
const STREAMS: u32 = 256;
/// The most heap memory a stream may cost (its 16 own lanes' lists and lane 0's).
const MOST_PER_STREAM: isize = 16 << 10;

/// Heap bytes per stream that `resource` holds after `THREADS` threads, each in a lane of
/// its own, and then the calling thread, in lane 0, have each allocated and freed one
/// 4 KiB block on each of `STREAMS` host streams (17 lists a stream), less what
/// `upstream_bytes` says it holds from its upstream on the heap.
fn per_stream<R: Resource + Sync>(resource: &R, upstream_bytes: impl Fn(&R) -> usize) -> isize {
    let l = memres::layout(4096).unwrap();
    // (What the threads leave in thread-locals goes as they exit, before the count.)
    let before = LIVE.load(Ordering::Relaxed) - upstream_bytes(resource) as isize;
    std::thread::scope(|s| {
        let threads: Vec<_> = (0..THREADS)
            .map(|_| {
                s.spawn(|| {
                    // Every thread in a lane of its own (threads that never run into each
                    // other share lane 0, and cost a stream one list).
                    memres::suballoc::own_lane();
                    for id in 1..=STREAMS {
                        let stream = StreamRef::host(id);
                        let p = resource.allocate(stream, l).unwrap();
                        // SAFETY: allocated just above with `l` on `stream`; not used.
                        unsafe { resource.deallocate(stream, p, l) };
                    }
                })
            })
            .collect();
        // A scope returns before its threads' thread-locals are destroyed, and the count
        // must come after.
        common::join_exited(threads);
    });
    // Then this thread, in lane 0 (threads that never ran into each other share it), once
    // on each stream: a stream's 17th list.
    for id in 1..=STREAMS {
        let stream = StreamRef::host(id);
        let p = resource.allocate(stream, l).unwrap();
        // SAFETY: allocated just above with `l` on `stream`; not used.
        unsafe { resource.deallocate(stream, p, l) };
    }
    let after = LIVE.load(Ordering::Relaxed) - upstream_bytes(resource) as isize;
    (after - before) / STREAMS as isize
}

fn check(name: &str, bytes: isize) {
    println!("{name}: {bytes} heap bytes a stream, {THREADS} threads' lanes and lane 0");
    assert!(
        bytes <= MOST_PER_STREAM,
        "{name}: {bytes} bytes a stream used by {THREADS} threads and lane 0, above {MOST_PER_STREAM}"
    );
}

#[test]
fn a_pool_stream_used_by_16_threads_costs_at_most_16_kib() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let pool = Pool::new(HostHeap, PoolConfig::new().initial_size(64 << 20)).unwrap();
    check("pool", per_stream(&pool, |p| p.stats().pool_size));
}

#[test]
fn a_virtual_pool_stream_used_by_16_threads_costs_at_most_16_kib() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    // (Its memory is mapped pages, not the heap.)
    let pool = HostVirtual::new(1 << 30, 64 << 10)
        .unwrap()
        .virtual_pool(VirtualPoolConfig::new())
        .unwrap();
    check("virtual pool", per_stream(&pool, |_| 0));
}

#[test]
fn a_fixed_size_stream_used_by_16_threads_costs_at_most_16_kib() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let fixed = FixedSize::with_block_size(HostHeap, 4096, 1024).unwrap();
    check(
        "fixed",
        per_stream(&fixed, |f| {
            f.upstream_allocations() * f.block_size() * f.blocks_per_chunk()
        }),
    );
}

#[test]
fn an_arena_stream_used_by_16_threads_costs_at_most_16_kib() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    // 64 superblocks of 1 MiB for 256 streams' 4,096 lane lists: most lists' superblocks
    // go back to the global arena for other streams.
    let arena = Arena::with_size(HostHeap, 64 << 20).unwrap();
    check("arena", per_stream(&arena, |a| a.size()));
}
