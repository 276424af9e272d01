//! An upstream that fails on purpose, for fault-injection tests.

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use memres::{Error, HostAccessible, HostHeap, Resource, StreamRef, SyncResource};

/// When a [`Faulty`] upstream refuses an allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Never.
    Never,
    /// The `n`th allocation (counted from 1) and no other.
    At(u64),
    /// Every `k`th allocation.
    Every(u64),
    /// At random, one in `one_in` on average, from `seed` (same seed, same failures for
    /// the same sequence of calls on one thread).
    Random { seed: u64, one_in: u64 },
    /// Every request of more than this many bytes (an upstream with memory left that
    /// refuses single large requests).
    Above(usize),
}

/// Heap memory that fails as its [`Fault`] says, with `OutOfMemory` (or, for `Random`, one
/// time in four, an `Unsupported` error, as a driver refusing a call would), and counts
/// what it has handed out so a test can see that nothing leaked.
#[derive(Debug)]
pub struct Faulty {
    fault: Fault,
    enabled: AtomicBool,
    calls: AtomicU64,
    failures: AtomicU64,
    live_bytes: AtomicUsize,
    live_blocks: AtomicUsize,
}

impl Faulty {
    pub fn new(fault: Fault) -> Faulty {
        Faulty {
            fault,
            enabled: AtomicBool::new(true),
            calls: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            live_bytes: AtomicUsize::new(0),
            live_blocks: AtomicUsize::new(0),
        }
    }

    /// Stops (or resumes) failing.
    pub fn set_enabled(&self, on: bool) {
        self.enabled.store(on, Ordering::SeqCst);
    }

    /// Bytes handed out and not yet freed.
    pub fn live_bytes(&self) -> usize {
        self.live_bytes.load(Ordering::SeqCst)
    }

    /// Blocks handed out and not yet freed.
    pub fn live_blocks(&self) -> usize {
        self.live_blocks.load(Ordering::SeqCst)
    }

    /// Allocations asked for so far (refused ones included).
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::SeqCst)
    }

    /// Allocations refused so far.
    pub fn failures(&self) -> u64 {
        self.failures.load(Ordering::SeqCst)
    }

    /// The error for call number `n` (from 1) of `size` bytes, if it fails.
    fn verdict(&self, n: u64, size: usize) -> Option<Error> {
        if !self.enabled.load(Ordering::SeqCst) {
            return None;
        }
        let oom = || Error::out_of_memory(size);
        match self.fault {
            Fault::Never => None,
            Fault::At(at) => (n == at).then(oom),
            Fault::Every(k) => n.is_multiple_of(k).then(oom),
            Fault::Above(limit) => (size > limit).then(oom),
            Fault::Random { seed, one_in } => {
                let r = splitmix(seed ^ n.wrapping_mul(0x9e37_79b9_7f4a_7c15));
                if !r.is_multiple_of(one_in) {
                    None
                } else if (r >> 32).is_multiple_of(4) {
                    Some(Error::Unsupported(
                        "injected: the upstream refused this call".into(),
                    ))
                } else {
                    Some(oom())
                }
            }
        }
    }
}

impl PartialEq for Faulty {
    /// Identity: memory from one `Faulty` goes back to that one.
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self, other)
    }
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

// SAFETY: blocks come from the heap (or the call fails and nothing is handed out).
unsafe impl SyncResource for Faulty {
    type Properties = HostAccessible;

    fn allocate_sync(&self, layout: Layout) -> Result<NonNull<u8>, Error> {
        if layout.size() == 0 {
            return HostHeap.allocate_sync(layout);
        }
        let n = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        if let Some(e) = self.verdict(n, layout.size()) {
            self.failures.fetch_add(1, Ordering::SeqCst);
            return Err(e);
        }
        let p = HostHeap.allocate_sync(layout)?;
        self.live_bytes.fetch_add(layout.size(), Ordering::SeqCst);
        self.live_blocks.fetch_add(1, Ordering::SeqCst);
        Ok(p)
    }

    unsafe fn deallocate_sync(&self, ptr: NonNull<u8>, layout: Layout) {
        if layout.size() > 0 {
            self.live_bytes.fetch_sub(layout.size(), Ordering::SeqCst);
            self.live_blocks.fetch_sub(1, Ordering::SeqCst);
        }
        // SAFETY: the caller's promise; the block came from the heap with `layout`.
        unsafe { HostHeap.deallocate_sync(ptr, layout) }
    }
}

// SAFETY: as for `SyncResource`; heap memory is usable at once in any stream order.
unsafe impl Resource for Faulty {
    fn allocate(&self, _: StreamRef<'_>, layout: Layout) -> Result<NonNull<u8>, Error> {
        self.allocate_sync(layout)
    }

    unsafe fn deallocate(&self, _: StreamRef<'_>, ptr: NonNull<u8>, layout: Layout) {
        // SAFETY: forwards the caller's promise.
        unsafe { self.deallocate_sync(ptr, layout) }
    }
}
