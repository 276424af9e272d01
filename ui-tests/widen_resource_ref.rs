// Rule: a `ResourceRef` can be narrowed to a subset of its properties, never widened: a
// `ResourceRef<Device>` does not promise host access, so it cannot become a
// `ResourceRef<HostDevice>`.
use memres::{Device, HostDevice, ResourceRef};

fn widen(device_only: ResourceRef<'_, Device>) -> ResourceRef<'_, HostDevice> {
    device_only.narrow()
}

fn main() {
    let _ = widen;
}
