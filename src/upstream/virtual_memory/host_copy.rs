//! [`HostCopy`]: the contents of mapped granules kept in host memory while a pool sleeps
//! with [`SleepMode::Offload`](crate::suballoc::SleepMode::Offload).

use std::alloc::Layout;
use std::fmt;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use super::registered::{self, Registrar};
use crate::error::Error;
use crate::resource::SyncResource;
use crate::upstream::{HostHeap, PinnedHost};

/// Host memory a sleeping pool uses: a copy of `len` bytes of a virtual-memory leaf, made
/// by [`GrowInPlace::save_at`](super::GrowInPlace::save_at) and written back by
/// [`GrowInPlace::wake_at`](super::GrowInPlace::wake_at), or a staging buffer those copies
/// pass through. A copy is pageable memory of its own mapping (`mmap`, with transparent
/// huge pages asked for), which the kernel backs on first touch, so that it costs no
/// pinning; a staging buffer is pinned (`cuMemHostAlloc`) for device memory, so that the
/// device's copies into and out of it run at the bus's speed, and the heap's for host
/// pages. A copy is registered with the driver from its start, a piece at a time, as a
/// sleep copies into it or afterwards (`registered.rs`), and the device then copies to and
/// from that part directly.
/// Dropping it frees that memory (unregistered first).
pub struct HostCopy {
    ptr: NonNull<u8>,
    layout: Layout,
    memory: Staging,
    /// Set when a copy of the device to or from it may still be under way (its lane could
    /// not be waited for: a broken device): dropping it then leaks its memory rather than
    /// free or unregister it under the copy.
    abandoned: AtomicBool,
}

/// Copies leaked because a device's copy might still use them (the lib's tests count them).
#[cfg(test)]
pub(crate) static ABANDONED: std::sync::atomic::AtomicUsize =
    std::sync::atomic::AtomicUsize::new(0);

/// Where a [`HostCopy`]'s memory came from.
enum Staging {
    Heap(HostHeap),
    Pinned(PinnedHost),
    /// A mapping of its own, shared with a thread that registers it (`registered.rs`).
    Pages(Arc<Pages>),
}

/// A copy's mapping: what `mmap` returned and its length, where the copy starts in it and
/// its bytes, and how much of it (from its start) is registered.
pub(crate) struct Pages {
    raw: usize,
    raw_len: usize,
    start: usize,
    size: usize,
    registered: Mutex<Registered>,
}

/// The registered prefix of a copy: by whom, and its bytes (whole pieces of
/// [`registered::PIECE`] but the last).
#[derive(Default)]
struct Registered {
    by: Option<Registrar>,
    bytes: usize,
}

impl Pages {
    fn registered(&self) -> std::sync::MutexGuard<'_, Registered> {
        self.registered
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether `by` can register more of it: some of it is unregistered, and what is
    /// registered is `by`'s.
    pub(crate) fn left_to_register(&self, by: &Registrar) -> bool {
        let r = self.registered();
        r.bytes < self.size && r.by.is_none_or(|b| b == *by)
    }

    /// Registers the next piece with `by`: `Ok(true)` once it is registered, `Ok(false)`
    /// when there is none to register (all of it is, another registered it, or only the
    /// caller still holds the mapping: its copy was freed).
    pub(crate) fn register_next(self: &Arc<Pages>, by: &Registrar) -> Result<bool, Error> {
        if Arc::strong_count(self) == 1 {
            return Ok(false);
        }
        let mut r = self.registered();
        if r.bytes >= self.size || r.by.is_some_and(|b| b != *by) {
            return Ok(false);
        }
        let len = registered::PIECE.min(self.size - r.bytes);
        // Registered under the lock: nothing else reads it meanwhile (the pool stops its
        // registering thread before it copies, and a sleep's thread registers only the
        // copy it copies into), and the mapping lives while `self` does.
        by.register(self.start + r.bytes, len)?;
        r.by = Some(*by);
        r.bytes += len;
        Ok(true)
    }
}

impl Drop for Pages {
    fn drop(&mut self) {
        let r = std::mem::take(
            self.registered
                .get_mut()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        if let Some(by) = r.by {
            let mut unregistered = true;
            for offset in (0..r.bytes).step_by(registered::PIECE) {
                // SAFETY: each piece was registered by `by` at this offset
                // (`register_next` registers whole pieces from the start), once; the copy
                // is going away, so no copy of the device uses it.
                unregistered &= unsafe { by.unregister(self.start + offset) };
            }
            if !unregistered {
                return; // left mapped: see `Registrar::unregister`
            }
        }
        // SAFETY: the mapping `HostCopy::pages` made, which only this reaches; it is
        // going away, unregistered.
        let r = unsafe {
            libc::munmap(
                std::ptr::with_exposed_provenance_mut(self.raw),
                self.raw_len,
            )
        };
        if r != 0 {
            tracing::error!(
                len = self.raw_len,
                "memres: a host copy could not be unmapped"
            );
        }
    }
}

/// Transparent huge pages are this large on x86-64 and most arm64 kernels: a copy's
/// mapping starts on such a boundary, so the kernel can back it with huge pages (fewer
/// faults, each zeroing 2 MiB).
const HUGE_PAGE: usize = 2 << 20;

/// Host memory is handed out in pieces aligned to a page, which both leaves honour.
const PAGE: usize = 4096;

/// The environment variable that says whether a copy's mapping asks for transparent huge
/// pages (`madvise(MADV_HUGEPAGE)`): `0` never, `1` always; unset (or anything else),
/// unless the kernel's setting is `[never]`. Read once per process. (`0` is there to
/// compare: in a virtual machine that hands free memory back to its host, a huge page
/// the guest has not used lately costs the host's faults when first written, and a
/// first sleep over such pages ran slower than over small ones, see BENCHMARKS.md.)
pub(crate) const HUGE_PAGES_VARIABLE: &str = "MEMRES_OFFLOAD_HUGE_PAGES";

/// Where the kernel says whether transparent huge pages are used: `always`, `madvise`
/// (only where asked for) or `never`, the one in force in brackets.
const THP_SETTING: &str = "/sys/kernel/mm/transparent_hugepage/enabled";

/// Whether copies ask for transparent huge pages ([`HUGE_PAGES_VARIABLE`],
/// [`THP_SETTING`]), decided once.
fn huge_pages() -> bool {
    static ASK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ASK.get_or_init(|| {
        let set = std::env::var(HUGE_PAGES_VARIABLE).ok();
        let kernel = std::fs::read_to_string(THP_SETTING).ok();
        ask_huge_pages(set.as_deref(), kernel.as_deref())
    })
}

/// [`huge_pages`] given the variable's value and the kernel's setting (if either can be
/// read). A setting that cannot be read (no such file: a kernel without transparent huge
/// pages, or a sandbox) still asks: a kernel that does not know the advice refuses it,
/// which costs one call and changes nothing.
fn ask_huge_pages(set: Option<&str>, kernel: Option<&str>) -> bool {
    match set.map(str::trim) {
        Some("0") => false,
        Some("1") => true,
        _ => kernel.is_none_or(|k| !k.contains("[never]")),
    }
}

// SAFETY: the memory is reached through the copy, and for a pageable copy also by the
// thread that registers it (`Arc<Pages>`: it only registers pieces, under the mapping's
// lock, and frees nothing while the copy lives); the leaves it is freed through are
// `Send + Sync`.
unsafe impl Send for HostCopy {}
// SAFETY: as for `Send`. Threads sharing `&HostCopy` write through `as_ptr` only the
// disjoint chunks each took from a counter, or the whole copy of a range one thread took
// (`staged.rs`), and no one reads a chunk until the threads are joined.
unsafe impl Sync for HostCopy {}

impl HostCopy {
    /// `len` bytes of the heap, for a copy of host pages.
    pub(crate) fn heap(len: usize) -> Result<HostCopy, Error> {
        HostCopy::from(Staging::Heap(HostHeap), len)
    }

    /// `len` bytes of pinned memory, for a staging buffer of device memory's copies.
    pub(crate) fn pinned(memory: PinnedHost, len: usize) -> Result<HostCopy, Error> {
        HostCopy::from(Staging::Pinned(memory), len)
    }

    /// `len` bytes (rounded up to a page) of pageable memory in a mapping of its own, for
    /// a copy: nothing is backed until it is written, so making it costs one `mmap`
    /// whatever its size. [`Error::OutOfMemory`] when the kernel refuses the mapping (the
    /// caller checks [`available`] first: a page the kernel cannot back when it is written
    /// is not an error but the out-of-memory killer).
    pub(crate) fn pages(len: usize) -> Result<HostCopy, Error> {
        let size = len
            .max(1)
            .checked_next_multiple_of(PAGE)
            .ok_or_else(|| Error::invalid_argument(format!("{len} bytes cannot be copied")))?;
        let raw_len = size
            .checked_add(HUGE_PAGE)
            .ok_or_else(|| Error::invalid_argument(format!("{len} bytes cannot be copied")))?;
        let layout = Layout::from_size_align(size, PAGE)
            .map_err(|_| Error::invalid_argument(format!("{len} bytes cannot be copied")))?;
        // SAFETY: a fresh private anonymous mapping at an address of the kernel's choosing
        // touches no existing memory.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                raw_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(Error::out_of_memory(len));
        }
        // The first huge-page boundary in the mapping: `size` bytes from it still lie in
        // the mapping, which is `HUGE_PAGE` longer.
        let start = raw
            .cast::<u8>()
            .wrapping_add(raw.addr().next_multiple_of(HUGE_PAGE) - raw.addr());
        if huge_pages() {
            // SAFETY: `start..start + size` lies inside the mapping just made (above); the
            // advice only changes how it is backed, and a kernel without transparent huge
            // pages refuses it (its result is not looked at: the copy then has small
            // pages, as without the advice).
            unsafe { libc::madvise(start.cast(), size, libc::MADV_HUGEPAGE) };
        }
        let ptr = NonNull::new(start).ok_or_else(|| Error::out_of_memory(len))?;
        Ok(HostCopy {
            ptr,
            layout,
            abandoned: AtomicBool::new(false),
            memory: Staging::Pages(Arc::new(Pages {
                raw: raw.addr(),
                raw_len,
                start: start.addr(),
                size,
                registered: Mutex::default(),
            })),
        })
    }

    /// Whether it is a copy (pageable, from [`pages`](Self::pages)) rather than a staging
    /// buffer.
    pub(crate) fn is_pageable(&self) -> bool {
        matches!(self.memory, Staging::Pages(_))
    }

    /// Its mapping, for a thread that registers it: a pageable copy's.
    pub(crate) fn mapping(&self) -> Option<Arc<Pages>> {
        match &self.memory {
            Staging::Pages(pages) => Some(Arc::clone(pages)),
            _ => None,
        }
    }

    /// Bytes registered with the driver from its start (0 for a staging buffer): the
    /// device copies to and from them directly.
    pub(crate) fn registered(&self) -> usize {
        match &self.memory {
            Staging::Pages(pages) => pages.registered().bytes.min(self.len()),
            _ => 0,
        }
    }

    fn from(memory: Staging, len: usize) -> Result<HostCopy, Error> {
        let layout = Layout::from_size_align(len.max(1), PAGE)
            .map_err(|_| Error::invalid_argument(format!("{len} bytes cannot be copied")))?;
        let ptr = match &memory {
            Staging::Heap(heap) => heap.allocate_sync(layout)?,
            Staging::Pinned(pinned) => pinned.allocate_sync(layout)?,
            Staging::Pages(_) => return HostCopy::pages(len),
        };
        Ok(HostCopy {
            ptr,
            layout,
            memory,
            abandoned: AtomicBool::new(false),
        })
    }

    /// Bytes held.
    pub fn len(&self) -> usize {
        self.layout.size()
    }

    /// Whether it holds nothing (never: a copy holds at least one byte).
    pub fn is_empty(&self) -> bool {
        self.layout.size() == 0
    }

    /// The first byte, valid for `len()` bytes while `self` lives.
    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Marks it as the source or target of a copy of the device that may still be under
    /// way: it stays usable, but dropping it leaks its memory (mapped and registered as it
    /// is) rather than give it back to the kernel under the device's copy.
    pub(crate) fn abandon(&self) {
        self.abandoned.store(true, Ordering::Relaxed);
    }
}

impl Drop for HostCopy {
    fn drop(&mut self) {
        if *self.abandoned.get_mut() {
            #[cfg(test)]
            ABANDONED.fetch_add(1, Ordering::Relaxed);
            tracing::error!(
                len = self.len(),
                "memres: a host copy a device's copy may still use is leaked"
            );
            if let Staging::Pages(pages) = &self.memory {
                // Its mapping outlives every owner: unmapped and unregistered never.
                std::mem::forget(Arc::clone(pages));
            }
            return;
        }
        match &self.memory {
            // SAFETY: allocated in `from` by this very leaf with this layout; the copy is
            // its only owner and is going away.
            Staging::Heap(heap) => unsafe { heap.deallocate_sync(self.ptr, self.layout) },
            // SAFETY: as for the heap.
            Staging::Pinned(pinned) => unsafe { pinned.deallocate_sync(self.ptr, self.layout) },
            // The mapping goes with the last `Arc` (this one, unless a registering thread
            // still holds it: until it next looks, at most one piece later).
            Staging::Pages(_) => {}
        }
    }
}

/// Bytes of host memory this process can still have: the kernel's `MemAvailable`, and
/// within a cgroup (v2: the process's own, from `/proc/self/cgroup`) the room under its
/// `memory.max` ([`cgroup_room`]); `None` where neither can be read.
pub(crate) fn available() -> Option<usize> {
    let read = |path: &str| std::fs::read_to_string(path).ok();
    let machine = read("/proc/meminfo").and_then(|m| mem_available(&m));
    // The process's own cgroup (v2: the `0::` line), else the root's.
    let dir = read("/proc/self/cgroup")
        .and_then(|c| own_cgroup(&c))
        .map_or_else(
            || "/sys/fs/cgroup".to_owned(),
            |p| format!("/sys/fs/cgroup{p}"),
        );
    let file = |name: &str| read(&format!("{dir}/{name}"));
    let cgroup = cgroup_room(
        file("memory.max").as_deref(),
        file("memory.current").as_deref(),
        file("memory.stat").as_deref(),
    );
    match (machine, cgroup) {
        (Some(m), Some(c)) => Some(m.min(c)),
        (m, c) => m.or(c),
    }
}

/// The path of this process's cgroup (v2) in a `/proc/self/cgroup` text: its `0::` line.
fn own_cgroup(text: &str) -> Option<String> {
    let path = text.lines().find_map(|l| l.strip_prefix("0::"))?.trim();
    (path.starts_with('/') && !path.contains("..")).then(|| path.trim_end_matches('/').to_owned())
}

/// The room under a cgroup's limit: `memory.max` less `memory.current`, plus the page
/// cache the kernel would reclaim first (`inactive_file` of `memory.stat`: files read
/// lately, such as a model's weights, count in `current`); `None` without a limit
/// (`max`) or where a file cannot be read.
fn cgroup_room(max: Option<&str>, current: Option<&str>, stat: Option<&str>) -> Option<usize> {
    let max = max?.trim().parse::<usize>().ok()?; // "max": no limit
    let current = current?.trim().parse::<usize>().ok()?;
    let reclaimable = stat
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("inactive_file ")))
        .and_then(|v| v.trim().parse::<usize>().ok())
        .unwrap_or(0);
    Some(max.saturating_sub(current.saturating_sub(reclaimable)))
}

/// `MemAvailable` of a `/proc/meminfo` text, in bytes.
fn mem_available(meminfo: &str) -> Option<usize> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib = line.split_whitespace().nth(1)?.parse::<usize>().ok()?;
    kib.checked_mul(1024)
}

impl fmt::Debug for HostCopy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostCopy")
            .field("len", &self.layout.size())
            .field(
                "memory",
                &match self.memory {
                    Staging::Heap(_) => "heap",
                    Staging::Pinned(_) => "pinned",
                    Staging::Pages(_) => "pages",
                },
            )
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::{HostCopy, ask_huge_pages, available, cgroup_room, mem_available, own_cgroup};

    #[test]
    fn a_cgroups_room_counts_its_reclaimable_page_cache_and_its_own_path_is_read() {
        let stat = "anon 100\nfile 700\ninactive_file 600\nactive_file 100\n";
        assert_eq!(
            cgroup_room(Some("1000\n"), Some("900\n"), Some(stat)),
            Some(700)
        );
        assert_eq!(
            cgroup_room(Some("1000"), Some("900"), None),
            Some(100),
            "no stat: none reclaimable"
        );
        assert_eq!(
            cgroup_room(Some("1000"), Some("1200"), None),
            Some(0),
            "over the limit"
        );
        assert_eq!(
            cgroup_room(Some("max\n"), Some("900"), Some(stat)),
            None,
            "no limit"
        );
        assert_eq!(cgroup_room(Some("1000"), None, Some(stat)), None);
        assert_eq!(
            own_cgroup("0::/user.slice/job-7\n").as_deref(),
            Some("/user.slice/job-7")
        );
        assert_eq!(own_cgroup("0::/\n").as_deref(), Some(""), "the root");
        assert_eq!(own_cgroup("1:memory:/a\n"), None, "cgroup v1 only");
        assert_eq!(own_cgroup("0::/../etc\n"), None);
    }

    #[test]
    fn huge_pages_are_asked_for_unless_the_kernel_or_the_variable_says_never() {
        let madvise = "always [madvise] never\n";
        let never = "always madvise [never]\n";
        assert!(ask_huge_pages(None, Some(madvise)));
        assert!(ask_huge_pages(None, Some("[always] madvise never")));
        assert!(!ask_huge_pages(None, Some(never)));
        assert!(
            ask_huge_pages(None, None),
            "unreadable: asked, refused at worst"
        );
        assert!(!ask_huge_pages(Some("0"), Some(madvise)));
        assert!(!ask_huge_pages(Some(" 0\n"), None));
        assert!(ask_huge_pages(Some("1"), Some(never)));
        assert!(
            ask_huge_pages(Some("yes"), Some(madvise)),
            "not 0 or 1: the kernel's"
        );
        assert!(!ask_huge_pages(Some(""), Some(never)));
    }

    #[test]
    fn mem_available_is_read_in_bytes() {
        let meminfo =
            "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   23627436 kB\n";
        assert_eq!(mem_available(meminfo), Some(23_627_436 * 1024));
        assert_eq!(mem_available("MemTotal: 1 kB\n"), None);
        assert_eq!(mem_available("MemAvailable: lots kB\n"), None);
        assert!(available().is_some_and(|n| n > 0), "this machine says");
    }

    #[test]
    fn a_pageable_copy_is_aligned_writable_and_counted_by_its_length() {
        let copy = HostCopy::pages(5 << 20).unwrap();
        assert!(copy.is_pageable());
        assert_eq!(copy.len(), 5 << 20);
        assert_eq!(
            copy.as_ptr().addr() % (2 << 20),
            0,
            "on a huge-page boundary"
        );
        // SAFETY: the copy holds `len()` bytes, this test's alone.
        unsafe { copy.as_ptr().write_bytes(3, copy.len()) };
        // SAFETY: as above, written just before.
        assert_eq!(unsafe { copy.as_ptr().add(copy.len() - 1).read() }, 3);
        assert_eq!(HostCopy::pages(1).unwrap().len(), 4096, "a page at least");
        assert!(HostCopy::pages(usize::MAX).is_err());
    }
}
