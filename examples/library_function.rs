//! A library function that takes "a memory resource": generic where speed matters,
//! erased (`ResourceRef`) where the API must not be generic, and the compiler checks that
//! the memory is where the function needs it.
//!
//! ```sh
//! cargo run --release --example library_function
//! ```
//!
//! Runs on host memory anywhere; on a machine with a GPU it also hands device memory to
//! the function that needs `Device` memory (on one without, it says so).

use memres::suballoc::{Pool, PoolConfig};
use memres::{
    Cuda, Device, Error, Has, Host, HostAccessible, HostHeap, Resource, ResourceExt, ResourceRef,
    StreamRef, layout,
};

/// Generic: inlined and monomorphised for each stack; needs memory the host may write.
fn checksum_scratch<R: Resource + Has<HostAccessible>>(mr: &R, n: usize) -> Result<u64, Error> {
    let l = layout(n)?;
    let p = mr.allocate(StreamRef::HOST, l)?;
    // SAFETY: `n` bytes of host-accessible memory (the bound says so), ours until freed.
    let bytes = unsafe {
        p.as_ptr().write_bytes(7, n);
        std::slice::from_raw_parts(p.as_ptr(), n)
    };
    let sum = bytes.iter().map(|&b| u64::from(b)).sum();
    // SAFETY: allocated above with `l` on the host stream; not used afterwards.
    unsafe { mr.deallocate(StreamRef::HOST, p, l) };
    Ok(sum)
}

/// Erased: one function for every stack (two words, one indirect call per operation).
/// `ResourceRef<'_, Host>` promises host-accessible memory.
fn scratch_bytes(mr: ResourceRef<'_, Host>, n: usize) -> Result<usize, Error> {
    let l = layout(n)?;
    let p = mr.allocate(StreamRef::HOST, l)?;
    // SAFETY: allocated above with `l`; never touched.
    unsafe { mr.deallocate(StreamRef::HOST, p, l) };
    Ok(n)
}

/// Needs device memory: a host-only resource here does not compile (see `ui-tests/`).
fn device_scratch(mr: ResourceRef<'_, Device>, stream: StreamRef<'_>) -> Result<(), Error> {
    let l = layout(1 << 20)?;
    let p = mr.allocate(stream, l)?;
    // SAFETY: allocated above with `l` on `stream`; nothing was enqueued on it.
    unsafe { mr.deallocate(stream, p, l) };
    Ok(())
}

fn main() -> Result<(), Error> {
    let heap = HostHeap::new();
    let pool = Pool::new(HostHeap::new(), PoolConfig::new())?.with_statistics();

    println!(
        "generic over HostHeap:        {}",
        checksum_scratch(&heap, 1000)?
    );
    println!(
        "generic over Statistics<Pool>: {}",
        checksum_scratch(&pool, 1000)?
    );
    let a = scratch_bytes(ResourceRef::new(&heap), 4096)?;
    let b = scratch_bytes(ResourceRef::new(&pool), 4096)?;
    println!("erased, the same two stacks:   {a} and {b} bytes");
    println!(
        "the pool counted {} allocations",
        pool.snapshot().allocations.total
    );

    // `device_scratch(ResourceRef::new(&heap), ..)` would not compile: HostHeap's memory
    // is not device-accessible.
    match Cuda::new() {
        Ok(cuda) => {
            let on_gpu = cuda.pool(PoolConfig::new())?;
            device_scratch(ResourceRef::new(&on_gpu), StreamRef::DEFAULT)?;
            println!("device memory: 1 MiB from a pool over cudaMalloc, on the default stream");
        }
        Err(e) => println!("no GPU here ({e}): on one, `device_scratch` gets a pool over Cuda"),
    }
    Ok(())
}
