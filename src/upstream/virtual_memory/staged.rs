//! Staged copies between a virtual-memory leaf's memory and pageable host copies, for a
//! pool that sleeps with [`SleepMode::Offload`](crate::suballoc::SleepMode::Offload)
//! ([`GrowInPlace::save_at`], [`GrowInPlace::wake_at`]).
//!
//! Why staged: the device copies at the bus's speed only to and from pinned memory, and
//! pinning costs far more than copying (`cuMemHostAlloc`: about 3 GB/s on an H200 where
//! copies ran at 55, and several threads pinning at once were slower still), so copies
//! pinned for the whole pool made a first sleep of 20 GiB take 10 to 17 s. Instead the
//! copies are pageable memory ([`HostCopy::pages`]: one `mmap` each, backed by the kernel
//! as it is written) and the device copies through a few pinned staging buffers per
//! thread. Each thread has a [`Lane`](super::Backend::Lane) (a stream) and two buffers of
//! [`CHUNK`] bytes: the device copies one chunk into a buffer while the thread copies the
//! chunk before it out of the other into its place in the copy, and so also backs (and
//! zeroes) the copy's pages, work spread over the threads too. A wake runs the other way:
//! a thread fills a buffer from the copy and has the device copy it to the chunk's
//! address once its range is mapped, while the calling thread and a few more map the
//! next ranges (see below). The
//! staging buffers (two a thread: at most `2 × 16 × 4 MiB` = 128 MiB) and the copies go
//! back to the caller's spares, for the next sleep and wake. Backing fresh pages may still
//! be slow (in a virtual machine that hands freed memory back to its host), so [`prepare`]
//! makes both ahead of a sleep, the copies' pages backed by threads writing them.
//!
//! A chunk that lies in the registered part of its copy ([`HostCopy::registered`]) skips
//! the staging: the device copies it to or from the copy directly, one DMA and no memcpy,
//! and its slot takes no staging buffer. A sleep registers the copies as it copies into
//! them: a range whose copy is not registered as far as it reaches goes whole to one
//! thread ([`copy_registering`]), which backs the copy a piece at a time, registers the
//! piece and copies into it directly; only where a registration fails is the rest of the
//! range staged (and registered in the background afterwards, `registered.rs`). So in a
//! first sleep the device writes each byte of the copies once, after the kernel zeroed it
//! (where staging also passed it through a staging buffer and a `memcpy`), and its wake,
//! and every sleep and wake after it, run at the bus's speed.
//!
//! Threads take a sleep's whole ranges first, then chunks, in order, each from a counter
//! of its own. One that fails records its error and
//! raises `stop`, which the others check before each chunk (and which wakes those waiting
//! for a range to be mapped); each waits for its lanes' copies before it ends, so when the
//! call returns no copy is under way. Only where a lane cannot be waited for (a broken
//! device) are its staging buffers leaked rather than freed under a copy, and the caller
//! told (`unsettled`), so that it leaves the device memory mapped.
//!
//! Mapping is the slow part of a wake, not the copies: the driver backs every granule with
//! a `cuMemCreate`, a `cuMemMap` and a `cuMemSetAccess` of its own (a granule is the unit a
//! pool gives back, and a mapping cannot start inside a larger allocation), about 37 µs a
//! granule on an H200 (`benches/gpu/map_parts.cu`: access 26-33, create 11-18, map 1-4),
//! so 0.38 s for 20 GiB where the copies take 0.4; a sleep's `cuMemUnmap`s and releases
//! cost 30-40 µs a granule too. So a wake maps its ranges on
//! [`map_threads`] threads (the calling thread and `MEMRES_OFFLOAD_MAP_THREADS - 1` more,
//! 1 in all unless it says otherwise, [`MAP_THREADS`]), each taking the next range not taken yet, in order,
//! and marking it mapped once the driver is done ([`Shared::map_ranges`]). The leaf
//! claims a range under its lock and calls the driver outside it (`Virtual::map_at`), so
//! the threads map at once as far as the driver lets them (it takes the calls from any
//! thread). A failed map stops every thread; the ranges marked mapped, and only those, are
//! unmapped again.
//!
//! A sleep ([`offload`]) unmaps the other way round: the calling thread unmaps each range
//! as soon as the threads have counted all its chunks as copied ([`Shared::copied`],
//! after waiting for their lanes; [`Shared::unmap_copied`]), while the rest is copied, so
//! that the driver's unmaps run under the copies (one thread; what it has not unmapped
//! when the copies end is left for after). Until the copies are all done the leaf keeps
//! the memory it unmaps ([`GrowInPlace::keep_unmapped`]), and gives it back then (0.15-0.18
//! s for 20 GiB of 2 MiB granules on an H200, after the copies): a failure maps the
//! ranges unmapped so far again from it and copies their contents back, so that a failed
//! sleep leaves the pool as it found it (unless that map or copy fails too: a broken
//! device; the memory is then lost, and the failure logged).

use std::sync::Arc;

use super::host_copy::Pages;
use super::registered::{self, Registrar};
use super::{Backend, GrowInPlace, HostCopy, Virtual};
use crate::error::Error;
use crate::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use crate::sync::{Condvar, Mutex, lock};

/// Bytes a staging buffer holds: the most one copy of the device moves. (Small in the
/// tests, and not a multiple of their pools' pieces, so that ranges end in short chunks.)
pub(crate) const CHUNK: usize = if cfg!(test) { 96 << 10 } else { 4 << 20 };

/// The most threads that copy at once.
const MAX_THREADS: usize = 16;

/// The environment variable that sets how many threads a sleep or wake copies on (1 to
/// 16); unset, as many as the machine has cores (less one for a wake, whose calling
/// thread maps meanwhile), one per 256 MiB to copy, at most 16.
pub(crate) const THREADS_VARIABLE: &str = "MEMRES_OFFLOAD_THREADS";

/// The environment variable that sets how many threads a wake maps on, and a discarding
/// sleep unmaps on (1 to 16; unset, [`MAP_THREADS`]; an offloading sleep unmaps on its
/// calling thread while it copies, [`offload`]).
pub(crate) const MAP_THREADS_VARIABLE: &str = "MEMRES_OFFLOAD_MAP_THREADS";

/// How many threads a wake maps on and a discarding sleep unmaps on, unless
/// [`MAP_THREADS_VARIABLE`] says otherwise. The driver's calls are per granule
/// (`cuMemCreate`, `cuMemMap` and `cuMemSetAccess` for each, `cuMemUnmap` and
/// `cuMemRelease` for each), 30-50 µs a granule on an H100 or H200: 0.4-0.6 s for 20 GiB
/// of 2 MiB granules, as long as the copies. More threads did not help there: the
/// driver runs each of these calls one at a time (`benches/gpu/map_parts.cu`), and the wake
/// of 20 GiB took 0.45-0.56 s on one mapping thread against 0.68-0.91 on 4 and 0.70-0.79
/// on 8 (BENCHMARKS.md, "Sleep and wake"). Larger granules do
/// ([`CudaVirtualConfig::granularity`](crate::upstream::CudaVirtualConfig::granularity)).
const MAP_THREADS: usize = 1;

/// One staged copy: `len` bytes at `addr` of the leaf, at `offset` in the copy of range
/// number `range`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Chunk {
    pub(crate) range: usize,
    pub(crate) addr: usize,
    pub(crate) offset: usize,
    pub(crate) len: usize,
}

/// `ranges` (`(address, bytes)`) cut into chunks of at most `chunk` bytes (at least 1), in
/// order: the ranges' order, and addresses rising within each.
pub(crate) fn chunks(ranges: &[(usize, usize)], chunk: usize) -> Vec<Chunk> {
    let chunk = chunk.max(1);
    ranges
        .iter()
        .enumerate()
        .flat_map(|(range, &(addr, len))| {
            (0..len).step_by(chunk).map(move |offset| Chunk {
                range,
                addr: addr + offset,
                offset,
                len: chunk.min(len - offset),
            })
        })
        .collect()
}

/// The fewest chunks a thread is started for unless [`THREADS_VARIABLE`] says otherwise:
/// 256 MiB. Each copying thread costs the device about 1 MiB while the pool sleeps (on an
/// H100, GPT-2's pools of 1,374 MiB: the device's free memory rose by 1,358 MiB after a
/// sleep on 16 threads, 1,372 on one), and a small pool copies as fast on few threads (the
/// same sleep: 203 ms on 16, 195 on one).
const CHUNKS_PER_THREAD: usize = if cfg!(test) { 2 } else { (256 << 20) / CHUNK };

/// How many threads copy `chunks` chunks `direction`: [`THREADS_VARIABLE`], else the
/// machine's cores (4 in the tests, whatever the machine), less one for a wake, whose
/// calling thread maps meanwhile, and no more than one per [`CHUNKS_PER_THREAD`]; at
/// most 16, at least 1, and no more than there are chunks.
fn threads(chunks: usize, direction: Direction) -> usize {
    let cores = if cfg!(test) {
        4
    } else {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    };
    let set = std::env::var(THREADS_VARIABLE).ok();
    thread_count(set.as_deref(), cores, chunks, direction)
}

/// [`threads`] given the variable's value (if set) and the cores.
fn thread_count(set: Option<&str>, cores: usize, chunks: usize, direction: Direction) -> usize {
    let default = match direction {
        Direction::Out => cores,
        Direction::In => cores.saturating_sub(1),
    }
    .min(chunks.div_ceil(CHUNKS_PER_THREAD));
    set.and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or(default)
        .min(MAX_THREADS)
        .min(chunks)
        .max(1)
}

/// How many threads map (or unmap) `ranges` ranges: [`MAP_THREADS_VARIABLE`], else
/// [`MAP_THREADS`]; at most 16, at least 1, no more than there are ranges. One under
/// loom (whose models run a wake's protocol on threads of their own).
pub(crate) fn map_threads(ranges: usize) -> usize {
    if cfg!(memres_loom) {
        return 1;
    }
    let set = std::env::var(MAP_THREADS_VARIABLE).ok();
    map_thread_count(set.as_deref(), ranges)
}

/// [`map_threads`] given the variable's value (if set).
fn map_thread_count(set: Option<&str>, ranges: usize) -> usize {
    set.and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or(MAP_THREADS)
        .min(MAX_THREADS)
        .min(ranges)
        .max(1)
}

/// Which ranges are mapped, for the threads of a wake: the mapping threads take ranges in
/// order (`next`) and mark each one done once mapped; the copying threads wait for their
/// chunk's range. For a sleep that unmaps as it goes, `copied` holds the ranges whose
/// copies are all done, for the unmapping thread, which marks each range not done once
/// it is unmapped.
struct Maps {
    done: Vec<bool>,
    next: usize,
    copied: Vec<usize>,
}

/// Where a [`Shared`]'s ranges start.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Start {
    /// Unmapped: a wake's threads map them ([`Shared::map_ranges`]).
    Unmapped,
    /// Mapped, and they stay so: a sleep's copies, unmapped by the caller.
    Mapped,
    /// Mapped, and each is unmapped once its copies are all done
    /// ([`Shared::unmap_copied`]): a sleep that unmaps while it copies.
    Unmapping,
}

/// What the copying threads share.
pub(crate) struct Shared<'a> {
    chunks: &'a [Chunk],
    /// A sleep's ranges whose copies are registered as they are copied into, each as its
    /// chunks (see [`copy_registering`]): a thread takes a whole range.
    groups: &'a [&'a [Chunk]],
    /// The next group to take.
    next_group: AtomicUsize,
    /// Bytes registered of each range's copy, from its start: the chunks that lie in them
    /// are copied directly, the others staged.
    registered: &'a [usize],
    /// The next chunk to take.
    next: AtomicUsize,
    /// Raised (under `mapped`'s lock) by the first failure: no thread starts another
    /// chunk, and the calling thread maps no more.
    stop: AtomicBool,
    error: Mutex<Option<Error>>,
    /// Staging buffers in no thread's hands.
    buffers: Mutex<Vec<HostCopy>>,
    /// Set when a lane could not be waited for: its copies may still be under way.
    unsettled: AtomicBool,
    /// Which ranges are mapped (all of them, for a sleep until it unmaps them), for the
    /// threads of a wake and the unmapping thread of a sleep.
    mapped: Mutex<Maps>,
    ready: Condvar,
    /// For a sleep that unmaps as it goes ([`Start::Unmapping`]): the chunks of each
    /// range whose copies are not known to be done yet (empty otherwise).
    left: Vec<AtomicUsize>,
    /// Copying threads started and not ended: the unmapping thread stops waiting for
    /// ranges once none runs.
    active: AtomicUsize,
}

/// What the copying threads leave: the first error, whether a lane could not be waited
/// for, the staging buffers to keep, and which ranges are mapped.
pub(crate) struct Outcome {
    pub(crate) error: Option<Error>,
    pub(crate) unsettled: bool,
    pub(crate) buffers: Vec<HostCopy>,
    pub(crate) mapped: Vec<bool>,
}

impl<'a> Shared<'a> {
    /// For `chunks` and `groups` (each a range's chunks, taken whole) of `ranges` ranges,
    /// with `buffers` to stage through first; the ranges start as `start` says; the
    /// chunks in the first `registered[range]` bytes of their range's copy are copied
    /// directly.
    pub(crate) fn new(
        chunks: &'a [Chunk],
        groups: &'a [&'a [Chunk]],
        registered: &'a [usize],
        buffers: Vec<HostCopy>,
        ranges: usize,
        start: Start,
    ) -> Self {
        let mapped = start != Start::Unmapped;
        let mut left = Vec::new();
        let mut copied = Vec::new();
        if start == Start::Unmapping {
            let mut counts = vec![0usize; ranges];
            for c in chunks.iter().chain(groups.iter().copied().flatten()) {
                counts[c.range] += 1;
            }
            // A range without chunks (none is empty, but the count decides) has nothing
            // to wait for.
            copied = (0..ranges).filter(|&r| counts[r] == 0).collect();
            left = counts.into_iter().map(AtomicUsize::new).collect();
        }
        Shared {
            chunks,
            groups,
            next_group: AtomicUsize::new(0),
            registered,
            next: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            error: Mutex::new(None),
            buffers: Mutex::new(buffers),
            unsettled: AtomicBool::new(false),
            mapped: Mutex::new(Maps {
                done: vec![mapped; ranges],
                next: if mapped { ranges } else { 0 },
                copied,
            }),
            ready: Condvar::new(),
            left,
            active: AtomicUsize::new(0),
        }
    }

    /// The next chunk, or `None` once they are all taken or a thread failed.
    pub(crate) fn take(&self) -> Option<Chunk> {
        if self.stopped() {
            return None;
        }
        // Each index goes to one thread: the counter only rises.
        let i = self.next.fetch_add(1, Ordering::Relaxed);
        self.chunks.get(i).copied()
    }

    /// The next group (a range's chunks), or `None` once they are all taken or a thread
    /// failed.
    pub(crate) fn take_group(&self) -> Option<&'a [Chunk]> {
        if self.stopped() {
            return None;
        }
        // Each index goes to one thread: the counter only rises.
        let i = self.next_group.fetch_add(1, Ordering::Relaxed);
        self.groups.get(i).copied()
    }

    /// Chunks to copy in all, the groups' included.
    fn chunk_count(&self) -> usize {
        self.chunks.len() + self.groups.iter().map(|g| g.len()).sum::<usize>()
    }

    /// Whether a thread failed.
    pub(crate) fn stopped(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    /// Records `e` (the first error is the one returned) and stops every thread, waking
    /// those that wait for a range.
    pub(crate) fn fail(&self, e: Error) {
        lock(&self.error).get_or_insert(e);
        // Under the lock that waiters check `stop` under, so none misses the wake-up.
        let _mapped = lock(&self.mapped);
        self.stop.store(true, Ordering::Release);
        self.ready.notify_all();
    }

    /// A mapping thread's work: takes the next range not taken yet, in order, and maps it
    /// with `map` (given its number), until none is left or a thread failed (this one,
    /// when `map` fails: nothing of that range stays mapped). A range mapped is marked so
    /// even after a failure elsewhere, so that the caller unmaps it.
    pub(crate) fn map_ranges(&self, map: impl Fn(usize) -> Result<(), Error>) {
        loop {
            let range = {
                let mut maps = lock(&self.mapped);
                if self.stop.load(Ordering::Acquire) || maps.next == maps.done.len() {
                    return;
                }
                maps.next += 1;
                maps.next - 1
            };
            if let Err(e) = map(range) {
                self.fail(e);
                return;
            }
            lock(&self.mapped).done[range] = true;
            self.ready.notify_all();
        }
    }

    /// Counts `n` chunks of range `range` as copied (their lanes were waited for): for a
    /// sleep that unmaps as it goes, the range is handed to the unmapping thread once
    /// the last is. Nothing otherwise.
    pub(crate) fn copied(&self, range: usize, n: usize) {
        let Some(left) = self.left.get(range) else {
            return;
        };
        // Each chunk is counted once, by the thread that copied it.
        if left.fetch_sub(n, Ordering::AcqRel) == n {
            lock(&self.mapped).copied.push(range);
            self.ready.notify_all();
        }
    }

    /// A copying thread is about to start (before it is spawned: the unmapping thread
    /// waits for ranges while one may still copy).
    fn thread_starts(&self) {
        self.active.fetch_add(1, Ordering::AcqRel);
    }

    /// A copying thread ended (or could not be started), waking the unmapping thread.
    fn thread_ends(&self) {
        // Under the lock that the unmapping thread checks `active` under, so that it does
        // not miss the wake-up.
        let _maps = lock(&self.mapped);
        self.active.fetch_sub(1, Ordering::AcqRel);
        self.ready.notify_all();
    }

    /// A sleep's unmapping thread ([`Start::Unmapping`]): unmaps each range with `unmap`
    /// (given its number) once its copies are all done, then marks it unmapped, until a
    /// thread failed, or no copying thread runs and no range waits. A range whose copies
    /// are done when a thread fails stays mapped; the caller unmaps what is left (none
    /// unless no copying thread could start) or, after a failure, maps back what was
    /// unmapped.
    pub(crate) fn unmap_copied(&self, unmap: impl Fn(usize)) {
        loop {
            let range = {
                let mut maps = lock(&self.mapped);
                loop {
                    if self.stop.load(Ordering::Acquire) {
                        return;
                    }
                    if let Some(range) = maps.copied.pop() {
                        break range;
                    }
                    if self.active.load(Ordering::Acquire) == 0 {
                        return;
                    }
                    maps = self
                        .ready
                        .wait(maps)
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                }
            };
            unmap(range);
            lock(&self.mapped).done[range] = false;
        }
    }

    /// Waits until range number `range` is mapped (true) or a thread failed (false).
    pub(crate) fn wait_mapped(&self, range: usize) -> bool {
        let mut mapped = lock(&self.mapped);
        loop {
            if self.stop.load(Ordering::Acquire) {
                return false;
            }
            if mapped.done.get(range).copied().unwrap_or(false) {
                return true;
            }
            mapped = self
                .ready
                .wait(mapped)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
    }

    /// A staging buffer for a thread: one no thread holds, else a new one.
    fn buffer<B: Backend>(&self, backend: &B) -> Result<HostCopy, Error> {
        let kept = lock(&self.buffers).pop();
        kept.map_or_else(|| backend.staging(CHUNK), Ok)
    }

    /// What the threads left, once they are all done.
    pub(crate) fn outcome(self) -> Outcome {
        Outcome {
            error: self
                .error
                .into_inner()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
            unsettled: self.unsettled.load(Ordering::Acquire),
            buffers: self
                .buffers
                .into_inner()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
            mapped: self
                .mapped
                .into_inner()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .done,
        }
    }
}

/// A thread's lane with its staging buffer (taken when a chunk first needs one) and the
/// chunk whose copy it holds or awaits, with whether it went through the buffer; and a
/// range whose direct copies are queued on the lane with no wait (a group of
/// [`copy_registering`]), with how many, counted as copied once the lane is waited for.
struct Slot<L> {
    lane: L,
    buffer: Option<HostCopy>,
    pending: Option<(Chunk, bool)>,
    queued: Option<(usize, usize)>,
}

/// Whether chunk `c` lies wholly in the registered part of its range's copy (the device
/// copies it directly), given the bytes registered of each copy.
fn is_direct(registered: &[usize], c: Chunk) -> bool {
    registered
        .get(c.range)
        .is_some_and(|&r| c.offset + c.len <= r)
}

/// Which way a thread copies.
#[derive(Clone, Copy)]
enum Direction {
    /// Leaf to copies (a sleep).
    Out,
    /// Copies to leaf (a wake): each chunk once its range is mapped.
    In,
}

/// One copying thread: takes chunks until none are left or a thread failed, staging each
/// through its two slots in turn, then waits for its lanes and gives its buffers back.
fn copy_on_thread<B: Backend>(
    backend: &B,
    shared: &Shared<'_>,
    copies: &[HostCopy],
    direction: Direction,
) {
    let mut slots: Vec<Slot<B::Lane>> = Vec::with_capacity(2);
    if let Err(e) = copy_chunks(backend, shared, copies, direction, &mut slots) {
        shared.fail(e);
    }
    for slot in slots {
        match backend.finish(&slot.lane) {
            Ok(()) => lock(&shared.buffers).extend(slot.buffer),
            Err(e) => {
                // A copy may still write into or read from the buffer (or a registered
                // copy): leak the buffer rather than free it under the device, and say so.
                tracing::error!(%e, "memres: a staging lane could not be waited for; its buffer is leaked");
                shared.unsettled.store(true, Ordering::Release);
                std::mem::forget(slot.buffer);
                shared.fail(e);
            }
        }
    }
}

/// [`copy_on_thread`]'s work, through `slots` (made as they are first needed): for a
/// sleep, whole ranges whose copies it registers as it goes ([`copy_registering`]), then
/// chunks, until none are left, a thread failed or this one fails; every chunk asked for
/// is done when it returns `Ok`.
fn copy_chunks<B: Backend>(
    backend: &B,
    shared: &Shared<'_>,
    copies: &[HostCopy],
    direction: Direction,
    slots: &mut Vec<Slot<B::Lane>>,
) -> Result<(), Error> {
    let mut turn = 0usize;
    if matches!(direction, Direction::Out) {
        let by = backend.registrar();
        while let Some(group) = shared.take_group() {
            copy_registering(backend, shared, copies, group, &by, slots, &mut turn)?;
        }
    }
    while let Some(c) = shared.take() {
        if matches!(direction, Direction::In) && !shared.wait_mapped(c.range) {
            break;
        }
        let direct = is_direct(shared.registered, c);
        step(
            backend, shared, copies, direction, slots, &mut turn, c, direct,
        )?;
    }
    // The chunks still in the buffers, older first.
    let n = slots.len();
    for k in 0..n {
        complete(
            backend,
            shared,
            &mut slots[(turn + k) % n],
            copies,
            direction,
        )?;
    }
    Ok(())
}

/// Slot number `i` of a thread, made (with its lane) if it is not yet.
fn slot<'s, B: Backend>(
    backend: &B,
    slots: &'s mut Vec<Slot<B::Lane>>,
    i: usize,
) -> Result<&'s mut Slot<B::Lane>, Error> {
    while slots.len() <= i {
        slots.push(Slot {
            lane: backend.lane()?,
            buffer: None,
            pending: None,
            queued: None,
        });
    }
    Ok(&mut slots[i])
}

/// Copies chunk `c` on the thread's next slot (its two in turn), once the slot's last
/// chunk is complete: directly (`direct`: the chunk lies in the registered part of its
/// copy) or through the slot's staging buffer.
#[allow(clippy::too_many_arguments)] // the thread's state, passed along
fn step<B: Backend>(
    backend: &B,
    shared: &Shared<'_>,
    copies: &[HostCopy],
    direction: Direction,
    slots: &mut Vec<Slot<B::Lane>>,
    turn: &mut usize,
    c: Chunk,
    direct: bool,
) -> Result<(), Error> {
    let slot = slot(backend, slots, *turn % 2)?;
    *turn += 1;
    complete(backend, shared, slot, copies, direction)?;
    start(backend, shared, slot, copies, direction, c, direct)
}

/// A sleep's copy of one range (`group`: its chunks, in order) into a copy registered as
/// it goes: before the chunks that reach past what is registered of the copy, the thread
/// backs the copy's next piece ([`registered::PIECE`](super::registered::PIECE)) by
/// writing a byte of every page (the kernel zeroes it, a huge page where it can) and
/// registers it; the device then copies each chunk straight into the copy, queued on the
/// thread's first lane with no wait (the thread backs the next piece meanwhile), and
/// its slot's [`finish`](Backend::finish) waits for them. Where the registration fails
/// or the copy is not the registrar's to register, the rest of the range is staged as
/// any other chunk (the pool's background registration tries the rest again later).
///
/// Why: a first sleep's copies are fresh pages, and backing them while the device copies
/// is the sleep's cost; registered, each byte is written once by the kernel's zeroing and
/// once by the device, where a staged copy also passes every byte through a staging
/// buffer and a `memcpy`. 20 GiB from an H200 on 16 threads (a probe of both ways in C,
/// BENCHMARKS.md): staged 19.3-24.1 GiB/s, registered as it goes 22.1-30.5.
#[allow(clippy::too_many_arguments)] // the thread's state, passed along
fn copy_registering<B: Backend>(
    backend: &B,
    shared: &Shared<'_>,
    copies: &[HostCopy],
    group: &[Chunk],
    by: &Registrar,
    slots: &mut Vec<Slot<B::Lane>>,
    turn: &mut usize,
) -> Result<(), Error> {
    let Some(copy) = group.first().map(|c| &copies[c.range]) else {
        return Ok(());
    };
    // (`None` once a registration fails: the rest of the range is staged.)
    let mut pages = copy.mapping();
    for &c in group {
        if shared.stopped() {
            break;
        }
        let end = c.offset + c.len;
        while let Some(p) = &pages
            && copy.registered() < end
        {
            if !register_next_piece(copy, p, by) {
                pages = None;
            }
        }
        if copy.registered() >= end {
            let first = slot(backend, slots, 0)?;
            if first.queued.is_some_and(|(range, _)| range != c.range) {
                // The last group's copies, waited for once this one's first piece is
                // registered: its range counts as copied (a sleep that unmaps as it
                // goes unmaps it).
                complete(backend, shared, first, copies, Direction::Out)?;
            }
            // SAFETY: the chunk lies in a mapped range that nothing writes to (the
            // caller's promise; a sleep that unmaps as it goes unmaps it only once this
            // lane was waited for, `complete`), and in the registered part of its copy,
            // which only this thread writes (each group is taken once; a copy is its
            // range's alone) and nothing reads until the lane is waited for
            // (`copy_on_thread`).
            unsafe {
                backend.copy_out(&first.lane, c.addr, copy.as_ptr().add(c.offset), c.len)?;
            };
            let queued = first.queued.map_or(0, |(_, n)| n);
            first.queued = Some((c.range, queued + 1));
        } else {
            step(
                backend,
                shared,
                copies,
                Direction::Out,
                slots,
                turn,
                c,
                false,
            )?;
        }
    }
    Ok(())
}

/// Backs and registers the next piece of `copy` (whose mapping is `pages`) with `by`;
/// whether it did (not when the registration failed, or the copy is all registered or
/// another registrar's).
fn register_next_piece(copy: &HostCopy, pages: &Arc<Pages>, by: &Registrar) -> bool {
    let from = copy.registered();
    let len = super::registered::PIECE.min(copy.len().saturating_sub(from));
    // SAFETY: `from..from + len` lies in the copy, which only the calling thread writes
    // (see `copy_registering`) and nothing reads yet.
    unsafe { back_pages(copy.as_ptr().add(from), len) };
    match pages.register_next(by) {
        Ok(registered) => registered,
        Err(e) => {
            tracing::debug!(%e, "memres: a host copy left unregistered during a sleep (the rest is staged)");
            false
        }
    }
}

/// Backs `len` bytes at `at` (host memory of a copy's own mapping) by writing a zero at
/// the start of every page of 4 KiB (and so of every larger page).
///
/// # Safety
/// `at..at + len` lies in a live mapping, writable, that no other thread touches and
/// whose contents do not matter.
unsafe fn back_pages(at: *mut u8, len: usize) {
    for offset in (0..len).step_by(4096) {
        // SAFETY: inside `at..at + len` (the caller's promise); a volatile write, so
        // that it is not elided, backs the page.
        unsafe { at.add(offset).write_volatile(0) };
    }
}

/// Starts the copy of chunk `c` on `slot` (whose last one is complete): directly where the
/// chunk lies in the registered part of its copy (`direct`), else through the slot's
/// staging buffer (taken now if it has none), filled first for a wake; it is `slot`'s
/// pending chunk.
fn start<B: Backend>(
    backend: &B,
    shared: &Shared<'_>,
    slot: &mut Slot<B::Lane>,
    copies: &[HostCopy],
    direction: Direction,
    c: Chunk,
    direct: bool,
) -> Result<(), Error> {
    // SAFETY: the chunk lies in its range's copy (`chunks` cut it from the range,
    // whose copy holds the range).
    let at = unsafe { copies[c.range].as_ptr().add(c.offset) };
    let buffer = if direct {
        at // registered: the device copies to or from it directly
    } else {
        #[cfg(test)]
        backend.registrar().count_staged();
        if slot.buffer.is_none() {
            slot.buffer = Some(shared.buffer(backend)?);
        }
        slot.buffer.as_ref().map_or(at, HostCopy::as_ptr)
    };
    match direction {
        // SAFETY: the chunk lies in a mapped range that nothing writes to (the
        // caller's promise; a sleep that unmaps as it goes unmaps it only once this lane
        // was waited for, `complete`); `buffer` is the chunk's place in its copy,
        // registered, or this slot's staging buffer of `CHUNK >= c.len` bytes; either
        // is written by this lane alone and not read until the lane is waited for.
        Direction::Out => unsafe { backend.copy_out(&slot.lane, c.addr, buffer, c.len)? },
        Direction::In => {
            if !direct {
                // SAFETY: `at` holds the chunk (above), which nothing writes to while
                // a wake runs; the buffer holds `CHUNK >= c.len` bytes and its lane's
                // last copy out of it is done (`complete`).
                unsafe { std::ptr::copy_nonoverlapping(at, buffer, c.len) };
            }
            // SAFETY: the chunk's range is mapped (`wait_mapped`) and nothing else uses
            // it (the caller's promise); `buffer` (the registered copy, or the staging
            // buffer) is unwritten until the lane is waited for (this slot's next
            // turn, or below).
            unsafe { backend.copy_in(&slot.lane, c.addr, buffer, c.len)? }
        }
    }
    slot.pending = Some((c, !direct));
    Ok(())
}

/// Waits for the copies of `slot`'s chunk and queued direct copies, if any, and (for a
/// sleep) moves the chunk out of the buffer into its copy (the buffer is free again) and
/// counts them as copied ([`Shared::copied`]).
fn complete<B: Backend>(
    backend: &B,
    shared: &Shared<'_>,
    slot: &mut Slot<B::Lane>,
    copies: &[HostCopy],
    direction: Direction,
) -> Result<(), Error> {
    let (pending, queued) = (slot.pending.take(), slot.queued.take());
    if pending.is_none() && queued.is_none() {
        return Ok(());
    }
    backend.finish(&slot.lane)?;
    if let Some((range, n)) = queued {
        shared.copied(range, n);
    }
    let Some((done, staged)) = pending else {
        return Ok(());
    };
    if let (Direction::Out, true, Some(buffer)) = (direction, staged, &slot.buffer) {
        // SAFETY: the lane's copy into the buffer is done (waited for just above); `done`
        // lies in its range's copy (`chunks` cut it from the range, whose copy holds the
        // range) and no other thread writes there (each chunk is taken once).
        unsafe { unstage(buffer, copies, done) };
    }
    if let Direction::Out = direction {
        shared.copied(done.range, 1);
    }
    Ok(())
}

/// Copies chunk `c` out of `buffer` into its place in its range's copy.
///
/// # Safety
/// The buffer holds the chunk's bytes (its copy is done); the chunk lies in
/// `copies[c.range]`, and no other thread touches that part of it.
unsafe fn unstage(buffer: &HostCopy, copies: &[HostCopy], c: Chunk) {
    let into = &copies[c.range];
    // SAFETY: the caller's promises; the buffer holds at least `c.len` bytes (`CHUNK`),
    // and buffer and copy are separate memory.
    unsafe { std::ptr::copy_nonoverlapping(buffer.as_ptr(), into.as_ptr().add(c.offset), c.len) };
}

/// Runs the copying threads over `shared` (none when it has no chunks) while `meanwhile`
/// runs on the calling thread and on `also - 1` threads more (the mapping threads of a
/// wake); if no copying thread can be started, copies on the calling thread once its
/// `meanwhile` is done.
fn run<B: Backend>(
    backend: &B,
    shared: &Shared<'_>,
    copies: &[HostCopy],
    direction: Direction,
    also: usize,
    meanwhile: impl Fn() + Sync,
) {
    let chunks = shared.chunk_count();
    let threads = if chunks == 0 {
        0
    } else {
        threads(chunks, direction)
    };
    std::thread::scope(|scope| {
        // The mapping threads first: the copies wait for what they map.
        for _ in 1..also {
            // One that cannot start leaves its share to the others.
            let _ = std::thread::Builder::new()
                .name("memres-offload-map".into())
                .spawn_scoped(scope, &meanwhile);
        }
        let started = (0..threads)
            .filter(|_| {
                shared.thread_starts();
                let spawned = std::thread::Builder::new()
                    .name("memres-offload".into())
                    .spawn_scoped(scope, || {
                        let _ends = ThreadEnds(shared);
                        copy_on_thread(backend, shared, copies, direction);
                    });
                if spawned.is_err() {
                    shared.thread_ends();
                }
                spawned.is_ok()
            })
            .count();
        meanwhile();
        if started == 0 && chunks > 0 {
            copy_on_thread(backend, shared, copies, direction);
        }
    });
}

/// Tells [`Shared`] that a copying thread ended when dropped, also when the thread
/// panics: the thread then fails first, so that the unmapping thread stops rather than
/// wait for ranges it will never copy (the scope then passes the panic on; the error
/// recorded is not returned).
struct ThreadEnds<'s, 'a>(&'s Shared<'a>);

impl Drop for ThreadEnds<'_, '_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.fail(Error::invalid_argument(
                "a thread copying the pool's memory panicked",
            ));
        }
        self.0.thread_ends();
    }
}

/// Keeps the memory a leaf unmaps ([`GrowInPlace::keep_unmapped`]) while it lives, and
/// gives the rest back when dropped (also on a panic).
struct Keeping<'l, B: Backend>(&'l Virtual<B>);

impl<'l, B: Backend> Keeping<'l, B> {
    fn new(leaf: &'l Virtual<B>) -> Self {
        leaf.keep_unmapped(true);
        Keeping(leaf)
    }
}

impl<B: Backend> Drop for Keeping<'_, B> {
    fn drop(&mut self) {
        self.0.keep_unmapped(false);
    }
}

/// A copy for each of `ranges`: the smallest spare copy that holds it, else a new one,
/// made once the host is known to have room for all the new ones (a pageable copy the
/// kernel cannot back is not an error but the out-of-memory killer). On failure the
/// spares taken go back to `spare`.
fn copies_for(
    ranges: &[(usize, usize)],
    spare: &mut Vec<HostCopy>,
) -> Result<Vec<HostCopy>, Error> {
    let mut fits: Vec<Option<HostCopy>> = ranges
        .iter()
        .map(|&(_, len)| {
            (0..spare.len())
                .filter(|&i| spare[i].is_pageable() && spare[i].len() >= len)
                .min_by_key(|&i| spare[i].len())
                .map(|i| spare.swap_remove(i))
        })
        .collect();
    let new: usize = ranges
        .iter()
        .zip(&fits)
        .filter(|(_, fit)| fit.is_none())
        .map(|(&(_, len), _)| len)
        .sum();
    if super::host_copy::available().is_some_and(|room| room < new) {
        spare.extend(fits.into_iter().flatten());
        return Err(Error::out_of_memory(new));
    }
    let mut copies = Vec::with_capacity(ranges.len());
    for (&(_, len), fit) in ranges.iter().zip(&mut fits) {
        match fit.take().map_or_else(|| HostCopy::pages(len), Ok) {
            Ok(copy) => copies.push(copy),
            Err(e) => {
                spare.extend(copies.into_iter().chain(fits.into_iter().flatten()));
                return Err(e);
            }
        }
    }
    Ok(copies)
}

/// Copies of each of `ranges` in new or `spare` host memory (see
/// [`GrowInPlace::save_at`]).
///
/// # Safety
/// The ranges are mapped memory of `backend`, which nothing writes to until the call
/// returns.
pub(super) unsafe fn save<B: Backend>(
    backend: &B,
    ranges: &[(usize, usize)],
    spare: &mut Vec<HostCopy>,
) -> Result<Vec<HostCopy>, Error> {
    let mut copies = copies_for(ranges, spare)?;
    // SAFETY: the caller's promises, passed on; nothing unmaps.
    let outcome = unsafe { copy_ranges_out(backend, ranges, &copies, spare, None) };
    match outcome.error {
        None => Ok(copies),
        Some(e) => {
            give_back_after_failure(&mut copies, outcome.unsettled, spare);
            Err(e)
        }
    }
}

/// Copies of each of `ranges` of `leaf` in new or `spare` host memory, each range
/// unmapped once its copies are done, while the others are copied (see
/// [`GrowInPlace::offload_at`]): the driver's unmaps (about 35 µs a granule of 2 MiB on
/// an H200, 0.3-0.45 s for 20 GiB, one at a time) run on the calling thread under the
/// copies, which they do not slow (`benches/gpu/unmap_cost.cu`: 20 GiB copied in 0.40 s
/// alone and in 0.41 s under the unmaps of another 20 GiB). The memory taken away stays
/// the leaf's ([`GrowInPlace::keep_unmapped`]) until the copies are all done, so that
/// after a failure the ranges unmapped so far are mapped again from it (and their
/// contents copied back), not from memory the device may no longer have; then it goes
/// back to the device.
///
/// # Safety
/// The ranges are mapped memory of `leaf`, apart from each other, which nothing uses
/// until the call returns (and, when it returns `Ok`, until they are mapped again).
pub(super) unsafe fn offload<B: Backend>(
    leaf: &Virtual<B>,
    ranges: &[(usize, usize)],
    spare: &mut Vec<HostCopy>,
) -> Result<Vec<HostCopy>, Error> {
    let copies = copies_for(ranges, spare)?;
    let unmap = |range: usize| {
        let (addr, len) = ranges[range];
        // SAFETY: mapped by the leaf (the caller's promise), unused, and its copies are
        // all done (the threads waited for their lanes before they counted them).
        unsafe { leaf.unmap_at(addr, len) };
    };
    let keeping = Keeping::new(leaf);
    // SAFETY: the caller's promises, passed on; `unmap` takes each range once, after its
    // copies.
    let mut outcome =
        unsafe { copy_ranges_out(&leaf.backend, ranges, &copies, spare, Some(&unmap)) };
    let Some(e) = outcome.error.take() else {
        let left: Vec<(usize, usize)> = ranges
            .iter()
            .zip(&outcome.mapped)
            .filter(|&(_, &mapped)| mapped)
            .map(|(&range, _)| range)
            .collect();
        drop(keeping);
        // SAFETY: as for `unmap`: every copy is done (no error).
        unsafe { unmap_ranges(leaf, &left) };
        return Ok(copies);
    };
    // SAFETY: the ranges marked unmapped were unmapped by this call, after their copies;
    // nothing uses them (the caller's promise).
    unsafe { map_back(leaf, ranges, copies, &outcome, keeping, spare, &e) };
    Err(e)
}

/// After `offload`'s copies failed with `e`: maps the ranges `outcome` marks unmapped
/// again (from the memory `keeping` holds, given back afterwards) and copies their
/// copies back; the copies go back to `spare` (or are leaked where a device may still
/// use them, see [`give_back_after_failure`]).
///
/// # Safety
/// The ranges marked unmapped were unmapped after their copies were done, into
/// `copies` (one per range, in order), and nothing uses them.
unsafe fn map_back<B: Backend>(
    leaf: &Virtual<B>,
    ranges: &[(usize, usize)],
    copies: Vec<HostCopy>,
    outcome: &Outcome,
    keeping: Keeping<'_, B>,
    spare: &mut Vec<HostCopy>,
    e: &Error,
) {
    let (mut back, mut rest): (Vec<HostCopy>, Vec<HostCopy>) = (Vec::new(), Vec::new());
    let mut gone = Vec::new();
    for ((copy, &range), &mapped) in copies.into_iter().zip(ranges).zip(&outcome.mapped) {
        if mapped {
            rest.push(copy);
        } else {
            back.push(copy);
            gone.push(range);
        }
    }
    // SAFETY: unmapped by `offload`, each copy holding its range (copied there in
    // full); nothing uses them (the caller's promise).
    let restored = unsafe { wake(leaf, &gone, &back, spare) };
    drop(keeping);
    give_back_after_failure(&mut rest, outcome.unsettled, spare);
    match restored {
        // Every lane that copied into these copies was waited for (their ranges were
        // counted as copied), so they go back to the spares even where another lane
        // could not be.
        Ok(()) => spare.append(&mut back),
        Err(again) => {
            // A driver or device failure while the leaf held the memory: the pool holds
            // memory that is not mapped, its contents in copies a broken device may still
            // read. They are leaked, and the failure said.
            tracing::error!(
                %e, %again,
                ranges = gone.len(),
                "memres: a failed sleep could not map back what it had unmapped; that memory is lost"
            );
            back.iter().for_each(HostCopy::abandon);
        }
    }
}

/// After a failed sleep: `copies` go back to `spare`, unless a lane could not be waited
/// for (`unsettled`): a broken device may still write into them (chunks copied
/// directly), so they are leaked as they go, not kept or freed under it.
fn give_back_after_failure(copies: &mut Vec<HostCopy>, unsettled: bool, spare: &mut Vec<HostCopy>) {
    if unsettled {
        copies.iter().for_each(HostCopy::abandon);
        copies.clear();
    } else {
        spare.append(copies);
    }
}

/// A sleep's copies of `ranges` into `copies` (one per range, each holding it) on the
/// copying threads, and with `unmap` (given a range's number) each range unmapped once
/// its copies are done, on the calling thread meanwhile ([`Shared::unmap_copied`]). The
/// staging buffers go back to `spare`.
///
/// # Safety
/// The ranges are mapped memory of `backend`, which nothing writes to until the call
/// returns; `unmap`, if any, may take each range once its copies are done.
unsafe fn copy_ranges_out<B: Backend>(
    backend: &B,
    ranges: &[(usize, usize)],
    copies: &[HostCopy],
    spare: &mut Vec<HostCopy>,
    unmap: Option<&(dyn Fn(usize) + Sync)>,
) -> Outcome {
    // A range whose copy is not registered as far as the range reaches is copied whole by
    // one thread that registers the copy as it goes (`copy_registering`); the rest by
    // chunks, staged or directly as their copies' registered parts say.
    let register = registered::enabled();
    let registers: Vec<bool> = copies
        .iter()
        .zip(ranges)
        .map(|(copy, &(_, len))| register && copy.is_pageable() && copy.registered() < len)
        .collect();
    let (whole, chunks): (Vec<Chunk>, Vec<Chunk>) = chunks(ranges, CHUNK)
        .into_iter()
        .partition(|c| registers[c.range]);
    let groups: Vec<&[Chunk]> = whole.chunk_by(|a, b| a.range == b.range).collect();
    let registered: Vec<usize> = copies.iter().map(HostCopy::registered).collect();
    let shared = Shared::new(
        &chunks,
        &groups,
        &registered,
        take_staging(spare),
        ranges.len(),
        if unmap.is_some() {
            Start::Unmapping
        } else {
            Start::Mapped
        },
    );
    run(backend, &shared, copies, Direction::Out, 1, || {
        if let Some(unmap) = unmap {
            shared.unmap_copied(unmap);
        }
    });
    let mut outcome = shared.outcome();
    spare.append(&mut outcome.buffers);
    outcome
}

/// Maps `ranges` and copies `copies` back (see [`GrowInPlace::wake_at`]; the copies are
/// checked by the caller: none, or one per range that holds it).
///
/// # Safety
/// Nothing uses the ranges until the call returns.
pub(super) unsafe fn wake<B: Backend>(
    leaf: &Virtual<B>,
    ranges: &[(usize, usize)],
    copies: &[HostCopy],
    spare: &mut Vec<HostCopy>,
) -> Result<(), Error> {
    let chunks = if copies.is_empty() {
        Vec::new()
    } else {
        chunks(ranges, CHUNK)
    };
    let registered: Vec<usize> = copies.iter().map(HostCopy::registered).collect();
    let shared = Shared::new(
        &chunks,
        &[],
        &registered,
        take_staging(spare),
        ranges.len(),
        Start::Unmapped,
    );
    let map_all = || {
        shared.map_ranges(|i| {
            let (addr, len) = ranges[i];
            leaf.map_at(addr, len)
        });
    };
    let mappers = map_threads(ranges.len());
    run(
        &leaf.backend,
        &shared,
        copies,
        Direction::In,
        mappers,
        map_all,
    );
    let outcome = shared.outcome();
    spare.extend(outcome.buffers);
    let Some(e) = outcome.error else {
        return Ok(());
    };
    if !outcome.unsettled {
        let mapped: Vec<(usize, usize)> = ranges
            .iter()
            .zip(&outcome.mapped)
            .filter(|&(_, &done)| done)
            .map(|(&range, _)| range)
            .collect();
        // SAFETY: mapped above by this call; nothing uses it (the caller's promise) and
        // every copy into it is done (each thread waited for its lanes).
        unsafe { unmap_ranges(leaf, &mapped) };
    }
    // Else a broken device: the memory stays mapped rather than unmapped under a copy
    // (the pool stays asleep; dropping it leaves the leaf to unmap what is mapped), and
    // the copies, which it may still read, are leaked when dropped.
    if outcome.unsettled {
        copies.iter().for_each(HostCopy::abandon);
    }
    Err(e)
}

/// Unmaps `ranges` of `leaf` (see [`GrowInPlace::unmap_ranges_at`]) on
/// [`map_threads`] threads, each taking the next range not taken yet; on the calling
/// thread alone where no other can start.
///
/// # Safety
/// As for [`GrowInPlace::unmap_at`], for every range; the ranges do not overlap.
pub(super) unsafe fn unmap_ranges<B: Backend>(leaf: &Virtual<B>, ranges: &[(usize, usize)]) {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let work = || {
        while let Some(&(addr, len)) =
            ranges.get(next.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
        {
            // SAFETY: the caller's promise; each range is taken by one thread.
            unsafe { leaf.unmap_at(addr, len) };
        }
    };
    let threads = map_threads(ranges.len());
    if threads <= 1 {
        return work();
    }
    std::thread::scope(|scope| {
        for _ in 1..threads {
            // One that cannot start leaves its share to the others.
            let _ = std::thread::Builder::new()
                .name("memres-offload-map".into())
                .spawn_scoped(scope, work);
        }
        work();
    });
}

/// Host memory made ahead of a sleep (see [`GrowInPlace::prepare_host_memory`]): a copy
/// of each of `lens` bytes, its pages backed now by threads writing them, and, where the
/// copies are not registered ([`registered::enabled`]: a sleep into registered copies
/// stages nothing), as many staging buffers as a sleep of them uses, less `staging`
/// already kept.
pub(super) fn prepare<B: Backend>(
    backend: &B,
    lens: &[usize],
    staging: usize,
) -> Result<Vec<HostCopy>, Error> {
    let new: usize = lens.iter().sum();
    if super::host_copy::available().is_some_and(|room| room < new) {
        return Err(Error::out_of_memory(new));
    }
    let copies = lens
        .iter()
        .map(|&len| HostCopy::pages(len))
        .collect::<Result<Vec<_>, _>>()?;
    // Each copy as a range at address 0: the chunks say where in which copy to write.
    let ranges: Vec<(usize, usize)> = lens.iter().map(|&len| (0, len)).collect();
    let chunks = chunks(&ranges, CHUNK);
    let next = AtomicUsize::new(0);
    let back = |c: Chunk| {
        // SAFETY: inside the copy (`chunks` cut `c` from its length), fresh, written by
        // this thread alone (each chunk is taken once).
        unsafe { back_pages(copies[c.range].as_ptr().add(c.offset), c.len) };
    };
    let workers = threads(chunks.len(), Direction::Out);
    std::thread::scope(|scope| {
        let work = || {
            while let Some(&c) = chunks.get(next.fetch_add(1, Ordering::Relaxed)) {
                back(c);
            }
        };
        for _ in 1..workers {
            // A thread that cannot start leaves its share to the others.
            let _ = std::thread::Builder::new()
                .name("memres-offload".into())
                .spawn_scoped(scope, work);
        }
        work();
    });
    let wanted = if registered::enabled() {
        0
    } else {
        2 * workers
    };
    let mut made = copies;
    for _ in staging.min(wanted)..wanted {
        made.push(backend.staging(CHUNK)?);
    }
    Ok(made)
}

/// Whether `copy` is a staging buffer that a sleep or wake would take from the spares.
pub(super) fn is_staging(copy: &HostCopy) -> bool {
    !copy.is_pageable() && copy.len() >= CHUNK
}

/// The staging buffers among `spare` (an earlier sleep's or wake's), taken out of it.
fn take_staging(spare: &mut Vec<HostCopy>) -> Vec<HostCopy> {
    let (staging, copies) = std::mem::take(spare).into_iter().partition(is_staging);
    *spare = copies;
    staging
}

#[cfg(test)]
mod tests {
    use super::{Chunk, Direction, chunks, map_thread_count, thread_count};

    #[test]
    fn map_threads_are_1_or_the_variable_within_1_to_16_and_the_ranges() {
        assert_eq!(map_thread_count(None, 80), 1);
        assert_eq!(map_thread_count(Some("4"), 3), 3, "no more than the ranges");
        assert_eq!(map_thread_count(Some("4"), 0), 1);
        assert_eq!(map_thread_count(Some("1"), 80), 1, "the old behaviour");
        assert_eq!(map_thread_count(Some(" 8 "), 80), 8);
        assert_eq!(map_thread_count(Some("99"), 80), 16, "at most 16");
        for junk in ["0", "-3", "many", ""] {
            assert_eq!(map_thread_count(Some(junk), 80), 1, "{junk:?} ignored");
        }
    }

    #[test]
    fn threads_follow_the_cores_or_the_variable_within_1_to_16_and_the_chunks() {
        let (out, into) = (Direction::Out, Direction::In);
        assert_eq!(thread_count(None, 16, 1000, out), 16);
        assert_eq!(thread_count(None, 16, 1000, into), 15, "one core maps");
        assert_eq!(thread_count(None, 64, 1000, out), 16, "at most 16");
        assert_eq!(thread_count(None, 1, 1000, into), 1, "at least 1");
        assert_eq!(
            thread_count(None, 16, 3, out),
            2,
            "a thread per 2 chunks (tests)"
        );
        assert_eq!(
            thread_count(None, 16, 7, into),
            4,
            "a thread per 2 chunks, rounded up"
        );
        assert_eq!(thread_count(None, 16, 0, out), 1);
        assert_eq!(
            thread_count(Some("3"), 16, 3, out),
            3,
            "the variable, up to the chunks"
        );
        assert_eq!(thread_count(Some(" 8 "), 16, 1000, into), 8, "the variable");
        assert_eq!(thread_count(Some("99"), 16, 1000, out), 16);
        for junk in ["0", "-3", "many", ""] {
            assert_eq!(
                thread_count(Some(junk), 16, 1000, out),
                16,
                "{junk:?} ignored"
            );
        }
    }

    #[test]
    fn ranges_are_cut_into_chunks_in_order_with_short_last_ones() {
        let got = chunks(&[(1000, 250), (5000, 100), (9000, 0), (20_000, 1)], 100);
        let want = [
            (0, 1000, 0, 100),
            (0, 1100, 100, 100),
            (0, 1200, 200, 50),
            (1, 5000, 0, 100),
            (3, 20_000, 0, 1),
        ]
        .map(|(range, addr, offset, len)| Chunk {
            range,
            addr,
            offset,
            len,
        });
        assert_eq!(got, want);
        assert!(chunks(&[], 100).is_empty());
        assert_eq!(
            chunks(&[(0, 3)], 0).len(),
            3,
            "a chunk of 0 bytes is taken as 1"
        );
    }
}

/// The threads' shared state under loom (`RUSTFLAGS="--cfg memres_loom" cargo test -p
/// memres --lib loom_`): chunks are taken once each, ranges mapped once each, a failure
/// stops every thread, waking the ones that wait for a range to be mapped, and every range
/// mapped is marked so (the caller unmaps those after a failure).
#[cfg(all(test, memres_loom))]
mod loom_models {
    use loom::sync::Arc;
    use loom::sync::atomic::{AtomicUsize, Ordering};
    use loom::thread;

    use super::{Chunk, Shared, Start};
    use crate::error::Error;

    /// A chunk of one byte at `i`, the whole of range `i`.
    const fn chunk(i: usize) -> Chunk {
        Chunk {
            range: i,
            addr: i,
            offset: 0,
            len: 1,
        }
    }

    /// Two chunks, one in each of two ranges.
    static CHUNKS: [Chunk; 2] = [chunk(0), chunk(1)];

    /// A wake's shared state for `chunks`, one range each, none mapped yet.
    fn waking(chunks: &'static [Chunk]) -> Arc<Shared<'static>> {
        let ranges = chunks.len();
        Arc::new(Shared::new(
            chunks,
            &[],
            &[],
            Vec::new(),
            ranges,
            Start::Unmapped,
        ))
    }

    /// What a wake's thread does with the chunks it takes: waits for the range, then
    /// counts the chunk as copied.
    fn copy_all(shared: &Shared<'_>) -> Vec<usize> {
        let mut copied = Vec::new();
        while let Some(c) = shared.take() {
            if !shared.wait_mapped(c.range) {
                break;
            }
            copied.push(c.range);
        }
        copied
    }

    /// A mapping thread whose map of range `failing` fails; the ranges it mapped are
    /// added to `mapped` as bits.
    fn map_all(shared: &Shared<'_>, failing: usize, mapped: &AtomicUsize) {
        shared.map_ranges(|r| {
            if r == failing {
                return Err(Error::out_of_memory(1));
            }
            let before = mapped.fetch_or(1 << r, Ordering::Relaxed);
            assert_eq!(before & (1 << r), 0, "range {r} mapped twice");
            Ok(())
        });
    }

    /// Two threads copy while the calling thread maps both ranges and the second map
    /// fails: both threads end (a lost wake-up would leave one waiting, which loom
    /// reports as a deadlock), the first range's chunk is copied at most once, and the
    /// second's never, since its range was never mapped.
    #[test]
    fn loom_a_failed_map_stops_the_threads_waiting_for_its_range() {
        loom::model(|| {
            let shared = waking(&CHUNKS);
            let threads: Vec<_> = (0..2)
                .map(|_| {
                    let shared = Arc::clone(&shared);
                    thread::spawn(move || copy_all(&shared))
                })
                .collect();
            map_all(&shared, 1, &AtomicUsize::new(0));
            let copied: Vec<usize> = threads
                .into_iter()
                .flat_map(|t| t.join().unwrap())
                .collect();
            assert!(copied.iter().all(|&r| r == 0), "{copied:?}");
            assert!(copied.len() <= 1, "{copied:?}");
        });
    }

    /// Without a failure, every chunk is copied exactly once, by one of two threads.
    #[test]
    fn loom_every_chunk_is_taken_exactly_once() {
        loom::model(|| {
            let shared = waking(&CHUNKS);
            let threads: Vec<_> = (0..2)
                .map(|_| {
                    let shared = Arc::clone(&shared);
                    thread::spawn(move || copy_all(&shared))
                })
                .collect();
            map_all(&shared, usize::MAX, &AtomicUsize::new(0));
            let mut copied: Vec<usize> = threads
                .into_iter()
                .flat_map(|t| t.join().unwrap())
                .collect();
            copied.sort_unstable();
            assert_eq!(copied, [0, 1]);
        });
    }

    /// A sleep's threads take whole ranges first, then chunks: with two groups and two
    /// chunks, a thread that takes all it can and another that takes one group, then
    /// fails, every group and chunk is taken at most once, and none after the failure by
    /// the failing thread (loom finds the interleavings where the other thread has not
    /// taken everything yet: without the `stop` checks the last assertion fails there);
    /// without a failure each would be taken exactly once (the other models).
    #[test]
    fn loom_groups_and_chunks_are_taken_once_and_not_after_a_failure() {
        static GROUP_0: [Chunk; 1] = [chunk(0)];
        static GROUP_1: [Chunk; 1] = [chunk(1)];
        static REST: [Chunk; 2] = [chunk(2), chunk(3)];
        static GROUPS: [&[Chunk]; 2] = [&GROUP_0, &GROUP_1];
        loom::model(|| {
            let shared = Arc::new(Shared::new(
                &REST,
                &GROUPS,
                &[],
                Vec::new(),
                4,
                Start::Mapped,
            ));
            let other = {
                let shared = Arc::clone(&shared);
                thread::spawn(move || {
                    let mut taken = Vec::new();
                    while let Some(group) = shared.take_group() {
                        taken.extend(group.iter().map(|c| c.range));
                    }
                    while let Some(c) = shared.take() {
                        taken.push(c.range);
                    }
                    taken
                })
            };
            let mut taken: Vec<usize> = shared
                .take_group()
                .into_iter()
                .flatten()
                .map(|c| c.range)
                .collect();
            shared.fail(Error::out_of_memory(1));
            let after = (shared.take_group().is_some(), shared.take().is_some());
            taken.extend(other.join().unwrap());
            let n = taken.len();
            taken.sort_unstable();
            taken.dedup();
            assert_eq!(taken.len(), n, "something taken twice");
            assert_eq!(after, (false, false), "taken after the failure");
        });
    }

    /// A sleep that unmaps as it goes: two threads copy range 0's two chunks and range
    /// 1's one, counting each as copied, while the calling thread unmaps (`unmap_copied`);
    /// `fail` makes the second thread fail after its first chunk (or none, when the
    /// other took them all). Returns the ranges
    /// unmapped (bits) and those the outcome marks unmapped.
    fn unmap_while_copying(fail: bool) -> (usize, usize) {
        static THREE: [Chunk; 3] = [
            chunk(0),
            Chunk {
                range: 0,
                addr: 8,
                offset: 1,
                len: 1,
            },
            chunk(1),
        ];
        let shared = Arc::new(Shared::new(
            &THREE,
            &[],
            &[],
            Vec::new(),
            2,
            Start::Unmapping,
        ));
        let done = Arc::new([AtomicUsize::new(0), AtomicUsize::new(0)]);
        let threads: Vec<_> = (0..2)
            .map(|t| {
                let (shared, done) = (Arc::clone(&shared), Arc::clone(&done));
                shared.thread_starts();
                thread::spawn(move || {
                    while let Some(c) = shared.take() {
                        done[c.range].fetch_add(1, Ordering::SeqCst);
                        shared.copied(c.range, 1);
                        if fail && t == 1 {
                            break;
                        }
                    }
                    if fail && t == 1 {
                        shared.fail(Error::out_of_memory(1));
                    }
                    shared.thread_ends();
                })
            })
            .collect();
        let unmapped = AtomicUsize::new(0);
        shared.unmap_copied(|r| {
            let chunks = [2, 1][r];
            assert_eq!(
                done[r].load(Ordering::SeqCst),
                chunks,
                "range {r} unmapped before its copies"
            );
            let before = unmapped.fetch_or(1 << r, Ordering::SeqCst);
            assert_eq!(before & (1 << r), 0, "range {r} unmapped twice");
        });
        for t in threads {
            t.join().unwrap();
        }
        let outcome = Arc::try_unwrap(shared).ok().unwrap().outcome();
        assert_eq!(outcome.error.is_some(), fail);
        let marked = outcome
            .mapped
            .iter()
            .enumerate()
            .filter(|&(_, &mapped)| !mapped)
            .fold(0, |bits, (r, _)| bits | 1 << r);
        (unmapped.load(Ordering::SeqCst), marked)
    }

    /// Without a failure every range is unmapped exactly once, after all its chunks are
    /// copied, and the unmapping thread ends (a lost wake-up would leave it waiting,
    /// which loom reports as a deadlock).
    #[test]
    fn loom_a_sleep_unmaps_each_range_once_after_its_copies() {
        let mut builder = loom::model::Builder::new();
        builder.preemption_bound = Some(2);
        builder.check(|| {
            let (unmapped, marked) = unmap_while_copying(false);
            assert_eq!((unmapped, marked), (0b11, 0b11));
        });
    }

    /// A thread that fails stops the unmapping thread: it ends, no range is unmapped
    /// before its copies, and the ranges marked unmapped are exactly those unmapped (the
    /// caller maps them back).
    #[test]
    fn loom_a_failed_sleep_marks_exactly_the_ranges_it_unmapped() {
        let mut builder = loom::model::Builder::new();
        builder.preemption_bound = Some(1);
        builder.check(|| {
            let (unmapped, marked) = unmap_while_copying(true);
            assert_eq!(unmapped, marked);
        });
    }

    /// Two threads map three ranges (the second's map fails) while a third copies: every
    /// thread ends, no range is mapped twice, a chunk is copied only once its range is
    /// mapped, and the ranges marked mapped when all are done are exactly those mapped
    /// (a map that succeeds after the failure is marked too, so the caller unmaps it).
    #[test]
    fn loom_ranges_mapped_on_two_threads_are_marked_exactly_when_mapped() {
        static THREE: [Chunk; 3] = [chunk(0), chunk(1), chunk(2)];
        let mut builder = loom::model::Builder::new();
        builder.preemption_bound = Some(2);
        builder.check(|| {
            let shared = waking(&THREE);
            let mapped = Arc::new(AtomicUsize::new(0));
            let mappers: Vec<_> = (0..2)
                .map(|_| {
                    let (shared, mapped) = (Arc::clone(&shared), Arc::clone(&mapped));
                    thread::spawn(move || map_all(&shared, 1, &mapped))
                })
                .collect();
            let copier = {
                let shared = Arc::clone(&shared);
                thread::spawn(move || copy_all(&shared))
            };
            for m in mappers {
                m.join().unwrap();
            }
            let copied = copier.join().unwrap();
            let mapped = mapped.load(Ordering::Relaxed);
            assert!(copied.iter().all(|&r| mapped & (1 << r) != 0), "{copied:?}");
            let outcome = Arc::try_unwrap(shared).ok().unwrap().outcome();
            assert!(outcome.error.is_some());
            let marked = outcome
                .mapped
                .iter()
                .enumerate()
                .filter(|&(_, &done)| done)
                .fold(0, |bits, (r, _)| bits | 1 << r);
            assert_eq!(marked, mapped, "marked exactly the ranges mapped");
        });
    }
}
