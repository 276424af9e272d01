// Rule: a DeviceVec has host slices only where its resource's memory is host-accessible;
// on device-only memory (`Cuda`) `as_slice` does not compile.
use memres::container::DeviceVec;

// Keeps `memres::Cuda` spelled out in the expected message on every machine (see
// statistics_over_device_memory_is_not_host_memory.rs).
#[allow(dead_code)]
struct Cuda;

fn read_on_host(v: &DeviceVec<'_, f32, memres::Cuda>) -> f32 {
    v.as_slice().unwrap()[0]
}

fn main() {
    let _ = read_on_host;
}
