// Rule: an `AnyResource` is `Send + Sync` and may be used from any thread, so it can only
// own a resource that is `Send + Sync`. This `Callback` counts through an `Rc<Cell<_>>`,
// which must stay on one thread.
use std::alloc::Layout;
use std::cell::Cell;
use std::ptr::NonNull;
use std::rc::Rc;

use memres::{AnyResource, Host, HostHeap, StreamRef, SyncResource, upstream::Callback};

fn main() {
    let calls = Rc::new(Cell::new(0));
    let allocate = move |l: Layout, _: StreamRef<'_>| {
        calls.set(calls.get() + 1);
        HostHeap.allocate_sync(l)
    };
    // SAFETY: `Callback` passes back only blocks from `allocate`, from `HostHeap`.
    let deallocate = |p: NonNull<u8>, l: Layout, _: StreamRef<'_>| unsafe {
        HostHeap.deallocate_sync(p, l)
    };
    // SAFETY: heap memory, host-accessible and usable at once on any stream.
    let counting = unsafe { Callback::<Host>::new(allocate, deallocate) };
    let _any: AnyResource<Host> = AnyResource::new(counting);
}
