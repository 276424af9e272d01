//! Virtual-memory leaves: one large reserved address range, backed by physical memory a
//! granule at a time ([`CudaVirtual`] on a GPU, [`HostVirtual`] on host pages).
//!
//! A reservation costs no memory; only mapped granules do. Because every byte such a
//! leaf hands out lies in one range, a [`VirtualPool`](crate::VirtualPool) over it
//! ([`VirtualPool::new`](crate::VirtualPool::new), or `.virtual_pool(config)` on the leaf) grows by
//! mapping exactly the granules a request lacks right after its free memory, merges
//! blocks across growth steps, and gives back any fully free granule, not only whole
//! upstream allocations: what PyTorch calls expandable segments.

mod cuda;
mod granules;
mod host;
mod host_copy;
mod registered;
mod staged;

// For the virtual pool's fault and sleep tests (not built under loom).
#[cfg(all(test, not(memres_loom)))]
pub(crate) use host::faults;
#[cfg(all(test, not(memres_loom)))]
pub(crate) use host_copy::ABANDONED;
#[cfg(all(test, not(memres_loom)))]
pub(crate) use registered::{PIECE as REGISTER_PIECE, faults as registration};
#[cfg(all(test, not(memres_loom)))]
pub(crate) use staged::CHUNK;

use std::alloc::Layout;
use std::fmt;
use std::ptr::NonNull;

pub use cuda::{CudaPhysical, CudaVirtualConfig};
pub(crate) use granules::Granules;
pub use host::HostPages;
pub use host_copy::HostCopy;
pub use registered::Registering;

use crate::error::Error;
use crate::resource::{Resource, SyncResource, dangling};
use crate::stream::StreamRef;
use crate::sync::{Mutex, MutexGuard};

/// A virtual-memory leaf over CUDA's virtual memory management (`cuMemAddressReserve`,
/// `cuMemCreate`, `cuMemMap`): device memory.
pub type CudaVirtual = Virtual<CudaPhysical>;

/// A virtual-memory leaf over host pages (`mmap` with `PROT_NONE`, pages committed with
/// `mprotect` and given back with a fresh `PROT_NONE` mapping): the same logic as
/// [`CudaVirtual`], runnable anywhere, for tests and for replaying GPU logs on a CPU.
pub type HostVirtual = Virtual<HostPages>;

mod sealed {
    pub trait Sealed {}
}

/// What backs a [`Virtual`] leaf: a reserved range whose granules can be mapped and
/// unmapped. Implemented by [`CudaPhysical`] and [`HostPages`] only.
pub trait Backend: sealed::Sealed + Send + Sync + 'static {
    /// The properties of the memory.
    type Properties: crate::property::PropertySet;

    /// Bytes per granule: the unit of mapping, and the alignment of the range.
    fn granularity(&self) -> usize;

    /// The reserved range: its first address and its length in bytes.
    fn range(&self) -> (usize, usize);

    /// Backs `addr..addr + len` (whole granules inside the range, all unmapped) with
    /// memory; on failure nothing of it stays mapped.
    fn map(&self, addr: usize, len: usize) -> Result<(), Error>;

    /// Gives back the memory under `addr..addr + len` (whole mapped granules).
    ///
    /// # Safety
    /// Nothing uses the memory any more, on the host or on any stream.
    unsafe fn unmap(&self, addr: usize, len: usize);

    /// Waits until work on `stream` is done (before memory freed on it is unmapped).
    fn wait(&self, stream: StreamRef<'_>) -> Result<(), Error>;

    /// While `keep` is on, [`unmap`](Self::unmap) keeps the physical memory it takes away
    /// for the next [`map`](Self::map)s to use again (moving memory to another address
    /// costs a remap, not a new allocation); turning it off gives back what no map took.
    /// The default keeps nothing.
    fn keep_unmapped(&self, keep: bool) {
        let _ = keep;
    }

    /// A queue of copies between the leaf's memory and host memory that run in the order
    /// they were asked for (a CUDA stream of its own; nothing for host pages, whose copies
    /// are done when the call returns). A pool's sleep and wake copy on several at once,
    /// one thread each.
    type Lane: Send;

    /// A new [`Lane`](Self::Lane).
    fn lane(&self) -> Result<Self::Lane, Error>;

    /// `len` bytes of new host memory that the copies of a lane may use (pinned, for
    /// device memory): a staging buffer. [`Error::OutOfMemory`] when it cannot be had.
    fn staging(&self, len: usize) -> Result<HostCopy, Error>;

    /// Copies `len` bytes at `addr` to `into`, in order on `lane`; it may still be under
    /// way when the call returns ([`finish`](Self::finish) waits for it).
    ///
    /// # Safety
    /// `addr..addr + len` is mapped and nothing writes to it, and `into` is valid for
    /// `len` writes and used by nothing else, until `finish(lane)` returns; `into` lies in
    /// a [`staging`](Self::staging) buffer or in the registered part of a copy
    /// ([`registrar`](Self::registrar)'s).
    unsafe fn copy_out(
        &self,
        lane: &Self::Lane,
        addr: usize,
        into: *mut u8,
        len: usize,
    ) -> Result<(), Error>;

    /// Copies `len` bytes at `from` to `addr`, in order on `lane`; it may still be under
    /// way when the call returns ([`finish`](Self::finish) waits for it).
    ///
    /// # Safety
    /// `addr..addr + len` is mapped and nothing else uses it, and `from` is valid for `len`
    /// reads and unwritten, until `finish(lane)` returns; `from` lies in a
    /// [`staging`](Self::staging) buffer or in the registered part of a copy.
    unsafe fn copy_in(
        &self,
        lane: &Self::Lane,
        addr: usize,
        from: *const u8,
        len: usize,
    ) -> Result<(), Error>;

    /// Waits until the copies asked for on `lane` are done.
    fn finish(&self, lane: &Self::Lane) -> Result<(), Error>;

    /// What registers host copies for this backend's copies (`registered.rs`), so that
    /// they run between a copy and the leaf's memory directly.
    #[doc(hidden)]
    fn registrar(&self) -> registered::Registrar;

    /// Waits until all work on the device is done (on every stream).
    fn synchronize(&self) -> Result<(), Error>;
}

/// A resource whose memory lies in one reserved address range that it maps a granule at
/// a time, so that a pool can grow it *in place*.
///
/// # Safety
/// Implementors promise: [`map_at`](Self::map_at) maps exactly the granules asked for (or
/// nothing, with an error); memory mapped by it or by `allocate` may be given back in any
/// pieces of whole granules, through [`unmap_at`](Self::unmap_at) or `deallocate_sync`
/// with a layout of that many bytes; and adjacent mapped granules are adjacent memory,
/// usable as one block.
pub unsafe trait GrowInPlace: Resource {
    /// Bytes per granule.
    fn granularity(&self) -> usize;

    /// The reserved range: its first address and its length in bytes.
    fn reservation(&self) -> (usize, usize);

    /// Maps `len` bytes at `addr`: one or more whole granules inside the reservation, none
    /// mapped yet ([`Error::InvalidArgument`] otherwise). [`Error::OutOfMemory`] when
    /// physical memory runs out.
    fn map_at(&self, addr: usize, len: usize) -> Result<(), Error>;

    /// Unmaps `len` bytes at `addr` (whole mapped granules).
    ///
    /// # Safety
    /// The range was mapped by this resource (through `map_at` or `allocate`) and nothing
    /// uses it any more, on the host or on any stream.
    unsafe fn unmap_at(&self, addr: usize, len: usize);

    /// While `keep` is on, memory [`unmap_at`](Self::unmap_at) takes away is kept for the
    /// next [`map_at`](Self::map_at)s (a pool that moves free memory to where a request
    /// fits remaps it instead of allocating anew); turning it off gives back the rest.
    /// The default keeps nothing.
    fn keep_unmapped(&self, keep: bool) {
        let _ = keep;
    }

    /// Unmaps each `(address, bytes)` range as [`unmap_at`](Self::unmap_at) does, in any
    /// order (a pool that sleeps and discards gives all its memory back at once): the
    /// leaves unmap on several threads (`MEMRES_OFFLOAD_MAP_THREADS`). The default: one
    /// after another.
    ///
    /// # Safety
    /// As for `unmap_at`, for every range; the ranges do not overlap.
    unsafe fn unmap_ranges_at(&self, ranges: &[(usize, usize)]) {
        for &(addr, len) in ranges {
            // SAFETY: the caller's promise.
            unsafe { self.unmap_at(addr, len) };
        }
    }

    /// Copies each `(address, bytes)` range (mapped granules) into host memory, one copy
    /// per range in their order, for a pool that sleeps with
    /// [`SleepMode::Offload`](crate::suballoc::SleepMode::Offload): into copies taken
    /// from `spare` where one is large enough (an earlier sleep's), else into new host
    /// memory, each registered with the driver (page-locked) as it is copied into where
    /// the leaves register, else staged through buffers taken from `spare` or made (they
    /// go back to it). On an error the copies taken or made go back to `spare` too. The
    /// default:
    /// [`Error::Unsupported`].
    ///
    /// # Safety
    /// The ranges were mapped by this resource, and nothing writes to them until the call
    /// returns, on the host or on any stream.
    unsafe fn save_at(
        &self,
        ranges: &[(usize, usize)],
        spare: &mut Vec<HostCopy>,
    ) -> Result<Vec<HostCopy>, Error> {
        let _ = (ranges, spare);
        Err(Error::unsupported(
            "this resource cannot copy its memory to the host",
        ))
    }

    /// Copies each `(address, bytes)` range into host memory as
    /// [`save_at`](Self::save_at) does and unmaps it as
    /// [`unmap_ranges_at`](Self::unmap_ranges_at) does: what a pool that sleeps with
    /// [`SleepMode::Offload`](crate::suballoc::SleepMode::Offload) does with its memory.
    /// When it returns `Ok`, every range is unmapped and its copy is in the result. On an
    /// error every range is mapped, with its contents, as before the call (unless the
    /// device cannot be waited for, or a range it unmapped cannot be mapped again: that
    /// memory is then lost, and the failure logged), and the copies go back to `spare`.
    /// The default: `save_at`, then `unmap_ranges_at`; the leaves unmap each range once
    /// its copy is done, while the others are copied.
    ///
    /// # Safety
    /// The ranges were mapped by this resource, apart from each other, and nothing uses
    /// them until the call returns, on the host or on any stream (nor afterwards, if it
    /// returns `Ok`, until they are mapped again).
    unsafe fn offload_at(
        &self,
        ranges: &[(usize, usize)],
        spare: &mut Vec<HostCopy>,
    ) -> Result<Vec<HostCopy>, Error> {
        // SAFETY: the caller's promises, passed on.
        let copies = unsafe { self.save_at(ranges, spare)? };
        // SAFETY: mapped by this resource and unused (the caller's promise); copied.
        unsafe { self.unmap_ranges_at(ranges) };
        Ok(copies)
    }

    /// Maps each `(address, bytes)` range (whole unmapped granules of the reservation) in
    /// order and, when `copies` is not empty (then it has one per range, each holding at
    /// least its range's bytes, from [`save_at`](Self::save_at)), copies each range's copy
    /// back, while the next ranges are mapped; every copy is done when the call returns.
    /// Staging buffers are taken from `spare` or made, and go back to it. On an error
    /// nothing it mapped stays mapped (unless the device cannot be waited for: then the
    /// memory under copies that may still run stays mapped). The default maps without
    /// copies, and refuses copies with [`Error::Unsupported`].
    ///
    /// # Safety
    /// Nothing uses the ranges until the call returns (memory that was handed out there
    /// before it was unmapped is still pointed to).
    unsafe fn wake_at(
        &self,
        ranges: &[(usize, usize)],
        copies: &[HostCopy],
        spare: &mut Vec<HostCopy>,
    ) -> Result<(), Error> {
        let _ = spare;
        if !copies.is_empty() {
            return Err(Error::unsupported(
                "this resource cannot copy host memory into its own",
            ));
        }
        for (i, &(addr, len)) in ranges.iter().enumerate() {
            if let Err(e) = self.map_at(addr, len) {
                for &(addr, len) in &ranges[..i] {
                    // SAFETY: mapped just above by this call; nothing uses it (the
                    // caller's promise).
                    unsafe { self.unmap_at(addr, len) };
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// Host memory for later [`save_at`](Self::save_at)s, made now: a copy of `len` bytes
    /// for each of `copies` (pageable, its pages backed now), and the staging buffers a
    /// save of them uses (none where copies are registered as they are copied into),
    /// less the `staging` buffers the caller keeps already
    /// ([`is_staging_buffer`](Self::is_staging_buffer)). For a pool that makes ahead what
    /// its first offloading sleep would otherwise make while it sleeps. The default:
    /// [`Error::Unsupported`].
    fn prepare_host_memory(
        &self,
        copies: &[usize],
        staging: usize,
    ) -> Result<Vec<HostCopy>, Error> {
        let _ = (copies, staging);
        Err(Error::unsupported(
            "this resource cannot copy its memory to the host",
        ))
    }

    /// Starts registering the pageable ones of `copies` (from [`save_at`](Self::save_at)
    /// or [`prepare_host_memory`](Self::prepare_host_memory)) with the driver, a piece at
    /// a time, on a thread of its own, so that later saves and wakes copy their
    /// registered parts directly rather than through staging buffers. Dropping what it
    /// returns stops it; the caller does so before it hands any of `copies` to
    /// `save_at` or `wake_at`, or frees them. `None` when there is nothing to register
    /// or it is turned off (`MEMRES_OFFLOAD_REGISTER=0`). The default: `None`.
    fn register_host_copies(&self, copies: &[&HostCopy]) -> Option<Registering> {
        let _ = copies;
        None
    }

    /// Whether `copy` (from [`save_at`](Self::save_at)'s spares) is a staging buffer
    /// rather than a copy. The default: never.
    fn is_staging_buffer(&self, copy: &HostCopy) -> bool {
        let _ = copy;
        false
    }

    /// Waits until all work on the memory's device is done, on every stream (before a
    /// pool that sleeps copies or unmaps its memory). The default:
    /// [`Error::Unsupported`].
    fn synchronize(&self) -> Result<(), Error> {
        Err(Error::unsupported(
            "this resource cannot wait for its device",
        ))
    }
}

/// A leaf that hands out whole granules of one reserved range ([`CudaVirtual`],
/// [`HostVirtual`]).
///
/// On its own it is a simple resource (first fit over the granules, every allocation
/// rounded up to whole granules, so use it under a pool); its point is
/// [`Virtual::virtual_pool`], a [`VirtualPool`](crate::VirtualPool) that grows in place.
///
/// - Alignment: any power of two up to the granularity.
/// - Stream-ordered frees wait for the stream before unmapping (memory usable at once is
///   usable in any stream order, so allocation ignores the stream).
/// - Dropping it unmaps whatever is still mapped and frees the reservation.
pub struct Virtual<B: Backend> {
    backend: B,
    granules: Mutex<Granules>,
    /// Held shared by every map and unmap from its check of the granules to its record of
    /// them, and exclusively by a change of which devices may reach the memory
    /// (`Virtual::grant_access`): such a change sees every mapped range whole (none half
    /// made), and every map after it gives the new access.
    maps: std::sync::RwLock<()>,
    /// The most granules mapped at once (a simulated device's memory for `HostVirtual`;
    /// unbounded for `CudaVirtual`, whose driver says when memory runs out).
    limit: usize,
}

impl<B: Backend> Virtual<B> {
    fn from_backend(backend: B, limit_bytes: usize) -> Virtual<B> {
        let (_, len) = backend.range();
        let g = backend.granularity();
        Virtual {
            granules: Mutex::new(Granules::new(len / g)),
            maps: std::sync::RwLock::new(()),
            limit: limit_bytes / g,
            backend,
        }
    }

    /// Maps granules `first..first + n` (unmapped, in range) under the caller's lock:
    /// [`Error::OutOfMemory`] past the limit or when the backend runs out.
    fn map_granules(&self, granules: &mut Granules, first: usize, n: usize) -> Result<(), Error> {
        let g = self.backend.granularity();
        if granules.mapped() + granules.claimed() + n > self.limit {
            return Err(Error::out_of_memory(n * g));
        }
        self.backend
            .map(self.backend.range().0 + first * g, n * g)?;
        granules.set(first, n, true);
        Ok(())
    }

    /// The backend (the CUDA device's or the host's pages).
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Bytes currently backed by memory.
    pub fn mapped_bytes(&self) -> usize {
        self.lock().mapped() * self.backend.granularity()
    }

    /// The most bytes backed by memory at once since the leaf was made: the footprint
    /// of whatever runs over it.
    pub fn peak_mapped_bytes(&self) -> usize {
        self.lock().peak() * self.backend.granularity()
    }

    fn lock(&self) -> MutexGuard<'_, Granules> {
        crate::sync::lock(&self.granules)
    }

    /// Held by a map or an unmap for its whole course (see [`Virtual::maps`]); taken
    /// before the granules' lock.
    fn mapping(&self) -> std::sync::RwLockReadGuard<'_, ()> {
        self.maps
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Held by a change of which devices may reach the memory: no map or unmap is under
    /// way while it lives.
    fn changing_access(&self) -> std::sync::RwLockWriteGuard<'_, ()> {
        self.maps
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The granule range of `addr..addr + len`, if both ends are granule-aligned and
    /// inside the reservation.
    fn granule_range(&self, addr: usize, len: usize) -> Option<(usize, usize)> {
        let g = self.backend.granularity();
        let (base, size) = self.backend.range();
        let end = addr.checked_add(len)?;
        (addr >= base
            && end <= base + size
            && (addr - base).is_multiple_of(g)
            && len.is_multiple_of(g))
        .then(|| ((addr - base) / g, len / g))
    }
}

impl<B: Backend> Drop for Virtual<B> {
    fn drop(&mut self) {
        let g = self.backend.granularity();
        let (base, _) = self.backend.range();
        let granules = std::mem::take(&mut *self.lock());
        for (first, n) in granules.mapped_runs() {
            // SAFETY: mapped by this leaf; whoever held blocks of it has given them back or
            // is going away with the leaf (a pool drops its upstream after waiting for its
            // streams).
            unsafe { self.backend.unmap(base + first * g, n * g) };
        }
    }
}

impl<B: Backend + fmt::Debug> fmt::Debug for Virtual<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Virtual")
            .field("backend", &self.backend)
            .field("mapped_bytes", &self.mapped_bytes())
            .finish()
    }
}

impl<B: Backend> PartialEq for Virtual<B> {
    /// Identity: only this leaf can unmap its range.
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self, other)
    }
}

// SAFETY: blocks are mapped granules of the reservation, handed out once (the bit set
// records them under its lock) and aligned to the granularity (the range is); the
// properties are the backend's; only the leaf itself is equal to it.
unsafe impl<B: Backend> SyncResource for Virtual<B> {
    type Properties = B::Properties;

    fn allocate_sync(&self, layout: Layout) -> Result<NonNull<u8>, Error> {
        if layout.size() == 0 {
            return Ok(dangling(layout));
        }
        let g = self.backend.granularity();
        if layout.align() > g {
            return Err(Error::invalid_argument(format!(
                "a virtual-memory leaf aligns to its granularity ({g} bytes); {} was asked",
                layout.align()
            )));
        }
        let n = layout.size().div_ceil(g);
        let _mapping = self.mapping();
        let mut granules = self.lock();
        let first = granules
            .find_unmapped(n)
            .ok_or_else(|| Error::out_of_memory(layout.size()))?;
        self.map_granules(&mut granules, first, n)?;
        let addr = self.backend.range().0 + first * g;
        // A reservation never starts at address 0.
        NonNull::new(std::ptr::with_exposed_provenance_mut(addr))
            .ok_or_else(|| Error::invalid_argument("a virtual-memory reservation at address 0"))
    }

    unsafe fn deallocate_sync(&self, ptr: NonNull<u8>, layout: Layout) {
        if layout.size() == 0 {
            return;
        }
        let g = self.backend.granularity();
        let len = layout.size().next_multiple_of(g);
        // SAFETY: the caller's promise: these granules came from this leaf and are unused.
        unsafe { self.unmap_at(ptr.as_ptr().addr(), len) }
    }
}

// SAFETY: as for `SyncResource`; a stream-ordered free waits for its stream first.
unsafe impl<B: Backend> Resource for Virtual<B> {
    fn allocate(&self, _stream: StreamRef<'_>, layout: Layout) -> Result<NonNull<u8>, Error> {
        self.allocate_sync(layout)
    }

    unsafe fn deallocate(&self, stream: StreamRef<'_>, ptr: NonNull<u8>, layout: Layout) {
        if layout.size() == 0 {
            return;
        }
        if let Err(e) = self.backend.wait(stream) {
            tracing::error!(%e, "memres: a virtual-memory leaf's stream failed; block leaked");
            return;
        }
        // SAFETY: the caller's promise, and the stream's work is done (above).
        unsafe { self.deallocate_sync(ptr, layout) }
    }
}

// SAFETY: `map_at` maps exactly the granules asked for or fails having mapped nothing
// (the backend's promise); granules are unmapped one range at a time in any pieces; the
// reservation is one contiguous range of addresses.
unsafe impl<B: Backend> GrowInPlace for Virtual<B> {
    fn granularity(&self) -> usize {
        self.backend.granularity()
    }

    fn reservation(&self) -> (usize, usize) {
        self.backend.range()
    }

    fn map_at(&self, addr: usize, len: usize) -> Result<(), Error> {
        // (No granule is no map: CUDA refuses one, `cuMemSetAccess` of 0 bytes.)
        let Some((first, n)) = self.granule_range(addr, len).filter(|&(_, n)| n > 0) else {
            return Err(Error::invalid_argument(format!(
                "{len} bytes at {addr:#x} are not whole granules of the reservation"
            )));
        };
        let _mapping = self.mapping();
        {
            let mut granules = self.lock();
            if !granules.all(first, n, false) {
                return Err(Error::invalid_argument(format!(
                    "{len} bytes at {addr:#x} are already (partly) mapped"
                )));
            }
            if granules.mapped() + granules.claimed() + n > self.limit {
                return Err(Error::out_of_memory(len));
            }
            granules.claim(first, n);
        }
        // The driver maps outside the lock, so that several threads map at once (a wake
        // maps its ranges on several); the claim keeps every other map off the range.
        let mapped = self.backend.map(addr, len);
        let mut granules = self.lock();
        match mapped {
            Ok(()) => granules.commit(n),
            Err(_) => granules.unclaim(first, n),
        }
        mapped
    }

    unsafe fn unmap_at(&self, addr: usize, len: usize) {
        let Some((first, n)) = self.granule_range(addr, len) else {
            tracing::error!(
                addr,
                len,
                "memres: unmap of a range outside the reservation"
            );
            return;
        };
        let _mapping = self.mapping();
        if !self.lock().all(first, n, true) {
            tracing::error!(addr, len, "memres: unmap of granules that are not mapped");
            return;
        }
        // SAFETY: mapped (checked above) and unused (the caller's promise). Outside the
        // lock, so that several threads unmap at once (a discarding sleep unmaps on
        // several); the granules stay marked mapped until the memory is gone, so no map
        // takes them before.
        unsafe { self.backend.unmap(addr, len) };
        self.lock().set(first, n, false);
    }

    unsafe fn unmap_ranges_at(&self, ranges: &[(usize, usize)]) {
        // SAFETY: the caller's promise, passed on.
        unsafe { staged::unmap_ranges(self, ranges) }
    }

    fn keep_unmapped(&self, keep: bool) {
        self.backend.keep_unmapped(keep);
    }

    unsafe fn save_at(
        &self,
        ranges: &[(usize, usize)],
        spare: &mut Vec<HostCopy>,
    ) -> Result<Vec<HostCopy>, Error> {
        ranges
            .iter()
            .try_for_each(|&(addr, len)| self.check_mapped(addr, len))?;
        // SAFETY: mapped (checked above); unwritten while it runs (the caller's promise).
        unsafe { staged::save(&self.backend, ranges, spare) }
    }

    unsafe fn offload_at(
        &self,
        ranges: &[(usize, usize)],
        spare: &mut Vec<HostCopy>,
    ) -> Result<Vec<HostCopy>, Error> {
        for &(addr, len) in ranges {
            self.check_mapped(addr, len)?;
        }
        // SAFETY: mapped (checked above); unused while it runs and, once unmapped, until
        // mapped again (the caller's promise).
        unsafe { staged::offload(self, ranges, spare) }
    }

    unsafe fn wake_at(
        &self,
        ranges: &[(usize, usize)],
        copies: &[HostCopy],
        spare: &mut Vec<HostCopy>,
    ) -> Result<(), Error> {
        if !copies.is_empty() {
            if copies.len() != ranges.len() {
                return Err(Error::invalid_argument(format!(
                    "{} host copies for {} ranges",
                    copies.len(),
                    ranges.len()
                )));
            }
            if let Some((&(_, len), copy)) = ranges.iter().zip(copies).find(|(r, c)| c.len() < r.1)
            {
                return Err(Error::invalid_argument(format!(
                    "a host copy of {} bytes cannot restore {len}",
                    copy.len()
                )));
            }
        }
        // SAFETY: the copies hold their ranges (checked above); nothing uses the ranges
        // (the caller's promise); `map_at` refuses ranges that are not whole unmapped
        // granules before anything is copied into them.
        unsafe { staged::wake(self, ranges, copies, spare) }
    }

    fn prepare_host_memory(
        &self,
        copies: &[usize],
        staging: usize,
    ) -> Result<Vec<HostCopy>, Error> {
        staged::prepare(&self.backend, copies, staging)
    }

    fn is_staging_buffer(&self, copy: &HostCopy) -> bool {
        staged::is_staging(copy)
    }

    fn register_host_copies(&self, copies: &[&HostCopy]) -> Option<Registering> {
        registered::start(self.backend.registrar(), copies)
    }

    fn synchronize(&self) -> Result<(), Error> {
        self.backend.synchronize()
    }
}

impl<B: Backend> Virtual<B> {
    /// [`Error::InvalidArgument`] unless `addr..addr + len` is whole mapped granules of
    /// the reservation.
    fn check_mapped(&self, addr: usize, len: usize) -> Result<(), Error> {
        match self.granule_range(addr, len) {
            Some((first, n)) if self.lock().all(first, n, true) => Ok(()),
            _ => Err(Error::invalid_argument(format!(
                "{len} bytes at {addr:#x} are not mapped granules of the reservation"
            ))),
        }
    }
}
