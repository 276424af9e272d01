//! The conformance suite: one set of cases that every memory resource must pass.
//!
//! It mirrors RMM's shared memory-resource tests. Instantiate it for a resource with
//! [`conformance_tests!`], which makes one `#[test]` per case:
//!
//! ```ignore
//! #[macro_use]
//! mod conformance;
//! conformance_tests!(host_heap, HostHeap::new(), Caps::host());
//! conformance_tests!(#[ignore = "needs a CUDA GPU"] cuda, Cuda::new().unwrap(), Caps::gpu());
//! ```
//!
//! Every case runs twice: through `allocate_sync`/`deallocate_sync` and through the
//! stream-ordered `allocate`/`deallocate` on `Caps::streams`. Resources that are only
//! `SyncResource`s go through [`SyncOnly`], which makes both halves use the sync calls.
//!
//! Every live block of every driver in the process is kept in one registry of address
//! ranges, so two blocks that overlap are caught whichever threads, cases or resources
//! they came from (all are real memory of one address space). Where the resource's type
//! says its memory is host-accessible, the cases also write a tag at both ends of every
//! block and check it before freeing.

#![allow(dead_code, unreachable_pub)]

use std::alloc::Layout;
use std::collections::BTreeMap;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Mutex, OnceLock, mpsc};

use memres::stream::{StreamFlags, StreamPool};
use memres::{
    Error, HostAccessible, Resource, StreamRef, SyncResource, layout, property::PropertySet,
};
use typenum::Unsigned;

/// What a resource can do, and how to drive it.
#[derive(Debug, Clone, Copy)]
pub struct Caps {
    /// Two streams for the stream-ordered half of each case; the cross-stream case
    /// allocates on the first and frees on the second (after the first's work is done).
    pub streams: [StreamRef<'static>; 2],
    /// The largest single allocation the fixed-size case asks for (64 MiB on the host,
    /// 1 GiB on a GPU).
    pub largest: usize,
    /// The largest alignment the resource honours; above it, `InvalidArgument` is expected.
    pub max_alignment: usize,
    /// Streams for the threads of `four_threads`, two each (GPU: each thread on its own
    /// streams); `None` shares `streams`.
    pub thread_streams: Option<&'static StreamPool>,
    /// The largest request the resource serves (a fixed block size); above it,
    /// `InvalidArgument` is expected. `None`: any size, memory permitting.
    pub max_size: Option<usize>,
}

impl Caps {
    /// A host resource: two host streams, 64 MiB, any alignment.
    pub fn host() -> Self {
        Caps {
            streams: [StreamRef::host(1), StreamRef::host(2)],
            largest: 64 << 20,
            max_alignment: usize::MAX,
            thread_streams: None,
            max_size: None,
        }
    }

    /// A GPU resource honouring alignments up to `max_alignment`: two non-blocking streams
    /// (and two more for each of four threads), 1 GiB blocks.
    pub fn gpu(max_alignment: usize) -> Self {
        static STREAMS: OnceLock<StreamPool> = OnceLock::new();
        let pool = STREAMS.get_or_init(|| {
            StreamPool::with_size(10, StreamFlags::NonBlocking).expect("streams on the GPU")
        });
        Caps {
            streams: [pool.get_by_id(0), pool.get_by_id(1)],
            largest: 1 << 30,
            max_alignment,
            thread_streams: Some(pool),
            max_size: None,
        }
    }

    /// GPU cases run one resource at a time: run all at once, the pools (which keep what
    /// they reserve) and 1 GiB blocks of a dozen tests would exhaust the device and turn
    /// the run into a crawl of out-of-memory retries. Host cases run in parallel.
    pub fn serialise(&self) -> Option<std::sync::MutexGuard<'static, ()>> {
        static GPU: Mutex<()> = Mutex::new(());
        self.thread_streams.map(|_| {
            GPU.lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
        })
    }

    /// The caps for thread `t` of `four_threads`.
    /// A resource of fixed blocks of `block` bytes, aligned to 256: the largest request
    /// is one block, larger ones and larger alignments are refused.
    pub fn fixed_blocks(self, block: usize) -> Self {
        Caps {
            largest: block,
            max_alignment: 256,
            max_size: Some(block),
            ..self
        }
    }

    fn for_thread(self, t: usize) -> Self {
        match self.thread_streams {
            Some(pool) => Caps {
                streams: [pool.get_by_id(2 + 2 * t), pool.get_by_id(3 + 2 * t)],
                ..self
            },
            None => self,
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
        [Api::Sync, Api::Stream(caps.streams[0])]
    }
}

/// True when `R`'s type says its memory is host-accessible, so the suite may touch it.
pub fn host_accessible<R: SyncResource>() -> bool {
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

/// Tags come from one counter for all drivers, so blocks of different drivers (and threads)
/// carry different tags.
static NEXT_TAG: AtomicU8 = AtomicU8::new(1);

/// Every live non-empty block in the process: start address -> size.
static LIVE: Mutex<BTreeMap<usize, usize>> = Mutex::new(BTreeMap::new());

fn live() -> std::sync::MutexGuard<'static, BTreeMap<usize, usize>> {
    // A case that panicked (on purpose, in `the_suite_catches`) may poison it; the map
    // itself is always consistent between operations.
    LIVE.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Records a new block, panicking if it overlaps any live block.
fn register(block: &Block) {
    let size = block.layout.size();
    if size == 0 {
        return; // dangling, and may share its address with other empty blocks
    }
    if size >= HUGE {
        // Only a lying resource serves it (the suite then fails that case as "succeeded");
        // in the registry, shared by every test of the process, its span would make other
        // tests' real blocks overlap it meanwhile (a CI run's `random_sizes`, 2026-11-28).
        return;
    }
    let mut live = live();
    if let Some((&start, &len)) = live.range(..=block.address).next_back() {
        assert!(
            start + len <= block.address,
            "{block:?} overlaps the live block [{start:#x}, +{len})"
        );
    }
    if let Some((&start, &len)) = live.range(block.address..).next() {
        assert!(
            block.address + size <= start,
            "{block:?} overlaps the live block [{start:#x}, +{len})"
        );
    }
    live.insert(block.address, size);
}

fn unregister(block: &Block) {
    if block.layout.size() > 0 && block.layout.size() < HUGE {
        live().remove(&block.address);
    }
}

/// Drives one resource through one API, checking every block it hands out.
pub struct Driver<'r, R: Resource> {
    pub resource: &'r R,
    pub api: Api,
    touch: bool,
}

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
        let block = Block {
            address,
            layout,
            tag: NEXT_TAG.fetch_add(1, Ordering::Relaxed),
        };
        register(&block);
        if self.touch && layout.size() > 0 {
            if let Api::Stream(s) = self.api {
                // Stream-ordered memory is the host's only once the stream has got there.
                s.synchronize()
                    .expect("synchronising the allocation's stream");
            }
            // SAFETY: the resource's type says the memory is host-accessible, and the
            // block covers `layout.size()` bytes from `ptr`; it is ours until freed.
            unsafe {
                ptr.as_ptr().write(block.tag);
                ptr.as_ptr().add(layout.size() - 1).write(block.tag);
            }
        }
        Ok(block)
    }

    pub fn allocate(&mut self, layout: Layout) -> Block {
        self.try_allocate(layout)
            .unwrap_or_else(|e| panic!("allocating {layout:?} through {:?}: {e}", self.api))
    }

    /// Checks the tag and frees the block, on this driver's stream.
    pub fn free(&mut self, block: Block) {
        let stream = match self.api {
            Api::Sync => None,
            Api::Stream(s) => Some(s),
        };
        self.free_on(block, stream);
    }

    /// Checks the tag and frees the block on `stream` (`None`: through the sync call).
    pub fn free_on(&mut self, block: Block, stream: Option<StreamRef<'static>>) {
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
        unregister(&block);
        match stream {
            // SAFETY: the block came from this resource with this layout and is freed
            // once; the suite's host work on it is done and it never enqueued stream work.
            None => unsafe { self.resource.deallocate_sync(ptr, block.layout) },
            // SAFETY: as above.
            Some(s) => unsafe { self.resource.deallocate(s, ptr, block.layout) },
        }
    }
}

/// The live blocks of one driver: a list to pick from.
#[derive(Default)]
pub struct Blocks(Vec<Block>);

impl Blocks {
    pub fn push(&mut self, block: Block) {
        self.0.push(block);
    }

    /// Removes and returns the block at `i` (swap-remove).
    pub fn take(&mut self, i: usize) -> Block {
        self.0.swap_remove(i)
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Frees every block through `driver`.
    pub fn free_all<R: Resource>(&mut self, driver: &mut Driver<'_, R>) {
        while let Some(block) = self.0.pop() {
            driver.free(block);
        }
    }
}

/// Makes a [`SyncResource`] look like a [`Resource`] whose stream-ordered calls are its sync
/// calls, so sync-only resources go through the same suite.
#[derive(Debug, PartialEq)]
pub struct SyncOnly<R>(pub R);

// SAFETY: memory from `allocate_sync` is usable at once, so in any stream order; a free
// through `deallocate_sync` is correct once the caller's stream work is done, which the
// suite's frees are (it never enqueues stream work).
unsafe impl<R: SyncResource> SyncResource for SyncOnly<R> {
    type Properties = R::Properties;
    fn allocate_sync(&self, l: Layout) -> Result<NonNull<u8>, Error> {
        self.0.allocate_sync(l)
    }
    unsafe fn deallocate_sync(&self, p: NonNull<u8>, l: Layout) {
        // SAFETY: forwards the caller's promise.
        unsafe { self.0.deallocate_sync(p, l) }
    }
}

// SAFETY: see the `SyncResource` impl.
unsafe impl<R: SyncResource> Resource for SyncOnly<R> {
    fn allocate(&self, _: StreamRef<'_>, l: Layout) -> Result<NonNull<u8>, Error> {
        self.0.allocate_sync(l)
    }
    unsafe fn deallocate(&self, _: StreamRef<'_>, p: NonNull<u8>, l: Layout) {
        // SAFETY: forwards the caller's promise (see the impl's comment).
        unsafe { self.0.deallocate_sync(p, l) }
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
                        live.push(block);
                        assert!(align <= caps.max_alignment, "{l:?} should be refused");
                    }
                    Err(Error::InvalidArgument(_)) if align > caps.max_alignment => {}
                    Err(e) => panic!("{l:?} through {api:?}: {e}"),
                }
            }
        }
        live.free_all(&mut d);
    }
}

/// 1 PiB is `OutOfMemory` naming the size, and the resource still serves requests.
pub fn out_of_memory_then_usable<R: Resource>(r: &R, caps: Caps) {
    for api in Api::both(caps) {
        let mut d = Driver::new(r, api);
        let keep = d.allocate(layout(1 << 10).unwrap());
        match d.try_allocate(layout(HUGE).unwrap()) {
            Err(Error::OutOfMemory { requested, .. }) => assert_eq!(requested, HUGE),
            Err(Error::InvalidArgument(_)) if caps.max_size.is_some_and(|m| m < HUGE) => {}
            Err(e) => panic!("1 PiB through {api:?}: expected OutOfMemory, got {e:?}"),
            Ok(block) => {
                d.free(block);
                panic!("1 PiB ({HUGE} bytes) through {api:?} succeeded");
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

/// Every case from 4 threads at once, on one shared resource. On a GPU each thread gets
/// its own caps (its own streams).
pub fn four_threads<R: Resource + Sync>(r: &R, caps: Caps) {
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let caps = caps.for_thread(t as usize);
            s.spawn(move || {
                zero_bytes(r, caps);
                fixed_sizes(r, caps);
                alignments(r, caps);
                out_of_memory_then_usable(r, caps);
                random_sizes(r, caps, 1000 + t);
                mixed_steps(r, caps, 2000 + t);
                cross_stream_free(r, caps);
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

/// Memory allocated on stream A is freed on stream B after B has been made to wait for A
/// (an event recorded on A), then reused on B.
pub fn cross_stream_free<R: Resource>(r: &R, caps: Caps) {
    let [a, b] = caps.streams;
    let mut d = Driver::new(r, Api::Stream(a));
    let mut state = 11;
    let mut live = Blocks::default();
    for _ in 0..32 {
        let size = 1 + (splitmix64(&mut state) % (64 << 10)) as usize;
        live.push(d.allocate(layout(size).unwrap()));
    }
    if !a.is_host() {
        let done_on_a = memres::stream::Event::new().expect("an event");
        done_on_a.record(a).expect("recording on A");
        b.wait_for(&done_on_a).expect("B waits for A");
    }
    while let Some(block) = live.0.pop() {
        d.free_on(block, Some(b));
    }
    let mut on_b = Driver::new(r, Api::Stream(b));
    for _ in 0..32 {
        let size = 1 + (splitmix64(&mut state) % (64 << 10)) as usize;
        live.push(on_b.allocate(layout(size).unwrap()));
    }
    live.free_all(&mut on_b);
}

/// Equality: a resource equals itself, and where two instances compare equal, memory from
/// one is freed through the other.
#[allow(clippy::eq_op)] // reflexivity is the point
pub fn equality<R: Resource>(one: &R, other: &R, caps: Caps) {
    assert!(one == one, "a resource must equal itself");
    assert_eq!(one == other, other == one, "equality must be symmetric");
    if one == other {
        for api in Api::both(caps) {
            let block = Driver::new(one, api).allocate(layout(4096).unwrap());
            Driver::new(other, api).free(block);
        }
    }
}

/// Every case, one after the other, on one resource (for resources that cannot go
/// through [`conformance_tests!`], such as ones that may be unsupported on a machine).
pub fn every_case<R: Resource + Sync>(r: &R, other: &R, caps: Caps) {
    zero_bytes(r, caps);
    fixed_sizes(r, caps);
    alignments(r, caps);
    out_of_memory_then_usable(r, caps);
    random_sizes(r, caps, 42);
    mixed_steps(r, caps, 43);
    four_threads(r, caps);
    cross_thread_free(r, caps);
    cross_stream_free(r, caps);
    equality(r, other, caps);
}

/// Makes one `#[test]` per conformance case for a resource.
///
/// `conformance_tests!($(#[attr])* name, make_resource_expr, caps_expr);` The expression
/// is evaluated afresh in each test (twice for the equality case).
#[macro_export]
macro_rules! conformance_tests {
    ($(#[$attr:meta])* $name:ident, $make:expr, $caps:expr $(,)?) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;

            $crate::conformance_tests!(@cases [$(#[$attr])*] $make, $caps;
                zero_bytes, fixed_sizes, alignments, out_of_memory_then_usable,
                four_threads, cross_thread_free, cross_stream_free);

            $(#[$attr])*
            #[test]
            fn random_sizes() {
                let _serial = $caps.serialise();
                let resource = $make;
                $crate::conformance::random_sizes(&resource, $caps, 42);
            }

            $(#[$attr])*
            #[test]
            fn mixed_steps() {
                let _serial = $caps.serialise();
                let resource = $make;
                $crate::conformance::mixed_steps(&resource, $caps, 43);
            }

            $(#[$attr])*
            #[test]
            fn equality() {
                let _serial = $caps.serialise();
                let (one, other) = ($make, $make);
                $crate::conformance::equality(&one, &other, $caps);
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
            let _serial = $caps.serialise();
            let resource = $make;
            $crate::conformance::$case(&resource, $caps);
        }
    };
}
