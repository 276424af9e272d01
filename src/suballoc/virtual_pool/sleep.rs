//! Sleep and wake for the virtual pool ([`VirtualPool::sleep`], [`VirtualPool::wake`]):
//! the physical memory goes back to the driver while the addresses stay reserved, so that
//! every block, and whatever recorded its address (a captured CUDA graph), is where it
//! was once the pool wakes.

use super::VirtualPool;
use super::grow::{Mapped, Space};
use super::slept::{self, SleepMode, Slept};
use crate::error::Error;
use crate::resource::Resource;
use crate::suballoc::coalescing::GrowthState;
use crate::sync::atomic::Ordering;
use crate::upstream::HostCopy;
use crate::upstream::virtual_memory::Granules;

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
    /// How `Offload` copies: into pageable host memory (one `mmap` per 256 MiB piece,
    /// aligned to 2 MiB, with transparent huge pages asked for, `madvise(MADV_HUGEPAGE)`,
    /// unless `/sys/kernel/mm/transparent_hugepage/enabled` says `[never]` or
    /// `MEMRES_OFFLOAD_HUGE_PAGES=0`; a kernel that refuses the advice gives small pages,
    /// silently), registered as they are copied into (below), else through pinned staging
    /// buffers of 4 MiB, two per copying thread, on as many threads as the machine has
    /// cores (one less for a wake; no more than one per 256 MiB to copy, each costing the device about 1 MiB
    /// while the pool sleeps; at most 16; the environment variable
    /// `MEMRES_OFFLOAD_THREADS` sets another number). Each thread
    /// has the device copy one chunk into a buffer, on a stream of its own, while it
    /// copies the chunk before out of its other buffer; the wake runs the same way back,
    /// while the pool maps the next pieces (on one thread; `MEMRES_OFFLOAD_MAP_THREADS`
    /// sets another number, 1 to 16, and a `Discard` sleep gives the memory back on as
    /// many). An `Offload` sleep unmaps each piece on the calling thread as soon as its
    /// copies are done, while the others are copied; until they all are, the leaf keeps
    /// the memory it unmapped (so that a failure maps those pieces again from it, with
    /// their contents), and gives it back to the device then. The driver maps and unmaps each granule on its own, which
    /// costs more than copying a 2 MiB one; larger granules,
    /// [`CudaVirtualConfig::granularity`](crate::upstream::CudaVirtualConfig::granularity),
    /// cost less). So no sleep allocates pinned memory the size of the pool
    /// (`cuMemHostAlloc`: 3.2 GB/s against 55 for copies on an H200; a first sleep that
    /// did took 10 to 17 s for 20 GiB): the kernel backs the copies' pages as the threads
    /// write them, and registering backed pages in place costs little (the `memres::pool`
    /// debug event "the sleep's steps" gives the time of each step). Backing fresh pages
    /// is what a first sleep costs over a second: 5 million faults of 4 KiB for 20 GiB,
    /// 10,240 of 2 MiB where the kernel has huge pages to give.
    ///
    /// The copying threads register the copies with the driver as they go
    /// (`cuMemHostRegister`, 32 MiB at a time, from each copy's start, each piece backed
    /// by the thread writing it first; the copies are private anonymous mappings, which
    /// the driver registers whether their pages are huge or small) and have the device
    /// copy into them directly, one DMA a chunk: in a first sleep the device so writes each
    /// byte of the copies once, after the kernel zeroed it, with no staging buffer and
    /// `memcpy` between (20 GiB from an H200 at 24.7-26.6 GiB/s with 16 MiB granules, against
    /// 18.4-24.9 staged; BENCHMARKS.md, "First sleep"), and its wake reads registered
    /// copies. Where a registration fails, the rest of that copy is staged, and once the
    /// sleep returns a thread of the pool's registers what is left;
    /// [`registered_host_bytes`](Self::registered_host_bytes) says how far it got. A wake
    /// stops that thread first (waiting for at most one piece), copies the registered part
    /// back directly and the rest through the staging buffers, and starts it again for
    /// what is left; so do the next sleep and [`prepare_offload`](Self::prepare_offload).
    /// `MEMRES_OFFLOAD_REGISTER=0` turns the registration off (every copy staged).
    ///
    /// **What the pool holds while asleep**: the host copies, as many bytes as it
    /// offloaded, pageable until registered, then page-locked (not swappable) as the
    /// registration goes, and the staging buffers if any chunk was staged. **What it holds
    /// while awake**, once it has slept with `Offload`: the same host copies (page-locked as
    /// far as they are registered: the whole pool's size once the registration is done,
    /// which a sleep that registered as it went did by its end) and the staging buffers
    /// (pinned, `2 × threads × 4 MiB`, at most 128 MiB; none where nothing was staged), kept for the next sleep
    /// (an RL loop sleeps every step), which then only copies, and counted in
    /// [`PoolStats::host_copy_bytes`](crate::suballoc::PoolStats::host_copy_bytes).
    /// [`trim`](Self::trim) stops the registration and frees them (unregistered). A pool
    /// that never offloaded holds no host memory.
    ///
    /// Errors leave the pool awake and its memory where it was (unless a piece it had
    /// unmapped cannot be mapped again, or its contents copied back, after a failure: a
    /// driver or device failure; that memory is then lost, and the failure logged at
    /// error level):
    /// [`Error::InvalidArgument`] for a pool asleep already, [`Error::OutOfMemory`] when
    /// host memory for the copies or the staging buffers runs out, a driver error when a
    /// copy fails. What host memory it took is kept for the next sleep, as after a wake. (Only this pool sleeps: a chunked
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
        // Nothing registers the copies while they are copied into.
        growth.memory.registering = None;
        // From here allocations fail at once. One already past that check may still take
        // a listed block (its memory then sleeps with the rest: the caller's race, which
        // `sleep`'s contract rules out), but none maps memory: growth looks at `slept`
        // under the growth lock, held here until the pool sleeps.
        space.asleep.store(true, Ordering::SeqCst);
        let asleep = match self.fall_asleep(space, &mut growth, mode) {
            Ok(slept) => {
                let size = slept.size();
                growth.size -= size;
                growth.frees += slept.pieces.len() as u64;
                growth.memory.slept = Some(slept);
                tracing::debug!(target: "memres::pool", size, ?mode, "memres: pool asleep");
                Ok(size)
            }
            Err(e) => {
                space.asleep.store(false, Ordering::SeqCst);
                Err(e)
            }
        };
        self.register_copies(&mut growth.memory);
        asleep
    }

    /// Waits for the device, gives free granules back, copies the rest (`Offload`) and
    /// unmaps it; on an error nothing is unmapped but what `trim` would have given back.
    fn fall_asleep(
        &self,
        space: &Space<U>,
        growth: &mut GrowthState<Mapped>,
        mode: SleepMode,
    ) -> Result<Slept, Error> {
        let start = std::time::Instant::now();
        (space.synchronize)(&self.core.upstream)?;
        let host = self.core.host_list();
        self.core.release_down_to(growth, host, 0)?;
        let trimmed = start.elapsed();
        let pieces = pieces(space, &growth.memory.mapped);
        let copies = match mode {
            // SAFETY: mapped by this pool, apart from each other; no work uses them (as
            // above) nor will until the pool wakes (the caller's promise).
            SleepMode::Discard => unsafe {
                (space.unmap_ranges)(&self.core.upstream, &pieces);
                Vec::new()
            },
            // SAFETY: as above. The copies an earlier wake kept are used again; each
            // piece is unmapped once copied, while the others are copied.
            SleepMode::Offload => unsafe {
                (space.offload)(&self.core.upstream, &pieces, &mut growth.memory.kept)?
            },
        };
        tracing::debug!(
            target: "memres::pool",
            wait_and_trim_s = trimmed.as_secs_f64(),
            copy_and_unmap_s = (start.elapsed() - trimmed).as_secs_f64(),
            "memres: the sleep's steps"
        );
        Ok(Slept {
            mode,
            pieces,
            copies,
        })
    }

    /// Wakes a sleeping pool: maps its memory again at the addresses it had and, if it
    /// slept with [`SleepMode::Offload`], copies the contents back (on several threads,
    /// through the staging buffers, while the next pieces are mapped: see
    /// [`sleep`](Self::sleep)). Returns the bytes mapped. Afterwards the pool serves
    /// allocations as before it slept.
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
        // Nothing registers the copies while they are copied from: the registered part
        // is copied directly, the rest staged.
        growth.memory.registering = None;
        // SAFETY: nothing uses a sleeping pool's memory (`sleep`'s contract) until this
        // call returns; the pieces were mapped by this pool when it slept, and the copies
        // (if any) are theirs, one a piece.
        let woken = unsafe {
            (space.wake)(
                &core.upstream,
                &slept.pieces,
                &slept.copies,
                &mut growth.memory.kept,
            )
        };
        if let Err(e) = woken {
            growth.memory.slept = Some(slept);
            self.register_copies(&mut growth.memory);
            return Err(e);
        }
        let size = slept.size();
        growth.size += size;
        growth.allocs += slept.pieces.len() as u64;
        growth.peak = growth.peak.max(growth.size);
        space.asleep.store(false, Ordering::SeqCst);
        tracing::debug!(target: "memres::pool", size, mode = ?slept.mode, "memres: pool awake");
        // Backing host memory costs more than copying into it: the copies are kept for
        // the next sleep (with the staging buffers, already there), until `trim` (or the
        // drop).
        growth.memory.kept.extend(slept.copies);
        self.register_copies(&mut growth.memory);
        Ok(size)
    }

    /// Starts registering what is left unregistered of the pool's host copies, on a
    /// thread of its own (see [`sleep`](Self::sleep)), stopping a registration under way.
    fn register_copies(&self, memory: &mut Mapped) {
        memory.registering = None;
        let copies: Vec<&HostCopy> = memory
            .slept
            .iter()
            .flat_map(|s| &s.copies)
            .chain(&memory.kept)
            .collect();
        memory.registering = (self.core.holding.register)(&self.core.upstream, &copies);
    }

    /// Bytes of the pool's host copies registered with the driver (page-locked): the
    /// device copies them back on a wake (and into them on a sleep) directly, without
    /// the staging buffers. A registration runs on a thread of its own after every
    /// offloading sleep, wake and [`prepare_offload`](Self::prepare_offload), until the
    /// copies are registered whole; see [`sleep`](Self::sleep).
    pub fn registered_host_bytes(&self) -> usize {
        let growth = self.core.lock_growth();
        let memory = &growth.memory;
        memory
            .slept
            .iter()
            .flat_map(|s| &s.copies)
            .chain(&memory.kept)
            .map(HostCopy::registered)
            .sum()
    }

    /// Makes ahead the host memory that an offloading [`sleep`](Self::sleep) of what the
    /// pool holds now would make: host copies (pageable, as many bytes as the pool
    /// holds, their pages backed now, on as many threads as a sleep copies on, then
    /// registered in the background as after a sleep) and, where copies are not
    /// registered (`MEMRES_OFFLOAD_REGISTER=0`), the pinned staging buffers, less what the
    /// pool keeps already (an earlier sleep's, or an earlier call's). Returns the bytes made. The first sleep then only copies,
    /// as later ones do: backing fresh host memory runs far slower than copying into it
    /// on some machines (in virtual machines that hand memory back to their host), and
    /// it costs the host memory from now on rather than from the sleep.
    ///
    /// The memory counts in [`PoolStats::host_copy_bytes`](crate::suballoc::PoolStats::host_copy_bytes)
    /// and stays until [`trim`](Self::trim) (which frees it) or the drop; memory the pool
    /// maps later is copied into new host memory when it sleeps. The pool serves
    /// allocations meanwhile (the memory is made outside its locks).
    ///
    /// [`Error::InvalidArgument`] for a sleeping pool; [`Error::OutOfMemory`] when the host
    /// lacks the room (nothing is kept then); [`Error::Unsupported`] for an upstream that
    /// cannot copy to the host.
    ///
    /// ```
    /// use memres::{Resource, StreamRef, VirtualPoolConfig, layout, suballoc::SleepMode, upstream::HostVirtual};
    ///
    /// let pool = HostVirtual::new(1 << 30, 64 << 10)?.virtual_pool(VirtualPoolConfig::new())?;
    /// let l = layout(1 << 20)?;
    /// let p = pool.allocate(StreamRef::HOST, l)?;
    /// let made = pool.prepare_offload()?;
    /// assert!(made >= 1 << 20, "a copy of the pool");
    /// assert_eq!(pool.prepare_offload()?, 0, "made already");
    /// // SAFETY: nothing touches the block until the pool wakes.
    /// unsafe { pool.sleep(SleepMode::Offload)? };
    /// assert_eq!(pool.stats().host_copy_bytes, made, "the sleep made no more");
    /// pool.wake()?;
    /// // SAFETY: allocated above with `l`; not used afterwards.
    /// unsafe { pool.deallocate(StreamRef::HOST, p, l) };
    /// # Ok::<(), memres::Error>(())
    /// ```
    pub fn prepare_offload(&self) -> Result<usize, Error> {
        let space = &self.core.holding;
        let (lens, staging) = {
            let growth = self.core.lock_growth();
            if growth.memory.slept.is_some() {
                return Err(Error::invalid_argument(
                    "the pool is asleep: prepare_offload() is for an awake pool",
                ));
            }
            let kept = &growth.memory.kept;
            let staging = kept
                .iter()
                .filter(|&c| (space.is_staging)(&self.core.upstream, c))
                .count();
            // The pieces a kept copy would hold (as a sleep picks them: the smallest that
            // holds each) need none.
            let mut free: Vec<usize> = kept
                .iter()
                .filter(|&c| !(space.is_staging)(&self.core.upstream, c))
                .map(HostCopy::len)
                .collect();
            free.sort_unstable();
            let lens: Vec<usize> = pieces(space, &growth.memory.mapped)
                .into_iter()
                .map(|(_, len)| len)
                .filter(|&len| {
                    let fit = free.partition_point(|&f| f < len);
                    let held = fit < free.len();
                    if held {
                        free.remove(fit);
                    }
                    !held
                })
                .collect();
            (lens, staging)
        };
        if lens.is_empty() {
            return Ok(0); // kept already, or nothing mapped
        }
        let made = (space.prepare)(&self.core.upstream, &lens, staging)?;
        let bytes = slept::bytes(&made);
        let mut growth = self.core.lock_growth();
        growth.memory.kept.extend(made);
        // Registered now, in the background: the first sleep then copies directly.
        self.register_copies(&mut growth.memory);
        drop(growth);
        tracing::debug!(target: "memres::pool", bytes, "memres: host memory made for a sleep");
        Ok(bytes)
    }

    /// Whether the pool sleeps ([`sleep`](Self::sleep)).
    pub fn is_asleep(&self) -> bool {
        self.core.holding.asleep.load(Ordering::Relaxed)
    }
}

/// What the pool maps in `mapped`, as `(address, bytes)` in address order: the mapped
/// runs cut into pieces of at most `PIECE` bytes (whole granules), which a sleep copies
/// one host copy each.
fn pieces<U>(space: &Space<U>, mapped: &Granules) -> Vec<(usize, usize)> {
    let g = space.granularity;
    let piece = PIECE.next_multiple_of(g);
    mapped
        .mapped_runs()
        .into_iter()
        .flat_map(|(first, n)| {
            let (start, end) = (space.base + first * g, space.base + (first + n) * g);
            (start..end)
                .step_by(piece)
                .map(move |addr| (addr, piece.min(end - addr)))
        })
        .collect()
}
