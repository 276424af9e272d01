//! [`CudaPhysical`]: the virtual-memory backend over CUDA's virtual memory management.

use std::fmt;

use super::registered::Registrar;
use super::{Backend, HostCopy, Virtual, sealed};
use crate::copy::{self, Access};
use crate::device::{Context, DeviceId, bind, process_is_exiting};
use crate::driver::{self, report};
use crate::error::Error;
use crate::platform::{Active, Attribute, MemHandle, Platform};
use crate::property::DeviceAccessible;
use crate::stream::{Stream, StreamFlags, StreamRef};
use crate::upstream::{ExportHandle, PinnedHost};

/// How to make a [`CudaVirtual`](super::CudaVirtual).
///
/// ```
/// use memres::upstream::{CudaVirtualConfig, ExportHandle};
///
/// let config = CudaVirtualConfig::new().reserve(256 << 30).export(ExportHandle::PosixFd);
/// assert_eq!(config.reserved(), Some(256 << 30));
/// assert_eq!(config.granule(), None, "the device's minimum");
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CudaVirtualConfig {
    reserve: Option<usize>,
    peers: Vec<DeviceId>,
    export: ExportHandle,
    granularity: Option<usize>,
}

impl CudaVirtualConfig {
    /// The defaults: twice the device's memory reserved (room for growth after trimming
    /// left holes), no peers, no export.
    pub fn new() -> CudaVirtualConfig {
        CudaVirtualConfig::default()
    }

    /// Bytes of address space to reserve (rounded up to the granularity).
    #[must_use]
    pub fn reserve(mut self, bytes: usize) -> CudaVirtualConfig {
        self.reserve = Some(bytes);
        self
    }

    /// Other devices that may read and write the memory (peer access over NVLink/PCIe),
    /// from the start. Each one makes every map and unmap dearer (on two H200s a granule's
    /// `cuMemSetAccess` took 105 us for two devices against 34 for one, its `cuMemUnmap`
    /// 58 against 22: `BENCHMARKS.md`), so name only the peers that will use the memory,
    /// or add one when it is first needed with
    /// [`CudaVirtual::grant_access`](super::Virtual::grant_access), as the C ABI does.
    #[must_use]
    pub fn peers(mut self, devices: impl IntoIterator<Item = DeviceId>) -> CudaVirtualConfig {
        self.peers = devices.into_iter().collect();
        self
    }

    /// Makes the physical memory exportable to other processes
    /// ([`CudaVirtual::export_fd`](super::Virtual::export_fd)).
    #[must_use]
    pub fn export(mut self, handle: ExportHandle) -> CudaVirtualConfig {
        self.export = handle;
        self
    }

    /// The reservation asked for, if any.
    pub fn reserved(&self) -> Option<usize> {
        self.reserve
    }

    /// Bytes per granule, the unit the leaf maps and gives back: a power of two, raised
    /// to the device's minimum (2 MiB on current GPUs) where it is smaller; the default
    /// is that minimum. Each granule is an allocation of its own (`cuMemCreate`,
    /// `cuMemMap`; `cuMemUnmap` to give it back), so larger granules mean fewer driver
    /// calls (a pool of 20 GiB that sleeps and wakes makes 10,240 of each at 2 MiB, 640 at
    /// 32 MiB) at the cost of coarser growth and trim: a pool over the leaf grows and
    /// gives back whole granules. A granularity that is not a power of two is
    /// [`Error::InvalidArgument`] when the leaf is made.
    #[must_use]
    pub fn granularity(mut self, bytes: usize) -> CudaVirtualConfig {
        self.granularity = Some(bytes);
        self
    }

    /// The granularity asked for, if any.
    pub fn granule(&self) -> Option<usize> {
        self.granularity
    }
}

/// Device memory behind a [`CudaVirtual`](super::CudaVirtual): one range reserved with
/// `cuMemAddressReserve`; each granule backed by its own `cuMemCreate` allocation, mapped
/// with `cuMemMap` and made accessible with `cuMemSetAccess`; unmapping a granule frees
/// its memory (the handle is released right after mapping, so the mapping holds the last
/// reference).
pub struct CudaPhysical {
    ctx: Context,
    base: usize,
    len: usize,
    granularity: usize,
    /// The devices that may read and write the memory (ours first, then its peers), by
    /// ordinal: every map gives them access; [`Virtual::grant_access`] adds to them.
    access: std::sync::Mutex<Vec<i32>>,
    export: ExportHandle,
    /// While [`Backend::keep_unmapped`] is on: the allocations of granules unmapped since,
    /// each with our reference, for `map` to use before creating new ones.
    spare: std::sync::Mutex<Option<Vec<MemHandle>>>,
}

impl fmt::Debug for CudaPhysical {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaPhysical")
            .field("device", &self.ctx.device())
            .field("base", &format_args!("{:#x}", self.base))
            .field("len", &self.len)
            .field("granularity", &self.granularity)
            .field("export", &self.export)
            .finish()
    }
}

impl sealed::Sealed for CudaPhysical {}

impl Virtual<CudaPhysical> {
    /// A virtual-memory leaf for the current device, with the defaults of
    /// [`CudaVirtualConfig`].
    pub fn new() -> Result<Virtual<CudaPhysical>, Error> {
        Virtual::with_config(DeviceId::current()?, CudaVirtualConfig::new())
    }

    /// A virtual-memory leaf for `device`.
    ///
    /// [`Error::NoDriver`] without libcuda; [`Error::Unsupported`] naming the attribute
    /// where the device lacks virtual memory management (or the export asked for).
    pub fn with_config(
        device: DeviceId,
        config: CudaVirtualConfig,
    ) -> Result<Virtual<CudaPhysical>, Error> {
        Ok(Virtual::from_backend(
            CudaPhysical::reserve(device, config)?,
            usize::MAX,
        ))
    }

    /// A POSIX file descriptor for the physical memory of the granule at `addr` (mapped,
    /// from a leaf made with `export(ExportHandle::PosixFd)`), for another process to
    /// import with `cuMemImportFromShareableHandle` and map into its own address space.
    pub fn export_fd(&self, addr: usize) -> Result<std::os::fd::OwnedFd, Error> {
        use std::os::fd::FromRawFd;
        let b = &self.backend;
        if b.export != ExportHandle::PosixFd {
            return Err(Error::unsupported(
                "this virtual-memory leaf was not made exportable as POSIX file descriptors",
            ));
        }
        let g = b.granularity;
        if addr < b.base || addr >= b.base + b.len {
            return Err(Error::invalid_argument(format!(
                "{addr:#x} is outside the reservation"
            )));
        }
        let first = (addr - b.base) / g;
        if !self.lock().all(first, 1, true) {
            return Err(Error::invalid_argument(format!("{addr:#x} is not mapped")));
        }
        let _current = bind(b.ctx)?;
        // SAFETY: the granule is mapped (checked above), so it has an allocation handle;
        // retaining it gives us a reference we release below.
        let handle = unsafe { Active::vm_retain(b.base + first * g) }?;
        // SAFETY: `handle` is live (retained above) and was created with the POSIX-fd
        // handle type.
        let exported = unsafe { Active::vm_export_fd(handle) };
        // SAFETY: the reference retained above.
        report("cuMemRelease", unsafe { Active::vm_release(handle) });
        let fd = exported?;
        // SAFETY: the driver handed us a new descriptor that nothing else owns.
        Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
    }

    /// Lets `peer` read and write the leaf's memory: every range mapped now
    /// (`cuMemSetAccess`, one call a run of mapped granules) and every map from now on,
    /// as [`CudaVirtualConfig::peers`] does from the start. This is how PyTorch's
    /// expandable segments add a peer: when a program first needs it, since access for
    /// more devices makes every map and unmap dearer (on two H200s, `cuMemSetAccess` for
    /// two devices costs about three times what it costs for one: `BENCHMARKS.md`).
    ///
    /// A peer granted already, or the leaf's own device, is `Ok` at once;
    /// [`Error::Unsupported`] where `peer` cannot reach this device's memory. Waits for
    /// the maps and unmaps under way, and they wait for it: one `cuMemSetAccess` a run of
    /// mapped granules, whose cost is per granule (about 100 us on two H200s, some 4 s
    /// for 80 GiB mapped). On an error the peer may reach part of what is mapped, and
    /// later maps do not give it access.
    ///
    /// ```no_run
    /// use memres::{CudaVirtual, device::DeviceId, upstream::CudaVirtualConfig};
    ///
    /// let leaf = CudaVirtual::with_config(DeviceId::new(0), CudaVirtualConfig::new())?;
    /// leaf.grant_access(DeviceId::new(1))?; // kernels on GPU 1 may now use its memory
    /// assert_eq!(leaf.accessible_from(), [DeviceId::new(0), DeviceId::new(1)]);
    /// # Ok::<(), memres::Error>(())
    /// ```
    pub fn grant_access(&self, peer: DeviceId) -> Result<(), Error> {
        let b = &self.backend;
        let own = b.ctx.device();
        if peer == own {
            return Ok(());
        }
        let _changing = self.changing_access();
        if b.access().contains(&peer.ordinal()) {
            return Ok(());
        }
        peer.require_peer_access(own)?;
        let _current = bind(b.ctx)?;
        let g = b.granularity;
        // No map or unmap is under way (`_changing`): every run is mapped whole.
        let runs = self.lock().mapped_runs();
        for (first, n) in runs {
            let (addr, len) = (b.base + first * g, n * g);
            // SAFETY: a run of mapped granules of our reservation, which stays mapped
            // while `_changing` keeps every unmap out.
            unsafe { Active::vm_set_access(addr, len, &[peer.ordinal()], len) }?;
        }
        b.access().push(peer.ordinal());
        Ok(())
    }

    /// The devices that may read and write the leaf's memory: its own first, then the
    /// peers named in its [`CudaVirtualConfig::peers`] or granted since
    /// ([`grant_access`](Self::grant_access)).
    pub fn accessible_from(&self) -> Vec<DeviceId> {
        self.backend
            .access()
            .iter()
            .map(|&ordinal| DeviceId::new(ordinal))
            .collect()
    }

    /// POSIX file descriptors for the granules under `addr..addr + len` (all mapped), in
    /// address order, and the first granule's address: what another process needs to map
    /// the same memory ([`Imported::map_fds`](crate::upstream::Imported::map_fds)). The
    /// descriptors keep the memory alive while they are open, even after this leaf unmaps
    /// it: close them once the other process has its own.
    pub fn export_fds(
        &self,
        addr: usize,
        len: usize,
    ) -> Result<(usize, Vec<std::os::fd::OwnedFd>), Error> {
        let g = self.backend.granularity;
        let end = addr
            .checked_add(len.max(1))
            .ok_or_else(|| Error::invalid_argument("the exported range overflows"))?;
        let first = addr - addr % g;
        let fds = (first..end)
            .step_by(g)
            .map(|granule| self.export_fd(granule))
            .collect::<Result<Vec<_>, Error>>()?;
        Ok((first, fds))
    }
}

impl CudaPhysical {
    // long: the driver's setup steps in order, a SAFETY comment a call.
    fn reserve(device: DeviceId, config: CudaVirtualConfig) -> Result<CudaPhysical, Error> {
        if let Some(g) = config.granularity.filter(|g| !g.is_power_of_two()) {
            return Err(Error::invalid_argument(format!(
                "a granularity of {g} bytes: not a power of two"
            )));
        }
        driver::init()?;
        if device.attribute(Attribute::VirtualMemoryManagement)? == 0 {
            return Err(Error::unsupported(format!(
                "{device} lacks CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"
            )));
        }
        if config.export == ExportHandle::PosixFd
            && device.attribute(Attribute::PosixFdHandles)? == 0
        {
            return Err(Error::unsupported(format!(
                "{device} lacks CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED"
            )));
        }
        let ctx = Context::primary(device)?;
        let _current = bind(ctx)?;
        let minimum = Active::vm_granularity(device.ordinal(), config.export.is_posix_fd())?;
        let granularity = config
            .granularity
            .map_or(minimum, |g| g.max(minimum).next_multiple_of(minimum));
        let reserve = match config.reserve {
            Some(bytes) => bytes,
            None => device.memory_info()?.total.saturating_mul(2),
        };
        if reserve == 0 {
            return Err(Error::invalid_argument(
                "a virtual-memory reservation needs at least one byte",
            ));
        }
        let len = reserve
            .checked_next_multiple_of(granularity)
            .ok_or_else(|| {
                Error::invalid_argument(format!("{reserve} bytes cannot be reserved"))
            })?;
        // Reserves address space only (no memory).
        let base = Active::vm_reserve(len, granularity)?;
        let access = std::iter::once(device)
            .chain(config.peers.iter().copied().filter(|&p| p != device))
            .map(DeviceId::ordinal)
            .collect();
        Ok(CudaPhysical {
            ctx,
            base,
            len,
            granularity,
            access: std::sync::Mutex::new(access),
            export: config.export,
            spare: std::sync::Mutex::new(None),
        })
    }

    /// The devices that may reach the memory, locked.
    fn access(&self) -> std::sync::MutexGuard<'_, Vec<i32>> {
        crate::sync::lock_std(&self.access)
    }

    /// The spare allocations, locked.
    fn spare(&self) -> std::sync::MutexGuard<'_, Option<Vec<MemHandle>>> {
        crate::sync::lock_std(&self.spare)
    }

    /// Unmaps granules `addr..addr + len` one by one (each is its own mapping), keeping
    /// their allocations as spares while that is on. The spares' lock is held for each
    /// granule's retain only, not across the driver's unmaps: a sleep unmaps while its
    /// copying threads copy, and a discarding one on several threads.
    fn unmap_granules(&self, addr: usize, len: usize) {
        for a in (addr..addr + len).step_by(self.granularity) {
            if let Some(kept) = self.spare().as_mut() {
                // SAFETY: `a` starts a mapped granule (the callers' promise), which has an
                // allocation; retaining it gives us a reference, kept in `kept`.
                if let Ok(handle) = unsafe { Active::vm_retain(a) } {
                    kept.push(handle);
                }
            }
            // SAFETY: `a` starts a mapped granule (the callers' promise); unmapping drops
            // the last reference to its memory.
            report("cuMemUnmap", unsafe {
                Active::vm_unmap(a, self.granularity)
            });
        }
    }
}

impl Backend for CudaPhysical {
    type Properties = DeviceAccessible;

    fn granularity(&self) -> usize {
        self.granularity
    }

    fn range(&self) -> (usize, usize) {
        (self.base, self.len)
    }

    fn map(&self, addr: usize, len: usize) -> Result<(), Error> {
        let _current = bind(self.ctx)?;
        let g = self.granularity;
        let mut done = 0;
        let result = (|| {
            while done < len {
                let spare = self.spare().as_mut().and_then(Vec::pop);
                let handle = match spare {
                    Some(handle) => handle,
                    // Pinned device memory of our device, one granule.
                    None => Active::vm_create(
                        g,
                        self.ctx.device().ordinal(),
                        self.export.is_posix_fd(),
                        len,
                    )?,
                };
                // SAFETY: `addr + done` is an unmapped granule of our reservation (the
                // caller's promise) and `handle` a live allocation of one granule.
                let mapped = unsafe { Active::vm_map(addr + done, g, handle, len) };
                // SAFETY: our reference to the allocation; once mapped, the mapping keeps
                // the memory alive until it is unmapped.
                report("cuMemRelease", unsafe { Active::vm_release(handle) });
                mapped?;
                done += g;
            }
            let access = self.access().clone();
            // SAFETY: `addr..addr + len` is mapped (above); the descriptors name our device
            // and its peers.
            unsafe { Active::vm_set_access(addr, len, &access, len) }
        })();
        if result.is_err() {
            self.unmap_granules(addr, done);
        }
        result
    }

    unsafe fn unmap(&self, addr: usize, len: usize) {
        if process_is_exiting() {
            return;
        }
        match bind(self.ctx) {
            Ok(_current) => self.unmap_granules(addr, len),
            Err(e) => tracing::error!(%e, "memres: CudaVirtual: cannot unmap"),
        }
    }

    fn wait(&self, stream: StreamRef<'_>) -> Result<(), Error> {
        stream.synchronize_in(self.ctx)
    }

    /// A stream of its own, which does not wait for the legacy stream (the pool waited
    /// for the whole device before it copies).
    type Lane = Stream;

    fn lane(&self) -> Result<Stream, Error> {
        Stream::on(self.ctx.device(), StreamFlags::NonBlocking)
    }

    fn staging(&self, len: usize) -> Result<HostCopy, Error> {
        HostCopy::pinned(PinnedHost::on(self.ctx.device())?, len)
    }

    unsafe fn copy_out(
        &self,
        lane: &Stream,
        addr: usize,
        into: *mut u8,
        len: usize,
    ) -> Result<(), Error> {
        let _current = bind(self.ctx)?;
        // SAFETY: `addr..addr + len` is mapped device memory nothing writes to, and `into`
        // pinned host memory valid for `len` bytes, until the lane is waited for (the
        // caller's promises); the lane is a stream of this device, whose context is
        // current.
        unsafe {
            copy::copy(
                into,
                Access::HOST,
                std::ptr::with_exposed_provenance(addr),
                Access::DEVICE,
                len,
                lane.as_ref(),
            )
        }
    }

    unsafe fn copy_in(
        &self,
        lane: &Stream,
        addr: usize,
        from: *const u8,
        len: usize,
    ) -> Result<(), Error> {
        let _current = bind(self.ctx)?;
        // SAFETY: `addr..addr + len` is mapped device memory nothing else uses, and `from`
        // pinned host memory valid for `len` unwritten bytes, until the lane is waited for
        // (the caller's promises); the context of the lane's device is current.
        unsafe {
            copy::copy(
                std::ptr::with_exposed_provenance_mut(addr),
                Access::DEVICE,
                from,
                Access::HOST,
                len,
                lane.as_ref(),
            )
        }
    }

    fn finish(&self, lane: &Stream) -> Result<(), Error> {
        lane.synchronize()
    }

    fn registrar(&self) -> Registrar {
        Registrar::cuda(self.ctx)
    }

    fn synchronize(&self) -> Result<(), Error> {
        self.ctx.synchronize()
    }

    fn keep_unmapped(&self, keep: bool) {
        let left = std::mem::replace(&mut *self.spare(), keep.then(Vec::new));
        let left = left.unwrap_or_default();
        if left.is_empty() || process_is_exiting() {
            return;
        }
        let Ok(_current) = bind(self.ctx) else {
            tracing::error!("memres: CudaVirtual: cannot give spare granules back");
            return;
        };
        for handle in left {
            // SAFETY: our reference to an allocation no mapping uses any more.
            report("cuMemRelease", unsafe { Active::vm_release(handle) });
        }
    }
}

impl Drop for CudaPhysical {
    fn drop(&mut self) {
        self.keep_unmapped(false);
        if process_is_exiting() {
            return;
        }
        // SAFETY: the reservation is ours and nothing in it is mapped any more (the leaf
        // unmapped its granules before its backend drops).
        report("cuMemAddressFree", unsafe {
            Active::vm_free(self.base, self.len)
        });
    }
}

#[cfg(all(test, not(memres_loom)))]
mod tests {
    use super::CudaVirtualConfig;
    use crate::CudaVirtual;
    use crate::device::DeviceId;
    use crate::error::Error;

    #[test]
    fn a_granularity_that_is_not_a_power_of_two_is_refused_before_the_driver_is_asked() {
        let config = CudaVirtualConfig::new().granularity(3 << 20);
        assert_eq!(config.granule(), Some(3 << 20));
        let made = CudaVirtual::with_config(DeviceId::new(0), config);
        assert!(
            matches!(made, Err(Error::InvalidArgument(_))),
            "{:?}",
            made.err()
        );
    }
}
