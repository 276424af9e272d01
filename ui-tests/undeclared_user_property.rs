// Rule: a property of the user's own is checked like the built-in ones: a resource that
// does not list it in `type Properties` does not have it.
use memres::property::{Property, PropertySet};
use memres::Has;
use memres::HostHeap;

/// Memory that is zeroed when handed out.
struct Zeroed;
// SAFETY: bit 8 is used by no other property in this program.
unsafe impl PropertySet for Zeroed {
    type Mask = typenum::U256;
}
impl Property for Zeroed {}

fn needs_zeroed<R: Has<Zeroed>>(_resource: &R) {}

fn main() {
    needs_zeroed(&HostHeap::new());
}
