//! [`Fallback`]: a second resource for what the first cannot hold.

use std::alloc::Layout;
use std::fmt;
use std::marker::PhantomData;
use std::ptr::NonNull;

use super::owners::Owners;
use super::statistics::{Statistics, StatisticsSnapshot};
use crate::error::Error;
use crate::property::{Contains, PropertySet};
use crate::resource::{Resource, SyncResource};
use crate::stream::StreamRef;

/// Tries `first`; when it runs out of memory ([`Error::OutOfMemory`]), `then` (RAPIDS users'
/// device pool -> pinned host pool, or -> managed memory). Other errors pass through:
/// only a full first tier sends requests on.
///
/// - **Properties**: `P`, what both tiers give (a device pool and a pinned host pool
///   are both device-accessible: `Fallback<_, _, Device>`); naming a property one of
///   them lacks does not compile.
/// - **Frees** go to the tier that served the block. Where the first tier's blocks all lie
///   in one address range ([`with_first_range`](Self::with_first_range): a
///   [`VirtualPool`](crate::VirtualPool)'s reservation, which `fallback(virtual_pool, ..)` in a spec uses), the address
///   says which tier, without a lookup. Otherwise the fallback tier's blocks are
///   recorded (a map under a lock); while it has none live, a free goes to `first`
///   without a lookup, so a program that never falls back pays one load per free. (The
///   same table tells a [`Router`](super::Router)'s members apart.)
///   Stream-ordered frees keep their stream in either tier.
/// - **Figures** per tier ([`tiers`](Self::tiers)): each tier is counted by a
///   [`Statistics`] layer of its own (bytes and allocations, now, at most and in all; the
///   peak across threads is approximate, as there).
///
/// ```
/// use memres::adaptor::{Fallback, Limiting};
/// use memres::{Host, HostHeap, SyncResource, layout};
///
/// // 1 MiB of "device" memory, then the heap.
/// let tiers = Fallback::<_, _, Host>::new(Limiting::new(HostHeap::new(), 1 << 20), HostHeap::new());
/// let small = tiers.allocate_sync(layout(512 << 10)?)?;
/// let large = tiers.allocate_sync(layout(2 << 20)?)?; // does not fit the first tier
/// let [first, then] = tiers.tiers();
/// assert_eq!((first.bytes.current, then.bytes.current), (512 << 10, 2 << 20));
/// // SAFETY: each allocated above with its layout, not used afterwards.
/// unsafe {
///     tiers.deallocate_sync(large, layout(2 << 20)?);
///     tiers.deallocate_sync(small, layout(512 << 10)?);
/// }
/// assert_eq!(tiers.tiers()[1].bytes.current, 0);
/// # Ok::<(), memres::Error>(())
/// ```
pub struct Fallback<A, B, P> {
    first: Statistics<A>,
    then: Statistics<B>,
    /// Which tier served a block: `first`'s range ([`FIRST`]), if one was given, else a
    /// record of each block of `then` ([`THEN`]).
    owners: Owners,
    /// `(base, len)`: every block of `first`, and none of `then`, lies in this range
    /// (then no block is recorded).
    first_range: Option<(usize, usize)>,
    properties: PhantomData<fn() -> P>,
}

/// The first tier, in `owners`.
const FIRST: usize = 0;
/// The fallback tier, in `owners`.
const THEN: usize = 1;

impl<A, B, P> Fallback<A, B, P> {
    /// `first`, and `then` for what `first` has no memory for.
    pub fn new(first: A, then: B) -> Self {
        Fallback {
            first: Statistics::new(first),
            then: Statistics::new(then),
            owners: Owners::default(),
            first_range: None,
            properties: PhantomData,
        }
    }

    /// Tells the tiers apart by address: `first`'s blocks all lie in `base..base + len`
    /// (the reservation of a virtual pool, [`GrowInPlace::reservation`]), so a free
    /// inside it goes to `first` and one outside to `then`, with no set of `then`'s
    /// blocks kept.
    ///
    /// ```
    /// use memres::adaptor::Fallback;
    /// use memres::{
    ///     Host, HostHeap, SyncResource, VirtualPoolConfig, layout,
    ///     upstream::{GrowInPlace, HostVirtual},
    /// };
    ///
    /// let pool = HostVirtual::with_limit(1 << 30, 64 << 10, 1 << 20)?.virtual_pool(VirtualPoolConfig::new())?;
    /// let (base, len) = pool.upstream().reservation();
    /// // SAFETY: the pool's blocks lie in its leaf's reservation; the heap's never do.
    /// let tiers = unsafe { Fallback::<_, _, Host>::new(pool, HostHeap).with_first_range(base, len) };
    /// let l = layout(2 << 20)?; // past the pool's 1 MiB of memory: the heap serves it
    /// let p = tiers.allocate_sync(l)?;
    /// // SAFETY: allocated above with `l`; not used afterwards.
    /// unsafe { tiers.deallocate_sync(p, l) };
    /// assert_eq!(tiers.tiers()[1].bytes.current, 0);
    /// # Ok::<(), memres::Error>(())
    /// ```
    ///
    /// # Safety
    /// Every block `first` hands out lies in `base..base + len`, and no block `then` hands
    /// out does (else a free would reach the wrong tier).
    ///
    /// [`GrowInPlace::reservation`]: crate::upstream::GrowInPlace::reservation
    #[must_use]
    pub unsafe fn with_first_range(self, base: usize, len: usize) -> Self {
        // A table of its own: records of `then`'s blocks made so far are not needed (the
        // range tells theirs apart: outside it), and a range given before is replaced.
        let owners = Owners::default();
        owners.add_range(base, len, FIRST);
        Fallback {
            owners,
            first_range: Some((base, len)),
            ..self
        }
    }

    /// The first tier.
    pub fn first(&self) -> &A {
        self.first.upstream()
    }

    /// The fallback tier.
    pub fn then(&self) -> &B {
        self.then.upstream()
    }

    /// The address range that tells the tiers apart, if one was given
    /// ([`with_first_range`](Self::with_first_range)).
    pub fn first_range(&self) -> Option<(usize, usize)> {
        self.first_range
    }

    /// The figures of `[first, then]`: bytes and allocations each served.
    pub fn tiers(&self) -> [StatisticsSnapshot; 2] {
        [self.first.snapshot(), self.then.snapshot()]
    }

    /// Records a block `then` served (not needed where the address tells).
    fn note_then(&self, ptr: NonNull<u8>) {
        if self.first_range.is_none() {
            self.owners.record(ptr.as_ptr().expose_provenance(), THEN);
        }
    }

    /// Whether `then` served the `layout` block at `ptr` (which the caller is freeing, so
    /// no other thread frees it at the same time), forgetting it if so.
    fn served_by_then(&self, ptr: NonNull<u8>, layout: Layout) -> bool {
        // The block's allocation happened before its free (the caller's contract hands
        // the pointer over with that order), so a block of `then` has been counted.
        if layout.size() == 0 {
            return false; // only `first` serves empty blocks
        }
        let owner = self.owners.take(ptr.as_ptr().addr());
        if self.first_range.is_some() {
            owner != Some(FIRST) // outside `first`'s range: `then`'s
        } else {
            owner == Some(THEN)
        }
    }

    /// Allocates from `first`, else (out of memory) from `then`.
    fn allocate_with(
        &self,
        layout: Layout,
        first: impl FnOnce() -> Result<NonNull<u8>, Error>,
        then: impl FnOnce() -> Result<NonNull<u8>, Error>,
    ) -> Result<NonNull<u8>, Error> {
        match first() {
            Err(Error::OutOfMemory { .. }) if layout.size() > 0 => {
                let p = then()?;
                self.note_then(p);
                Ok(p)
            }
            served => served,
        }
    }
}

impl<A: PartialEq, B: PartialEq, P> PartialEq for Fallback<A, B, P> {
    /// Equal when both tiers are: each can then free the other's blocks.
    fn eq(&self, other: &Self) -> bool {
        self.first() == other.first() && self.then() == other.then()
    }
}

impl<A: fmt::Debug, B: fmt::Debug, P> fmt::Debug for Fallback<A, B, P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Fallback")
            .field("first", self.first())
            .field("then", self.then())
            .finish_non_exhaustive()
    }
}

// SAFETY: every block comes from one tier unchanged and goes back to that tier: a block
// is `then`'s exactly when `owners` recorded it (before the block is handed out, the
// record taken by its free), or, with a first range, outside that range
// (`with_first_range`'s contract); and both tiers give at least `P`.
unsafe impl<A, B, P> SyncResource for Fallback<A, B, P>
where
    A: SyncResource<Properties: Contains<P>>,
    B: SyncResource<Properties: Contains<P>>,
    P: PropertySet,
{
    type Properties = P;

    fn allocate_sync(&self, layout: Layout) -> Result<NonNull<u8>, Error> {
        self.allocate_with(
            layout,
            || self.first.allocate_sync(layout),
            || self.then.allocate_sync(layout),
        )
    }

    unsafe fn deallocate_sync(&self, ptr: NonNull<u8>, layout: Layout) {
        // SAFETY: the caller's promise, for the tier that served the block.
        unsafe {
            if self.served_by_then(ptr, layout) {
                self.then.deallocate_sync(ptr, layout)
            } else {
                self.first.deallocate_sync(ptr, layout)
            }
        }
    }
}

// SAFETY: as for `SyncResource`; a free keeps its stream in the tier it goes to.
unsafe impl<A, B, P> Resource for Fallback<A, B, P>
where
    A: Resource<Properties: Contains<P>>,
    B: Resource<Properties: Contains<P>>,
    P: PropertySet,
{
    fn allocate(&self, stream: StreamRef<'_>, layout: Layout) -> Result<NonNull<u8>, Error> {
        self.allocate_with(
            layout,
            || self.first.allocate(stream, layout),
            || self.then.allocate(stream, layout),
        )
    }

    unsafe fn deallocate(&self, stream: StreamRef<'_>, ptr: NonNull<u8>, layout: Layout) {
        // SAFETY: the caller's promise, for the tier that served the block.
        unsafe {
            if self.served_by_then(ptr, layout) {
                self.then.deallocate(stream, ptr, layout)
            } else {
                self.first.deallocate(stream, ptr, layout)
            }
        }
    }

    unsafe fn deallocate_used_on(
        &self,
        stream: StreamRef<'_>,
        ptr: NonNull<u8>,
        layout: Layout,
        used_on: &[StreamRef<'_>],
    ) {
        // SAFETY: the caller's promise, for the tier that served the block.
        unsafe {
            if self.served_by_then(ptr, layout) {
                self.then.deallocate_used_on(stream, ptr, layout, used_on)
            } else {
                self.first.deallocate_used_on(stream, ptr, layout, used_on)
            }
        }
    }
}

#[cfg(all(test, not(memres_loom)))]
mod tests {
    use super::*;
    use crate::adaptor::Limiting;
    use crate::property::Host;
    use crate::resource::layout;
    use crate::upstream::HostHeap;

    fn tiers(first_limit: usize) -> Fallback<Limiting<HostHeap>, Limiting<HostHeap>, Host> {
        Fallback::new(
            Limiting::new(HostHeap::new(), first_limit),
            Limiting::new(HostHeap::new(), 1 << 30),
        )
    }

    /// Requests go to the first tier until it is full, then to the second; each block is
    /// freed through the tier that served it (each `Limiting` counts exactly its own),
    /// whatever the order of the frees and their streams.
    #[test]
    fn frees_reach_the_tier_that_served_the_block() {
        let r = tiers(1 << 20);
        let l = layout(256 << 10).unwrap();
        let blocks: Vec<_> = (0..8u32)
            .map(|i| (r.allocate(StreamRef::host(i), l).unwrap(), i))
            .collect();
        assert_eq!(
            r.first().allocated_bytes(),
            1 << 20,
            "four blocks fill the first tier"
        );
        assert_eq!(
            r.then().allocated_bytes(),
            1 << 20,
            "four more in the second"
        );
        let [first, then] = r.tiers();
        assert_eq!(
            (first.allocations.current, then.allocations.current),
            (4, 4)
        );
        assert_eq!(then.bytes.peak, 1 << 20);
        // Freed in an order that mixes the tiers (odd ones, then even ones), each on
        // another stream than its own.
        let (odd, even): (Vec<_>, Vec<_>) = blocks.into_iter().partition(|(_, i)| i % 2 == 1);
        for (n, (p, i)) in odd.into_iter().chain(even).enumerate() {
            // SAFETY: allocated above with `l`, not used; freed once.
            unsafe { r.deallocate(StreamRef::host(i + 100), p, l) };
            if n == 3 {
                assert_eq!(r.first().allocated_bytes(), 512 << 10, "two of each freed");
                assert_eq!(r.then().allocated_bytes(), 512 << 10);
            }
        }
        assert_eq!(r.first().allocated_bytes() + r.then().allocated_bytes(), 0);
        let p = r.allocate_sync(l).unwrap();
        // SAFETY: as above.
        unsafe { r.deallocate_sync(p, l) };
    }

    /// Only out-of-memory falls back: a request no tier can take (an alignment the
    /// first refuses as invalid) is that error, and a full second tier is out of memory.
    #[test]
    fn only_out_of_memory_falls_back() {
        let r = tiers(1 << 20);
        let huge = layout(2 << 30).unwrap();
        assert!(matches!(
            r.allocate_sync(huge),
            Err(Error::OutOfMemory { .. })
        ));
        let [first, then] = r.tiers();
        assert_eq!((first.allocations.total, then.allocations.total), (0, 0));
        let fits_then = layout(4 << 20).unwrap();
        let p = r.allocate_sync(fits_then).unwrap();
        assert_eq!(r.tiers()[1].bytes.current, 4 << 20);
        // SAFETY: allocated above with `fits_then`, not used.
        unsafe { r.deallocate_sync(p, fits_then) };
        assert_eq!(r.then().allocated_bytes(), 0);
        // A zero-byte request is the first tier's, and never falls back.
        let zero = Layout::from_size_align(0, 256).unwrap();
        let z = r.allocate_sync(zero).unwrap();
        // SAFETY: as above.
        unsafe { r.deallocate_sync(z, zero) };
        assert_eq!(r.tiers()[1].allocations.total, 1);
    }

    /// With the first tier's range known, each free goes by its address: no set is kept,
    /// and every block still reaches the tier that served it (each tier's own count ends
    /// at zero), whatever the order and the stream of the frees.
    #[test]
    fn a_first_range_routes_frees_by_address_without_the_set() {
        use crate::upstream::{GrowInPlace, HostVirtual};
        use crate::{VirtualPool, VirtualPoolConfig};

        let pool = HostVirtual::with_limit(1 << 30, 64 << 10, 1 << 20)
            .and_then(|v| VirtualPool::new(v, VirtualPoolConfig::new()))
            .unwrap();
        let (base, len) = pool.upstream().reservation();
        // SAFETY: the pool's blocks lie in its leaf's reservation; the heap's never do.
        let r = unsafe {
            Fallback::<_, _, Host>::new(pool, Limiting::new(HostHeap::new(), 1 << 30))
                .with_first_range(base, len)
        };
        let l = layout(192 << 10).unwrap();
        let mut blocks: Vec<_> = (0..12u32)
            .map(|i| (r.allocate(StreamRef::host(i % 3), l).unwrap(), i % 3))
            .collect();
        let [first, then] = r.tiers();
        assert!(first.allocations.current > 0 && then.allocations.current > 0);
        assert_eq!(r.owners.recorded(), 0, "no record kept");
        // Freed in another order, some on other streams.
        blocks.reverse();
        blocks.rotate_left(5);
        for (p, s) in blocks {
            // SAFETY: allocated above with `l`, not used; host streams.
            unsafe { r.deallocate(StreamRef::host((s + 1) % 3), p, l) };
        }
        let [first, then] = r.tiers();
        assert_eq!((first.bytes.current, then.bytes.current), (0, 0));
        assert_eq!(
            r.then().allocated_bytes(),
            0,
            "each heap block went back to the heap"
        );
        assert_eq!(
            r.first().stats().live_bytes(),
            0,
            "and each pool block to the pool"
        );
    }
}
