//! The conformance suite over every resource that lives on the host.

#[macro_use]
mod conformance;

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::Arc;

use conformance::Caps;
use memres::{AnyResource, Callback, Host, HostHeap, ResourceExt, ResourceRef, SyncResource};

static HEAP: HostHeap = HostHeap::new();

/// A `Callback` that forwards to the global allocator.
fn heap_callback() -> impl memres::Resource<Properties = Host> + Sync {
    Callback::<Host>::new(
        |l: Layout| HEAP.allocate_sync(l),
        // SAFETY: `Callback` passes back only pointers its allocate closure returned, with
        // their layout; those came from `HEAP`.
        |p: NonNull<u8>, l: Layout| unsafe { HEAP.deallocate_sync(p, l) },
    )
}

conformance_tests!(host_heap, HostHeap::new(), Caps::host());
conformance_tests!(callback_over_host_heap, heap_callback(), Caps::host());
conformance_tests!(ref_host_heap, &HEAP, Caps::host());
conformance_tests!(arc_host_heap, Arc::new(HostHeap::new()), Caps::host());
conformance_tests!(shared_host_heap, HostHeap::new().shared(), Caps::host());
conformance_tests!(
    any_resource_host,
    AnyResource::<Host>::new(HostHeap::new()),
    Caps::host()
);
conformance_tests!(
    resource_ref_host,
    ResourceRef::<Host>::new(&HEAP),
    Caps::host()
);
conformance_tests!(
    any_resource_over_callback,
    heap_callback().into_any::<Host>(),
    Caps::host()
);

/// The suite must be able to fail: broken resources are caught.
mod the_suite_catches {
    use super::*;
    use std::sync::Mutex;

    /// Hands out the same block for every request up to 1 MiB.
    fn same_block_twice() -> impl memres::Resource<Properties = Host> + Sync {
        let l = Layout::from_size_align(1 << 20, 4096).unwrap();
        let block = HEAP.allocate_sync(l).unwrap().as_ptr() as usize;
        Callback::<Host>::new(
            move |req: Layout| {
                assert!(req.size() <= 1 << 20 && req.align() <= 4096);
                Ok(NonNull::new(block as *mut u8).unwrap())
            },
            |_, _| {},
        )
    }

    #[test]
    #[should_panic(expected = "overlaps")]
    fn overlapping_blocks() {
        conformance::fixed_sizes(
            &same_block_twice(),
            Caps {
                largest: 1 << 20,
                ..Caps::host()
            },
        );
    }

    #[test]
    #[should_panic(expected = "was overwritten")]
    fn overlap_across_threads() {
        // Two drivers that cannot see each other's blocks: only the tags catch it.
        let r = same_block_twice();
        let mut a = conformance::Driver::new(&r, conformance::Api::Sync);
        let mut b = conformance::Driver::new(&r, conformance::Api::Sync);
        let first = a.allocate(memres::layout(64).unwrap());
        let _second = b.allocate(memres::layout(64).unwrap());
        a.free(first);
    }

    #[test]
    #[should_panic(expected = "succeeded")]
    fn a_pebibyte_that_is_not_refused() {
        // Claims any size, but really hands out 1-byte blocks from the heap. Its set is
        // empty, so the suite does not write into the blocks.
        let r = Callback::<()>::new(
            |l: Layout| HEAP.allocate_sync(Layout::from_size_align(1, l.align()).unwrap()),
            // SAFETY: every pointer came from `HEAP` with size 1 and this alignment.
            |p: NonNull<u8>, l: Layout| unsafe {
                HEAP.deallocate_sync(p, Layout::from_size_align(1, l.align()).unwrap())
            },
        );
        conformance::out_of_memory_then_usable(&r, Caps::host());
    }

    #[test]
    #[should_panic(expected = "should be refused")]
    fn an_alignment_that_should_have_been_refused() {
        conformance::alignments(
            &HostHeap::new(),
            Caps {
                max_alignment: 256,
                ..Caps::host()
            },
        );
    }

    #[test]
    fn nothing_leaks() {
        // Every case frees what it allocates: count live bytes through a Callback.
        let live = Mutex::new(0usize);
        let counted = Callback::<Host>::new(
            |l: Layout| {
                let p = HEAP.allocate_sync(l)?;
                *live.lock().unwrap() += l.size();
                Ok(p)
            },
            |p: NonNull<u8>, l: Layout| {
                *live.lock().unwrap() -= l.size();
                // SAFETY: `p` came from `HEAP` with `l` in the closure above.
                unsafe { HEAP.deallocate_sync(p, l) }
            },
        );
        let caps = Caps::host();
        conformance::zero_bytes(&counted, caps);
        conformance::fixed_sizes(&counted, caps);
        conformance::alignments(&counted, caps);
        conformance::out_of_memory_then_usable(&counted, caps);
        conformance::random_sizes(&counted, caps, 1);
        conformance::mixed_steps(&counted, caps, 2);
        conformance::four_threads(&counted, caps);
        conformance::cross_thread_free(&counted, caps);
        assert_eq!(*live.lock().unwrap(), 0);
    }
}
