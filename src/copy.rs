//! Moving bytes between memories in stream order (containers and the guard adaptor).
//!
//! One rule picks the engine: on a CUDA stream the driver copies (`cuMemcpyAsync`, which
//! tells host from device memory by address, so any pair of memories works) and sets
//! (`cuMemsetD8Async`, device-accessible memory only); on a host stream, whose work is
//! always complete, the host copies, which needs host-accessible memory on both sides.

use crate::error::Error;
use crate::platform::{Active, Platform};
use crate::resource::SyncResource;
use crate::resource::{is_device_accessible, is_host_accessible};
use crate::stream::StreamRef;

/// Who may touch a block of memory: what the copy engine needs to know about each side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Access {
    host: bool,
    device: bool,
}

impl Access {
    /// Ordinary host memory: a slice the caller lends.
    pub(crate) const HOST: Access = Access {
        host: true,
        device: false,
    };

    /// Memory only the device may touch.
    pub(crate) const DEVICE: Access = Access {
        host: false,
        device: true,
    };

    /// The memory of resource `R`, as its properties say.
    pub(crate) const fn of<R: SyncResource + ?Sized>() -> Access {
        Access {
            host: is_host_accessible::<R>(),
            device: is_device_accessible::<R>(),
        }
    }

    pub(crate) const fn host(self) -> bool {
        self.host
    }

    pub(crate) const fn device(self) -> bool {
        self.device
    }
}

fn host_stream_needs_host_memory() -> Error {
    Error::invalid_argument(
        "a container on a host stream can only copy host-accessible memory; \
         give it a CUDA stream (`set_stream`) to copy device memory",
    )
}

/// Copies `len` bytes from `src` to `dst`, in order on `stream`.
///
/// # Safety
/// `dst` is valid for `len` writes and `src` for `len` reads, the two do not overlap, and
/// both stay valid until the copy is done: at once on a host stream, and on a CUDA stream
/// until the work enqueued on it so far is complete. `dst_access` and `src_access` are
/// true of the memory. On a CUDA stream, the context of the stream's device is current.
pub(crate) unsafe fn copy(
    dst: *mut u8,
    dst_access: Access,
    src: *const u8,
    src_access: Access,
    len: usize,
    stream: StreamRef<'_>,
) -> Result<(), Error> {
    if len == 0 {
        return Ok(());
    }
    match stream.cu() {
        None if dst_access.host && src_access.host => {
            // SAFETY: both are host memory, valid for `len` bytes and disjoint (the
            // caller's promise); a host stream has no work in flight on them.
            unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
            Ok(())
        }
        None => Err(host_stream_needs_host_memory()),
        Some(raw) => {
            // SAFETY: the pointers are valid until the stream's work is done and the
            // stream's context is current (the caller's promise); the driver infers the
            // direction from the addresses (unified addressing).
            unsafe { Active::copy_async(dst as usize, src as usize, len, raw) }
        }
    }
}

/// Sets `len` bytes at `dst` to zero, in order on `stream`.
///
/// # Safety
/// As [`copy`], for `dst` alone.
pub(crate) unsafe fn zero(
    dst: *mut u8,
    access: Access,
    len: usize,
    stream: StreamRef<'_>,
) -> Result<(), Error> {
    // SAFETY: the caller's promise, passed on.
    unsafe { fill(dst, 0, access, len, stream) }
}

/// Sets `len` bytes at `dst` to `value`, in order on `stream`.
///
/// # Safety
/// As [`copy`], for `dst` alone.
pub(crate) unsafe fn fill(
    dst: *mut u8,
    value: u8,
    access: Access,
    len: usize,
    stream: StreamRef<'_>,
) -> Result<(), Error> {
    if len == 0 {
        return Ok(());
    }
    match stream.cu() {
        Some(raw) if access.device => {
            // SAFETY: device-accessible memory valid for `len` bytes until the stream's
            // work is done; the stream's context is current (the caller's promise).
            unsafe { Active::fill_async(dst as usize, value, len, raw) }
        }
        Some(_) if access.host => {
            // Host-only memory: the driver cannot set it, the host can once the stream
            // no longer uses it.
            stream.synchronize()?;
            // SAFETY: host memory valid for `len` bytes, unused by the (idle) stream.
            unsafe { std::ptr::write_bytes(dst, value, len) };
            Ok(())
        }
        None if access.host => {
            // SAFETY: host memory valid for `len` bytes; host streams are always idle.
            unsafe { std::ptr::write_bytes(dst, value, len) };
            Ok(())
        }
        None => Err(host_stream_needs_host_memory()),
        Some(_) => Err(Error::invalid_argument(
            "memory that is neither host- nor device-accessible cannot be set",
        )),
    }
}
