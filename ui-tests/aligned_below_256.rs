// Rule: an alignment fixed in the type must be at least 256 bytes, CUDA's own alignment:
// a smaller power of two does not compile.
use memres::HostHeap;
use memres::adaptor::Aligned;

fn main() {
    let _bad = Aligned::with_alignment::<typenum::U128>(HostHeap::new(), 0);
}
