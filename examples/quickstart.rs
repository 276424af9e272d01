//! memres in one screen: build a small stack over host memory, hand it to code that takes
//! "a memory resource", and see what happened.
//!
//! ```sh
//! cargo run --release --example quickstart
//! ```
//!
//! Runs anywhere; where a CUDA driver and a GPU are present it also allocates on the GPU.

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};

use memres::device::DeviceId;
use memres::stream::{Stream, StreamFlags};
use memres::{
    AnyResource, Error, Host, HostHeap, PoolConfig, Resource, ResourceExt, ResourceRef, StreamRef,
    SyncResource, layout,
    upstream::{Callback, CudaAsync},
};

/// Bytes in flight and the high-water mark, kept by the counting layer of the stack.
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
static CALLS: AtomicUsize = AtomicUsize::new(0);

/// Library code: takes any host-accessible resource, without being generic over it.
/// It builds a prefix-sum table in scratch memory and returns the last entry.
fn prefix_sum_of_squares(mr: ResourceRef<'_, Host>, n: usize) -> Result<u64, Error> {
    let stream = StreamRef::HOST;
    let bytes = n * size_of::<u64>();
    let l = layout(bytes)?;
    let table = mr.allocate(stream, l)?.cast::<u64>();
    let mut acc = 0u64;
    for i in 0..n {
        acc += (i as u64) * (i as u64);
        // SAFETY: `mr` promises host-accessible memory (its type says `Host`), the block
        // holds `n` u64s (`bytes` = n * 8, aligned to 256 bytes), and nothing else uses it.
        // Writing through the pointer initialises slot `i`.
        unsafe { table.add(i).write(acc) };
    }
    let last = if n == 0 {
        0
    } else {
        // SAFETY: slot `n - 1` was initialised in the loop above.
        unsafe { table.add(n - 1).read() }
    };
    // SAFETY: allocated above from `mr` with `l` on `stream`; the slice is not used again.
    unsafe { mr.deallocate(stream, table.cast(), l) };
    Ok(last)
}

fn main() -> Result<(), Error> {
    // The stack, bottom-up: host heap -> a counting layer -> a pool -> shared -> erased.
    let heap = HostHeap::new();
    let allocate = move |l: Layout, _: StreamRef<'_>| {
        let p = heap.allocate_sync(l)?;
        CALLS.fetch_add(1, Ordering::Relaxed);
        let live = LIVE.fetch_add(l.size(), Ordering::Relaxed) + l.size();
        PEAK.fetch_max(live, Ordering::Relaxed);
        Ok(p)
    };
    let deallocate = move |p: NonNull<u8>, l: Layout, _: StreamRef<'_>| {
        LIVE.fetch_sub(l.size(), Ordering::Relaxed);
        // SAFETY: `Callback` passes back only blocks `allocate` returned, with their
        // layout; those came from `heap`.
        unsafe { heap.deallocate_sync(p, l) }
    };
    // SAFETY: the closures hand out and take back heap memory, which is host-accessible
    // and usable at once whatever the stream.
    let counting = unsafe { Callback::<Host>::new(allocate, deallocate) };
    let mr: AnyResource<Host> = counting.pool(PoolConfig::new())?.shared().into_any();
    println!("stack: {mr:?}");

    // Hand it to library code, from four threads at once.
    let sums: Vec<u64> = std::thread::scope(|s| {
        let handles: Vec<_> = (1..=4)
            .map(|k| {
                let mr = mr.clone();
                s.spawn(move || prefix_sum_of_squares(mr.as_resource_ref(), k * 100_000))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("worker panicked"))
            .collect::<Result<_, _>>()
    })?;
    for (k, sum) in (1..=4).zip(&sums) {
        println!("sum of squares below {:>7}: {sum}", k * 100_000);
    }

    // Out of memory is an error you can handle, not an abort.
    match mr.allocate_sync(layout(1 << 50)?) {
        Err(e) => println!("asking for 1 PiB: {e}"),
        Ok(_) => println!("asking for 1 PiB: it worked?!"),
    }

    println!(
        "the pool took {} allocations from the heap (peak bytes: {}, held now: {})",
        CALLS.load(Ordering::Relaxed),
        PEAK.load(Ordering::Relaxed),
        LIVE.load(Ordering::Relaxed)
    );

    report_gpu();
    Ok(())
}

/// Where a CUDA driver and a GPU are present, allocates device memory in stream order
/// from a driver pool; elsewhere says why not. Errors are reported, never fatal.
fn report_gpu() {
    match use_gpu() {
        Ok(done) => println!("{done}"),
        Err(Error::NoDriver) => println!("CUDA driver: not found (host memory only)"),
        Err(e) => println!("GPU: not used ({e})"),
    }
}

fn use_gpu() -> Result<String, Error> {
    let device = DeviceId::current()?;
    let stream = Stream::with_flags(StreamFlags::NonBlocking)?;
    let pool = CudaAsync::new()?;
    let l = layout(64 << 20)?;
    let p = pool.allocate(stream.as_ref(), l)?;
    // SAFETY: allocated just above on `stream`; no work uses it.
    unsafe { pool.deallocate(stream.as_ref(), p, l) };
    stream.synchronize()?;
    let info = device.memory_info()?;
    Ok(format!(
        "GPU {device} ({}): allocated and freed 64 MiB in stream order from a CudaAsync pool \
         (reserved now: {} MiB; device free/total: {}/{} GiB)",
        device.name()?,
        pool.reserved_bytes()? >> 20,
        info.free >> 30,
        info.total >> 30
    ))
}
