//! [`HostPages`]: the virtual-memory backend over host pages.

use std::fmt;

use super::registered::Registrar;
use super::{Backend, HostCopy, Virtual, sealed};
use crate::copy::{self, Access};
use crate::error::Error;
use crate::property::HostAccessible;
use crate::stream::StreamRef;

/// Host pages behind a [`HostVirtual`](super::HostVirtual): a range reserved with
/// `mmap(PROT_NONE, MAP_NORESERVE)` (no memory), granules committed with
/// `mprotect(PROT_READ | PROT_WRITE)` and given back by mapping fresh `PROT_NONE` pages
/// over them (the kernel frees the old pages at once).
pub struct HostPages {
    /// What `mmap` returned (before aligning to the granularity) and its length.
    raw: usize,
    raw_len: usize,
    base: usize,
    len: usize,
    granularity: usize,
}

impl fmt::Debug for HostPages {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostPages")
            .field("base", &format_args!("{:#x}", self.base))
            .field("len", &self.len)
            .field("granularity", &self.granularity)
            .finish()
    }
}

impl sealed::Sealed for HostPages {}

impl Virtual<HostPages> {
    /// Reserves `reserve` bytes of address space, mapped `granularity` bytes at a time
    /// (a power of two, at least the page size, 4 KiB; `reserve` is rounded up to it).
    ///
    /// [`Error::InvalidArgument`] for a bad granularity or a reservation of zero bytes;
    /// [`Error::OutOfMemory`] when the address space cannot be reserved.
    pub fn new(reserve: usize, granularity: usize) -> Result<Virtual<HostPages>, Error> {
        Virtual::with_limit(reserve, granularity, usize::MAX)
    }

    /// As [`new`](Self::new), with at most `limit` bytes (rounded down to whole
    /// granules) mapped at once, a simulated device's memory: mapping past it is
    /// [`Error::OutOfMemory`].
    pub fn with_limit(
        reserve: usize,
        granularity: usize,
        limit: usize,
    ) -> Result<Virtual<HostPages>, Error> {
        Ok(Virtual::from_backend(
            HostPages::reserve(reserve, granularity)?,
            limit,
        ))
    }
}

impl HostPages {
    fn reserve(reserve: usize, granularity: usize) -> Result<HostPages, Error> {
        if !granularity.is_power_of_two() || granularity < 4096 {
            return Err(Error::invalid_argument(format!(
                "a host virtual-memory granularity must be a power of two of at least 4096 \
                 bytes; {granularity} was asked"
            )));
        }
        if reserve == 0 {
            return Err(Error::invalid_argument(
                "a virtual-memory reservation needs at least one byte",
            ));
        }
        let too_large = || Error::invalid_argument(format!("{reserve} bytes cannot be reserved"));
        let len = reserve
            .checked_next_multiple_of(granularity)
            .ok_or_else(too_large)?;
        let raw_len = len.checked_add(granularity).ok_or_else(too_large)?;
        // SAFETY: a fresh anonymous mapping at an address of the kernel's choosing touches
        // no existing memory; PROT_NONE with MAP_NORESERVE commits none.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                raw_len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(Error::out_of_memory(reserve));
        }
        let raw = raw.addr();
        #[cfg(test)]
        {
            super::registered::faults::forget(raw.next_multiple_of(granularity));
            faults::forget_unmaps(raw.next_multiple_of(granularity));
        }
        Ok(HostPages {
            raw,
            raw_len,
            base: raw.next_multiple_of(granularity),
            len,
            granularity,
        })
    }
}

impl Backend for HostPages {
    type Properties = HostAccessible;

    fn granularity(&self) -> usize {
        self.granularity
    }

    fn range(&self) -> (usize, usize) {
        (self.base, self.len)
    }

    fn map(&self, addr: usize, len: usize) -> Result<(), Error> {
        #[cfg(test)]
        if faults::fail_this_map(self.base) {
            return Err(Error::out_of_memory(len));
        }
        // SAFETY: `addr..addr + len` lies inside our own PROT_NONE reservation (the
        // caller's promise), so changing its protection touches no other memory.
        let r = unsafe {
            libc::mprotect(
                std::ptr::with_exposed_provenance_mut(addr),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
            )
        };
        if r != 0 {
            return Err(Error::out_of_memory(len));
        }
        Ok(())
    }

    unsafe fn unmap(&self, addr: usize, len: usize) {
        #[cfg(test)]
        faults::count_unmap(self.base, len);
        // SAFETY: inside our reservation (the caller's promise) and unused; a fixed
        // mapping over it replaces the pages (their contents are freed) and keeps the
        // range reserved.
        let r = unsafe {
            libc::mmap(
                std::ptr::with_exposed_provenance_mut(addr),
                len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if r == libc::MAP_FAILED {
            tracing::error!(addr, len, "memres: host pages could not be given back");
        }
    }

    fn wait(&self, _stream: StreamRef<'_>) -> Result<(), Error> {
        // Host memory is only used by the host, whose work is done when it frees.
        Ok(())
    }

    /// Nothing: the host copies at once.
    #[cfg(not(test))]
    type Lane = ();
    /// In the lib's tests, the copies a leaf may hold until the lane is waited for
    /// ([`faults::defer_copies`]), as a GPU's lane does.
    #[cfg(test)]
    type Lane = faults::Lane;

    #[cfg(not(test))]
    fn lane(&self) -> Result<(), Error> {
        Ok(())
    }

    #[cfg(test)]
    fn lane(&self) -> Result<faults::Lane, Error> {
        Ok(faults::Lane::default())
    }

    fn staging(&self, len: usize) -> Result<HostCopy, Error> {
        #[cfg(test)]
        if faults::staging_fails(self.base) {
            return Err(Error::out_of_memory(len));
        }
        HostCopy::heap(len)
    }

    unsafe fn copy_out(
        &self,
        _lane: &Self::Lane,
        addr: usize,
        into: *mut u8,
        len: usize,
    ) -> Result<(), Error> {
        #[cfg(test)]
        if faults::save_fails(addr) {
            return Err(Error::out_of_memory(len));
        }
        #[cfg(test)]
        if faults::defers(self.base) {
            _lane.defer(into.expose_provenance(), addr, len);
            return Ok(());
        }
        // SAFETY: `addr..addr + len` is mapped host memory nobody writes to, and `into`
        // separate host memory valid for `len` bytes (the caller's promises); a host
        // stream copies at once.
        unsafe {
            copy::copy(
                into,
                Access::HOST,
                std::ptr::with_exposed_provenance(addr),
                Access::HOST,
                len,
                StreamRef::HOST,
            )
        }
    }

    unsafe fn copy_in(
        &self,
        _lane: &Self::Lane,
        addr: usize,
        from: *const u8,
        len: usize,
    ) -> Result<(), Error> {
        #[cfg(test)]
        if faults::save_fails(addr) {
            return Err(Error::out_of_memory(len));
        }
        #[cfg(test)]
        if faults::defers(self.base) {
            _lane.defer(addr, from.expose_provenance(), len);
            return Ok(());
        }
        // SAFETY: `addr..addr + len` is mapped host memory nobody else uses, and `from`
        // separate host memory valid for `len` bytes (the caller's promises).
        unsafe {
            copy::copy(
                std::ptr::with_exposed_provenance_mut(addr),
                Access::HOST,
                from,
                Access::HOST,
                len,
                StreamRef::HOST,
            )
        }
    }

    fn finish(&self, _lane: &Self::Lane) -> Result<(), Error> {
        #[cfg(test)]
        if faults::finish_fails(self.base) {
            return Err(Error::invalid_argument(
                "(a test's broken device) a lane cannot be waited for",
            ));
        }
        // SAFETY: each copy held was asked for under `copy_out`'s or `copy_in`'s contract,
        // which holds until this call returns.
        #[cfg(test)]
        unsafe {
            _lane.run()
        };
        Ok(()) // every copy is done when its call returns (or here, if held)
    }

    fn registrar(&self) -> Registrar {
        Registrar::host(self.base)
    }

    fn synchronize(&self) -> Result<(), Error> {
        Ok(()) // no device: host work is done when the call comes
    }
}

impl Drop for HostPages {
    fn drop(&mut self) {
        // SAFETY: the whole reservation is ours; the leaf unmapped its granules first and
        // nothing uses any of it.
        unsafe {
            libc::munmap(
                std::ptr::with_exposed_provenance_mut(self.raw),
                self.raw_len,
            )
        };
    }
}

/// Fault injection for the lib's tests: a thread's maps fail where its plan says (the
/// virtual pool's out-of-memory paths, without a device that runs out).
#[cfg(test)]
pub(crate) mod faults {
    /// Reservations (by their base) whose maps fail: (base, maps made so far, fail every
    /// map whose number is a multiple of this). Per leaf, not per thread: a wake maps on
    /// several threads.
    static PLANS: std::sync::Mutex<Vec<(usize, u64, u64)>> = std::sync::Mutex::new(Vec::new());

    /// Address ranges whose copies to or from the host fail, as when host memory runs out
    /// (on any thread: a pool copies on several at once).
    static FAILING_SAVES: std::sync::Mutex<Vec<(usize, usize)>> = std::sync::Mutex::new(Vec::new());

    /// Address ranges whose copies fail once the leaf at a base has unmapped so many
    /// bytes: (from, to, base, bytes).
    static LATE_FAILING_SAVES: std::sync::Mutex<Vec<(usize, usize, usize, usize)>> =
        std::sync::Mutex::new(Vec::new());

    /// Bytes each leaf (by its base) unmapped since it was made.
    static UNMAPPED: std::sync::Mutex<Vec<(usize, usize)>> = std::sync::Mutex::new(Vec::new());

    /// A leaf at `base` is made: it has unmapped nothing (whatever one there before did).
    pub(super) fn forget_unmaps(base: usize) {
        let mut unmapped = UNMAPPED.lock().unwrap_or_else(|p| p.into_inner());
        unmapped.retain(|&(b, _)| b != base);
    }

    /// The leaf at `base` unmaps `len` bytes.
    pub(super) fn count_unmap(base: usize, len: usize) {
        let mut unmapped = UNMAPPED.lock().unwrap_or_else(|p| p.into_inner());
        match unmapped.iter_mut().find(|(b, _)| *b == base) {
            Some((_, bytes)) => *bytes += len,
            None => unmapped.push((base, len)),
        }
    }

    /// Bytes the leaf at `base` unmapped since it was made.
    pub(crate) fn unmapped_bytes(base: usize) -> usize {
        let unmapped = UNMAPPED.lock().unwrap_or_else(|p| p.into_inner());
        unmapped
            .iter()
            .find(|(b, _)| *b == base)
            .map_or(0, |&(_, bytes)| bytes)
    }

    /// From now on, a copy to or from the host of memory in `from..to` waits until the
    /// leaf at `base` has unmapped `bytes` bytes (up to 10 s), then fails (`on`); or they
    /// work again: a sleep that fails after it unmapped some of its memory.
    #[cfg(not(memres_loom))]
    pub(crate) fn fail_saves_once_unmapped(
        from: usize,
        to: usize,
        base: usize,
        bytes: usize,
        on: bool,
    ) {
        let mut failing = LATE_FAILING_SAVES.lock().unwrap_or_else(|p| p.into_inner());
        failing.retain(|&(f, t, _, _)| (f, t) != (from, to));
        if on {
            failing.push((from, to, base, bytes));
        }
    }

    /// Reservations (by their base) whose lanes hold their copies until waited for.
    static DEFERRING: std::sync::Mutex<Vec<usize>> = std::sync::Mutex::new(Vec::new());

    /// From now on (`on`), the copies of the leaf at `base` are made only when their lane
    /// is waited for (`Backend::finish`), as a GPU's are, so that a sleep that unmaps a
    /// range, or reads a staging buffer, before its lane's wait fails the tests (reading
    /// the unmapped range faults; the buffer's bytes are wrong); or at once again.
    #[cfg(not(memres_loom))]
    pub(crate) fn defer_copies(base: usize, on: bool) {
        let mut deferring = DEFERRING.lock().unwrap_or_else(|p| p.into_inner());
        deferring.retain(|&b| b != base);
        if on {
            deferring.push(base);
        }
    }

    /// Whether the leaf at `base` holds its copies until their lane is waited for.
    pub(super) fn defers(base: usize) -> bool {
        let deferring = DEFERRING.lock().unwrap_or_else(|p| p.into_inner());
        deferring.contains(&base)
    }

    /// A lane of host pages in the lib's tests: the copies it holds, in order (`to`,
    /// `from`, `len`), made when it is waited for.
    #[derive(Default)]
    pub struct Lane {
        held: std::cell::RefCell<Vec<(usize, usize, usize)>>,
    }

    impl Lane {
        /// Holds a copy of `len` bytes from `from` to `to` until [`run`](Self::run).
        pub(super) fn defer(&self, to: usize, from: usize, len: usize) {
            self.held.borrow_mut().push((to, from, len));
        }

        /// Makes the copies held, in order.
        ///
        /// # Safety
        /// Each copy's memory is as `Backend::copy_out` / `copy_in` asked: valid, mapped
        /// and unused by others, its two sides apart.
        pub(super) unsafe fn run(&self) {
            for (to, from, len) in self.held.take() {
                // SAFETY: the caller's promise.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        std::ptr::with_exposed_provenance::<u8>(from),
                        std::ptr::with_exposed_provenance_mut::<u8>(to),
                        len,
                    )
                };
            }
        }
    }

    /// Reservations (by their base) whose staging buffers fail after so many more are
    /// made.
    static FAILING_STAGING: std::sync::Mutex<Vec<(usize, usize)>> =
        std::sync::Mutex::new(Vec::new());

    /// From now on, the leaf whose reservation starts at `base` makes `more` staging
    /// buffers, then fails to make more (as when pinning fails); `None`: it works again.
    #[cfg(not(memres_loom))]
    pub(crate) fn fail_staging(base: usize, more: Option<usize>) {
        let mut failing = FAILING_STAGING.lock().unwrap_or_else(|p| p.into_inner());
        failing.retain(|&(b, _)| b != base);
        if let Some(more) = more {
            failing.push((base, more));
        }
    }

    pub(super) fn staging_fails(base: usize) -> bool {
        let mut failing = FAILING_STAGING.lock().unwrap_or_else(|p| p.into_inner());
        match failing.iter_mut().find(|(b, _)| *b == base) {
            Some((_, 0)) => true,
            Some((_, more)) => {
                *more -= 1;
                false
            }
            None => false,
        }
    }

    /// Reservations (by their base) whose lanes cannot be waited for (a broken device).
    static FAILING_FINISH: std::sync::Mutex<Vec<usize>> = std::sync::Mutex::new(Vec::new());

    /// From now on, waiting for a lane of the leaf whose reservation starts at `base`
    /// fails (`on`), as on a broken device, or works again.
    #[cfg(not(memres_loom))]
    pub(crate) fn fail_finish(base: usize, on: bool) {
        let mut failing = FAILING_FINISH.lock().unwrap_or_else(|p| p.into_inner());
        failing.retain(|&b| b != base);
        if on {
            failing.push(base);
        }
    }

    pub(super) fn finish_fails(base: usize) -> bool {
        let failing = FAILING_FINISH.lock().unwrap_or_else(|p| p.into_inner());
        failing.contains(&base)
    }

    /// From now on, copies to or from the host of memory in `from..to` fail (`on`) or
    /// work again.
    #[cfg(not(memres_loom))]
    pub(crate) fn fail_saves(from: usize, to: usize, on: bool) {
        let mut failing = FAILING_SAVES.lock().unwrap_or_else(|p| p.into_inner());
        failing.retain(|&r| r != (from, to));
        if on {
            failing.push((from, to));
        }
    }

    pub(super) fn save_fails(addr: usize) -> bool {
        let late = {
            let failing = LATE_FAILING_SAVES.lock().unwrap_or_else(|p| p.into_inner());
            failing
                .iter()
                .find(|&&(from, to, _, _)| (from..to).contains(&addr))
                .map(|&(_, _, base, bytes)| (base, bytes))
        };
        if let Some((base, bytes)) = late {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while unmapped_bytes(base) < bytes && std::time::Instant::now() < deadline {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            return true;
        }
        let failing = FAILING_SAVES.lock().unwrap_or_else(|p| p.into_inner());
        failing.iter().any(|&(from, to)| (from..to).contains(&addr))
    }

    /// From now on, every `every`-th map of the leaf whose reservation starts at `base`
    /// fails (0: none), counted from this call on whichever threads map.
    #[cfg(not(memres_loom))]
    pub(crate) fn fail_every(base: usize, every: u64) {
        let mut plans = PLANS.lock().unwrap_or_else(|p| p.into_inner());
        plans.retain(|&(b, _, _)| b != base);
        if every != 0 {
            plans.push((base, 0, every));
        }
    }

    pub(super) fn fail_this_map(base: usize) -> bool {
        let mut plans = PLANS.lock().unwrap_or_else(|p| p.into_inner());
        match plans.iter_mut().find(|(b, _, _)| *b == base) {
            Some((_, n, every)) => {
                *n += 1;
                n.is_multiple_of(*every)
            }
            None => false,
        }
    }
}
