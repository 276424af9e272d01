// Rule: an `AnyResource` is `Send + Sync` and may be used from any thread, so it can only
// own a resource that is `Send + Sync`. This `Callback` counts through an `Rc<Cell<_>>`,
// which must stay on one thread.
use std::alloc::Layout;
use std::cell::Cell;
use std::ptr::NonNull;
use std::rc::Rc;

use memres::{AnyResource, Callback, Host, HostHeap, SyncResource};

fn main() {
    let calls = Rc::new(Cell::new(0));
    let counting = Callback::<Host>::new(
        move |l: Layout| {
            calls.set(calls.get() + 1);
            HostHeap.allocate_sync(l)
        },
        // SAFETY: pointers came from `HostHeap` with their layout.
        |p: NonNull<u8>, l: Layout| unsafe { HostHeap.deallocate_sync(p, l) },
    );
    let _any: AnyResource<Host> = AnyResource::new(counting);
}
