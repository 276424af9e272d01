//! The pool that grows in place ([`Pool::in_place`], [`Virtual::pool`]): its growth maps
//! the granules a request lacks right after its free memory, and its release unmaps
//! fully free granules; the rest of the pool is shared with the chunked one.

use super::*;
use crate::upstream::virtual_memory::{Backend, HostCopy, Virtual};

/// [`GrowInPlace::save_at`]: copies of `(address, bytes)` ranges in host memory.
type Save<U> = unsafe fn(&U, &[(usize, usize)], &mut Vec<HostCopy>) -> Result<Vec<HostCopy>, Error>;

/// How a pool that grows in place reaches its upstream ([`GrowInPlace`]'s methods, taken
/// when the pool is made, so that `Pool<U>` needs no other bound).
pub(super) struct Space<U> {
    pub(super) base: usize,
    pub(super) granularity: usize,
    pub(super) map: fn(&U, usize, usize) -> Result<(), Error>,
    pub(super) unmap: unsafe fn(&U, usize, usize),
    keep_unmapped: fn(&U, bool),
    pub(super) save: Save<U>,
    pub(super) restore: unsafe fn(&U, usize, usize, &HostCopy) -> Result<(), Error>,
    pub(super) synchronize: fn(&U) -> Result<(), Error>,
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

// The in-place pool's constructor on its leaf, written here beside the pool (not in
// `upstream`, which imports nothing from `suballoc`).
impl<B: Backend> Virtual<B> {
    /// A [`Pool`] over this leaf that grows in place ([`Pool::in_place`]).
    ///
    /// ```
    /// use memres::{HostVirtual, PoolConfig, Resource, StreamRef, layout};
    ///
    /// let pool = HostVirtual::new(1 << 30, 64 << 10)?.pool_in_place(PoolConfig::new())?;
    /// let l = layout(100 << 10)?;
    /// let p = pool.allocate(StreamRef::HOST, l)?;
    /// assert_eq!(pool.stats().pool_size, 128 << 10, "two 64 KiB granules");
    /// // SAFETY: allocated just above with `l` on the same stream; not used afterwards.
    /// unsafe { pool.deallocate(StreamRef::HOST, p, l) };
    /// pool.trim()?;
    /// assert_eq!(pool.stats().pool_size, 0);
    /// # Ok::<(), memres::Error>(())
    /// ```
    pub fn pool_in_place(self, config: PoolConfig) -> Result<Pool<Virtual<B>>, Error> {
        Pool::in_place(self, config)
    }

    /// The in-place pool under its old name, kept so that code written for it keeps the
    /// pool growing in place (without it, `.pool(config)` on the leaf would reach
    /// [`ResourceExt::pool`](crate::ResourceExt::pool), a chunked pool over the leaf).
    #[deprecated(note = "renamed `pool_in_place` (`ResourceExt::pool` makes a chunked pool)")]
    pub fn pool(self, config: PoolConfig) -> Result<Pool<Virtual<B>>, Error> {
        self.pool_in_place(config)
    }
}

impl<U: Resource> Pool<U> {
    /// A pool that grows in place over `upstream`'s reserved range: it maps only what a
    /// request lacks (whole granules, at least [`PoolConfig::growth_step`]) right after
    /// the free memory at the top of what it holds, so blocks merge across growth steps
    /// and no upstream allocation boundary fragments it; [`trim`](Self::trim) unmaps
    /// every fully free granule, also between live blocks. `config.initial()` is mapped
    /// at once (rounded up to the granularity); `config.maximum()` bounds what is mapped
    /// (a maximum below one granule, or one that the rounded initial size passes, is
    /// [`Error::InvalidArgument`]).
    ///
    /// ```
    /// use memres::{HostVirtual, Pool, PoolConfig, Resource, StreamRef, layout};
    ///
    /// let pool = Pool::in_place(HostVirtual::new(1 << 30, 64 << 10)?, PoolConfig::new())?;
    /// let (a, b) = (layout(96 << 10)?, layout(96 << 10)?);
    /// let pa = pool.allocate(StreamRef::HOST, a)?; // maps two 64 KiB granules
    /// let pb = pool.allocate(StreamRef::HOST, b)?;
    /// // The second growth mapped only the one granule b lacked, right after the first two.
    /// assert_eq!(pool.stats().pool_size, 192 << 10);
    /// // SAFETY: each freed once with its layout; unused afterwards.
    /// unsafe {
    ///     pool.deallocate(StreamRef::HOST, pa, a);
    ///     pool.deallocate(StreamRef::HOST, pb, b);
    /// }
    /// assert_eq!(pool.stats().largest_free_block, 192 << 10, "merged across growths");
    /// # Ok::<(), memres::Error>(())
    /// ```
    // long: config checks, each error written out, then one struct literal.
    pub fn in_place(upstream: U, config: PoolConfig) -> Result<Pool<U>, Error>
    where
        U: GrowInPlace,
    {
        config.validate()?;
        let granularity = upstream.granularity();
        let (base, len) = upstream.reservation();
        if !granularity.is_power_of_two() || granularity < GRANULE {
            return Err(Error::invalid_argument(format!(
                "an in-place pool needs a granularity that is a power of two of at least \
                 {GRANULE} bytes; the upstream's is {granularity}"
            )));
        }
        // The pool maps whole granules and never holds more than its maximum.
        if let Some(max) = config.maximum {
            if max < granularity {
                return Err(Error::invalid_argument(format!(
                    "an in-place pool's maximum of {max} bytes is below one granule of its \
                     upstream ({granularity} bytes): it could never map anything"
                )));
            }
            if config.initial.next_multiple_of(granularity) > max {
                return Err(Error::invalid_argument(format!(
                    "an in-place pool's initial size of {} bytes rounds up to {} bytes \
                     (whole granules of {granularity}), above its maximum of {max}",
                    config.initial,
                    config.initial.next_multiple_of(granularity)
                )));
            }
        }
        let pool = Pool {
            upstream,
            config,
            growth: Mutex::new(GrowthState {
                mapped: Granules::new(len / granularity),
                ..GrowthState::default()
            }),
            shards: ShardMap::default(),
            space: Some(Space {
                base,
                granularity,
                map: <U as GrowInPlace>::map_at,
                unmap: <U as GrowInPlace>::unmap_at,
                keep_unmapped: <U as GrowInPlace>::keep_unmapped,
                save: <U as GrowInPlace>::save_at,
                restore: <U as GrowInPlace>::restore_at,
                synchronize: <U as GrowInPlace>::synchronize,
            }),
            release_pending: AtomicBool::new(false),
            asleep: AtomicBool::new(false),
            held: Deferred::default(),
            host_key: StreamKey::of_lane(StreamRef::HOST),
        };
        // As in `new`: the host list exists from the start.
        let host = pool.new_shard(pool.host_key);
        if config.initial > 0 {
            let mut growth = pool.lock_growth();
            let space = pool.space.as_ref().expect("set above");
            let len = config.initial.next_multiple_of(granularity);
            let mut s = host.state.lock();
            pool.map_into(space, &mut growth, &mut s, base, len)?;
            pool.shards.note_free(host);
        }
        Ok(pool)
    }

    /// In-place growth: maps the fewest granules that make a free block of `min` bytes
    /// (`size` with room for `align`), in any unmapped run of the reservation, together
    /// with the free blocks on either side of it (so the pieces of partly free granules
    /// left around unmapped holes are used again, not only the free block at the top of
    /// what the pool holds). Without `may_wait` (under capture) it gives nothing back
    /// first, since that waits for the stream.
    // long: pick sites, remap surplus, map one: the steps share one lock guard.
    pub(super) fn grow_in_place(
        &self,
        space: &Space<U>,
        growth: &mut GrowthState,
        own: &Shard<PoolShard>,
        size: usize,
        align: usize,
        may_wait: bool,
    ) -> Result<Option<usize>, Error> {
        // The caller checked that this does not overflow.
        let min = size + (align - GRANULE);
        let g = space.granularity;
        let mut s = own.state.lock();
        s.flush();
        let step = self.config.step.next_multiple_of(g).max(g);
        let top = space.base + growth.mapped.top() * g;
        let mut tries = growth_sites(space, &growth.mapped, &s.free, min, top, step);
        let Some(best) = tries.first().copied() else {
            return Ok(None);
        };
        // Free granules elsewhere in the list hold memory that this growth would add to:
        // give back as much as is about to be mapped, so that what the pool holds follows
        // what is live rather than how fragmented its range is. (Blocks of `own`'s stream
        // may still be in use by its work: wait for it first. The free blocks the growth
        // joins stay.)
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
        // nothing can move, and the wait (for the whole device) would be for nothing.
        let whole_granule_free = || {
            s.free.blocks().any(|b| {
                let lo = (b.addr - space.base).next_multiple_of(g);
                !spare.contains(&b.addr) && lo + g <= b.addr - space.base + b.size
            })
        };
        if may_wait && surplus >= g && whole_granule_free() {
            let waited = own.ctx.map_or(Ok(()), |ctx| ctx.synchronize());
            if waited.is_ok() {
                let keep = s.free_bytes().saturating_sub(best.len);
                if self.unmap_in(space, growth, &mut s, keep, spare) > 0 {
                    // Unmapping made new holes: a better site may be among them.
                    let top = space.base + growth.mapped.top() * g;
                    tries = growth_sites(space, &growth.mapped, &s.free, min, top, step);
                }
            }
        }
        for site in tries {
            if growth
                .maximum(self.config.maximum)
                .is_some_and(|max| growth.size.saturating_add(site.len) > max)
            {
                continue;
            }
            match self.map_into(space, growth, &mut s, site.addr, site.len) {
                Ok(()) => {
                    self.shards.note_free(own);
                    let taken = s.free.take(size, align);
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
        space: &Space<U>,
        growth: &mut GrowthState,
        into: &mut PoolShard,
        addr: usize,
        len: usize,
    ) -> Result<(), Error> {
        (space.map)(&self.upstream, addr, len)?;
        let g = space.granularity;
        growth.mapped.set((addr - space.base) / g, len / g, true);
        growth.size += len;
        growth.peak = growth.peak.max(growth.size);
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
    pub(super) fn unmap_free_granules(
        &self,
        space: &Space<U>,
        growth: &mut GrowthState,
        from: &Shard<PoolShard>,
        keep: usize,
    ) -> usize {
        let mut s = from.state.lock();
        s.flush();
        if s.free_bytes() <= keep {
            return 0;
        }
        // Blocks freed on `from`'s own stream may still be in use by its work.
        if let Some(ctx) = from.ctx
            && let Err(e) = ctx.synchronize()
        {
            tracing::warn!("a pool could not wait for a stream to return memory: {e}");
            return 0;
        }
        self.unmap_in(space, growth, &mut s, keep, [usize::MAX; 2])
    }

    /// Unmaps fully free granules of blocks in `s` other than those starting at an
    /// address in `spare`, highest first, until at most `keep` bytes of `s` are free. The
    /// caller has made sure that no work uses the blocks of `s`.
    pub(super) fn unmap_in(
        &self,
        space: &Space<U>,
        growth: &mut GrowthState,
        s: &mut PoolShard,
        keep: usize,
        spare: [usize; 2],
    ) -> usize {
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
            s.free.remove_starting_at(b.addr);
            if lo > b.addr {
                s.insert(b.addr, lo - b.addr);
            }
            if end > hi {
                s.insert(hi, end - hi);
            }
            // SAFETY: whole mapped granules inside a free block, handed out to no one;
            // no work uses `s`'s blocks (this function's contract, kept by its callers).
            unsafe { (space.unmap)(&self.upstream, lo, hi - lo) };
            growth
                .mapped
                .set((lo - space.base) / g, (hi - lo) / g, false);
            growth.size -= hi - lo;
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
