// Rule: `HostAllocator` (collections writing from the host) takes only host-accessible
// resources; device-only memory (`Cuda`) is refused.
use memres::container::HostAllocator;

// Keeps `memres::Cuda` spelled out in the expected message on every machine.
#[allow(dead_code)]
struct Cuda;

fn main() -> Result<(), memres::Error> {
    let _allocator = HostAllocator::new(memres::Cuda::new()?);
    Ok(())
}
