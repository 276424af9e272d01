// Shared by `fuzz/fuzz_targets/suballoc.rs` (libFuzzer, nightly) and
// `tests/fuzz_corpus.rs` (replays the committed corpus on stable), through `include!`.
//
// The first byte picks a sub-allocator over host memory (counted by a `Statistics` layer
// shared with the test); every following 4 bytes are one operation: allocate (size,
// alignment and one of three host streams from the bytes), free a live block (on any of
// the streams), or trim / coalesce. Checked: every allocation is aligned, lies apart
// from every live block and keeps what was written into it until it is freed; failures
// are `Err`, never panics; at the end everything is freed and, once the sub-allocator
// is trimmed and dropped, its upstream holds nothing.

use std::collections::BTreeMap;
use std::ptr::NonNull;

use memres::adaptor::Statistics;
use memres::{
    Arena, Binning, FixedSize, HostHeap, HostVirtual, Pool, PoolConfig, Resource, Shared,
    StreamRef,
};

type Counted = Shared<Statistics<HostHeap>>;

/// Runs one input (see the file's comment).
pub(crate) fn run(data: &[u8]) {
    let Some((&which, ops)) = data.split_first() else {
        return;
    };
    let counted: Counted = Shared::new(Statistics::new(HostHeap::new()));
    match which % 5 {
        0 => {
            let config = PoolConfig::new().maximum_size(64 << 20);
            let pool = Pool::new(counted.clone(), config).expect("a pool");
            exercise(&pool, ops, &|op| maintain_pool(&pool, op));
            pool.trim().expect("trim");
            assert_eq!(pool.stats().pool_size, 0, "a trimmed, empty pool holds nothing");
        }
        1 => {
            // The in-place pool over host pages: its upstream is the reservation itself.
            let leaf = HostVirtual::new(256 << 20, 64 << 10).expect("a reservation");
            let pool = leaf.pool(PoolConfig::new()).expect("an in-place pool");
            exercise(&pool, ops, &|op| maintain_pool(&pool, op));
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
            exercise(&binning, ops, &|op| maintain_pool(binning.upstream(), op));
        }
        _ => {
            let fixed = FixedSize::with_block_size(counted.clone(), 64 << 10, 16).expect("fixed");
            exercise(&fixed, ops, &|_| {});
        }
    }
    assert_eq!(counted.bytes().current, 0, "the upstream holds nothing after drop");
}

fn maintain_pool<U: Resource>(pool: &Pool<U>, op: u8) {
    if op.is_multiple_of(2) {
        pool.trim().expect("trim");
    } else {
        pool.coalesce().expect("coalesce");
    }
}

/// A live block: its layout and the byte written at both of its ends.
struct Live {
    layout: std::alloc::Layout,
    mark: u8,
}

fn exercise<R: Resource>(r: &R, ops: &[u8], maintain: &dyn Fn(u8)) {
    let streams = [StreamRef::host(1), StreamRef::host(2), StreamRef::host(3)];
    // Start address -> block.
    let mut live: BTreeMap<usize, Live> = BTreeMap::new();
    for (n, op) in ops.chunks_exact(4).enumerate() {
        let stream = streams[usize::from(op[3] >> 6) % 3];
        match op[0] % 4 {
            0 | 1 => {
                let size = usize::from(u16::from_le_bytes([op[1], op[2]])) << (op[3] % 8);
                let align = 1usize << ((op[0] >> 2) % 14);
                let Ok(layout) = std::alloc::Layout::from_size_align(size, align) else {
                    continue;
                };
                let Ok(p) = r.allocate(stream, layout) else {
                    continue; // out of memory, or a size this resource refuses
                };
                let addr = p.as_ptr() as usize;
                assert_eq!(addr % align, 0, "aligned to {align}");
                if size == 0 {
                    // SAFETY: from `r` with `layout` on `stream`; never used.
                    unsafe { r.deallocate(stream, p, layout) };
                    continue;
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
                    continue;
                }
                let k = usize::from(u16::from_le_bytes([op[1], op[2]])) % live.len();
                let addr = *live.keys().nth(k).expect("k < len");
                free(r, stream, addr, live.remove(&addr).expect("live"));
            }
            _ => maintain(op[1]),
        }
    }
    for (addr, block) in std::mem::take(&mut live) {
        free(r, streams[0], addr, block);
    }
    maintain(0);
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
