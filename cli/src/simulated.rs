//! Simulated device memory: addresses from a range of a given size, never touched, so a
//! log from an 80 GB GPU replays on a laptop or in CI.

use std::alloc::Layout;
use std::collections::BTreeMap;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, PoisonError};

use memres::{Error, Resource, StreamRef, upstream::Callback};

/// Where the simulated range starts: high, page-aligned, and unlike any host address a
/// reader might confuse it with.
const BASE: usize = 0x7e00_0000_0000;
/// Blocks are multiples of this (what CUDA and memres align to).
const GRANULE: usize = 256;

/// A first-fit free list over `[BASE, BASE + size)`, coalescing on free.
struct Range {
    /// Free blocks: start address to size.
    free: BTreeMap<usize, usize>,
}

impl Range {
    fn new(size: usize) -> Range {
        // The range must fit in the address space above `BASE`.
        let size = size.min(usize::MAX - BASE) / GRANULE * GRANULE;
        let mut free = BTreeMap::new();
        if size > 0 {
            free.insert(BASE, size);
        }
        Range { free }
    }

    fn take(&mut self, layout: Layout) -> Option<usize> {
        let size = layout.size().checked_next_multiple_of(GRANULE)?;
        let align = layout.align().max(GRANULE);
        let (&start, &len, pad) = self.free.iter().find_map(|(start, len)| {
            let pad = start.checked_next_multiple_of(align)? - start;
            (*len >= size.checked_add(pad)?).then_some((start, len, pad))
        })?;
        self.free.remove(&start);
        if pad > 0 {
            self.free.insert(start, pad);
        }
        let rest = len - pad - size;
        if rest > 0 {
            self.free.insert(start + pad + size, rest);
        }
        Some(start + pad)
    }

    fn give(&mut self, addr: usize, layout: Layout) {
        let mut start = addr;
        let mut size = layout.size().div_ceil(GRANULE) * GRANULE;
        let end = addr + size;
        if let Some((&prev, &prev_len)) = self.free.range(..addr).next_back()
            && prev + prev_len == addr
        {
            self.free.remove(&prev);
            start = prev;
            size += prev_len;
        }
        if let Some(next_len) = self.free.remove(&end) {
            size += next_len;
        }
        self.free.insert(start, size);
    }
}

/// A resource handing out simulated addresses: no memory behind them, so it claims no
/// property (`()`): nothing may read or write them, which a replay never does.
pub(crate) fn simulated(size: usize) -> impl Resource<Properties = ()> + Send + Sync + 'static {
    let range = Arc::new(Mutex::new(Range::new(size)));
    let take = Arc::clone(&range);
    let allocate = move |layout: Layout, _: StreamRef<'_>| -> Result<NonNull<u8>, Error> {
        let addr = take
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take(layout)
            .ok_or(Error::out_of_memory(layout.size()))?;
        // A made-up address: never dereferenced (the resource claims no access), so it
        // needs no provenance.
        NonNull::new(std::ptr::without_provenance_mut(addr))
            .ok_or(Error::out_of_memory(layout.size()))
    };
    let deallocate = move |ptr: NonNull<u8>, layout: Layout, _: StreamRef<'_>| {
        range
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .give(ptr.as_ptr() as usize, layout);
    };
    // Blocks come from a first-fit list over one range: disjoint until given back, at
    // least `layout.size()` bytes (rounded up to 256), aligned as asked (at least 256).
    // SAFETY: they are valid (as addresses) until freed; the properties claim no access,
    // so nothing may touch them; reuse is immediate, right for memory no work can use.
    unsafe { Callback::<()>::new(allocate, deallocate) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use memres::SyncResource;

    #[test]
    fn first_fit_and_coalescing() {
        let mut r = Range::new(4096);
        let l = |n| Layout::from_size_align(n, 256).unwrap();
        let a = r.take(l(1000)).unwrap();
        let b = r.take(l(1000)).unwrap();
        assert_eq!((a, b), (BASE, BASE + 1024));
        assert!(r.take(l(4096)).is_none());
        r.give(a, l(1000));
        r.give(b, l(1000));
        assert_eq!(
            r.free.len(),
            1,
            "coalesced back into one block: {:?}",
            r.free
        );
        assert_eq!(r.take(l(4096)), Some(BASE));
        let aligned = Range::new(1 << 20).take(Layout::from_size_align(10, 65536).unwrap());
        assert_eq!(aligned.map(|a| a % 65536), Some(0));
    }

    #[test]
    fn out_of_the_range_is_out_of_memory() {
        let sim = simulated(1 << 20);
        let l = memres::layout(1 << 20).unwrap();
        let p = sim.allocate_sync(l).unwrap();
        assert!(sim.allocate_sync(l).unwrap_err().is_out_of_memory());
        // SAFETY: from `sim` with `l`.
        unsafe { sim.deallocate_sync(p, l) };
        assert!(sim.allocate_sync(l).is_ok());
    }
}
