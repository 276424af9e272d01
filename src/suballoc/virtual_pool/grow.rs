//! How a [`VirtualPool`](super::VirtualPool) holds memory ([`Space`], its [`Holding`]):
//! its growth maps the granules a request lacks right after its free memory, and its
//! release unmaps fully free granules; the rest of the pool is its body, [`Coalescing`],
//! shared with the chunked [`Pool`](crate::suballoc::Pool).

use super::config::VirtualPoolConfig;
use super::slept::{self, Slept};
use crate::device::Context;
use crate::error::Error;
use crate::resource::Resource;
use crate::stream::StreamRef;
use crate::suballoc::coalescing::{Coalescing, GrowthState, Holding};
use crate::suballoc::core::free_blocks::{FreeBlock, FreeBlocks, GRANULE};
use crate::suballoc::core::free_list::FreeList;
use crate::suballoc::core::list_table::List;
use crate::sync::atomic::{AtomicBool, Ordering};
use crate::upstream::GrowInPlace;
use crate::upstream::Registering;
use crate::upstream::virtual_memory::{Granules, HostCopy};

/// [`GrowInPlace::save_at`]: copies of `(address, bytes)` ranges in host memory.
type Save<U> = unsafe fn(&U, &[(usize, usize)], &mut Vec<HostCopy>) -> Result<Vec<HostCopy>, Error>;

/// [`GrowInPlace::prepare_host_memory`]: host memory made ahead of a sleep.
type Prepare<U> = fn(&U, &[usize], usize) -> Result<Vec<HostCopy>, Error>;

/// [`GrowInPlace::wake_at`]: maps ranges again, with their copies if any.
type Wake<U> =
    unsafe fn(&U, &[(usize, usize)], &[HostCopy], &mut Vec<HostCopy>) -> Result<(), Error>;

/// How a pool that grows in place reaches its upstream ([`GrowInPlace`]'s methods, taken
/// when the pool is made, so that `VirtualPool<U>` needs no other bound), with its
/// configuration and whether it sleeps.
pub(crate) struct Space<U> {
    pub(super) base: usize,
    pub(super) granularity: usize,
    pub(super) map: fn(&U, usize, usize) -> Result<(), Error>,
    pub(super) unmap: unsafe fn(&U, usize, usize),
    pub(super) unmap_ranges: unsafe fn(&U, &[(usize, usize)]),
    keep_unmapped: fn(&U, bool),
    pub(super) offload: Save<U>,
    pub(super) wake: Wake<U>,
    pub(super) prepare: Prepare<U>,
    pub(super) is_staging: fn(&U, &HostCopy) -> bool,
    pub(super) register: fn(&U, &[&HostCopy]) -> Option<Registering>,
    pub(super) synchronize: fn(&U) -> Result<(), Error>,
    pub(super) config: VirtualPoolConfig,
    /// Set while the pool sleeps (read first by every allocation; written under the
    /// growth lock, with [`Mapped::slept`]).
    pub(super) asleep: AtomicBool,
}

impl<U: GrowInPlace> Space<U> {
    /// The reservation of `upstream`, with `config`.
    pub(super) fn new(upstream: &U, config: VirtualPoolConfig) -> Space<U> {
        Space {
            base: upstream.reservation().0,
            granularity: upstream.granularity(),
            map: <U as GrowInPlace>::map_at,
            unmap: <U as GrowInPlace>::unmap_at,
            unmap_ranges: <U as GrowInPlace>::unmap_ranges_at,
            keep_unmapped: <U as GrowInPlace>::keep_unmapped,
            offload: <U as GrowInPlace>::offload_at,
            wake: <U as GrowInPlace>::wake_at,
            prepare: <U as GrowInPlace>::prepare_host_memory,
            is_staging: <U as GrowInPlace>::is_staging_buffer,
            register: <U as GrowInPlace>::register_host_copies,
            synchronize: <U as GrowInPlace>::synchronize,
            config,
            asleep: AtomicBool::new(false),
        }
    }
}

/// What a [`VirtualPool`](super::VirtualPool) holds, under its growth lock.
#[derive(Default)]
pub(crate) struct Mapped {
    /// The registration of the host copies (`slept`'s and `kept`'s) under way, if any:
    /// stopped (dropped) before anything copies into or out of them or frees them, and
    /// first of the fields, so that it stops before they go.
    pub(super) registering: Option<Registering>,
    /// Which granules of the reservation it holds (while it sleeps: which it maps again
    /// when woken).
    pub(super) mapped: Granules,
    /// Set while the pool sleeps: what waking it maps and restores.
    pub(super) slept: Option<Slept>,
    /// Host memory kept for the next offloading sleep and wake (freed by `trim`): the
    /// copies a wake kept, and the pinned staging buffers the copies went through.
    pub(super) kept: Vec<HostCopy>,
    /// The most the pool has held, or held and asked for at a growth that mapped (what it
    /// held and the request), since it was made or last released memory other than at a
    /// growth (a trim, its release threshold, an out-of-memory retry; one that found
    /// nothing to give back too): a growth that stays well below it keeps its free
    /// granules (see [`Coalescing::grow_in_place`]).
    pub(super) high_water: usize,
}

/// Keeps the physical memory of granules unmapped while it lives for the maps that follow
/// (see [`GrowInPlace::keep_unmapped`]); gives the rest back when dropped.
pub(super) struct KeepUnmapped<'a, U> {
    space: &'a Space<U>,
    upstream: &'a U,
}

impl<'a, U> KeepUnmapped<'a, U> {
    pub(super) fn new(space: &'a Space<U>, upstream: &'a U) -> Self {
        (space.keep_unmapped)(upstream, true);
        KeepUnmapped { space, upstream }
    }
}

impl<U> Drop for KeepUnmapped<'_, U> {
    fn drop(&mut self) {
        (self.space.keep_unmapped)(self.upstream, false);
    }
}

impl<U: Resource> Holding<U> for Space<U> {
    type Memory = Mapped;

    // Host `cross-stream` 1.136 -> 1.100 of live (BENCHMARKS.md, issue 51 item 5).
    const MERGES_FREEING_HOST_LISTS: bool = true;

    // Not the large cache: a cached block is handed out again where it was, not low,
    // which costs footprint (host, `random` seed 42: 1.128 of live against 1.114).
    fn new_free_list(&self, _memory: &Mapped) -> FreeList {
        FreeList::new(std::iter::empty(), Some(self.base))
    }

    fn grow(
        pool: &Coalescing<U, Space<U>>,
        growth: &mut GrowthState<Mapped>,
        stream: StreamRef<'_>,
        own: &List<FreeList>,
        size: usize,
        align: usize,
        may_wait: bool,
    ) -> Result<Option<usize>, Error> {
        pool.grow_in_place(growth, stream, own, size, align, may_wait)
    }

    fn release(
        pool: &Coalescing<U, Space<U>>,
        growth: &mut GrowthState<Mapped>,
        from: &List<FreeList>,
        keep: usize,
    ) -> usize {
        pool.unmap_free_granules(growth, from, keep)
    }

    fn segments(&self, memory: &Mapped) -> Vec<(usize, usize)> {
        if memory.slept.is_some() {
            return Vec::new(); // nothing is mapped while the pool sleeps
        }
        let g = self.granularity;
        memory
            .mapped
            .mapped_runs()
            .into_iter()
            .map(|(first, n)| (self.base + first * g, n * g))
            .collect()
    }

    fn upstream_allocations(memory: &Mapped) -> usize {
        memory.mapped.mapped_runs().len()
    }

    fn drop_memory(pool: &Coalescing<U, Space<U>>, memory: Mapped) {
        if memory.slept.is_some() {
            return; // asleep: nothing is mapped (the copies go with `memory`)
        }
        if !crate::device::process_is_exiting()
            && let Err(e) = pool.lists.synchronize_streams()
        {
            tracing::error!("a pool could not wait for its streams before freeing: {e}");
        }
        let space = &pool.holding;
        let g = space.granularity;
        for (first, n) in memory.mapped.mapped_runs() {
            // SAFETY: granules this pool mapped; it is going away and its streams' work
            // is complete (above), so nothing uses them.
            unsafe { (space.unmap)(&pool.upstream, space.base + first * g, n * g) };
        }
    }

    #[inline(always)]
    fn is_asleep(&self) -> bool {
        self.asleep.load(Ordering::Relaxed)
    }

    fn asleep_bytes(memory: &Mapped) -> Option<usize> {
        memory.slept.as_ref().map(Slept::size)
    }

    fn host_copy_bytes(memory: &Mapped) -> usize {
        memory.slept.as_ref().map_or(0, Slept::copy_bytes) + slept::bytes(&memory.kept)
    }

    fn take_host_copies(memory: &mut Mapped) -> Vec<HostCopy> {
        // The copies go: their registration stops first (and a sleeping pool's, whose
        // copies are then staged where they are not registered yet).
        memory.registering = None;
        std::mem::take(&mut memory.kept)
    }
}

impl<U: Resource> Coalescing<U, Space<U>> {
    /// In-place growth: maps the fewest granules that make a free block holding `size`
    /// bytes from its first address aligned to `align`, in any unmapped run of the
    /// reservation, together with the free blocks on either side of it (so the pieces of
    /// partly free granules left around unmapped holes are used again, not only the free
    /// block at the top of what the pool holds). A growth that takes the pool into the
    /// top eighth of the most it has held, or past it, first gives back the whole free
    /// granules it does not join; one below keeps them. Without `may_wait` (under
    /// capture) it gives nothing back, since that waits for the stream.
    // long: pick sites, remap surplus, map one: the steps share one lock guard.
    fn grow_in_place(
        &self,
        growth: &mut GrowthState<Mapped>,
        stream: StreamRef<'_>,
        own: &List<FreeList>,
        size: usize,
        align: usize,
        may_wait: bool,
    ) -> Result<Option<usize>, Error> {
        let space = &self.holding;
        let g = space.granularity;
        // What the request takes of the pool: `size` (the sites map what it needs at its
        // aligned start), with room for the alignment's worst case past the granule's (the
        // caller checked that this does not overflow).
        let most = if align <= g {
            size
        } else {
            size + (align - GRANULE)
        };
        let mut s = own.state.lock();
        s.flush();
        let step = space.config.step.next_multiple_of(g).max(g);
        // The sites, from what is mapped and free now (the top: what the pool holds).
        let sites = |mapped: &Granules, free: &FreeBlocks| {
            let top = space.base + mapped.top() * g;
            growth_sites(space, mapped, free, size, align, top, step)
        };
        let mut tries = sites(&growth.memory.mapped, &s.free);
        let Some(best) = tries.first().copied() else {
            return Ok(None);
        };
        // A site of no bytes: the free block beside its run holds the request already
        // (the index's search, which looks at a few blocks of the request's own size
        // class, missed it, or a thread sharing the list freed it since the search). No
        // growth: the request is cut from that block, nothing given back or mapped (a map
        // of no bytes is refused: on a GPU, `cuMemSetAccess` of 0 bytes is
        // `CUDA_ERROR_INVALID_VALUE`).
        if let Some(b) = holder(&tries, size, align) {
            return Ok(Some(cut(&mut s, b, size, align)));
        }
        // Free granules elsewhere in the list hold memory that this growth would add to:
        // when the growth takes the pool near the most it has held (its top eighth or
        // above), give every one of them back, so that what the pool holds at its peaks
        // follows what is live rather than how fragmented its range is. (Blocks of
        // `own`'s stream may still be in use by its work: wait for it first. The free
        // blocks the growth joins stay.) Every one, not only as many bytes as the growth
        // maps: a growth is the only moment the pool's size rises, and whole free
        // granules kept through it are held at that moment without serving anything.
        // Keeping as much as the growth mapped left `cross-stream` (the allocating stream
        // sees the other's frees only at its next merge) at 1.128 of live on the H100
        // where `random` is 1.107; all of them: see BENCHMARKS.md (issue 51, item 5).
        // Well below the peak the free granules stay for later requests: moving a
        // granule costs the driver about 50 us (an unmap, a map and its access), and
        // giving back at every growth cost a program whose sizes vary widely 25-34 us an
        // allocation on the H100 (`python/proofs/alloc_cost.py`; the peaks, and so the
        // footprint rows, are the same: BENCHMARKS.md, issue 51 item 2).
        let mark = growth.memory.high_water;
        let grown = growth.size.saturating_add(most);
        let near_peak = grown > mark - mark / 8;
        let joined = best
            .joins
            .map(|b| b.map_or(0, |b| b.size))
            .iter()
            .sum::<usize>();
        let surplus = s.free_bytes() - joined;
        // Granules unmapped here are mapped again at the growth site: their memory moves
        // (a remap) rather than being given back and allocated anew.
        let _keep = KeepUnmapped::new(space, &self.upstream);
        let spare = best.joins.map(|b| b.map_or(usize::MAX, |b| b.addr));
        // Only when a free block outside the joined ones holds a whole granule: else
        // nothing can move, and the wait (for the stream, `wait_for_list`) would be for
        // nothing.
        let whole_granule_free = || {
            s.free.blocks().any(|b| {
                let lo = (b.addr - space.base).next_multiple_of(g);
                !spare.contains(&b.addr) && lo + g <= b.addr - space.base + b.size
            })
        };
        // A release threshold is free memory the pool may keep: a growth keeps as much of
        // its surplus too (so a program whose sizes vary widely does not remap granules at
        // every growth: `python/proofs/alloc_cost.py`, BENCHMARKS.md).
        let keep = self.release_threshold.unwrap_or(0);
        if may_wait && near_peak && surplus >= g && surplus > keep && whole_granule_free() {
            let waited = own.ctx.map_or(Ok(()), |ctx| wait_for_list(stream, ctx));
            if waited.is_ok() && self.unmap_in(growth, &mut s, keep + joined, spare) > 0 {
                // Unmapping made new holes: a better site may be among them.
                tries = sites(&growth.memory.mapped, &s.free);
            }
        }
        for site in tries {
            if let Some(b) = holder(&[site], size, align) {
                // (A site of no bytes that the give-back above made: cut, as above.)
                return Ok(Some(cut(&mut s, b, size, align)));
            }
            if self
                .maximum(growth)
                .is_some_and(|max| growth.size.saturating_add(site.len) > max)
            {
                continue;
            }
            // Where the site's block will start: the mapped granules join the free block
            // before them, whether the site counted it or not.
            let start = s.free.ending_at(site.addr).map_or(site.addr, |b| b.addr);
            match self.map_into(growth, &mut s, site.addr, site.len) {
                Ok(()) => {
                    // Only a growth that maps raises the mark: a request that fails was
                    // never held.
                    growth.memory.high_water = growth.memory.high_water.max(grown);
                    self.lists.note_free(own);
                    // The list's search, as for any request; where it looks for room for
                    // the alignment's worst case, which the site may not have mapped, the
                    // site's block (the joined free blocks with the granules mapped).
                    let taken = s.free.take(size, align).or_else(|| {
                        let b = s.free.starting_at(start)?;
                        fits(b, size, align).then(|| cut(&mut s, b, size, align))
                    });
                    debug_assert!(taken.is_some(), "in-place growth fits its request");
                    return Ok(taken);
                }
                Err(Error::OutOfMemory { .. }) => continue,
                Err(e) => return Err(e),
            }
        }
        Ok(None)
    }

    /// Maps `addr..addr + len` (whole unmapped granules) and puts it, free, in `into`.
    pub(super) fn map_into(
        &self,
        growth: &mut GrowthState<Mapped>,
        into: &mut FreeList,
        addr: usize,
        len: usize,
    ) -> Result<(), Error> {
        let space = &self.holding;
        (space.map)(&self.upstream, addr, len)?;
        let g = space.granularity;
        growth
            .memory
            .mapped
            .set((addr - space.base) / g, len / g, true);
        growth.size += len;
        growth.allocs += 1;
        growth.peak = growth.peak.max(growth.size);
        growth.memory.high_water = growth.memory.high_water.max(growth.size);
        into.insert(addr, len);
        tracing::debug!(
            target: "memres::pool",
            addr,
            len,
            held = growth.size,
            "memres: pool grew in place"
        );
        Ok(())
    }

    /// Unmaps fully free granules of `from`'s list (which holds all free memory, the
    /// lists having been merged into it), highest first, until at most `keep` bytes are
    /// free. Returns how many bytes went back.
    fn unmap_free_granules(
        &self,
        growth: &mut GrowthState<Mapped>,
        from: &List<FreeList>,
        keep: usize,
    ) -> usize {
        let mut s = from.state.lock();
        s.flush();
        // Blocks freed on `from`'s own stream may still be in use by its work.
        let waited = || match from.ctx.map_or(Ok(()), |ctx| ctx.synchronize()) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!("a pool could not wait for a stream to return memory: {e}");
                false
            }
        };
        let released = if s.free_bytes() > keep && waited() {
            self.unmap_in(growth, &mut s, keep, [usize::MAX; 2])
        } else {
            0
        };
        // What the pool holds now is where its growths measure their peak from.
        growth.memory.high_water = growth.size;
        released
    }

    /// Unmaps fully free granules of blocks in `s` other than those starting at an
    /// address in `spare`, highest first, until at most `keep` bytes of `s` are free. The
    /// caller has made sure that no work uses the blocks of `s`.
    fn unmap_in(
        &self,
        growth: &mut GrowthState<Mapped>,
        s: &mut FreeList,
        keep: usize,
        spare: [usize; 2],
    ) -> usize {
        let space = &self.holding;
        let g = space.granularity;
        let mut free = s.free_bytes();
        let mut blocks: Vec<FreeBlock> = s.free.blocks().collect();
        blocks.sort_unstable_by_key(|b| std::cmp::Reverse(b.addr));
        let mut released = 0;
        for b in blocks {
            if free <= keep {
                break;
            }
            let end = b.addr + b.size;
            if spare.contains(&b.addr) {
                continue;
            }
            let lo = space.base + (b.addr - space.base).next_multiple_of(g);
            let hi = space.base + (end - space.base) / g * g;
            if hi <= lo {
                continue;
            }
            // Only as many granules (from the top of the block) as bring `free` to `keep`.
            let lo = lo.max(hi.saturating_sub((free - keep).next_multiple_of(g)));
            carve(s, b, lo, hi);
            // SAFETY: whole mapped granules inside a free block, handed out to no one;
            // no work uses `s`'s blocks (this function's contract, kept by its callers).
            unsafe { (space.unmap)(&self.upstream, lo, hi - lo) };
            growth
                .memory
                .mapped
                .set((lo - space.base) / g, (hi - lo) / g, false);
            growth.size -= hi - lo;
            growth.frees += 1;
            free -= hi - lo;
            released += hi - lo;
        }
        if released > 0 {
            tracing::debug!(
                target: "memres::pool",
                released,
                held = growth.size,
                "memres: pool unmapped free granules"
            );
        }
        released
    }
}

/// The free block beside a site of no bytes among `sites`, which holds `size` bytes
/// aligned to `align` by itself, if there is such a site.
fn holder(sites: &[Site], size: usize, align: usize) -> Option<FreeBlock> {
    sites
        .iter()
        .filter(|site| site.len == 0)
        .flat_map(|site| site.joins)
        .flatten()
        .find(|&b| fits(b, size, align))
}

/// Whether `size` bytes aligned to `align` fit in `b`.
fn fits(b: FreeBlock, size: usize, align: usize) -> bool {
    aligned_end(b.addr, size, align).is_some_and(|end| end <= b.addr + b.size)
}

/// Where `size` bytes aligned to `align` from `addr` on end.
fn aligned_end(addr: usize, size: usize, align: usize) -> Option<usize> {
    addr.checked_next_multiple_of(align)?.checked_add(size)
}

/// Cuts `size` bytes aligned to `align` out of `b`, a free block of `s` that holds them
/// with room for the alignment; the pieces on either side stay free.
fn cut(s: &mut FreeList, b: FreeBlock, size: usize, align: usize) -> usize {
    let addr = b.addr.next_multiple_of(align);
    carve(s, b, addr, addr + size);
    addr
}

/// Takes `lo..hi` out of `b`, a free block of `s` that contains it; the pieces on either
/// side stay free.
fn carve(s: &mut FreeList, b: FreeBlock, lo: usize, hi: usize) {
    s.free.remove_starting_at(b.addr);
    if lo > b.addr {
        s.insert(b.addr, lo - b.addr);
    }
    let end = b.addr + b.size;
    if end > hi {
        s.insert(hi, end - hi);
    }
}

/// Waits until no work of `stream`, whose list a growth gives whole free granules of
/// back, can use a block of that list: the stream alone, not its whole device `ctx`, so
/// that a growth does not wait for other streams' work (NCCL's collectives, under DDP).
/// Blocks other streams freed reach the list only after a wait for those streams
/// (`ListTable::merge_into`); a block used on another stream before its free waits in
/// the pool's held blocks until that stream's work is done. The whole device where the
/// list may hold blocks freed on several threads' streams of one name (the per-thread
/// default stream).
fn wait_for_list(stream: StreamRef<'_>, ctx: Context) -> Result<(), Error> {
    if stream.is_per_thread() {
        ctx.synchronize()
    } else {
        stream.synchronize_in(ctx)
    }
}

/// A place where a virtual pool can grow: `len` bytes of unmapped granules at `addr`,
/// which join the free blocks `joins` (before, after) into one block. A site of no bytes:
/// one of `joins` holds the request by itself.
#[derive(Clone, Copy, Debug)]
struct Site {
    addr: usize,
    len: usize,
    joins: [Option<FreeBlock>; 2],
}

/// Where a virtual pool can map memory so that, with the free blocks next to it, one
/// free block holds `size` bytes aligned to `align`: the sites that map the fewest bytes
/// first (lowest address among equals), at most one per unmapped run. At the top of what
/// the pool holds (`top`), a site maps at least `step` when the reservation has room,
/// followed by the same site without the step as a fallback.
fn growth_sites(
    space: &Space<impl Resource>,
    mapped: &Granules,
    free: &FreeBlocks,
    size: usize,
    align: usize,
    top: usize,
    step: usize,
) -> Vec<Site> {
    let g = space.granularity;
    let mut sites = Vec::new();
    for (first, n) in mapped.unmapped_runs() {
        let (lo, hi) = (space.base + first * g, space.base + (first + n) * g);
        let before = free.ending_at(lo);
        let after = free.starting_at(hi);
        let a = after.map_or(0, |b| b.size);
        // Where the request ends, aligned from the block before's start (or the run's).
        let Some(end) = aligned_end(before.map_or(lo, |b| b.addr), size, align) else {
            continue;
        };
        if end > hi + a {
            continue;
        }
        // Map next to the block before, next to the one after (the granules mapped start
        // the block there, aligned as a granule is: room for a larger alignment's worst
        // case), or the whole run.
        let from_before = end.saturating_sub(lo).next_multiple_of(g);
        let slack = if align <= g { 0 } else { align - GRANULE };
        let from_after = (size + slack).saturating_sub(a).next_multiple_of(g);
        let site = if from_before <= n * g && from_before <= from_after {
            Site {
                addr: lo,
                len: from_before,
                joins: [before, None],
            }
        } else if from_after <= n * g {
            Site {
                addr: hi - from_after,
                len: from_after,
                joins: [None, after],
            }
        } else {
            Site {
                addr: lo,
                len: n * g,
                joins: [before, after],
            }
        };
        if lo == top && site.len < step && step <= n * g {
            sites.push((site.len, Site { len: step, ..site }));
        }
        sites.push((site.len, site));
    }
    // Stable: among equal needs the lower address (and the stepped top site) first.
    sites.sort_by_key(|&(need, _)| need);
    sites.into_iter().map(|(_, site)| site).collect()
}
