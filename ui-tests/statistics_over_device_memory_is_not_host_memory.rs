// Rule: an adaptor keeps exactly its upstream's properties: counting `Cuda` memory does
// not make it host-accessible, so host code cannot ask for it.
use memres::adaptor::Statistics;
use memres::{Has, HostAccessible};

// rustc prints a type by its bare name only when no other item in the build shares it,
// which varies with what is loaded; this local name keeps `memres::Cuda` spelled out in
// the expected message on every machine.
#[allow(dead_code)]
struct Cuda;

fn fill_from_the_host<R: Has<HostAccessible>>(_resource: &R) {}

fn main() {
    let counted = Statistics::new(memres::Cuda::new().unwrap());
    fill_from_the_host(&counted);
}
