//! Writing your own adaptor: a layer that wraps any resource, keeps its properties, and
//! adds one behaviour (here: it counts requests by size class, to see what a program
//! asks for). The same shape as memres's own adaptors (`src/adaptor/profiling.rs` is the
//! smallest).
//!
//! ```sh
//! cargo run --release --example own_adaptor
//! ```
//!
//! Runs on host memory anywhere; over `Cuda` it would count device requests the same way
//! (the adaptor never touches the memory, so it works over any memory).

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

use memres::suballoc::PoolConfig;
use memres::{
    Error, Has, HostAccessible, HostHeap, Resource, ResourceExt, StreamRef, SyncResource,
    layer::Layer, layout,
};

/// Counts allocations in size classes: up to 4 KiB, up to 1 MiB, larger.
struct SizeClasses<U> {
    upstream: U,
    counts: [AtomicU64; 3],
}

impl<U> SizeClasses<U> {
    fn count(&self, size: usize) {
        let class = match size {
            0..=4096 => 0,
            4097..=1_048_576 => 1,
            _ => 2,
        };
        self.counts[class].fetch_add(1, Ordering::Relaxed);
    }

    fn counts(&self) -> [u64; 3] {
        self.counts.each_ref().map(|c| c.load(Ordering::Relaxed))
    }
}

/// Equal when the upstreams are: memory passes through unchanged, so either may free the
/// other's blocks.
impl<U: PartialEq> PartialEq for SizeClasses<U> {
    fn eq(&self, other: &Self) -> bool {
        self.upstream == other.upstream
    }
}

// SAFETY: every block comes from the upstream unchanged and goes back to it unchanged;
// the adaptor only counts. Its properties are the upstream's.
unsafe impl<U: SyncResource> SyncResource for SizeClasses<U> {
    type Properties = U::Properties;

    fn allocate_sync(&self, layout: Layout) -> Result<NonNull<u8>, Error> {
        let p = self.upstream.allocate_sync(layout)?;
        self.count(layout.size());
        Ok(p)
    }

    unsafe fn deallocate_sync(&self, ptr: NonNull<u8>, layout: Layout) {
        // SAFETY: the caller's promise, for the upstream that made the block.
        unsafe { self.upstream.deallocate_sync(ptr, layout) }
    }
}

// SAFETY: as for `SyncResource`, in the caller's stream order.
unsafe impl<U: Resource> Resource for SizeClasses<U> {
    fn allocate(&self, stream: StreamRef<'_>, layout: Layout) -> Result<NonNull<u8>, Error> {
        let p = self.upstream.allocate(stream, layout)?;
        self.count(layout.size());
        Ok(p)
    }

    unsafe fn deallocate(&self, stream: StreamRef<'_>, ptr: NonNull<u8>, layout: Layout) {
        // SAFETY: the caller's promise, for the upstream that made the block.
        unsafe { self.upstream.deallocate(stream, ptr, layout) }
    }
}

/// The layer, so that stacks read top-down: `pool.with(CountSizes)`.
struct CountSizes;

impl<U> Layer<U> for CountSizes {
    type Resource = SizeClasses<U>;

    fn layer(self, upstream: U) -> SizeClasses<U> {
        SizeClasses {
            upstream,
            counts: Default::default(),
        }
    }
}

/// Code that needs host memory accepts the adaptor: it kept the pool's properties.
fn touch<R: Resource + Has<HostAccessible>>(mr: &R, n: usize) -> Result<(), Error> {
    let l = layout(n)?;
    let p = mr.allocate(StreamRef::HOST, l)?;
    // SAFETY: `n` host-accessible bytes, ours until freed just below.
    unsafe {
        p.as_ptr().write_bytes(1, n);
        mr.deallocate(StreamRef::HOST, p, l);
    }
    Ok(())
}

fn main() -> Result<(), Error> {
    let stack = HostHeap::new().pool(PoolConfig::new())?.with(CountSizes);
    for n in [100, 3000, 70_000, 2 << 20, 512, 8 << 20] {
        touch(&stack, n)?;
    }
    let [small, medium, large] = stack.counts();
    println!("requests up to 4 KiB: {small}, up to 1 MiB: {medium}, larger: {large}");
    assert_eq!([small, medium, large], [3, 1, 2]);
    Ok(())
}
