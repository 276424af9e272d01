//! [`Binning`]: requests sorted into bins by size.

use std::alloc::Layout;
use std::fmt;
use std::ptr::{self, NonNull};
use std::sync::Arc;

use super::core::free_blocks::GRANULE;
use super::fixed::FixedSize;
use crate::erased::AnyResource;
use crate::error::Error;
use crate::resource::{Resource, dangling};
use crate::stream::StreamRef;

/// What serves one bin.
enum BinResource<U: Resource> {
    Fixed(FixedSize<Arc<U>>),
    Custom(AnyResource<U::Properties>),
}

struct Bin<U: Resource> {
    size: usize,
    resource: BinResource<U>,
}

/// Sends each request to the smallest bin that holds it (RMM's
/// `binning_memory_resource`): bins are [`FixedSize`] resources over the upstream, or any
/// resource added with [`add_bin`](Binning::add_bin); requests larger than every bin, or
/// aligned to more than 256 bytes, go to the upstream itself.
///
/// Bins are added before the first allocation (`add_*` take `&mut self`, so they cannot
/// race with one; and they refuse once memory has been handed out, because a new bin would
/// send the free of an earlier allocation to a resource that never made it). The upstream
/// is held in an `Arc`, shared with the fixed-size bins.
///
/// ```
/// use memres::suballoc::{Binning, Pool, PoolConfig};
/// use memres::{HostHeap, SyncResource, layout};
///
/// let pool = Pool::new(HostHeap::new(), PoolConfig::new())?;
/// // Bins of 256 B, 512 B, ... 64 KiB; larger requests go to the pool.
/// let binning = Binning::new(pool, 8, 16)?;
/// let l = layout(3000)?; // from the 4 KiB bin
/// let p = binning.allocate_sync(l)?;
/// // SAFETY: allocated above with `l`; not used afterwards.
/// unsafe { binning.deallocate_sync(p, l) };
/// # Ok::<(), memres::Error>(())
/// ```
pub struct Binning<U: Resource> {
    upstream: Arc<U>,
    bins: Vec<Bin<U>>,
    /// The bins' sizes, smallest first (a compact copy for the lookup).
    sizes: Vec<usize>,
    /// For requests of `(2^(k-1), 2^k]` bytes, the first bin that may hold one.
    first_for_log2: [u16; usize::BITS as usize + 1],
    /// `Some(e)` when the bins are exactly 2^`e`, 2^(`e`+1), ... (what [`Binning::new`]
    /// makes): a request's bin is then its size's power of two less `e`, computed rather
    /// than looked up, which takes a load off the path to the bin's thread cache.
    powers_from: Option<u32>,
    /// How many blocks each fixed-size bin takes from the upstream at a time.
    blocks_per_chunk: usize,
    used: std::sync::atomic::AtomicBool,
}

impl<U: Resource + Send + Sync + 'static> Binning<U> {
    /// Fixed-size bins of 2^`min_exponent` .. 2^`max_exponent` bytes (sizes below 256
    /// round up to 256, so exponents below 8 add nothing), each taking 128 blocks at a
    /// time from `upstream` (RMM's default; the first 128 when the bin is made).
    pub fn new(upstream: U, min_exponent: u32, max_exponent: u32) -> Result<Binning<U>, Error> {
        if min_exponent > max_exponent || max_exponent >= usize::BITS - 1 {
            return Err(Error::invalid_argument(format!(
                "bin exponents {min_exponent}..={max_exponent} are not a range of sizes"
            )));
        }
        let mut binning = Binning::without_bins(upstream);
        for e in min_exponent.max(8)..=max_exponent {
            binning.add_fixed_bin(1 << e)?;
        }
        Ok(binning)
    }

    /// No bins yet: every request goes to `upstream` until bins are added.
    pub fn without_bins(upstream: U) -> Binning<U> {
        Binning {
            upstream: Arc::new(upstream),
            bins: Vec::new(),
            sizes: Vec::new(),
            first_for_log2: [0; usize::BITS as usize + 1],
            powers_from: None,
            blocks_per_chunk: 128,
            used: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Adds a [`FixedSize`] bin of `size` bytes (rounded up to 256) over the upstream.
    pub fn add_fixed_bin(&mut self, size: usize) -> Result<(), Error> {
        let size = size
            .max(1)
            .checked_next_multiple_of(GRANULE)
            .filter(|&n| n <= isize::MAX as usize)
            .ok_or_else(|| {
                Error::invalid_argument(format!(
                    "a bin of {size} bytes is larger than any allocation can be"
                ))
            })?;
        self.check_new_bin(size)?;
        let fixed =
            FixedSize::with_block_size(Arc::clone(&self.upstream), size, self.blocks_per_chunk)?;
        self.insert(Bin {
            size,
            resource: BinResource::Fixed(fixed),
        });
        Ok(())
    }

    /// Adds a bin of `size` bytes served by `resource` (which must offer at least the
    /// upstream's properties; [`ResourceExt::into_any`](crate::ResourceExt::into_any)
    /// makes one). It gets every request above the next smaller bin, up to `size`, aligned
    /// to at most 256 bytes.
    pub fn add_bin(
        &mut self,
        size: usize,
        resource: AnyResource<U::Properties>,
    ) -> Result<(), Error> {
        self.check_new_bin(size)?;
        self.insert(Bin {
            size,
            resource: BinResource::Custom(resource),
        });
        Ok(())
    }

    /// Trims every fixed-size bin ([`FixedSize::trim`]): every thread's cached blocks
    /// back, every stream's blocks in the host list, and the lists of streams left
    /// without blocks freed. Bins added with [`add_bin`](Self::add_bin) and the
    /// upstream are left as they are (trim them through their own handles: a pool under
    /// the bins gives memory back with [`Pool::trim`](super::Pool::trim)).
    pub fn trim(&self) -> Result<(), Error> {
        for bin in &self.bins {
            if let BinResource::Fixed(fixed) = &bin.resource {
                fixed.trim()?;
            }
        }
        Ok(())
    }

    fn check_new_bin(&mut self, size: usize) -> Result<(), Error> {
        if *self.used.get_mut() {
            return Err(Error::invalid_argument(
                "bins cannot be added once a Binning resource has handed out memory",
            ));
        }
        if self.bins.len() >= usize::from(u16::MAX) {
            return Err(Error::invalid_argument(
                "a Binning resource has too many bins",
            ));
        }
        if self.bins.iter().any(|b| b.size == size) {
            return Err(Error::invalid_argument(format!(
                "there is already a bin of {size} bytes"
            )));
        }
        Ok(())
    }

    fn insert(&mut self, bin: Bin<U>) {
        let at = self.bins.partition_point(|b| b.size < bin.size);
        self.bins.insert(at, bin);
        self.sizes = self.bins.iter().map(|b| b.size).collect();
        for (k, first) in self.first_for_log2.iter_mut().enumerate() {
            // Every bin that fits a request above 2^(k-1) bytes is larger than that.
            let below = if k == 0 { 0 } else { 1usize << (k - 1) };
            let i = self.sizes.partition_point(|&s| s <= below);
            *first = u16::try_from(i).expect("bins are counted in u16");
        }
        let first = self.sizes[0].trailing_zeros();
        let powers = self.sizes.iter().enumerate().all(|(i, &s)| {
            s.is_power_of_two() && s.trailing_zeros() as usize == first as usize + i
        });
        self.powers_from = powers.then_some(first);
    }
}

impl<U: Resource> Binning<U> {
    /// The bin sizes, smallest first.
    pub fn bin_sizes(&self) -> impl Iterator<Item = usize> + '_ {
        self.bins.iter().map(|b| b.size)
    }

    /// The upstream resource.
    pub fn upstream(&self) -> &U {
        &self.upstream
    }

    /// The bin for `layout` (the smallest that holds it), or `None` for the upstream: the
    /// size's power of two less the first bin's where the bins are consecutive powers of
    /// two, else a table lookup by the size's power of two and a step or two.
    #[inline]
    fn bin(&self, layout: Layout) -> Option<&BinResource<U>> {
        let n = layout.size();
        if layout.align() > GRANULE {
            return None;
        }
        // ceil(log2(n)) for n >= 1 (zero-size requests never get here).
        let k = (usize::BITS - (n - 1).leading_zeros()) as usize;
        if let Some(first) = self.powers_from {
            return self
                .bins
                .get(k.saturating_sub(first as usize))
                .map(|b| &b.resource);
        }
        let mut i = usize::from(self.first_for_log2[k]);
        while self.sizes.get(i).is_some_and(|&s| s < n) {
            i += 1;
        }
        self.bins.get(i).map(|b| &b.resource)
    }
}

impl<U: Resource> PartialEq for Binning<U> {
    fn eq(&self, other: &Self) -> bool {
        ptr::eq(self, other)
    }
}

impl<U: Resource + fmt::Debug> fmt::Debug for Binning<U> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Binning")
            .field("upstream", &self.upstream)
            .field("bins", &self.bin_sizes().collect::<Vec<_>>())
            .finish()
    }
}

sync_on_the_host_stream!(Binning);

// SAFETY: every block comes from a bin or the upstream, which keep the contract and
// offer at least the upstream's properties; a free goes to the same place as the
// allocation did, because the route depends only on the layout and the bins, which
// cannot change once memory has been handed out.
unsafe impl<U: Resource> Resource for Binning<U> {
    #[inline]
    fn allocate(&self, stream: StreamRef<'_>, layout: Layout) -> Result<NonNull<u8>, Error> {
        if layout.size() == 0 {
            return Ok(dangling(layout));
        }
        if !self.used.load(std::sync::atomic::Ordering::Relaxed) {
            self.used.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        match self.bin(layout) {
            Some(BinResource::Fixed(fixed)) => fixed.allocate(stream, layout),
            Some(BinResource::Custom(any)) => any.allocate(stream, layout),
            None => self.upstream.allocate(stream, layout),
        }
    }

    #[inline]
    unsafe fn deallocate(&self, stream: StreamRef<'_>, ptr: NonNull<u8>, layout: Layout) {
        if layout.size() == 0 {
            return;
        }
        // SAFETY: the caller's promise; the block came from the same route (above).
        unsafe {
            match self.bin(layout) {
                Some(BinResource::Fixed(fixed)) => fixed.deallocate(stream, ptr, layout),
                Some(BinResource::Custom(any)) => any.deallocate(stream, ptr, layout),
                None => self.upstream.deallocate(stream, ptr, layout),
            }
        }
    }

    #[inline]
    unsafe fn deallocate_used_on(
        &self,
        stream: StreamRef<'_>,
        ptr: NonNull<u8>,
        layout: Layout,
        used_on: &[StreamRef<'_>],
    ) {
        if layout.size() == 0 {
            return;
        }
        // SAFETY: as in `deallocate`.
        unsafe {
            match self.bin(layout) {
                Some(BinResource::Fixed(f)) => f.deallocate_used_on(stream, ptr, layout, used_on),
                Some(BinResource::Custom(a)) => a.deallocate_used_on(stream, ptr, layout, used_on),
                None => self
                    .upstream
                    .deallocate_used_on(stream, ptr, layout, used_on),
            }
        }
    }
}

#[cfg(all(test, not(memres_loom)))]
mod tests {
    use super::*;
    use crate::upstream::HostHeap;

    /// The index of the bin `size` goes to, or `None` for the upstream.
    fn route(b: &Binning<HostHeap>, size: usize, align: usize) -> Option<usize> {
        let found = b.bin(Layout::from_size_align(size, align).unwrap())?;
        b.bins.iter().position(|bin| ptr::eq(&bin.resource, found))
    }

    #[test]
    fn requests_go_to_the_smallest_bin_that_holds_them() {
        let mut b = Binning::without_bins(HostHeap::new());
        for size in [768, 3000, 4096, 1 << 20] {
            b.add_fixed_bin(size).unwrap();
        }
        assert_eq!(
            b.bin_sizes().collect::<Vec<_>>(),
            [768, 3072, 4096, 1 << 20]
        );
        for (size, bin) in [
            (1, Some(0)),
            (768, Some(0)),
            (769, Some(1)),
            (2048, Some(1)),
            (3072, Some(1)),
            (3073, Some(2)),
            (4096, Some(2)),
            (4097, Some(3)),
            (1 << 20, Some(3)),
            ((1 << 20) + 1, None),
            (isize::MAX as usize - 4096, None),
        ] {
            assert_eq!(route(&b, size, 256), bin, "{size} bytes");
        }
        assert_eq!(
            route(&b, 100, 512),
            None,
            "alignment above 256 goes upstream"
        );
        assert!(b.add_fixed_bin(3000).is_err(), "a second bin of one size");
    }

    /// Bins of consecutive powers of two are found by arithmetic, not the table: the
    /// same bin as the smallest that holds the request, at every power of two and next
    /// to it, and again once a bin breaks the sequence.
    #[test]
    fn power_of_two_bins_route_like_the_smallest_that_holds() {
        let smallest = |b: &Binning<HostHeap>, n: usize| b.bin_sizes().position(|s| s >= n);
        for (min, max) in [(8, 22), (3, 10), (12, 12)] {
            let mut b = Binning::new(HostHeap::new(), min, max).unwrap();
            assert!(b.powers_from.is_some());
            for k in 0..=24 {
                for n in [(1usize << k) - 1, 1 << k, (1 << k) + 1] {
                    let n = n.max(1);
                    assert_eq!(
                        route(&b, n, 256),
                        smallest(&b, n),
                        "{n} bytes, bins {min}..={max}"
                    );
                }
            }
            b.add_fixed_bin(3 << 20).unwrap();
            assert!(
                b.powers_from.is_none(),
                "a bin of 3 MiB breaks the sequence"
            );
            for n in [1 << 20, (2 << 20) + 1, 3 << 20, (3 << 20) + 1] {
                assert_eq!(route(&b, n, 256), smallest(&b, n), "{n} bytes");
            }
        }
    }
}
