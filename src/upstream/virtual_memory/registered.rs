//! Registering host copies with the driver ([`Registering`], on a thread of its own), so
//! that a wake (and a sleep) copies between them and the device directly, one DMA a chunk,
//! rather than through the staging buffers (`staged.rs`).
//!
//! A sleep registers the copies it copies into itself, as it goes (`staged.rs`,
//! `copy_registering`): each copying thread backs a piece of its copy by writing it, then
//! registers it, and the device copies straight into it. Registering pages already backed
//! runs at about 40 GiB/s (20 GiB in 0.4-0.6 s on an H200, the driver taking one
//! registration at a time), where registering fresh pages, which the kernel then backs
//! one by one, ran at 5 GiB/s, and `cuMemHostAlloc` at 3.2 GB/s. What is left (a piece
//! whose registration failed, a copy kept from an earlier sleep that is larger than its
//! range) is registered here afterwards, while the pool sleeps (or is awake again with the
//! copies kept). Each copy is registered a [`PIECE`] at a time from its start
//! (`cuMemHostRegister`), so [`HostCopy::registered`] is a prefix of it; a chunk wholly in
//! that prefix is copied directly, any other through the staging buffers.
//!
//! The pool stops the thread (raises `stop`, which it reads before each piece, and joins
//! it) before a sleep, a wake or a `trim` touches the copies, so no copy runs while this
//! thread registers a piece (a sleep's copying threads register their own copies'
//! pieces, each before the device copies into it), and starts one again afterwards for
//! what is left. A registration
//! that fails ends the thread: the pieces registered stay so, the rest is staged. A copy
//! is unregistered, a piece at a time, when it is freed (`trim`, or the pool's drop).
//! `MEMRES_OFFLOAD_REGISTER=0` turns the registration off.

use std::sync::Arc;

use super::HostCopy;
use super::host_copy::Pages;
use crate::device::Context;
use crate::error::Error;
use crate::platform::{Active, Platform};
use crate::sync::atomic::{AtomicBool, Ordering};

/// Bytes registered at once: what a wake that stops the thread waits for at most (a few
/// ms at the rates pinning runs at). (Small in the tests, and not a multiple of their
/// chunks, so that chunks straddle the end of what is registered.)
pub(crate) const PIECE: usize = if cfg!(test) { 64 << 10 } else { 32 << 20 };

/// The environment variable that turns the registration off (`0`).
pub(crate) const REGISTER_VARIABLE: &str = "MEMRES_OFFLOAD_REGISTER";

/// What registers a copy's pages with a device's driver, and unregisters them (a
/// [`Backend`](super::Backend)'s, hidden: only memres makes and uses one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Registrar(By);

/// How a [`Registrar`] registers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum By {
    /// `cuMemHostRegister` (portable: every context's copies run directly) in this
    /// context.
    Cuda(Context),
    /// Host pages, whose copies are the host's: nothing to pin; the pieces are only
    /// recorded (the tests count and fail them by the reservation's base), so a host
    /// pool copies registered chunks directly too.
    Host {
        /// The leaf's reservation.
        base: usize,
    },
}

impl Registrar {
    /// `cuMemHostRegister` in `ctx`.
    pub(crate) fn cuda(ctx: Context) -> Registrar {
        Registrar(By::Cuda(ctx))
    }

    /// Host pages of the leaf whose reservation starts at `base`.
    pub(crate) fn host(base: usize) -> Registrar {
        Registrar(By::Host { base })
    }

    /// Counts a chunk staged by a copy of this registrar's leaf (the tests' count of
    /// chunks that were not copied directly).
    #[cfg(test)]
    pub(crate) fn count_staged(&self) {
        if let By::Host { base } = self.0 {
            faults::staged(base);
        }
    }

    /// Registers `len` bytes at `addr` (a piece of a copy's own mapping, unregistered).
    pub(crate) fn register(&self, addr: usize, len: usize) -> Result<(), Error> {
        match self.0 {
            By::Cuda(ctx) => {
                if crate::device::process_is_exiting() {
                    // The pools live in statics: a registration still running at exit
                    // stops here rather than call a driver that is shutting down.
                    return Err(Error::invalid_argument("the process is exiting"));
                }
                let _current = crate::device::bind(ctx)?;
                // SAFETY: `addr..addr + len` lies in a live mapping of the copy's (the
                // caller's promise), none of it registered yet; registering only pins it.
                unsafe { Active::host_register(addr, len) }
            }
            By::Host { base } => {
                #[cfg(test)]
                return faults::register(base, len);
                #[cfg(not(test))]
                {
                    let _ = (base, len);
                    Ok(())
                }
            }
        }
    }

    /// Unregisters the piece registered at `addr`; whether it is unregistered, so that
    /// its memory may be unmapped (not at exit, where the driver unpins what the process
    /// holds as it goes, nor where the driver refused: the driver would keep a
    /// registration of addresses the kernel may hand out again).
    ///
    /// # Safety
    /// `addr` starts a piece [`register`](Self::register)ed by `self`, not unregistered
    /// since, that no copy of the device uses any more.
    #[must_use]
    pub(crate) unsafe fn unregister(&self, addr: usize) -> bool {
        match self.0 {
            By::Cuda(ctx) => {
                if crate::device::process_is_exiting() {
                    return false;
                }
                let Ok(_current) = crate::device::bind(ctx) else {
                    tracing::error!("memres: a host copy could not be unregistered");
                    return false;
                };
                // SAFETY: registered by `self` at `addr` (the caller's promise) and unused.
                let r = unsafe { Active::host_unregister(addr) };
                let unregistered = r.is_ok();
                crate::platform::report("cuMemHostUnregister", r);
                unregistered
            }
            By::Host { base } => {
                #[cfg(test)]
                faults::unregister(base);
                #[cfg(not(test))]
                let _ = base;
                true
            }
        }
    }
}

/// A registration of host copies running on a thread of its own
/// ([`GrowInPlace::register_host_copies`](super::GrowInPlace::register_host_copies)).
/// Dropping it stops the thread, and waits for it (at most the registration of one
/// piece): the pieces registered so far stay so.
pub struct Registering {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for Registering {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registering").finish_non_exhaustive()
    }
}

impl Drop for Registering {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(thread) = self.thread.take()
            && thread.join().is_err()
        {
            tracing::error!("memres: the thread registering host copies panicked");
        }
    }
}

/// Whether host copies are registered at all: unless [`REGISTER_VARIABLE`] is `0`.
pub(crate) fn enabled() -> bool {
    std::env::var(REGISTER_VARIABLE).map_or(true, |v| v.trim() != "0")
}

/// Starts registering the pageable `copies` with `by`, each from the end of what is
/// registered of it; `None` when none has anything left to register, when
/// [`REGISTER_VARIABLE`] is `0`, or when no thread can be started.
pub(super) fn start(by: Registrar, copies: &[&HostCopy]) -> Option<Registering> {
    if !enabled() {
        return None;
    }
    let pages: Vec<Arc<Pages>> = copies
        .iter()
        .filter_map(|c| c.mapping())
        .filter(|p| p.left_to_register(&by))
        .collect();
    if pages.is_empty() {
        return None;
    }
    let stop = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&stop);
    let thread = std::thread::Builder::new()
        .name("memres-register".into())
        .spawn(move || {
            let mut at = 0;
            let done = register_until_stopped(&flag, || {
                while let Some(p) = pages.get(at) {
                    if p.register_next(&by)? {
                        return Ok(true);
                    }
                    at += 1; // registered whole, or freed by the pool
                }
                Ok(false)
            });
            if let Err(e) = done {
                tracing::debug!(%e, "memres: host copies left unregistered (they are staged)");
            }
        })
        .ok()?;
    Some(Registering {
        stop,
        thread: Some(thread),
    })
}

/// Calls `next` (which registers one piece: `Ok(false)` once none is left) until it
/// says none is left, fails, or `stop` is raised; returns how many pieces it registered,
/// or the first error.
pub(crate) fn register_until_stopped(
    stop: &AtomicBool,
    mut next: impl FnMut() -> Result<bool, Error>,
) -> Result<usize, Error> {
    let mut registered = 0;
    while !stop.load(Ordering::Acquire) {
        if !next()? {
            break;
        }
        registered += 1;
    }
    Ok(registered)
}

/// Fault injection and counts for the lib's tests, by the host leaf's base: its copies'
/// registrations fail after so many more, and the live ones and the staged chunks are
/// counted.
#[cfg(test)]
pub(crate) mod faults {
    use std::sync::Mutex;

    use crate::error::Error;

    /// A leaf's counts.
    #[derive(Default)]
    struct Leaf {
        base: usize,
        /// Pieces registered and not unregistered.
        live: usize,
        /// Registrations left before they fail (`None`: never).
        left: Option<usize>,
        /// Chunks copied through a staging buffer.
        staged: usize,
    }

    static LEAVES: Mutex<Vec<Leaf>> = Mutex::new(Vec::new());

    fn with<T>(base: usize, f: impl FnOnce(&mut Leaf) -> T) -> T {
        let mut leaves = LEAVES.lock().unwrap_or_else(|p| p.into_inner());
        let i = leaves
            .iter()
            .position(|l| l.base == base)
            .unwrap_or_else(|| {
                leaves.push(Leaf {
                    base,
                    ..Leaf::default()
                });
                leaves.len() - 1
            });
        f(&mut leaves[i])
    }

    /// A new leaf at `base` (a reservation may reuse a dropped one's address): it starts
    /// with no counts, whatever a leaf there before left (copies leaked as abandoned keep
    /// their registrations).
    pub(crate) fn forget(base: usize) {
        let mut leaves = LEAVES.lock().unwrap_or_else(|p| p.into_inner());
        leaves.retain(|l| l.base != base);
    }

    /// From now on the leaf at `base` registers `more` pieces, then fails (`None`: never).
    #[cfg(not(memres_loom))]
    pub(crate) fn fail_registration(base: usize, more: Option<usize>) {
        with(base, |l| l.left = more);
    }

    /// Pieces of the leaf at `base`'s copies registered and not yet unregistered.
    #[cfg(not(memres_loom))]
    pub(crate) fn live_registrations(base: usize) -> usize {
        with(base, |l| l.live)
    }

    /// Chunks of the leaf at `base` copied through staging buffers since the last call.
    #[cfg(not(memres_loom))]
    pub(crate) fn take_staged(base: usize) -> usize {
        with(base, |l| std::mem::take(&mut l.staged))
    }

    pub(super) fn staged(base: usize) {
        with(base, |l| l.staged += 1);
    }

    pub(super) fn register(base: usize, len: usize) -> Result<(), Error> {
        with(base, |l| match &mut l.left {
            Some(0) => Err(Error::out_of_memory(len)),
            left => {
                if let Some(n) = left {
                    *n -= 1;
                }
                l.live += 1;
                Ok(())
            }
        })
    }

    pub(super) fn unregister(base: usize) {
        with(base, |l| l.live -= 1);
    }
}

/// The registering thread's stop under loom (`RUSTFLAGS="--cfg memres_loom" cargo test -p
/// memres --lib loom_`): once the pool has raised `stop` and joined the thread, what the
/// copies record as registered is exactly what was registered.
#[cfg(all(test, memres_loom))]
mod loom_models {
    use loom::sync::Arc;
    use loom::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use loom::thread;

    use super::register_until_stopped;

    /// The pool's step against the registering thread, both spawned: the pool raises
    /// `stop`, joins the thread, then frees the copies (three pieces to register): no
    /// piece is registered once the copies are freed (without the join loom finds the
    /// interleaving that does), and each piece is counted once. (That the flag stops the
    /// thread is the next model's: without the check it never ends.)
    #[test]
    fn loom_a_stopped_registration_ends_before_the_copies_are_freed() {
        loom::model(|| {
            let stop = Arc::new(AtomicBool::new(false));
            let freed = Arc::new(AtomicBool::new(false));
            let driver = Arc::new(AtomicUsize::new(0));
            let registering = {
                let (stop, freed, driver) =
                    (Arc::clone(&stop), Arc::clone(&freed), Arc::clone(&driver));
                thread::spawn(move || {
                    register_until_stopped(&stop, || {
                        if driver.load(Ordering::Relaxed) == 3 {
                            return Ok(false);
                        }
                        assert!(!freed.load(Ordering::SeqCst), "registered a freed copy");
                        driver.fetch_add(1, Ordering::Relaxed);
                        Ok(true)
                    })
                    .unwrap()
                })
            };
            let pool = {
                let (stop, freed) = (Arc::clone(&stop), Arc::clone(&freed));
                thread::spawn(move || {
                    stop.store(true, Ordering::Release);
                    let n = registering.join().unwrap();
                    freed.store(true, Ordering::SeqCst);
                    n
                })
            };
            let n = pool.join().unwrap();
            assert_eq!(driver.load(Ordering::Relaxed), n, "each piece counted once");
        });
    }

    /// A registration stopped before its thread runs registers nothing (the flag is read
    /// before each piece, the first included): a wake right after a sleep waits for none.
    /// One interleaving only (the flag is raised before the spawn): without the check the
    /// thread never ends, and loom fails it for exceeding its branches.
    #[test]
    fn loom_a_registration_stopped_before_it_starts_registers_nothing() {
        loom::model(|| {
            let stop = Arc::new(AtomicBool::new(false));
            stop.store(true, Ordering::Release);
            let flag = Arc::clone(&stop);
            let t = thread::spawn(move || register_until_stopped(&flag, || Ok(true)).unwrap());
            assert_eq!(t.join().unwrap(), 0);
        });
    }
}
