//! Finding a leak with `Tracking`: every live allocation with the call stack that made
//! it, so the one that was never freed names its culprit.
//!
//! ```sh
//! RUST_BACKTRACE=1 cargo run --example find_a_leak
//! ```
//!
//! Runs on host memory anywhere. On a GPU the stack is the same with `Cuda` (or a pool
//! over it) at the bottom: `Tracking::with_stacks(Cuda::new()?.pool(config)?)`.

use memres::adaptor::Tracking;
use memres::suballoc::PoolConfig;
use memres::{Error, HostHeap, Resource, ResourceExt, StreamRef, layout};

/// A "batch" that forgets to free its index buffer when the batch is large.
fn process_batch<R: Resource>(mr: &R, items: usize) -> Result<(), Error> {
    let data = layout(items * 64)?;
    let index = layout(items * 8)?;
    let d = mr.allocate(StreamRef::HOST, data)?;
    let i = mr.allocate(StreamRef::HOST, index)?;
    // SAFETY: both allocated above on the host stream; not used afterwards.
    unsafe {
        mr.deallocate(StreamRef::HOST, d, data);
        if items < 1000 {
            mr.deallocate(StreamRef::HOST, i, index);
        } // the bug: the index of a large batch is never freed
    }
    Ok(())
}

fn main() -> Result<(), Error> {
    let tracked = Tracking::with_stacks(HostHeap::new().pool(PoolConfig::new())?);
    for items in [10, 100, 5000, 20] {
        process_batch(&tracked, items)?;
    }
    let leaks = tracked.outstanding();
    println!(
        "{} allocation(s) still live, {} bytes:",
        leaks.len(),
        tracked.allocated_bytes()
    );
    for leak in &leaks {
        println!("  {:#x}: {} B", leak.address, leak.size);
        // The frames of the allocating stack that are this program's own.
        if let Some(stack) = &leak.stack {
            for line in stack.lines().filter(|l| l.contains("find_a_leak")) {
                println!("    {}", line.trim());
            }
        }
    }
    assert_eq!(leaks.len(), 1, "the one leaked index buffer");
    Ok(())
}
