//! An asymmetric pair of fences: [`light`], which a hot path runs on every
//! call and which costs nothing at run time, and [`heavy`], which a rare
//! path runs and which makes every thread of the process execute a full fence (Linux's
//! `membarrier`). Together they order a store before each against a load after the
//! other, as two `SeqCst` fences would (the Dekker pattern: each side stores its flag,
//! fences, then reads the other's; at least one sees the other's flag). Under loom both
//! are `SeqCst` fences, whose meaning the heavy one gives the pair.

/// The hot side: a compiler fence. Pairs with [`heavy`], whose caller must go
/// without the pairing when it returns false.
#[cfg(not(memres_loom))]
#[inline(always)]
pub(crate) fn light() {
    std::sync::atomic::compiler_fence(std::sync::atomic::Ordering::SeqCst);
}

/// The hot side (under loom: a `SeqCst` fence).
#[cfg(memres_loom)]
pub(crate) fn light() {
    loom::sync::atomic::fence(loom::sync::atomic::Ordering::SeqCst);
}

/// Whether [`heavy`] is offered here: Linux's `membarrier` with its private
/// expedited command (Linux 4.14 and later), for which the process registers on the
/// first call (a resource that needs it calls this when it is made, so that the
/// registration's cost does not fall inside a reclaim). A caller that finds it false
/// may not rely on the pairing. Only definite answers are kept: a registration that
/// failed for want of kernel memory is tried again at the next call.
#[cfg(all(not(memres_loom), target_os = "linux"))]
pub(crate) fn heavy_available() -> bool {
    use std::sync::atomic::Ordering;
    match STATE.load(Ordering::Acquire) {
        YES => return true,
        NO => return false,
        _ => {}
    }
    let offered = membarrier(QUERY);
    let answer = if offered < 0 || offered & PRIVATE_EXPEDITED == 0 {
        Some(false)
    } else if membarrier(REGISTER_PRIVATE_EXPEDITED) == 0 {
        Some(true)
    } else {
        // ENOMEM and the like pass; a refusal (EPERM, EINVAL: a sandbox) stays.
        let transient = matches!(last_errno(), libc::ENOMEM | libc::EAGAIN | libc::EINTR);
        (!transient).then_some(false)
    };
    match answer {
        Some(yes) => {
            STATE.store(if yes { YES } else { NO }, Ordering::Release);
            yes
        }
        None => false,
    }
}

// What `heavy_available` found out: nothing yet, offered, not offered.
#[cfg(all(not(memres_loom), target_os = "linux"))]
const UNKNOWN: u8 = 0;
#[cfg(all(not(memres_loom), target_os = "linux"))]
const YES: u8 = 1;
#[cfg(all(not(memres_loom), target_os = "linux"))]
const NO: u8 = 2;
#[cfg(all(not(memres_loom), target_os = "linux"))]
static STATE: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(UNKNOWN);

/// In a forked child (`grace`'s fork handler): the next [`heavy_available`] asks the
/// kernel again and registers the child, whatever its parent's registration left it.
#[cfg(all(not(memres_loom), target_os = "linux"))]
pub(crate) fn forget_registration() {
    STATE.store(UNKNOWN, std::sync::atomic::Ordering::Release);
}

/// Whether [`heavy`] is offered here: not outside Linux.
#[cfg(all(not(memres_loom), not(target_os = "linux")))]
pub(crate) fn heavy_available() -> bool {
    false
}

/// Whether [`heavy`] is offered here (under loom: always).
#[cfg(memres_loom)]
pub(crate) fn heavy_available() -> bool {
    true
}

/// The rare side: every running thread of the process executes a full memory
/// barrier before this returns, so a thread's stores before its [`light`] are seen
/// here, or its loads after it see this thread's stores before this call. Only where
/// [`heavy_available`] said true.
///
/// A caller has already published what the other threads must see, and cannot take
/// it back, so this does not return without the barrier: it tries again while the
/// kernel lacks memory for it (`ENOMEM`), and ends the process if the kernel refuses
/// a registered process (which `membarrier`'s contract rules out), since going on
/// without the barrier would let two threads use one cache.
#[cfg(all(not(memres_loom), target_os = "linux"))]
pub(crate) fn heavy() {
    debug_assert!(heavy_available());
    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    loop {
        if membarrier(PRIVATE_EXPEDITED) == 0 {
            break;
        }
        let errno = last_errno();
        if !matches!(errno, libc::ENOMEM | libc::EAGAIN | libc::EINTR) {
            tracing::error!(errno, "memres: membarrier refused a registered process");
            eprintln!("memres: membarrier refused a registered process (errno {errno})");
            std::process::abort();
        }
        std::thread::yield_now();
    }
    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
}

/// The rare side: never called outside Linux (see [`heavy_available`]).
#[cfg(all(not(memres_loom), not(target_os = "linux")))]
pub(crate) fn heavy() {
    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
}

/// The rare side (under loom: a `SeqCst` fence).
#[cfg(memres_loom)]
pub(crate) fn heavy() {
    loom::sync::atomic::fence(loom::sync::atomic::Ordering::SeqCst);
}

// The kernel's `membarrier` commands (linux/membarrier.h).
#[cfg(all(not(memres_loom), target_os = "linux"))]
const QUERY: libc::c_long = 0;
#[cfg(all(not(memres_loom), target_os = "linux"))]
const PRIVATE_EXPEDITED: libc::c_long = 1 << 3;
#[cfg(all(not(memres_loom), target_os = "linux"))]
const REGISTER_PRIVATE_EXPEDITED: libc::c_long = 1 << 4;

/// The calling thread's `errno`.
#[cfg(all(not(memres_loom), target_os = "linux"))]
fn last_errno() -> libc::c_int {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// `membarrier(cmd, 0, 0)`.
#[cfg(all(not(memres_loom), target_os = "linux"))]
fn membarrier(cmd: libc::c_long) -> libc::c_long {
    // SAFETY: `membarrier(cmd, flags = 0, cpu_id = 0)` reads and writes no memory of
    // ours; an unknown command is an error return.
    unsafe {
        libc::syscall(
            libc::SYS_membarrier,
            cmd,
            0 as libc::c_long,
            0 as libc::c_long,
        )
    }
}
