// Rule: code that hands memory to the GPU bounds its resource `R: Has<DeviceAccessible>`,
// and a host-only resource such as `HostHeap` does not satisfy it.
use memres::{DeviceAccessible, Has, HostHeap};

fn launch_kernel_on<R: Has<DeviceAccessible>>(_resource: &R) {}

fn main() {
    launch_kernel_on(&HostHeap::new());
}
