// Shared by `fuzz/fuzz_targets/suballoc.rs` (libFuzzer, nightly) and
// `tests/fuzz_corpus.rs` (replays the committed corpus on stable), through `include!`.
//
// The first byte picks a sub-allocator over host memory (counted by a `Statistics` layer
// shared with the test): chunked pools growing by either rule, with and without release
// thresholds, the virtual pool with and without one, an arena, `Binning` over a pool and
// `FixedSize`. Every following 4 bytes are one operation: allocate (size, alignment and
// one of three host streams from the bytes), free a live block (on any of the streams),
// or trim / coalesce; each runs on one of four threads picked by the input (the
// operations run one after another, handed from thread to thread, so a run is
// deterministic while threads' lanes and caches are exercised). Checked: every
// allocation is aligned, lies apart from every live block and keeps what was written
// into it until it is freed; failures are `Err`, never panics; at the end everything is
// freed and, once the sub-allocator is trimmed and dropped, its upstream holds nothing.

use std::collections::BTreeMap;
use std::ptr::NonNull;
use std::sync::{Mutex, mpsc};

use memres::adaptor::Statistics;
use memres::suballoc::Growth;
use memres::{
    Error, HostHeap, Pool, PoolConfig, Resource, StreamRef, VirtualPoolConfig, erased::Shared,
    suballoc::{Arena, Binning, FixedSize},
    upstream::HostVirtual,
};

type Counted = Shared<Statistics<HostHeap>>;

/// Runs one input (see the file's comment).
pub(crate) fn run(data: &[u8]) {
    let Some((&which, ops)) = data.split_first() else {
        return;
    };
    let counted: Counted = Shared::new(Statistics::new(HostHeap::new()));
    match which % 8 {
        0 | 5 | 7 => {
            let config = match which % 8 {
                0 => PoolConfig::new(),
                // RMM's growth rule, and a release threshold crossed often.
                5 => PoolConfig::new().growth(Growth::Rmm).release_threshold(1 << 20),
                // Every free past nothing held free releases.
                _ => PoolConfig::new().release_threshold(0),
            };
            let pool = Pool::new(counted.clone(), config.maximum_size(64 << 20)).expect("a pool");
            exercise(&pool, ops, &|op| maintain(op, || pool.trim(), || pool.coalesce()));
            pool.trim().expect("trim");
            assert_eq!(pool.stats().pool_size, 0, "a trimmed, empty pool holds nothing");
        }
        1 | 6 => {
            // The virtual pool over host pages: its upstream is the reservation itself.
            let leaf = HostVirtual::new(256 << 20, 64 << 10).expect("a reservation");
            let config = if which % 8 == 1 {
                VirtualPoolConfig::new()
            } else {
                VirtualPoolConfig::new().release_threshold(256 << 10)
            };
            let pool = leaf.virtual_pool(config).expect("a virtual pool");
            exercise(&pool, ops, &|op| maintain(op, || pool.trim(), || pool.coalesce()));
            pool.trim().expect("trim");
            assert_eq!(pool.stats().pool_size, 0, "a trimmed, empty pool holds nothing");
            assert_eq!(pool.upstream().mapped_bytes(), 0, "every granule unmapped");
        }
        2 => {
            let arena = Arena::with_size(counted.clone(), 32 << 20).expect("an arena");
            exercise(&arena, ops, &|_| {});
            assert_eq!(arena.free_bytes(), arena.size(), "every byte free again");
        }
        3 => {
            let pool = Pool::new(counted.clone(), PoolConfig::new().maximum_size(64 << 20))
                .expect("a pool");
            let binning = Binning::new(pool, 8, 16).expect("binning");
            let pool = binning.upstream();
            exercise(&binning, ops, &|op| maintain(op, || pool.trim(), || pool.coalesce()));
        }
        _ => {
            let fixed = FixedSize::with_block_size(counted.clone(), 64 << 10, 16).expect("fixed");
            exercise(&fixed, ops, &|_| {});
        }
    }
    assert_eq!(counted.bytes().current, 0, "the upstream holds nothing after drop");
}

/// A pool's `trim` or `coalesce`, as `op` says.
fn maintain(
    op: u8,
    trim: impl Fn() -> Result<usize, Error>,
    coalesce: impl Fn() -> Result<(), Error>,
) {
    if op.is_multiple_of(2) {
        trim().expect("trim");
    } else {
        coalesce().expect("coalesce");
    }
}

/// A live block: its layout and the byte written at both of its ends.
struct Live {
    layout: std::alloc::Layout,
    mark: u8,
}

/// One job for a worker thread: an operation, run while the caller waits.
type Job<'a> = Box<dyn FnOnce() + Send + 'a>;

fn exercise<R: Resource + Sync>(r: &R, ops: &[u8], maintain: &(dyn Fn(u8) + Sync)) {
    // Start address -> block.
    let live: Mutex<BTreeMap<usize, Live>> = Mutex::new(BTreeMap::new());
    std::thread::scope(|scope| {
        // Three workers beside this thread; each operation runs on the one its bits name,
        // and the next starts once it is done.
        let workers: Vec<_> = (0..3)
            .map(|_| {
                let (jobs, inbox) = mpsc::channel::<Job<'_>>();
                let (done, finished) = mpsc::channel::<()>();
                let worker = scope.spawn(move || {
                    for job in inbox {
                        job();
                        let _ = done.send(());
                    }
                });
                (jobs, finished, worker)
            })
            .collect();
        for (n, op) in ops.chunks_exact(4).enumerate() {
            let op: [u8; 4] = op.try_into().expect("4 bytes");
            let (live, maintain) = (&live, maintain);
            match usize::from((op[3] >> 4) & 3) {
                0 => step(r, op, n, live, maintain),
                t => {
                    let (jobs, finished, _) = &workers[t - 1];
                    jobs.send(Box::new(move || step(r, op, n, live, maintain)))
                        .expect("the worker is alive");
                    // A worker that panicked (a failed check) drops its sender: the scope
                    // then passes its panic on.
                    if finished.recv().is_err() {
                        return;
                    }
                }
            }
        }
        // Joined, not only left to the scope's end, which does not wait for a thread's
        // exit: a worker's thread caches go back to their lists as it exits.
        for (jobs, _, worker) in workers {
            drop(jobs);
            if let Err(panic) = worker.join() {
                std::panic::resume_unwind(panic);
            }
        }
    });
    let streams = [StreamRef::host(1), StreamRef::host(2), StreamRef::host(3)];
    let live = live.into_inner().unwrap_or_else(|e| e.into_inner());
    for (addr, block) in live {
        free(r, streams[0], addr, block);
    }
    maintain(0);
}

/// Operation `n` (see the file's comment), on the calling thread.
fn step<R: Resource>(
    r: &R,
    op: [u8; 4],
    n: usize,
    live: &Mutex<BTreeMap<usize, Live>>,
    maintain: &(dyn Fn(u8) + Sync),
) {
    let streams = [StreamRef::host(1), StreamRef::host(2), StreamRef::host(3)];
    let stream = streams[usize::from(op[3] >> 6) % 3];
    let mut live = live.lock().unwrap_or_else(|e| e.into_inner());
    match op[0] % 4 {
        0 | 1 => {
            let size = usize::from(u16::from_le_bytes([op[1], op[2]])) << (op[3] % 8);
            let align = 1usize << ((op[0] >> 2) % 14);
            let Ok(layout) = std::alloc::Layout::from_size_align(size, align) else {
                return;
            };
            let Ok(p) = r.allocate(stream, layout) else {
                return; // out of memory, or a size this resource refuses
            };
            let addr = p.as_ptr() as usize;
            assert_eq!(addr % align, 0, "aligned to {align}");
            if size == 0 {
                // SAFETY: from `r` with `layout` on `stream`; never used.
                unsafe { r.deallocate(stream, p, layout) };
                return;
            }
            let end = addr + size;
            if let Some((&a, b)) = live.range(..end).next_back() {
                assert!(a + b.layout.size() <= addr || a >= end, "blocks overlap");
            }
            let mark = n as u8;
            // SAFETY: host memory of `size` bytes just handed out.
            unsafe {
                p.as_ptr().write(mark);
                p.as_ptr().add(size - 1).write(mark);
            }
            live.insert(addr, Live { layout, mark });
        }
        2 => {
            if live.is_empty() {
                return;
            }
            let k = usize::from(u16::from_le_bytes([op[1], op[2]])) % live.len();
            let addr = *live.keys().nth(k).expect("k < len");
            let block = live.remove(&addr).expect("live");
            free(r, stream, addr, block);
        }
        _ => {
            drop(live);
            maintain(op[1]);
        }
    }
}

fn free<R: Resource>(r: &R, stream: StreamRef<'_>, addr: usize, block: Live) {
    let size = block.layout.size();
    let p = NonNull::new(addr as *mut u8).expect("non-null");
    // SAFETY: a live block of `size` host bytes from `r`.
    let (first, last) = unsafe { (p.as_ptr().read(), p.as_ptr().add(size - 1).read()) };
    assert_eq!((first, last), (block.mark, block.mark), "a block was overwritten");
    // SAFETY: from `r` with this layout; host streams are always complete, so any stream
    // may free it.
    unsafe { r.deallocate(stream, p, block.layout) };
}
