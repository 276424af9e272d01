// Rule: freeing memory is `unsafe`: only the caller can promise the pointer came from this
// resource with this layout, is freed once, and is no longer in use.
use memres::{HostHeap, SyncResource, layout};

fn main() {
    let heap = HostHeap::new();
    let l = layout(64).unwrap();
    let p = heap.allocate_sync(l).unwrap();
    heap.deallocate_sync(p, l);
}
