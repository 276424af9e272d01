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
