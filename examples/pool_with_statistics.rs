//! A pool over CUDA memory with statistics: how much is live, the peak, how much the pool
//! holds from the device, and giving memory back.
//!
//! ```sh
//! cargo run --release --example pool_with_statistics
//! ```
//!
//! On a machine with a GPU the pool grows in place over CUDA virtual memory (the stack
//! that holds the least); without one, the same stack runs over host pages
//! (`HostVirtual`, the host simulation of it), and the figures mean the same.

use memres::suballoc::VirtualPoolConfig;
use memres::{CudaVirtual, Error, Resource, ResourceExt, StreamRef, layout, upstream::HostVirtual};

/// Allocates 16 blocks of 1 to 16 MiB on `stream` and frees every other one (the rest
/// stay live, for the figures; the pool gives everything back when it drops).
fn work<R: Resource>(mr: &R, stream: StreamRef<'_>) -> Result<(), Error> {
    let mut live = Vec::new();
    for i in 0..16 {
        let l = layout((i + 1) << 20)?;
        live.push((mr.allocate(stream, l)?, l));
    }
    for (p, l) in live.drain(..).step_by(2) {
        // SAFETY: allocated above on `stream` with `l`; not used afterwards.
        unsafe { mr.deallocate(stream, p, l) };
    }
    Ok(())
}

fn main() -> Result<(), Error> {
    match CudaVirtual::new() {
        Ok(leaf) => {
            let pool = leaf.virtual_pool(VirtualPoolConfig::new())?;
            let stats = pool.with_statistics();
            let stream = memres::stream::Stream::new()?;
            work(&stats, stream.as_ref())?;
            report(
                "GPU (Pool over CudaVirtual)",
                &stats,
                stats.upstream().stats(),
            );
            println!("trim gave back {} bytes", stats.upstream().trim()?);
        }
        Err(e) => {
            println!("no GPU here ({e}); the same stack over host pages:");
            let pool =
                HostVirtual::new(64 << 30, 2 << 20)?.virtual_pool(VirtualPoolConfig::new())?;
            let stats = pool.with_statistics();
            work(&stats, StreamRef::HOST)?;
            report(
                "host (Pool over HostVirtual)",
                &stats,
                stats.upstream().stats(),
            );
            println!("trim gave back {} bytes", stats.upstream().trim()?);
        }
    }
    Ok(())
}

fn report<U>(
    what: &str,
    stats: &memres::adaptor::Statistics<U>,
    pool: memres::suballoc::PoolStats,
) {
    let s = stats.snapshot();
    println!("{what}:");
    println!(
        "  live {} B in {} blocks; peak {} B; {} allocations in all",
        s.bytes.current, s.allocations.current, s.bytes.peak, s.allocations.total
    );
    println!(
        "  the pool holds {} B ({:.2} of the peak live); {} B free, largest free block {} B",
        pool.pool_size,
        pool.pool_size as f64 / s.bytes.peak.max(1) as f64,
        pool.free_bytes,
        pool.largest_free_block
    );
}
