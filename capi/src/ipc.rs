//! Blocks shared with other processes (`memres_ipc_export`, `memres_ipc_open`,
//! `memres_ipc_close`): PyTorch's CUDA tensors sent through `torch.multiprocessing`.
//!
//! A handle is bytes, in one of two forms:
//!
//! - **64 bytes**: the `cudaIpcMemHandle_t` of a `cuMemAlloc` allocation (chunked pools,
//!   arenas, `cuda`). PyTorch's own allocator sends and opens the same bytes, so either
//!   process may run without memres. The form `2, 'c', <64 bytes>` of newer PyTorch
//!   versions is opened too.
//! - **granules** (the default in-place pool, whose memory is mapped a granule at a time),
//!   in the form of PyTorch's expandable segments (checked with PyTorch 2.11, whose handle
//!   version is 2: its own allocator in the receiving process opens it, with or without
//!   expandable segments, and memres opens PyTorch's; BENCHMARKS.md, `ipc_to_torch`):
//!
//!   | bytes | what |
//!   | --- | --- |
//!   | 0 | 2, PyTorch's handle version |
//!   | 1 | `'e'`, an expandable segment |
//!   | 2..6 | the sender's process id (`i32`, little-endian as every field) |
//!   | 6..10 | zero (the header's padding) |
//!   | 10..18 | bytes per granule (`u64`) |
//!   | 18..26 | granules, `n` (`u64`) |
//!   | 26.. | `n` descriptor numbers in the sender (`i32`) |
//!
//!   The receiver takes the descriptors with `pidfd_getfd` (Linux 5.6; it needs the right
//!   to ptrace the sender, as PyTorch's expandable segments do) and maps them in order.
//!   The sender keeps its descriptors open until the block is freed (PyTorch keeps a
//!   sent block alive until every receiver released it). memres adds 8 bytes after the
//!   descriptors: a number no other export of this process had, so that a later block
//!   whose descriptors got the same numbers never has the same handle (receivers,
//!   PyTorch's and memres's, keep opened ranges by the handle's bytes; PyTorch reads the
//!   header and the descriptors and leaves what follows). A handle is never 64 bytes
//!   long (26 + 4n, or 34 + 4n), the length PyTorch reads as a bare CUDA IPC handle.

use std::collections::HashMap;
use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::sync::PoisonError;
use std::sync::atomic::{AtomicU64, Ordering};

use std::ffi::{c_int, c_void};

use mr::Error;
use mr::device::DeviceId;

use crate::exports::Shared;
use crate::{Failure, MEMRES_OK, guarded, slot};
use mr::upstream::{IPC_HANDLE_SIZE, Imported};

/// PyTorch's handle version, the first byte of both forms that carry a type.
const VERSION: u8 = 2;
/// The type byte of an expandable segment's handle (granules).
const GRANULES: u8 = b'e';
/// The type byte of a `cudaIpcMemHandle_t` after the version.
const CUDA: u8 = b'c';
/// Version, type and PyTorch's header (`pid`, padding, granule size, granule count).
const HEADER: usize = 26;
/// The export's number after the descriptors (memres's handles only).
const EXPORT_NUMBER: usize = 8;
/// The numbers of this process's exports.
static EXPORTS: AtomicU64 = AtomicU64::new(0);

/// A decoded handle.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Handle {
    Cuda([u8; IPC_HANDLE_SIZE]),
    Granules {
        pid: u32,
        granule: u64,
        fds: Vec<i32>,
    },
}

impl Handle {
    /// The length of memres's granules handle of `n` granules (never 64, the length of
    /// a bare CUDA IPC handle).
    pub(crate) fn granules_len(n: usize) -> usize {
        HEADER + 4 * n + EXPORT_NUMBER
    }

    /// The bytes of a granules handle, numbered as no other export of this process.
    pub(crate) fn encode_granules(pid: u32, granule: u64, fds: &[i32]) -> Vec<u8> {
        let number = EXPORTS.fetch_add(1, Ordering::Relaxed);
        let mut out = Vec::with_capacity(Handle::granules_len(fds.len()));
        out.extend_from_slice(&[VERSION, GRANULES]);
        out.extend_from_slice(&pid.to_le_bytes());
        out.extend_from_slice(&[0; 4]);
        out.extend_from_slice(&granule.to_le_bytes());
        out.extend_from_slice(&(fds.len() as u64).to_le_bytes());
        for fd in fds {
            out.extend_from_slice(&fd.to_le_bytes());
        }
        out.extend_from_slice(&number.to_le_bytes());
        out
    }

    /// Reads a handle; a message saying what is wrong with one it cannot read.
    pub(crate) fn decode(bytes: &[u8]) -> Result<Handle, String> {
        if bytes.len() == IPC_HANDLE_SIZE {
            return Ok(Handle::Cuda(bytes.try_into().expect("64 bytes")));
        }
        match bytes {
            [version, ..] if *version > VERSION => Err(format!(
                "a handle of version {version} (a newer PyTorch's?); this memres reads version \
                 {VERSION}"
            )),
            [VERSION, CUDA, cuda @ ..] if cuda.len() == IPC_HANDLE_SIZE => {
                Ok(Handle::Cuda(cuda.try_into().expect("64 bytes")))
            }
            [VERSION, GRANULES, ..] => Handle::decode_granules(bytes),
            _ => Err(format!(
                "a {}-byte handle that is neither a CUDA IPC handle nor an expandable \
                 segment's",
                bytes.len()
            )),
        }
    }

    fn decode_granules(bytes: &[u8]) -> Result<Handle, String> {
        if bytes.len() < HEADER {
            return Err(format!(
                "an expandable segment's handle of {} bytes, shorter than its header",
                bytes.len()
            ));
        }
        let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8"));
        let pid = u32::from_le_bytes(bytes[2..6].try_into().expect("4"));
        let granule = u64_at(10);
        let n = u64_at(18);
        if n == 0 || granule == 0 {
            return Err(format!(
                "an expandable segment's handle of {n} granules of {granule} bytes"
            ));
        }
        // PyTorch's handles end with the descriptors; memres's carry the export's number.
        let end = usize::try_from(n)
            .ok()
            .and_then(|n| n.checked_mul(4)?.checked_add(HEADER));
        let fits = end.is_some_and(|end| [end, end + EXPORT_NUMBER].contains(&bytes.len()));
        let Some(end) = end.filter(|_| fits) else {
            return Err(format!(
                "an expandable segment's handle of {} bytes names {n} granules: cut short or \
                 padded",
                bytes.len()
            ));
        };
        let fds: Vec<i32> = bytes[HEADER..end]
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect();
        Ok(Handle::Granules { pid, granule, fds })
    }
}

/// Raises this process's soft limit on open descriptors to its hard limit, once: a block
/// of the in-place pool travels as one descriptor per granule (a 10 GiB tensor: 5,120 of
/// the default 2 MiB, 640 of 16 MiB), which the usual soft limit of 1,024 would refuse on
/// both sides.
fn raise_descriptor_limit() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: `limit` is a valid place for the call to write.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0
            && limit.rlim_cur < limit.rlim_max
        {
            limit.rlim_cur = limit.rlim_max;
            // SAFETY: raising the soft limit up to the hard one needs no privilege; a
            // failure leaves the limit as it was.
            unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) };
        }
    });
}

/// What another process needs to map the block (see `DeviceStack::share`), with the
/// descriptor limit raised first.
fn share(stack: &crate::stack::DeviceStack, address: usize, size: usize) -> Result<Shared, Error> {
    raise_descriptor_limit();
    stack.share(address, size)
}

/// Takes descriptor `fd` of process `pid` (`pidfd_open` + `pidfd_getfd`).
fn take_fd(pidfd: &OwnedFd, fd: i32) -> Result<OwnedFd, std::io::Error> {
    use std::os::fd::AsRawFd;
    // SAFETY: plain syscall on descriptors we own; a failure is -1 with errno.
    let got = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
    if got < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the kernel handed us a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(got as i32) })
}

fn open_pid(pid: u32) -> Result<OwnedFd, std::io::Error> {
    // SAFETY: plain syscall; a failure is -1 with errno.
    let got = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if got < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the kernel handed us a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(got as i32) })
}

/// Maps a decoded handle on `device`.
pub(crate) fn import(handle: &Handle, device: DeviceId) -> Result<Imported, Error> {
    match handle {
        Handle::Cuda(bytes) => Imported::open_ipc_handle(device, bytes),
        Handle::Granules { pid, granule, fds } => {
            raise_descriptor_limit();
            let pidfd = open_pid(*pid).map_err(|e| {
                Error::invalid_argument(format!(
                    "the sending process {pid} cannot be reached (pidfd_open: {e}); has it \
                     exited?"
                ))
            })?;
            let taken = fds
                .iter()
                .map(|&fd| take_fd(&pidfd, fd))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| {
                    Error::invalid_argument(format!(
                        "cannot take the sending process {pid}'s memory descriptors \
                         (pidfd_getfd: {e}); the receiver needs the right to ptrace the \
                         sender (the same user, and /proc/sys/kernel/yama/ptrace_scope 0 \
                         or CAP_SYS_PTRACE), as for PyTorch's expandable segments"
                    ))
                })?;
            let granule = usize::try_from(*granule)
                .map_err(|_| Error::invalid_argument("a granule larger than memory"))?;
            let borrowed: Vec<_> = taken.iter().map(AsFd::as_fd).collect();
            Imported::map_fds(device, granule, &borrowed)
        }
    }
}

/// Ranges opened in this process, shared by every open of the same handle (a CUDA IPC
/// handle can be opened once per process).
#[derive(Default)]
pub(crate) struct Opened {
    by_handle: HashMap<Vec<u8>, usize>,
    by_base: HashMap<usize, OpenRange>,
}

struct OpenRange {
    imported: Imported,
    handle: Vec<u8>,
    opens: usize,
}

impl Opened {
    /// The base of the range `handle` names on `device`, mapped now or by an earlier open.
    pub(crate) fn open(&mut self, handle: &[u8], device: DeviceId) -> Result<usize, Error> {
        if let Some(&base) = self.by_handle.get(handle) {
            let range = self.by_base.get_mut(&base).expect("both maps agree");
            if range.imported.device() == device {
                range.opens += 1;
                return Ok(base);
            }
        }
        let decoded = Handle::decode(handle).map_err(Error::invalid_argument)?;
        let imported = import(&decoded, device)?;
        let base = imported.base();
        self.by_handle.insert(handle.to_vec(), base);
        self.by_base.insert(
            base,
            OpenRange {
                imported,
                handle: handle.to_vec(),
                opens: 1,
            },
        );
        Ok(base)
    }

    /// Closes one open of the range at `base`; the last returns the range, for the caller
    /// to drop (which waits for the device, then unmaps) once it has let go of the lock.
    /// `None` for an address no open returned.
    pub(crate) fn close(&mut self, base: usize) -> Option<Option<Imported>> {
        let range = self.by_base.get_mut(&base)?;
        range.opens -= 1;
        if range.opens > 0 {
            return Some(None);
        }
        let range = self.by_base.remove(&base).expect("found above");
        if self.by_handle.get(&range.handle) == Some(&base) {
            self.by_handle.remove(&range.handle);
        }
        Some(Some(range.imported))
    }
}

/// The ranges this process opened.
pub(crate) static OPENED: std::sync::Mutex<Option<Opened>> = std::sync::Mutex::new(None);

/// Writes into `out` (at most `capacity` bytes) a handle with which another process maps
/// the block `ptr` (`size` bytes from `memres_malloc` on `device`, live) through
/// `memres_ipc_open`, and the block's offset in the mapped range into `offset`. Returns the
/// handle's length; with `out` NULL, only that length (nothing is exported). Blocks of the
/// in-place pool (the default) export their granules as POSIX descriptors, kept open
/// until the block is freed; others the `cudaIpcMemHandle_t` of their allocation (the
/// bytes PyTorch's own allocator sends). A negative code on failure: a null or foreign
/// pointer, a driver pool (`cuda_async`), a buffer too small.
///
/// # Safety
/// `out` is null or valid for `capacity` bytes; `offset` is null or valid for one
/// `size_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memres_ipc_export(
    ptr: *mut c_void,
    size: isize,
    device: c_int,
    out: *mut c_void,
    capacity: usize,
    offset: *mut usize,
) -> i64 {
    guarded(i64::from, || {
        let size = usize::try_from(size)
            .ok()
            .filter(|&s| s > 0)
            .ok_or_else(|| Failure::invalid(format!("memres_ipc_export: size {size}")))?;
        if ptr.is_null() {
            return Err(Failure::invalid("memres_ipc_export: the pointer is null"));
        }
        let stack = crate::stack_of_block("memres_ipc_export", ptr as usize, device, "")?;
        let _on = mr::device::DeviceGuard::new(DeviceId::new(device))?;
        if out.is_null() {
            // Only the length, which follows from the range.
            let len = match stack.granules_of(ptr as usize, size) {
                Some(n) => Handle::granules_len(n),
                None => mr::upstream::IPC_HANDLE_SIZE,
            };
            return Ok(len as i64);
        }
        let again = stack.granules_of(ptr as usize, size).and_then(|n| {
            stack
                .exported()
                .handle_of(ptr as usize, Handle::granules_len(n))
        });
        let (bytes, at, kept) = match again {
            Some((bytes, at)) => (bytes, at, None),
            None => match share(stack, ptr as usize, size)? {
                Shared::CudaHandle { handle, offset } => (handle.to_vec(), offset, None),
                Shared::Granules {
                    granule,
                    offset,
                    fds,
                } => {
                    use std::os::fd::AsRawFd;
                    let numbers: Vec<i32> = fds.iter().map(AsRawFd::as_raw_fd).collect();
                    let bytes =
                        Handle::encode_granules(std::process::id(), granule as u64, &numbers);
                    (bytes, offset, Some(fds))
                }
            },
        };
        if bytes.len() > capacity {
            return Err(Failure::invalid(format!(
                "memres_ipc_export: the handle takes {} bytes; the buffer has {capacity}",
                bytes.len()
            )));
        }
        // SAFETY: the caller's promise: `out` is valid for `capacity` bytes, which
        // holds the handle (checked above).
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), out.cast::<u8>(), bytes.len()) };
        if !offset.is_null() {
            // SAFETY: the caller's promise about `offset`.
            unsafe { offset.write(at) };
        }
        if let Some(fds) = kept {
            stack.exported().keep(ptr as usize, bytes.clone(), at, fds);
        }
        Ok(bytes.len() as i64)
    })
}

/// Maps on `device` the memory a handle of `memres_ipc_export` (in another process) names,
/// or a CUDA IPC handle of 64 bytes (as PyTorch sends), and writes its first address into
/// `base` (add the sender's offset). Opening the same handle again returns the same
/// address; each open is closed with `memres_ipc_close`. `MEMRES_ERROR_INVALID_ARGUMENT`
/// for a malformed handle or a sender that cannot be reached; `MEMRES_ERROR_CUDA` where
/// the driver refuses it.
///
/// # Safety
/// `handle` is valid for `len` bytes; `base` is valid for one pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memres_ipc_open(
    handle: *const c_void,
    len: usize,
    device: c_int,
    base: *mut *mut c_void,
) -> c_int {
    guarded(
        |code| code,
        || {
            if handle.is_null() || base.is_null() {
                return Err(Failure::invalid("memres_ipc_open: a null pointer"));
            }
            slot(device)?; // a device ordinal memres serves
            // SAFETY: the caller's promise about `handle`.
            let bytes = unsafe { std::slice::from_raw_parts(handle.cast::<u8>(), len) };
            let mut opened = OPENED.lock().unwrap_or_else(PoisonError::into_inner);
            let at = opened
                .get_or_insert_with(Opened::default)
                .open(bytes, DeviceId::new(device))?;
            // SAFETY: the caller's promise about `base`.
            unsafe { base.write(std::ptr::without_provenance_mut(at)) };
            Ok(MEMRES_OK)
        },
    )
}

/// Closes one `memres_ipc_open` of the range at `base`; the last close waits for the
/// device and unmaps it. `MEMRES_ERROR_INVALID_ARGUMENT` for an address no open returned.
#[unsafe(no_mangle)]
pub extern "C" fn memres_ipc_close(base: *mut c_void) -> c_int {
    guarded(
        |code| code,
        || {
            let closed = OPENED
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get_or_insert_with(Opened::default)
                .close(base as usize);
            if let Some(last) = closed {
                drop(last); // the last close: unmapped here, outside the lock
                Ok(MEMRES_OK)
            } else {
                Err(Failure::invalid(format!(
                    "memres_ipc_close: {base:p} is not a range memres_ipc_open returned (closed \
                     twice?)"
                )))
            }
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_granules_handle_reads_back() {
        let bytes = Handle::encode_granules(4242, 2 << 20, &[7, 8, 31]);
        assert_eq!(bytes.len(), Handle::granules_len(3));
        assert_eq!(
            Handle::decode(&bytes),
            Ok(Handle::Granules {
                pid: 4242,
                granule: 2 << 20,
                fds: vec![7, 8, 31]
            })
        );
    }

    #[test]
    fn no_granules_handle_has_the_length_of_a_cuda_handle() {
        for n in 1..40 {
            let fds: Vec<i32> = (0..n).collect();
            let bytes = Handle::encode_granules(7, 1 << 21, &fds);
            assert_ne!(bytes.len(), IPC_HANDLE_SIZE, "{n} granules");
            assert_eq!(bytes.len(), Handle::granules_len(n as usize));
            assert_eq!(
                Handle::decode(&bytes),
                Ok(Handle::Granules {
                    pid: 7,
                    granule: 1 << 21,
                    fds
                })
            );
        }
    }

    #[test]
    fn cuda_handles_read_in_both_forms() {
        let raw = [9u8; IPC_HANDLE_SIZE];
        assert_eq!(Handle::decode(&raw), Ok(Handle::Cuda(raw)));
        let mut torch = vec![2, b'c'];
        torch.extend_from_slice(&raw);
        assert_eq!(Handle::decode(&torch), Ok(Handle::Cuda(raw)));
    }

    #[test]
    fn malformed_handles_say_what_is_wrong() {
        let err = |b: &[u8]| Handle::decode(b).unwrap_err();
        assert!(err(b"").contains("neither a CUDA IPC handle nor an expandable segment's"));
        assert!(err(&[2, b'x', 0, 0]).contains("neither"));
        assert!(
            err(&[2, b'c', 0, 0]).contains("neither"),
            "a CUDA handle cut short"
        );
        assert!(err(&[2, b'e', 0, 0]).contains("shorter than its header"));
        let good = Handle::encode_granules(1, 4096, &[3, 4]);
        assert!(err(&good[..good.len() - 2]).contains("cut short"));
        assert!(err(&good[..good.len() - 4]).contains("cut short"));
        let mut long = good.clone();
        long.push(0);
        assert!(err(&long).contains("padded"));
        let mut future = good.clone();
        future[0] = 3;
        assert!(err(&future).contains("version 3"));
        let none = Handle::encode_granules(1, 4096, &[]);
        assert!(err(&none).contains("0 granules"));
        let zero = Handle::encode_granules(1, 0, &[3]);
        assert!(err(&zero).contains("of 0 bytes"));
        let mut huge = good.clone();
        huge[18..26].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(err(&huge).contains("cut short or padded"));
    }

    /// The bytes are PyTorch's expandable-segment handle, field by field: what its own
    /// allocator in another process opens (PyTorch 2.11's `ShareHeader`: pid, padding,
    /// segment size, handle count; then one descriptor number per segment).
    #[test]
    fn a_granules_handle_is_laid_out_as_pytorchs() {
        let bytes = Handle::encode_granules(0x0102_0304, 2 << 20, &[5, 6]);
        let mut expected = vec![2, b'e', 4, 3, 2, 1, 0, 0, 0, 0];
        expected.extend_from_slice(&(2u64 << 20).to_le_bytes());
        expected.extend_from_slice(&2u64.to_le_bytes());
        expected.extend_from_slice(&[5, 0, 0, 0, 6, 0, 0, 0]);
        assert_eq!(bytes[..expected.len()], expected[..]);
        assert_eq!(
            bytes.len(),
            expected.len() + EXPORT_NUMBER,
            "the export's number"
        );
        // PyTorch's own handle (no number after the descriptors) reads the same.
        assert_eq!(Handle::decode(&expected), Handle::decode(&bytes));
    }

    /// Two exports of the same descriptor numbers (a block freed, its descriptors closed,
    /// a new block's given the same numbers) never have the same handle: receivers keep
    /// opened ranges by the handle's bytes.
    #[test]
    fn a_new_block_with_reused_descriptor_numbers_has_a_new_handle() {
        let first = Handle::encode_granules(7, 2 << 20, &[5, 6]);
        let again = Handle::encode_granules(7, 2 << 20, &[5, 6]);
        assert_ne!(first, again);
        assert_eq!(Handle::decode(&first), Handle::decode(&again));
    }

    #[test]
    fn a_vanished_sender_is_an_error() {
        let handle = Handle::Granules {
            pid: u32::MAX - 1,
            granule: 4096,
            fds: vec![3],
        };
        let e = import(&handle, DeviceId::new(0)).unwrap_err();
        assert!(e.to_string().contains("cannot be reached"), "{e}");
        // The import raised the descriptor limit first (a block's granules each take one).
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: `limit` is a valid place for the call to write.
        let got = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) };
        assert_eq!(got, 0);
        assert_eq!(limit.rlim_cur, limit.rlim_max);
    }

    #[test]
    fn closing_an_address_never_opened_is_refused() {
        assert!(Opened::default().close(0x1000).is_none());
    }
}
