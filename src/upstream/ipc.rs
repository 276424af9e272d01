//! Device memory shared between processes.
//!
//! Two ways, after how the memory was made:
//!
//! - **`cuMemAlloc` memory** ([`Cuda`](crate::Cuda), and the pools and arenas over it):
//!   [`ipc_handle`] gives the 64-byte `cudaIpcMemHandle_t` of the whole allocation that
//!   holds a pointer, and the pointer's offset in it; the other process opens it with
//!   [`Imported::open_ipc_handle`]. This is the handle PyTorch's own allocator sends, so
//!   either side may be PyTorch without memres.
//! - **Virtual memory** ([`CudaVirtual`](crate::CudaVirtual) made with
//!   [`ExportHandle::PosixFd`](super::ExportHandle), the virtual pool's leaf): each
//!   granule is its own physical allocation, exported as a POSIX file descriptor
//!   (`CudaVirtual::export_fds`); the other process gets the
//!   descriptors (over a Unix socket, or with `pidfd_getfd`) and maps them in order at a
//!   new address with [`Imported::map_fds`].
//!
//! Either way the importer sees the same bytes at another address; ordering between the
//! processes' work is the caller's (an IPC event, or a synchronize before sending).

use std::fmt;
use std::os::fd::{AsRawFd, BorrowedFd};

use crate::device::{Context, DeviceId, bind, process_is_exiting};
use crate::driver::{self, report};
use crate::error::Error;
use crate::platform::{Active, Platform};

/// Bytes in a `cudaIpcMemHandle_t` / `CUipcMemHandle`.
pub const IPC_HANDLE_SIZE: usize = crate::platform::IPC_HANDLE_SIZE;

/// The IPC handle of the `cuMemAlloc` allocation that holds device address `ptr`, and the
/// offset of `ptr` in that allocation.
///
/// [`Error::Driver`] where the memory cannot be shared this way (virtual memory mapped
/// with `cuMemMap`, memory of a driver pool); [`Error::NoDriver`] without libcuda.
pub fn ipc_handle(ptr: usize) -> Result<([u8; IPC_HANDLE_SIZE], usize), Error> {
    driver::init()?;
    let _current = bind(Context::current()?)?;
    let (base, _size) = Active::address_range(ptr)?;
    // The driver checks `ptr` (an error for memory it cannot share).
    let handle = Active::ipc_get(ptr)?;
    Ok((handle, ptr - base))
}

/// How an [`Imported`] range was made, for its release.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Origin {
    /// `cuIpcOpenMemHandle`: closed with `cuIpcCloseMemHandle`.
    IpcHandle,
    /// Granules mapped into a reservation of ours: unmapped and the reservation freed.
    Mapped,
}

/// Device memory of another process, mapped into this one; unmapped when dropped (after
/// waiting for the device, so no queued work still reads it).
///
/// ```no_run
/// use memres::device::DeviceId;
/// use memres::upstream::{Imported, ipc_handle};
///
/// # fn main() -> Result<(), memres::Error> {
/// # let (handle, _offset) = ipc_handle(0)?;
/// // `handle` came from another process's `ipc_handle`.
/// let shared = Imported::open_ipc_handle(DeviceId::new(0), &handle)?;
/// println!("{} bytes at {:#x}", shared.len(), shared.base());
/// # Ok(())
/// # }
/// ```
pub struct Imported {
    ctx: Context,
    base: usize,
    /// Bytes mapped (from `base`).
    len: usize,
    /// Bytes of address space reserved (`Origin::Mapped`; else 0).
    reserved: usize,
    origin: Origin,
}

impl fmt::Debug for Imported {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Imported")
            .field("device", &self.ctx.device())
            .field("base", &format_args!("{:#x}", self.base))
            .field("len", &self.len)
            .field("origin", &self.origin)
            .finish()
    }
}

impl Imported {
    /// Opens another process's [`ipc_handle`] on `device` (the allocation's first byte is
    /// at [`base`](Self::base); add the sender's offset). Peer access is enabled lazily
    /// where the memory is on another device. A process opens a given allocation once:
    /// opening it twice is a driver error.
    pub fn open_ipc_handle(
        device: DeviceId,
        handle: &[u8; IPC_HANDLE_SIZE],
    ) -> Result<Imported, Error> {
        driver::init()?;
        let ctx = Context::primary(device)?;
        let _current = bind(ctx)?;
        // The driver validates the handle.
        let base = Active::ipc_open(handle)?;
        // `base` is mapped (opened above).
        let ranged = Active::address_range(base);
        let imported = Imported {
            ctx,
            base,
            len: ranged.as_ref().map_or(0, |&(_, len)| len),
            reserved: 0,
            origin: Origin::IpcHandle,
        };
        ranged?; // dropping `imported` closes the handle
        Ok(imported)
    }

    /// Maps physical allocations that another process exported as POSIX file descriptors
    /// (each `granule` bytes, in order) into one new range on `device`, readable and
    /// writable there. The descriptors stay the caller's (close them after: the mapping
    /// keeps the memory). [`Error::InvalidArgument`] for no descriptors or a granule of 0.
    // long: one driver sequence, a SAFETY comment a call; `imported` undoes it on error.
    pub fn map_fds(
        device: DeviceId,
        granule: usize,
        fds: &[BorrowedFd<'_>],
    ) -> Result<Imported, Error> {
        if fds.is_empty() || granule == 0 {
            return Err(Error::invalid_argument(
                "importing memory needs at least one descriptor of at least one byte",
            ));
        }
        let len = granule
            .checked_mul(fds.len())
            .ok_or_else(|| Error::invalid_argument("the imported range overflows"))?;
        driver::init()?;
        let ctx = Context::primary(device)?;
        let _current = bind(ctx)?;
        // Reserves address space only.
        let base = Active::vm_reserve(len, reservation_alignment(granule))?;
        // From here on, dropping `imported` unmaps what is mapped and frees the range.
        let mut imported = Imported {
            ctx,
            base,
            len: 0,
            reserved: len,
            origin: Origin::Mapped,
        };
        for fd in fds {
            let handle = Active::vm_import_fd(fd.as_raw_fd())?;
            let at = imported.base + imported.len;
            // SAFETY: `at..at + granule` is unmapped space of our reservation; `handle` is
            // live (imported above). A size mismatch is the driver's error.
            let mapped = unsafe { Active::vm_map(at, granule, handle, granule) };
            // SAFETY: our reference from the import; the mapping keeps the memory.
            report("cuMemRelease", unsafe { Active::vm_release(handle) });
            mapped?;
            imported.len += granule;
        }
        // SAFETY: the whole range is mapped (above); readable and writable by our device.
        unsafe { Active::vm_set_access(base, len, &[device.ordinal()], len) }?;
        Ok(imported)
    }

    /// The first address of the range in this process.
    pub fn base(&self) -> usize {
        self.base
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty (never: an import maps at least one byte).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device it is mapped on.
    pub fn device(&self) -> DeviceId {
        self.ctx.device()
    }
}

impl Drop for Imported {
    fn drop(&mut self) {
        if process_is_exiting() {
            return;
        }
        let Ok(_current) = bind(self.ctx) else {
            tracing::error!("memres: cannot release memory imported from another process");
            return;
        };
        // Work queued on any stream may still use the range.
        // SAFETY: the context is current; the call only waits.
        report("cuCtxSynchronize", Active::synchronize_context());
        let base = self.base;
        match self.origin {
            // SAFETY: `base` was opened by `cuIpcOpenMemHandle` and is closed once, here.
            Origin::IpcHandle => report("cuIpcCloseMemHandle", unsafe { Active::ipc_close(base) }),
            Origin::Mapped => {
                if self.len > 0 {
                    // SAFETY: `base..base + len` is what we mapped; nothing uses it (the
                    // owner dropped it and the device is idle).
                    report("cuMemUnmap", unsafe { Active::vm_unmap(base, self.len) });
                }
                // SAFETY: our reservation, nothing mapped in it any more.
                report("cuMemAddressFree", unsafe {
                    Active::vm_free(base, self.reserved)
                });
            }
        }
    }
}

/// The alignment of a reservation for pieces of `granule` bytes: the largest power of two
/// that divides it (the driver takes powers of two only; PyTorch's expandable segments
/// send pieces of 20 MiB, 4 MiB-aligned then).
fn reservation_alignment(granule: usize) -> usize {
    1 << granule.trailing_zeros()
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;

    use super::*;

    #[test]
    fn reservations_align_to_a_power_of_two_dividing_the_piece() {
        assert_eq!(reservation_alignment(2 << 20), 2 << 20);
        assert_eq!(reservation_alignment(20 << 20), 4 << 20);
        assert_eq!(reservation_alignment(64 << 10), 64 << 10);
    }

    #[test]
    fn nothing_to_map_is_an_invalid_argument() {
        let (r, _w) = std::io::pipe().expect("a pipe");
        let fd: std::os::fd::OwnedFd = r.into();
        for (granule, fds) in [(2 << 20, vec![]), (0, vec![fd.as_fd()])] {
            let e = Imported::map_fds(DeviceId::new(0), granule, &fds).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
        }
        let e =
            Imported::map_fds(DeviceId::new(0), usize::MAX, &[fd.as_fd(), fd.as_fd()]).unwrap_err();
        assert!(e.to_string().contains("overflows"), "{e}");
    }

    #[test]
    fn without_a_driver_there_is_no_handle_to_take_or_open() {
        if driver::is_present() {
            println!(
                "memres-skip: a CUDA driver is present (this test is for machines without one)"
            );
            return;
        }
        assert!(matches!(ipc_handle(0x1000), Err(Error::NoDriver)));
        let e = Imported::open_ipc_handle(DeviceId::new(0), &[0; IPC_HANDLE_SIZE]).unwrap_err();
        assert!(matches!(e, Error::NoDriver), "{e}");
    }
}
