//! The synchronisation primitives every shared-state type in memres goes through, each
//! in a file of its own: the std/loom switch and loom-checkable cells (here), the
//! asymmetric fence pair ([`barrier`]), grace periods for freeing what lock-free readers
//! reach ([`grace`]), a value one thread uses and another can take ([`takeable`]), thread numbers
//! and lanes ([`threads`]), the
//! spin lock ([`spin`]), per-thread slots
//! folded in at thread exit ([`per_thread`]), a value on cache lines of its own
//! ([`CachePadded`]), a list read without a lock that only grows ([`AppendOnly`]) and
//! the lock that ignores poisoning ([`lock`]).
//!
//! Built normally, these are `std::sync`'s. Built with `RUSTFLAGS="--cfg memres_loom"`
//! (see `tests/loom.rs`), they are loom's, so the loom model tests explore every
//! interleaving of the protocols built on them. The cfg is the crate's own: a plain
//! `--cfg loom` would switch dependencies that know that name too.

#[cfg(not(memres_loom))]
pub(crate) use std::sync::{Arc, Condvar, Mutex, MutexGuard, atomic};

#[cfg(memres_loom)]
pub(crate) use loom::sync::{Arc, Condvar, Mutex, MutexGuard, atomic};

/// Turns a `std` `Arc` (which can be unsized into `Arc<dyn Trait>`) into the shim's `Arc`.
#[cfg(not(memres_loom))]
#[inline]
pub(crate) fn arc_from_std<T: ?Sized>(arc: std::sync::Arc<T>) -> Arc<T> {
    arc
}

/// Turns a `std` `Arc` (which can be unsized into `Arc<dyn Trait>`) into the shim's `Arc`.
#[cfg(memres_loom)]
pub(crate) fn arc_from_std<T: ?Sized>(arc: std::sync::Arc<T>) -> Arc<T> {
    Arc::from_std(arc)
}

/// A cell whose accesses loom can check (`loom::cell::UnsafeCell`'s interface, over
/// `std::cell::UnsafeCell` in normal builds).
#[cfg(not(memres_loom))]
pub(crate) mod cell {
    /// See the module.
    #[derive(Debug, Default)]
    pub(crate) struct UnsafeCell<T>(std::cell::UnsafeCell<T>);

    impl<T> UnsafeCell<T> {
        pub(crate) const fn new(value: T) -> Self {
            UnsafeCell(std::cell::UnsafeCell::new(value))
        }

        #[inline]
        pub(crate) fn get_mut(&self) -> MutPtr<T> {
            MutPtr(self.0.get())
        }

        /// A pointer for reading (loom tracks it as a read).
        #[inline]
        pub(crate) fn get(&self) -> ConstPtr<T> {
            ConstPtr(self.0.get())
        }
    }

    /// A pointer to a cell's value for reading, from [`UnsafeCell::get`].
    pub(crate) struct ConstPtr<T>(*const T);

    impl<T> ConstPtr<T> {
        /// Calls `f` with the raw pointer to the value.
        #[inline]
        pub(crate) fn with<R>(&self, f: impl FnOnce(*const T) -> R) -> R {
            f(self.0)
        }
    }

    /// A pointer to a cell's value, from [`UnsafeCell::get_mut`].
    pub(crate) struct MutPtr<T>(*mut T);

    impl<T> MutPtr<T> {
        /// Calls `f` with the raw pointer to the value.
        #[inline]
        pub(crate) fn with<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
            f(self.0)
        }
    }
}

#[cfg(memres_loom)]
pub(crate) use loom::cell;

/// Lets other threads run (a spin loop's back-off; loom needs it to explore spin loops).
#[cfg(not(memres_loom))]
#[inline]
pub(crate) fn yield_now() {
    std::thread::yield_now();
}

#[cfg(memres_loom)]
pub(crate) use loom::thread::yield_now;

mod append_only;
pub(crate) mod barrier;
pub(crate) mod grace;
mod padded;
pub(crate) mod per_thread;
pub(crate) mod spin;
pub(crate) mod takeable;
pub(crate) mod threads;

pub(crate) use append_only::AppendOnly;
pub(crate) use padded::CachePadded;
pub(crate) use spin::{SpinGuard, SpinLock};

/// Locks a mutex, ignoring poisoning: memres's critical sections leave their state
/// consistent at every point a panic could leave them, so a panic elsewhere is no reason
/// to fail every later call.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// [`lock`] for a `std` mutex that stays `std` under loom: process-wide statics that a
/// loom model cannot hold (loom's types live in one model run), each with a written
/// reason where it is declared.
#[cfg(memres_loom)]
pub(crate) fn lock_std<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// [`lock`] for a `std` mutex that stays `std` under loom (the same function here).
#[cfg(not(memres_loom))]
pub(crate) use lock as lock_std;
