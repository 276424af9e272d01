// Rule: an alignment fixed in the type must be a power of two of at least 256; any other
// number does not compile (the runtime constructor `Aligned::new` returns an error instead).
use memres::HostHeap;
use memres::adaptor::Aligned;

fn main() {
    let _ok = Aligned::with_alignment::<typenum::U4096>(HostHeap::new(), 0);
    let _bad = Aligned::with_alignment::<typenum::U1000>(HostHeap::new(), 0);
}
