//! Sleep and wake for the virtual pool ([`VirtualPool::sleep`], [`VirtualPool::wake`]):
//! the physical memory goes back to the driver while the addresses stay reserved, so that
//! every block, and whatever recorded its address (a captured CUDA graph), is where it
//! was once the pool wakes.

use super::VirtualPool;
use super::grow::{Mapped, Space};
use super::slept::{SleepMode, Slept};
use crate::error::Error;
use crate::resource::Resource;
use crate::suballoc::coalescing::GrowthState;
use crate::sync::atomic::Ordering;

/// The most bytes copied or mapped in one piece: a wake maps the next piece while the
/// last one's contents are copied back. (Small in the tests, so that their pools have
/// several.)
const PIECE: usize = if cfg!(test) { 256 << 10 } else { 256 << 20 };

impl<U: Resource> VirtualPool<U> {
    /// Puts the pool to sleep: gives every granule it holds back to the driver while its
    /// address range stays reserved, so that [`wake`](Self::wake) maps memory at the same
    /// addresses again and every block handed out is valid where it was. What the blocks
    /// hold is lost or kept on the host as `mode` says. Returns the bytes given back.
    ///
    /// First it waits for all work on the device (every stream), gives fully free
    /// granules back as [`trim`](Self::trim) does, then (for [`SleepMode::Offload`])
    /// copies the rest to host memory and unmaps it. While the pool sleeps:
    /// - allocations fail with [`Error::Asleep`] (not a wait);
    /// - frees are taken (the block is free once the pool wakes), as are
    ///   [`trim`](Self::trim) (it gives nothing back) and [`stats`](Self::stats)
    ///   (`pool_size` 0, [`PoolStats::asleep_bytes`](crate::suballoc::PoolStats::asleep_bytes) what waking maps);
    /// - dropping the pool frees the host copies.
    ///
    /// After a wake the host copies are kept ([`PoolStats::host_copy_bytes`](crate::suballoc::PoolStats::host_copy_bytes)), so that the
    /// next offloading sleep (an RL loop sleeps every step) only copies: pinning host
    /// memory costs far more than copying into it (3.2 against 55 GB/s on an H200).
    /// [`trim`](Self::trim) frees them.
    ///
    /// Errors leave the pool awake and its memory where it was:
    /// [`Error::InvalidArgument`] for a pool asleep already, [`Error::OutOfMemory`] when
    /// host memory for the copies runs out. (Only this pool sleeps: a chunked
    /// [`Pool`](crate::suballoc::Pool) has no such method, since only mapped granules can
    /// go back while their addresses stay.)
    ///
    /// Separate pools sleep and wake separately: a program that wants its weights back
    /// before its KV cache gives each its own pool (a tag each, in the C ABI and Python:
    /// `memres.tag("weights")`) and wakes them in turn.
    ///
    /// ```
    /// use memres::{
    ///     Resource, StreamRef, VirtualPoolConfig, layout,
    ///     suballoc::SleepMode,
    ///     upstream::HostVirtual,
    /// };
    ///
    /// let pool = HostVirtual::new(1 << 30, 64 << 10)?.virtual_pool(VirtualPoolConfig::new())?;
    /// let l = layout(100 << 10)?;
    /// let p = pool.allocate(StreamRef::HOST, l)?;
    /// // SAFETY: fresh block of 100 KiB, host memory.
    /// unsafe { p.as_ptr().write_bytes(7, l.size()) };
    /// // SAFETY: nothing touches the block until the pool wakes.
    /// let released = unsafe { pool.sleep(SleepMode::Offload)? };
    /// assert_eq!(released, 128 << 10);
    /// assert!(pool.allocate(StreamRef::HOST, l).is_err(), "no memory while asleep");
    /// pool.wake()?;
    /// // SAFETY: the block is mapped again, with its contents.
    /// assert_eq!(unsafe { p.as_ptr().add(l.size() - 1).read() }, 7);
    /// // SAFETY: allocated above with `l`; not used afterwards.
    /// unsafe { pool.deallocate(StreamRef::HOST, p, l) };
    /// # Ok::<(), memres::Error>(())
    /// ```
    ///
    /// # Safety
    /// From this call until [`wake`](Self::wake) returns `Ok`, nothing uses the memory of
    /// this pool's blocks, on the host or on any stream: it is not mapped (a kernel that
    /// touches it faults, and so does the host). Work enqueued before the call is waited
    /// for.
    pub unsafe fn sleep(&self, mode: SleepMode) -> Result<usize, Error> {
        let (core, space) = (&self.core, &self.core.holding);
        let _pin = core.lists.pin(); // (see `ListTable::retire`)
        let mut growth = core.lock_growth();
        if growth.memory.slept.is_some() {
            return Err(Error::invalid_argument(
                "the pool is asleep already: wake it before it sleeps again",
            ));
        }
        // From here allocations fail at once. One already past that check may still take
        // a listed block (its memory then sleeps with the rest: the caller's race, which
        // `sleep`'s contract rules out), but none maps memory: growth looks at `slept`
        // under the growth lock, held here until the pool sleeps.
        space.asleep.store(true, Ordering::SeqCst);
        match self.fall_asleep(space, &mut growth, mode) {
            Ok(slept) => {
                let size = slept.size();
                growth.size -= size;
                growth.memory.slept = Some(slept);
                tracing::debug!(target: "memres::pool", size, ?mode, "memres: pool asleep");
                Ok(size)
            }
            Err(e) => {
                space.asleep.store(false, Ordering::SeqCst);
                Err(e)
            }
        }
    }

    /// Waits for the device, gives free granules back, copies the rest (`Offload`) and
    /// unmaps it; on an error nothing is unmapped but what `trim` would have given back.
    fn fall_asleep(
        &self,
        space: &Space<U>,
        growth: &mut GrowthState<Mapped>,
        mode: SleepMode,
    ) -> Result<Slept, Error> {
        (space.synchronize)(&self.core.upstream)?;
        let host = self.core.host_list();
        self.core.release_down_to(growth, host, 0)?;
        let g = space.granularity;
        let piece = PIECE.next_multiple_of(g);
        let pieces: Vec<(usize, usize)> = growth
            .memory
            .mapped
            .mapped_runs()
            .into_iter()
            .flat_map(|(first, n)| {
                let (start, end) = (space.base + first * g, space.base + (first + n) * g);
                (start..end)
                    .step_by(piece)
                    .map(move |addr| (addr, piece.min(end - addr)))
            })
            .collect();
        let copies = match mode {
            SleepMode::Discard => Vec::new(),
            // SAFETY: mapped by the pool; all work on the device is done (waited for
            // above) and the caller promises no new use until the pool wakes.
            // The copies an earlier wake kept are used again: this sleep only copies.
            SleepMode::Offload => unsafe {
                (space.save)(&self.core.upstream, &pieces, &mut growth.memory.kept)?
            },
        };
        for &(addr, len) in &pieces {
            // SAFETY: mapped by this pool; no work uses them (as above), and the copies,
            // if any, are made.
            unsafe { (space.unmap)(&self.core.upstream, addr, len) };
        }
        Ok(Slept {
            mode,
            pieces,
            copies,
        })
    }

    /// Wakes a sleeping pool: maps its memory again at the addresses it had and, if it
    /// slept with [`SleepMode::Offload`], copies the contents back. Returns the bytes
    /// mapped. Afterwards the pool serves allocations as before it slept.
    ///
    /// [`Error::InvalidArgument`] for a pool that is not asleep; [`Error::OutOfMemory`]
    /// when the device cannot back the memory (another process holds it): the pool stays
    /// asleep with its copies, and a later `wake` may succeed.
    pub fn wake(&self) -> Result<usize, Error> {
        let (core, space) = (&self.core, &self.core.holding);
        let _pin = core.lists.pin(); // (see `ListTable::retire`)
        let mut growth = core.lock_growth();
        let Some(slept) = growth.memory.slept.take() else {
            return Err(Error::invalid_argument(
                "the pool is not asleep: wake() without sleep()",
            ));
        };
        if let Err(e) = self.wake_up(space, &slept) {
            growth.memory.slept = Some(slept);
            return Err(e);
        }
        let size = slept.size();
        growth.size += size;
        growth.peak = growth.peak.max(growth.size);
        space.asleep.store(false, Ordering::SeqCst);
        tracing::debug!(target: "memres::pool", size, mode = ?slept.mode, "memres: pool awake");
        // Pinning host memory costs far more than copying into it (and unpinning about as
        // much): the copies are kept for the next sleep, until `trim` (or the drop).
        growth.memory.kept.extend(slept.copies);
        Ok(size)
    }

    /// Maps every piece of `slept`, each followed by the copy of its contents (which runs
    /// while the next piece is mapped), then waits for the copies; on an error unmaps
    /// what it mapped.
    fn wake_up(&self, space: &Space<U>, slept: &Slept) -> Result<(), Error> {
        let mut mapped = 0;
        let result = (|| {
            for (i, &(addr, len)) in slept.pieces.iter().enumerate() {
                (space.map)(&self.core.upstream, addr, len)?;
                mapped += 1;
                if let Some(copy) = slept.copies.get(i) {
                    // SAFETY: mapped just above, by this pool; nothing uses a sleeping
                    // pool's memory (`sleep`'s contract) and `slept` lives until the
                    // copies are waited for, below.
                    unsafe { (space.restore)(&self.core.upstream, addr, len, copy)? };
                }
            }
            (space.synchronize)(&self.core.upstream)
        })();
        if result.is_err() {
            // Copies may be under way into what is about to be unmapped.
            let waited = (space.synchronize)(&self.core.upstream);
            for &(addr, len) in &slept.pieces[..mapped] {
                if waited.is_err() {
                    // A broken device: leave the memory mapped rather than unmap it under
                    // a copy (the pool stays asleep; dropping it leaves the leaf to
                    // unmap what is mapped).
                    break;
                }
                // SAFETY: mapped above by this call; nothing uses it and the copies into
                // it are done (waited for above).
                unsafe { (space.unmap)(&self.core.upstream, addr, len) };
            }
        }
        result
    }

    /// Whether the pool sleeps ([`sleep`](Self::sleep)).
    pub fn is_asleep(&self) -> bool {
        self.core.holding.asleep.load(Ordering::Relaxed)
    }
}
