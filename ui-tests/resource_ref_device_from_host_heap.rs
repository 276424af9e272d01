// Rule: a `ResourceRef<P>` is built only from a resource whose property set contains `P`;
// `HostHeap` memory is not device-accessible, so it cannot back a `ResourceRef<Device>`.
use memres::{Device, HostHeap, ResourceRef};

fn main() {
    let heap = HostHeap::new();
    let _device: ResourceRef<'_, Device> = ResourceRef::new(&heap);
}
