// The spec target's code, shared by the fuzz target (`fuzz/fuzz_targets/spec.rs`) and the
// corpus replay of `cargo test` (`tests/fuzz_corpus.rs`), which `include!` it.
//
// Arbitrary text through the spec language: a spec or an error with a message, never a
// panic, and the same answer twice. A spec small enough to build on the host (no log
// files, sizes of at most 64 MiB) is built by the library's builder over host memory and
// serves a request, or refuses the spec with an error.

use memres::spec::{LeafOptions, Spec, Target};
use memres::upstream::HostPages;
use memres::{AnyResource, Error, Host, HostHeap, Resource, StreamRef, upstream::HostVirtual};

/// The most a spec built here may ask for, per size.
const MOST: usize = 64 << 20;

/// Host memory: heap blocks, and a reservation of 64 KiB granules.
struct OnTheHost;

impl Target for OnTheHost {
    type Properties = Host;
    type Memory = HostHeap;
    type Backend = HostPages;

    fn memory(&mut self) -> Result<HostHeap, Error> {
        Ok(HostHeap)
    }

    fn virtual_leaf(&mut self, leaf: &LeafOptions) -> Result<HostVirtual, Error> {
        HostVirtual::new(leaf.reserve.unwrap_or(MOST), leaf.granule.unwrap_or(64 << 10))
    }

    fn arena_size(&mut self) -> Result<usize, Error> {
        Ok(4 << 20)
    }
}

/// Whether `spec` can be built here: no log files written, no size past [`MOST`].
fn small(spec: &Spec) -> bool {
    let fits = |size: &Option<usize>| size.is_none_or(|s| s <= MOST);
    match spec {
        Spec::Logging { .. } => false,
        Spec::Statistics(inner) | Spec::Limiting { inner, .. } => small(inner),
        Spec::Fallback { first, then } => small(first) && small(then),
        Spec::Pool { initial, max, .. } => fits(initial) && fits(max),
        Spec::VirtualPool {
            initial,
            max,
            step,
            release,
            reserve,
            granule,
        } => [initial, max, step, release, reserve, granule].into_iter().all(fits),
        Spec::Arena { size } => fits(size),
        // Blocks are rounded up to 256 bytes: `block=2B,blocks=18999999` takes 4.9 GB.
        Spec::FixedSize { block, blocks } => {
            (*block).max(256).saturating_add(255).saturating_mul(*blocks) <= MOST
        }
        Spec::Binning { max, .. } => *max <= 20,
        _ => true,
    }
}

pub(crate) fn run(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let spec = match Spec::parse(text) {
        Ok(spec) => spec,
        Err(e) => {
            assert!(!e.message().is_empty());
            return;
        }
    };
    assert_eq!(Spec::parse(text).ok(), Some(spec.clone()));
    if !small(&spec) {
        return;
    }
    let stack: AnyResource<Host> = match spec.build(&mut OnTheHost) {
        Ok(stack) => stack,
        Err(e) => {
            assert!(!e.to_string().is_empty());
            return;
        }
    };
    let l = memres::layout(4096).unwrap();
    if let Ok(p) = stack.allocate(StreamRef::HOST, l) {
        // SAFETY: allocated just above with `l` on the same stream; written within it,
        // then not used after the free.
        unsafe {
            p.as_ptr().write_bytes(0xa5, l.size());
            stack.deallocate(StreamRef::HOST, p, l);
        }
    }
}
