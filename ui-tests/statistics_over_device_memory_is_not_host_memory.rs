// Rule: an adaptor keeps exactly its upstream's properties: counting `Cuda` memory does
// not make it host-accessible, so host code cannot ask for it.
use memres::adaptor::Statistics;
use memres::{Cuda, Has, HostAccessible};

fn fill_from_the_host<R: Has<HostAccessible>>(_resource: &R) {}

fn main() {
    let counted = Statistics::new(Cuda::new().unwrap());
    fill_from_the_host(&counted);
}
