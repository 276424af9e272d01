//! Stand-in resources shared by the integration tests.

#![allow(dead_code, unreachable_pub)]

use std::alloc::Layout;
use std::marker::PhantomData;
use std::ptr::NonNull;

pub mod faulty;

use memres::{Error, HostHeap, Resource, StreamRef, SyncResource, property::PropertySet};

/// Heap memory that claims the properties `P`, told apart from other instances by `id`
/// (equal ids: equal resources). For tests of types, maps and erasure: whatever `P` claims
/// beyond host access must never be used (no kernel is ever given its memory).
#[derive(Debug)]
pub struct HeapAs<P> {
    pub id: u32,
    properties: PhantomData<fn() -> P>,
}

impl<P> HeapAs<P> {
    pub fn new(id: u32) -> Self {
        HeapAs {
            id,
            properties: PhantomData,
        }
    }
}

impl<P> PartialEq for HeapAs<P> {
    fn eq(&self, other: &Self) -> bool {
        self.id == other.id
    }
}

// SAFETY: blocks come from the heap; the claimed properties beyond host access are never
// used (the type's contract with the tests); all instances free through the same heap.
unsafe impl<P: PropertySet> SyncResource for HeapAs<P> {
    type Properties = P;
    fn allocate_sync(&self, l: Layout) -> Result<NonNull<u8>, Error> {
        HostHeap.allocate_sync(l)
    }
    unsafe fn deallocate_sync(&self, p: NonNull<u8>, l: Layout) {
        // SAFETY: forwards the caller's promise; the block came from the heap.
        unsafe { HostHeap.deallocate_sync(p, l) }
    }
}

// SAFETY: as for `SyncResource`; heap memory is usable at once in any stream order.
unsafe impl<P: PropertySet> Resource for HeapAs<P> {
    fn allocate(&self, _: StreamRef<'_>, l: Layout) -> Result<NonNull<u8>, Error> {
        self.allocate_sync(l)
    }
    unsafe fn deallocate(&self, _: StreamRef<'_>, p: NonNull<u8>, l: Layout) {
        // SAFETY: forwards the caller's promise.
        unsafe { self.deallocate_sync(p, l) }
    }
}

/// A step of the sub-allocators' property tests.
#[derive(Debug, Clone)]
pub enum Step {
    Allocate {
        stream: u32,
        size: usize,
        align_shift: u32,
    },
    Free {
        index: usize,
        stream: u32,
    },
    Trim,
}

/// Steps over `streams` streams (numbered from 0), sizes below 300,000 bytes and
/// alignments of 2^0 to 2^(`align_shifts` - 1): allocations, frees of a live block
/// (`index` modulo the number live) and trims, 6 : 5 : 1.
pub fn step(streams: u32, align_shifts: u32) -> impl proptest::strategy::Strategy<Value = Step> {
    use proptest::prelude::*;
    prop_oneof![
        6 => (0..streams, 1..300_000usize, 0..align_shifts)
            .prop_map(|(stream, size, align_shift)| Step::Allocate { stream, size, align_shift }),
        5 => (any::<usize>(), 0..streams).prop_map(|(index, stream)| Step::Free { index, stream }),
        1 => Just(Step::Trim),
    ]
}

/// What both coalescing pools ([`Pool`](memres::Pool) and
/// [`VirtualPool`](memres::VirtualPool)) have, for the helpers that test either one
/// (their methods are inherent: one set a type).
pub trait CoalescingPool: Resource + Sync {
    fn stats(&self) -> memres::suballoc::PoolStats;
    fn pool_size(&self) -> usize;
    fn trim(&self) -> Result<usize, Error>;
    fn coalesce(&self) -> Result<(), Error>;
}

/// The pool's figures once every thread's cached blocks are back in its lists: a
/// chunked pool's thread caches go back when their thread's thread-locals are destroyed,
/// which for `std::thread::scope`'s threads may be after the scope has returned (the
/// scope waits for the closures, not for the threads' exits); `coalesce` takes them back
/// at once, and so does `trim`.
#[allow(dead_code)] // (not every test binary that includes this module calls it)
pub fn settled_stats<P: CoalescingPool>(pool: &P) -> memres::suballoc::PoolStats {
    pool.coalesce().expect("coalesce");
    pool.stats()
}

/// Joins scoped threads one by one, so that each has exited, its thread-locals destroyed
/// and its cached blocks back with their resource, when this returns: the scope alone
/// waits for the closures, not for the exits (see [`settled_stats`]). A thread's panic
/// goes on in the caller.
#[allow(dead_code)] // (not every test binary that includes this module calls it)
pub fn join_exited<T>(threads: Vec<std::thread::ScopedJoinHandle<'_, T>>) {
    for t in threads {
        if let Err(panic) = t.join() {
            std::panic::resume_unwind(panic);
        }
    }
}

macro_rules! coalescing_pools {
    ($($ty:ident),*) => {
        $(
            impl<U: Resource + Sync> CoalescingPool for memres::$ty<U> {
                fn stats(&self) -> memres::suballoc::PoolStats {
                    memres::$ty::stats(self)
                }
                fn pool_size(&self) -> usize {
                    memres::$ty::pool_size(self)
                }
                fn trim(&self) -> Result<usize, Error> {
                    memres::$ty::trim(self)
                }
                fn coalesce(&self) -> Result<(), Error> {
                    memres::$ty::coalesce(self)
                }
            }
        )*
    };
}

coalescing_pools!(Pool, VirtualPool);

/// Runs `f` while another thread (live, idle) holds a block of `layout` that it allocated
/// and freed on `stream` through `r` (so that it waits in that thread's cache); the
/// thread exits after `f`.
#[allow(dead_code)] // (not every test binary that includes this module calls it)
pub fn while_another_thread_caches<R: Resource + Send + Sync + 'static>(
    r: &std::sync::Arc<R>,
    stream: StreamRef<'static>,
    layout: Layout,
    f: impl FnOnce(),
) {
    use std::sync::mpsc;
    let (cached, wait_cached) = mpsc::channel::<()>();
    let (done, wait_done) = mpsc::channel::<()>();
    let other = std::sync::Arc::clone(r);
    let idle = std::thread::spawn(move || {
        let p = other.allocate(stream, layout).unwrap();
        // SAFETY: allocated just above with `layout` on `stream`; not used.
        unsafe { other.deallocate(stream, p, layout) };
        cached.send(()).unwrap();
        wait_done.recv().unwrap();
    });
    wait_cached.recv().unwrap();
    f();
    done.send(()).unwrap();
    idle.join().unwrap();
}
