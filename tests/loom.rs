//! loom models of the concurrency protocols in memres, run with
//!
//! ```sh
//! RUSTFLAGS="--cfg memres_loom" LOOM_MAX_PREEMPTIONS=2 \
//!     cargo test --release --test loom --target-dir target/loom
//! ```
//!
//! Built that way, `crate::sync` is loom's, so every interleaving of the reference counts
//! behind `Shared` and `AnyResource` is explored: these models check that memres shares
//! one resource among clones on several threads and drops it exactly once, after its last
//! use (they fail if a handle cloned its resource instead of sharing it, or dropped it
//! early). Protocols of memres's own (the per-device map, pool free lists) get models of
//! their own as they arrive. Without the cfg this file is empty.
#![cfg(memres_loom)]

use std::alloc::Layout;
use std::ptr::NonNull;

use loom::sync::Arc;
use loom::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use loom::thread;
use memres::{
    AnyResource, Host, HostHeap, Resource, StreamRef, SyncResource, erased::Shared, layout,
};

/// A resource that records its own drop and checks it is never used after it.
struct Watched {
    dropped: Arc<AtomicBool>,
    drops: Arc<AtomicUsize>,
}

impl PartialEq for Watched {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self, other)
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        self.dropped.store(true, Ordering::Relaxed);
        self.drops.fetch_add(1, Ordering::Relaxed);
    }
}

// SAFETY: blocks come from `HostHeap`; equality is identity.
unsafe impl SyncResource for Watched {
    type Properties = memres::HostAccessible;
    fn allocate_sync(&self, l: Layout) -> Result<NonNull<u8>, memres::Error> {
        // Relaxed is enough for the check: a use after drop would have to be ordered after
        // the drop by the reference count's own synchronisation, which is what is tested.
        assert!(!self.dropped.load(Ordering::Relaxed), "used after drop");
        HostHeap.allocate_sync(l)
    }
    unsafe fn deallocate_sync(&self, p: NonNull<u8>, l: Layout) {
        assert!(!self.dropped.load(Ordering::Relaxed), "used after drop");
        // SAFETY: forwards the caller's promise; the memory came from `HostHeap`.
        unsafe { HostHeap.deallocate_sync(p, l) }
    }
}

// SAFETY: as for `SyncResource`.
unsafe impl Resource for Watched {
    fn allocate(&self, _: StreamRef<'_>, l: Layout) -> Result<NonNull<u8>, memres::Error> {
        self.allocate_sync(l)
    }
    unsafe fn deallocate(&self, _: StreamRef<'_>, p: NonNull<u8>, l: Layout) {
        // SAFETY: forwards the caller's promise.
        unsafe { self.deallocate_sync(p, l) }
    }
}

fn watched() -> (Watched, Arc<AtomicBool>, Arc<AtomicUsize>) {
    let dropped = Arc::new(AtomicBool::new(false));
    let drops = Arc::new(AtomicUsize::new(0));
    let w = Watched {
        dropped: dropped.clone(),
        drops: drops.clone(),
    };
    (w, dropped, drops)
}

/// Allocates and frees once through `r`.
fn use_once<R: SyncResource>(r: &R) {
    let l = layout(64).unwrap();
    let p = r.allocate_sync(l).unwrap();
    // SAFETY: allocated just above with `l`.
    unsafe { r.deallocate_sync(p, l) };
}

#[test]
fn shared_clones_dropped_on_several_threads_drop_the_resource_once() {
    loom::model(|| {
        let (w, _, drops) = watched();
        let shared = Shared::new(w);
        let handles: Vec<_> = (0..2)
            .map(|_| {
                let mine = shared.clone();
                thread::spawn(move || {
                    use_once(&mine);
                    drop(mine);
                })
            })
            .collect();
        use_once(&shared);
        drop(shared);
        for h in handles {
            h.join().unwrap();
        }
        assert_eq!(drops.load(Ordering::Relaxed), 1);
    });
}

#[test]
fn memory_from_one_any_resource_clone_is_freed_through_another() {
    loom::model(|| {
        let (w, _, drops) = watched();
        let any = AnyResource::<Host>::new(w);
        let l = layout(64).unwrap();
        let p = any.allocate(StreamRef::HOST, l).unwrap().as_ptr() as usize;
        let other = any.clone();
        let t = thread::spawn(move || {
            let p = NonNull::new(p as *mut u8).unwrap();
            // SAFETY: `p` came from a clone of `other`'s resource with `l`, once.
            unsafe { other.deallocate(StreamRef::HOST, p, l) };
        });
        drop(any);
        t.join().unwrap();
        assert_eq!(drops.load(Ordering::Relaxed), 1);
    });
}

/// `Statistics`: counting from one thread while another pushes and pops a frame loses no
/// count: afterwards the bytes and allocations balance and every allocation is in a total.
/// The counting thread stays alive until the counts are read (they are still in its own
/// slot, unpublished), and says it is done through a release store.
#[test]
fn statistics_frames_and_counting_race_without_losing_counts() {
    use memres::adaptor::Statistics;
    loom::model(|| {
        let stats = Arc::new(Statistics::new(HostHeap::new()));
        let done = Arc::new(AtomicBool::new(false));
        let read = Arc::new(AtomicBool::new(false));
        let counting = stats.clone();
        let (done2, read2) = (done.clone(), read.clone());
        let t = thread::spawn(move || {
            use_once(&*counting);
            done2.store(true, Ordering::Release);
            while !read2.load(Ordering::Acquire) {
                thread::yield_now();
            }
        });
        stats.push_counters();
        let _ = stats.pop_counters().unwrap();
        while !done.load(Ordering::Acquire) {
            thread::yield_now();
        }
        let s = stats.snapshot();
        read.store(true, Ordering::Release);
        t.join().unwrap();
        assert_eq!(s.bytes.current, 0);
        assert_eq!(s.allocations.current, 0);
        assert_eq!(s.allocations.total, 1);
        assert_eq!(s.bytes.total, 64);
        assert!(s.bytes.peak == 64, "{s:?}");
    });
}

/// `Limiting`: two threads allocating against one limit, each from its own reserve, never
/// hold more than the limit together. (That an exiting thread gives its reserve back is
/// tested in `tests/adaptors.rs`: loom's `join` does not order a thread's thread-local
/// destructors before it returns, as std's does, so a model cannot check it.)
#[test]
fn limiting_reserves_never_pass_the_limit() {
    use memres::adaptor::Limiting;
    loom::model(|| {
        let lim = Arc::new(Limiting::new(HostHeap::new(), 1024));
        let held = Arc::new(AtomicUsize::new(0));
        let threads: Vec<_> = (0..2)
            .map(|_| {
                let (lim, held) = (lim.clone(), held.clone());
                thread::spawn(move || {
                    let l = layout(512).unwrap();
                    if let Ok(p) = lim.allocate_sync(l) {
                        let before = held.fetch_add(512, Ordering::SeqCst);
                        assert!(before + 512 <= 1024, "over the limit");
                        held.fetch_sub(512, Ordering::SeqCst);
                        // SAFETY: allocated just above with `l`.
                        unsafe { lim.deallocate_sync(p, l) };
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
    });
}

/// `Statistics` read while a thread that counted exits: the exiting thread folds its slot
/// into the shared counters (under the registry's lock), and a read must count it once,
/// before or after, never both or neither (the read takes the slots and the shared
/// counters under that one lock). What a user who reads right after a scope sees.
#[test]
fn statistics_read_while_a_thread_exits_counts_it_once() {
    use memres::adaptor::Statistics;
    loom::model(|| {
        let stats = Arc::new(Statistics::new(HostHeap::new()));
        let done = Arc::new(AtomicBool::new(false));
        let (counting, done2) = (stats.clone(), done.clone());
        let t = thread::spawn(move || {
            use_once(&*counting);
            done2.store(true, Ordering::Release);
            // Returns at once: the slot is retired as the thread's locals are dropped.
        });
        while !done.load(Ordering::Acquire) {
            thread::yield_now();
        }
        let s = stats.snapshot();
        t.join().unwrap();
        assert_eq!((s.bytes.current, s.bytes.total), (0, 64), "{s:?}");
        assert_eq!(
            (s.allocations.current, s.allocations.total),
            (0, 1),
            "{s:?}"
        );
    });
}

/// `Limiting` read while a thread that holds a block exits: the exiting thread gives its
/// unused reserve back, and a read must see the block once, whatever the interleaving.
#[test]
fn limiting_read_while_a_thread_exits_counts_its_block_once() {
    use memres::adaptor::Limiting;
    loom::model(|| {
        let lim = Arc::new(Limiting::new(HostHeap::new(), 1 << 20));
        let held = Arc::new(AtomicUsize::new(0));
        let (lim2, held2) = (lim.clone(), held.clone());
        let l = layout(512).unwrap();
        let t = thread::spawn(move || {
            let p = lim2.allocate_sync(l).unwrap();
            held2.store(p.as_ptr() as usize, Ordering::Release);
        });
        let p = loop {
            match held.load(Ordering::Acquire) {
                0 => thread::yield_now(),
                p => break NonNull::new(p as *mut u8).unwrap(),
            }
        };
        let during = lim.allocated_bytes();
        t.join().unwrap();
        assert_eq!(during, 512);
        // SAFETY: allocated by the thread with `l`, handed over, freed once.
        unsafe { lim.deallocate_sync(p, l) };
    });
}

/// `Fallback`'s routing: a block the second tier served, handed to another thread and
/// freed there while a third thread frees a block of the first tier, goes back to the
/// second tier (the set of its blocks, and the count that lets frees skip the set).
#[test]
fn fallback_frees_reach_the_tier_that_served_them_across_threads() {
    use memres::adaptor::{Fallback, Limiting};

    loom::model(|| {
        let l = layout(256).unwrap();
        let tiers = Arc::new(Fallback::<_, _, Host>::new(
            Limiting::new(HostHeap::new(), 256),
            Limiting::new(HostHeap::new(), 1 << 20),
        ));
        let first = tiers.allocate_sync(l).unwrap();
        let handed = Arc::new(loom::sync::Mutex::new(None::<usize>));
        let (t, h) = (Arc::clone(&tiers), Arc::clone(&handed));
        let producer = thread::spawn(move || {
            let p = t.allocate_sync(l).unwrap(); // the first tier is full
            *h.lock().unwrap() = Some(p.as_ptr() as usize);
        });
        let (t, h) = (Arc::clone(&tiers), Arc::clone(&handed));
        let consumer = thread::spawn(move || {
            loop {
                if let Some(addr) = h.lock().unwrap().take() {
                    let p = NonNull::new(addr as *mut u8).unwrap();
                    // SAFETY: allocated by the producer with `l`, handed over, freed once.
                    unsafe { t.deallocate_sync(p, l) };
                    return;
                }
                thread::yield_now();
            }
        });
        // The first tier's block is freed while the consumer frees the other (the
        // producer has allocated by then: the first tier stayed full for it).
        producer.join().unwrap();
        // SAFETY: allocated above with `l`, not used; freed once.
        unsafe { tiers.deallocate_sync(first, l) };
        consumer.join().unwrap();
        assert_eq!(tiers.first().allocated_bytes(), 0);
        assert_eq!(
            tiers.then().allocated_bytes(),
            0,
            "the second tier got its block back"
        );
        let [a, b] = tiers.tiers();
        assert_eq!((a.allocations.total, b.allocations.total), (1, 1));
    });
}
