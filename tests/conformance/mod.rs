//! The conformance suite: one set of cases that every memory resource must pass.
//!
//! It mirrors RMM's shared memory-resource tests. Instantiate it for a resource with
//! [`conformance_tests!`], which makes one `#[test]` per case:
//!
//! ```ignore
//! #[macro_use]
//! mod conformance;
//! conformance_tests!(host_heap, HostHeap::new(), Caps::host());
//! conformance_tests!(#[ignore = "needs a CUDA GPU"] cuda, Cuda::new()?, Caps::gpu(stream));
//! ```
//!
//! Every case runs twice: through `allocate_sync`/`deallocate_sync` and through the
//! stream-ordered `allocate`/`deallocate` on `Caps::stream`. Where the resource's type says
//! its memory is host-accessible, the cases also write a tag into every allocation and
//! check it before freeing, which catches overlapping blocks across threads too.

#![allow(dead_code, unreachable_pub)]

use std::alloc::Layout;
use std::collections::BTreeMap;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::mpsc;

use memres::{Error, HostAccessible, PropertySet, Resource, StreamRef, layout};
use typenum::Unsigned;

/// What a resource can do, and how to drive it.
#[derive(Debug, Clone, Copy)]
pub struct Caps {
    /// The stream the stream-ordered half of each case uses.
    pub stream: StreamRef<'static>,
    /// The largest single allocation the fixed-size case asks for (64 MiB on the host,
    /// 1 GiB on a GPU).
    pub largest: usize,
    /// The largest alignment the resource honours; above it, `InvalidArgument` is expected.
    pub max_alignment: usize,
}

impl Caps {
    /// A host resource: host stream, 64 MiB, any alignment.
    pub fn host() -> Self {
        Caps {
            stream: StreamRef::HOST,
            largest: 64 << 20,
            max_alignment: usize::MAX,
        }
    }
}

/// 1 PiB: more than any machine has.
pub const HUGE: usize = 1 << 50;

/// The next draw of splitmix64 (the generator of `shared/bench/WORKLOADS.md`).
pub fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Which half of the API a case goes through.
#[derive(Debug, Clone, Copy)]
pub enum Api {
    Sync,
    Stream(StreamRef<'static>),
}

impl Api {
    pub fn both(caps: Caps) -> [Api; 2] {
        [Api::Sync, Api::Stream(caps.stream)]
    }
}

/// True when `R`'s type says its memory is host-accessible, so the suite may touch it.
pub fn host_accessible<R: Resource>() -> bool {
    let mask = <<R::Properties as PropertySet>::Mask as Unsigned>::USIZE;
    let host = <<HostAccessible as PropertySet>::Mask as Unsigned>::USIZE;
    mask & host == host
}

/// A live allocation and the tag written into it.
#[derive(Debug, Clone, Copy)]
pub struct Block {
    pub address: usize,
    pub layout: Layout,
    pub tag: u8,
}

/// Drives one resource through one API, checking every block it hands out.
pub struct Driver<'r, R: Resource> {
    pub resource: &'r R,
    pub api: Api,
    touch: bool,
}

/// Tags come from one counter for all drivers, so that blocks of different drivers (and
/// threads) carry different tags and an overlap between them shows.
static NEXT_TAG: AtomicU8 = AtomicU8::new(1);

impl<'r, R: Resource> Driver<'r, R> {
    pub fn new(resource: &'r R, api: Api) -> Self {
        Driver {
            resource,
            api,
            touch: host_accessible::<R>(),
        }
    }

    /// Allocates `layout`, checks the pointer's alignment and tags the memory.
    pub fn try_allocate(&mut self, layout: Layout) -> Result<Block, Error> {
        let ptr = match self.api {
            Api::Sync => self.resource.allocate_sync(layout)?,
            Api::Stream(s) => self.resource.allocate(s, layout)?,
        };
        let address = ptr.as_ptr() as usize;
        assert!(
            address.is_multiple_of(layout.align()),
            "{address:#x} is not aligned to {} ({:?})",
            layout.align(),
            self.api
        );
        let tag = NEXT_TAG.fetch_add(1, Ordering::Relaxed);
        if self.touch && layout.size() > 0 {
            // SAFETY: the resource's type says the memory is host-accessible, and the
            // block covers `layout.size()` bytes from `ptr`; it is ours until freed.
            unsafe {
                ptr.as_ptr().write(tag);
                ptr.as_ptr().add(layout.size() - 1).write(tag);
            }
        }
        Ok(Block {
            address,
            layout,
            tag,
        })
    }

    pub fn allocate(&mut self, layout: Layout) -> Block {
        self.try_allocate(layout)
            .unwrap_or_else(|e| panic!("allocating {layout:?} through {:?}: {e}", self.api))
    }

    /// Checks the tag and frees the block.
    pub fn free(&mut self, block: Block) {
        let ptr = NonNull::new(block.address as *mut u8).expect("blocks are never null");
        if self.touch && block.layout.size() > 0 {
            // SAFETY: as in `try_allocate`; the block is still live.
            let (first, last) = unsafe {
                (
                    ptr.as_ptr().read(),
                    ptr.as_ptr().add(block.layout.size() - 1).read(),
                )
            };
            assert_eq!(
                (first, last),
                (block.tag, block.tag),
                "block {block:?} was overwritten: another block overlaps it"
            );
        }
        match self.api {
            // SAFETY: the block came from this resource with this layout and is freed once;
            // host work on it is done and no stream work was ever enqueued on it.
            Api::Sync => unsafe { self.resource.deallocate_sync(ptr, block.layout) },
            // SAFETY: as above, on the stream it was allocated on.
            Api::Stream(s) => unsafe { self.resource.deallocate(s, ptr, block.layout) },
        }
    }
}

/// The live blocks of one driver, checked for overlap as they come: a list plus an index
/// by address (zero-size blocks are dangling and may share addresses, so they are listed
/// but not indexed).
#[derive(Default)]
pub struct Blocks {
    list: Vec<Block>,
    index: BTreeMap<usize, usize>,
}

impl Blocks {
    /// Adds a block, asserting it overlaps no live block.
    pub fn push(&mut self, block: Block) {
        let size = block.layout.size();
        if size > 0 {
            if let Some((&start, &len)) = self.index.range(..=block.address).next_back() {
                assert!(
                    start + len <= block.address,
                    "{block:?} overlaps [{start:#x}, +{len})"
                );
            }
            if let Some((&start, _)) = self.index.range(block.address..).next() {
                assert!(
                    block.address + size <= start,
                    "{block:?} overlaps block at {start:#x}"
                );
            }
            self.index.insert(block.address, size);
        }
        self.list.push(block);
    }

    /// Removes and returns the block at `i` (swap-remove).
    pub fn take(&mut self, i: usize) -> Block {
        let block = self.list.swap_remove(i);
        if block.layout.size() > 0 {
            self.index.remove(&block.address);
        }
        block
    }

    pub fn len(&self) -> usize {
        self.list.len()
    }

    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// Frees every block through `driver`.
    pub fn free_all<R: Resource>(&mut self, driver: &mut Driver<'_, R>) {
        while !self.is_empty() {
            let block = self.take(self.len() - 1);
            driver.free(block);
        }
    }
}

// ---------------------------------------------------------------------------------------
// The cases. Each takes the resource and its caps, and runs through both APIs.

/// Zero bytes: succeeds, aligned, and freeing it does not fail.
pub fn zero_bytes<R: Resource>(r: &R, caps: Caps) {
    for api in Api::both(caps) {
        let mut d = Driver::new(r, api);
        for align in [1, 256, 4096] {
            let block = d.allocate(Layout::from_size_align(0, align).unwrap());
            d.free(block);
        }
    }
}

/// 4 B, 1 KiB, 1 MiB and the largest size: each non-null and aligned, all live at once.
pub fn fixed_sizes<R: Resource>(r: &R, caps: Caps) {
    for api in Api::both(caps) {
        let mut d = Driver::new(r, api);
        let mut live = Blocks::default();
        for size in [4, 1 << 10, 1 << 20, caps.largest] {
            live.push(d.allocate(layout(size).unwrap()));
        }
        live.free_all(&mut d);
    }
}

/// Alignments 16 to 4096 are honoured where supported, else `InvalidArgument`.
pub fn alignments<R: Resource>(r: &R, caps: Caps) {
    for api in Api::both(caps) {
        let mut d = Driver::new(r, api);
        let mut live = Blocks::default();
        for shift in 4..=12 {
            let align = 1usize << shift;
            for size in [1, align - 1, align, 3 * align + 1] {
                let l = Layout::from_size_align(size, align).unwrap();
                match d.try_allocate(l) {
                    Ok(block) => {
                        assert!(align <= caps.max_alignment, "{l:?} should be refused");
                        live.push(block);
                    }
                    Err(Error::InvalidArgument(_)) if align > caps.max_alignment => {}
                    Err(e) => panic!("{l:?} through {api:?}: {e}"),
                }
            }
        }
        live.free_all(&mut d);
    }
}

/// 1 PiB is `OutOfMemory`, and the resource still serves requests afterwards.
pub fn out_of_memory_then_usable<R: Resource>(r: &R, caps: Caps) {
    for api in Api::both(caps) {
        let mut d = Driver::new(r, api);
        let keep = d.allocate(layout(1 << 10).unwrap());
        match d.try_allocate(layout(HUGE).unwrap()) {
            Err(Error::OutOfMemory { requested, .. }) => {
                assert!(
                    requested == HUGE || requested == 0,
                    "requested = {requested}"
                )
            }
            Err(e) => panic!("1 PiB through {api:?}: expected OutOfMemory, got {e:?}"),
            Ok(block) => {
                d.free(block);
                panic!("1 PiB through {api:?} succeeded");
            }
        }
        let after = d.allocate(layout(1 << 20).unwrap());
        d.free(after);
        d.free(keep);
    }
}

/// 100 allocations of sizes uniform in [1, 5 MiB], then all freed.
pub fn random_sizes<R: Resource>(r: &R, caps: Caps, seed: u64) {
    for api in Api::both(caps) {
        let mut d = Driver::new(r, api);
        let mut state = seed;
        let mut live = Blocks::default();
        for _ in 0..100 {
            let size = 1 + (splitmix64(&mut state) % (5 << 20)) as usize;
            live.push(d.allocate(layout(size).unwrap()));
        }
        live.free_all(&mut d);
    }
}

/// 200 mixed steps: allocate with probability 0.53 while fewer than 100 are live, else
/// free a random live block; whatever is live at the end is freed.
pub fn mixed_steps<R: Resource>(r: &R, caps: Caps, seed: u64) {
    for api in Api::both(caps) {
        let mut d = Driver::new(r, api);
        let mut state = seed;
        let mut live = Blocks::default();
        for _ in 0..200 {
            let allocate = splitmix64(&mut state) % 100 < 53;
            if live.is_empty() || (allocate && live.len() < 100) {
                let size = 1 + (splitmix64(&mut state) % (1 << 20)) as usize;
                live.push(d.allocate(layout(size).unwrap()));
            } else {
                let i = (splitmix64(&mut state) % live.len() as u64) as usize;
                let block = live.take(i);
                d.free(block);
            }
        }
        live.free_all(&mut d);
    }
}

/// The random and mixed cases from 4 threads at once, on one shared resource.
pub fn four_threads<R: Resource + Sync>(r: &R, caps: Caps) {
    std::thread::scope(|s| {
        for t in 0..4u64 {
            s.spawn(move || {
                fixed_sizes(r, caps);
                random_sizes(r, caps, 1000 + t);
                mixed_steps(r, caps, 2000 + t);
            });
        }
    });
}

/// Memory allocated on one thread is freed on another.
pub fn cross_thread_free<R: Resource + Sync>(r: &R, caps: Caps) {
    for api in Api::both(caps) {
        let (tx, rx) = mpsc::channel::<Block>();
        std::thread::scope(|s| {
            s.spawn(move || {
                let mut d = Driver::new(r, api);
                let mut state = 7;
                for _ in 0..64 {
                    let size = 1 + (splitmix64(&mut state) % (256 << 10)) as usize;
                    tx.send(d.allocate(layout(size).unwrap())).unwrap();
                }
            });
            s.spawn(move || {
                let mut d = Driver::new(r, api);
                let mut freed = 0;
                for block in rx {
                    d.free(block);
                    freed += 1;
                }
                assert_eq!(freed, 64);
            });
        });
    }
}

/// A resource equals itself (memory from it may be freed by it).
#[allow(clippy::eq_op)] // reflexivity is the point
pub fn equals_itself<R: Resource>(r: &R, _caps: Caps) {
    assert!(r == r);
}

/// Makes one `#[test]` per conformance case for a resource.
///
/// `conformance_tests!($(#[attr])* name, make_resource_expr, caps_expr);` The expression
/// is evaluated afresh in each test.
#[macro_export]
macro_rules! conformance_tests {
    ($(#[$attr:meta])* $name:ident, $make:expr, $caps:expr $(,)?) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;

            $crate::conformance_tests!(@cases [$(#[$attr])*] $make, $caps;
                zero_bytes, fixed_sizes, alignments, out_of_memory_then_usable,
                four_threads, cross_thread_free, equals_itself);

            $(#[$attr])*
            #[test]
            fn random_sizes() {
                let resource = $make;
                $crate::conformance::random_sizes(&resource, $caps, 42);
            }

            $(#[$attr])*
            #[test]
            fn mixed_steps() {
                let resource = $make;
                $crate::conformance::mixed_steps(&resource, $caps, 43);
            }
        }
    };
    (@cases $attrs:tt $make:expr, $caps:expr; $($case:ident),*) => {$(
        $crate::conformance_tests!(@case $attrs $case, $make, $caps);
    )*};
    (@case [$($attr:tt)*] $case:ident, $make:expr, $caps:expr) => {
        $($attr)*
        #[test]
        fn $case() {
            let resource = $make;
            $crate::conformance::$case(&resource, $caps);
        }
    };
}
