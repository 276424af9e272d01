//! A spin lock for the per-stream free lists.
//!
//! A list is locked for a few nanoseconds on the allocation path and is rarely contended
//! (one stream is seldom used by several threads at once). Taking `std`'s mutex costs two
//! atomic read-modify-writes (lock and unlock); this lock costs one and a plain release
//! store. A waiter spins briefly, then yields its time slice, so a holder that was
//! preempted (or waits for the GPU in a slow path) does not keep a core busy.

use std::hint::spin_loop;
use std::ops::{Deref, DerefMut};

use crate::sync::atomic::{AtomicBool, Ordering};
use crate::sync::cell::{MutPtr, UnsafeCell};
use crate::sync::yield_now;

/// Spins this many times before yielding.
const SPINS: u32 = 64;

/// A mutual-exclusion lock that spins, then yields. Its flag comes first (`repr(C)`), so
/// that it shares a line with the start of the value it guards (a stream's list:
/// `suballoc::core::list_table::List`, whose state begins with its small blocks' cache).
#[derive(Debug, Default)]
#[repr(C)]
pub(crate) struct SpinLock<T> {
    locked: AtomicBool,
    value: UnsafeCell<T>,
}

// SAFETY: the lock hands out access to the value to one thread at a time, so sharing the
// lock shares the value the way `Mutex<T>` does: safe when `T: Send`.
unsafe impl<T: Send> Sync for SpinLock<T> {}

impl<T> SpinLock<T> {
    pub(crate) fn new(value: T) -> SpinLock<T> {
        SpinLock {
            locked: AtomicBool::new(false),
            value: UnsafeCell::new(value),
        }
    }

    /// Waits until the lock is free and takes it.
    #[inline]
    pub(crate) fn lock(&self) -> SpinGuard<'_, T> {
        while self
            .locked
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            self.wait();
        }
        SpinGuard {
            lock: self,
            value: self.value.get_mut(),
        }
    }

    #[cold]
    fn wait(&self) {
        // A thread that keeps finding lists' locks held spreads to a lane of its own (a
        // compare-exchange that failed spuriously, the lock free, does not count).
        if self.locked.load(Ordering::Relaxed) {
            crate::sync::threads::note_contention();
        }
        let mut spins = 0;
        while self.locked.load(Ordering::Relaxed) {
            if spins < SPINS && cfg!(not(memres_loom)) {
                spin_loop();
                spins += 1;
            } else {
                yield_now();
            }
        }
    }
}

/// Access to a [`SpinLock`]'s value; unlocks when dropped.
pub(crate) struct SpinGuard<'a, T> {
    lock: &'a SpinLock<T>,
    value: MutPtr<T>,
}

impl<T> Deref for SpinGuard<'_, T> {
    type Target = T;

    #[inline]
    fn deref(&self) -> &T {
        // SAFETY: the guard holds the lock, so no other guard (the only other way to the
        // value) exists; the reference borrows the guard, so no `&mut` from it coexists.
        self.value.with(|p| unsafe { &*p })
    }
}

impl<T> DerefMut for SpinGuard<'_, T> {
    #[inline]
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as in `deref`; `&mut self` makes the reference exclusive.
        self.value.with(|p| unsafe { &mut *p })
    }
}

impl<T> Drop for SpinGuard<'_, T> {
    #[inline]
    fn drop(&mut self) {
        self.lock.locked.store(false, Ordering::Release);
    }
}
