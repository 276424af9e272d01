//! A value that one thread uses without an atomic read-modify-write and that another
//! thread can take from it at any time, also while the first never runs again (the
//! thread caches' blocks: `suballoc/thread_cache.rs`).
//!
//! **Protocol.** The owning thread brackets every use: `busy = true` (relaxed), the light
//! fence ([`barrier::light`]), a check that `taken` is clear, the use, `busy = false`
//! (release). The taker sets `taken` (relaxed), runs the heavy fence
//! ([`barrier::heavy`]: every thread executes a full fence), then waits until `busy`
//! reads false (acquire) and takes the value. The two fences order each side's store
//! before its later load, so for every use either the taker sees `busy` set and waits
//! for the use to end, or the use sees `taken` and leaves the value alone. Once taken, a
//! value stays taken: its owner drops it. The model below (and the thread caches' models
//! in `suballoc/loom_models.rs`) checks this with both fences as `SeqCst` fences; it
//! fails if the light fence or the wait for `busy` is removed.

use crate::sync::atomic::{AtomicBool, Ordering};
use crate::sync::barrier;
use crate::sync::cell::UnsafeCell;

/// See the module.
#[derive(Debug)]
pub(crate) struct Takeable<T> {
    /// Set by the owning thread while it uses `value`.
    busy: AtomicBool,
    /// Set by a taker: the value is the taker's from its heavy fence on.
    taken: AtomicBool,
    value: UnsafeCell<T>,
}

// SAFETY: `value` is used by one thread at a time, by the module's protocol (the owning
// thread between `busy` and its release; the taker after `taken`, the heavy fence and an
// acquire load of `busy` reading false); the rest is atomics. The value moves between
// threads, so it must be `Send`.
unsafe impl<T: Send> Send for Takeable<T> {}
// SAFETY: as for `Send`: shared access never hands out `&T` to two threads at once.
unsafe impl<T: Send> Sync for Takeable<T> {}

impl<T> Takeable<T> {
    pub(crate) fn new(value: T) -> Takeable<T> {
        Takeable {
            busy: AtomicBool::new(false),
            taken: AtomicBool::new(false),
            value: UnsafeCell::new(value),
        }
    }

    /// Runs `f` on the value, as its owning thread (one thread at a time calls this);
    /// `None` if a taker has it.
    #[inline]
    pub(crate) fn with<R>(&self, f: impl FnOnce(&mut T) -> R) -> Option<R> {
        /// Clears `busy` (release: the taker's acquire load that reads false sees the
        /// use's writes), also if the use unwinds, so that no taker waits forever.
        struct Done<'a>(&'a AtomicBool);
        impl Drop for Done<'_> {
            #[inline]
            fn drop(&mut self) {
                self.0.store(false, Ordering::Release);
            }
        }
        self.busy.store(true, Ordering::Relaxed);
        let _done = Done(&self.busy);
        barrier::light();
        if self.taken.load(Ordering::Relaxed) {
            return None;
        }
        Some(self.value.get_mut().with(|value| {
            // SAFETY: `busy` is set and `taken` was clear after the light fence: no taker
            // has the value, and one waits for `busy` to clear before it takes it; no
            // other thread uses it (one owning thread at a time, the caller's promise).
            f(unsafe { &mut *value })
        }))
    }

    /// Marks the value as taken (the taker's first step; the heavy fence follows).
    pub(crate) fn mark_taken(&self) {
        self.taken.store(true, Ordering::Relaxed);
    }

    /// Takes the value, as the taker, leaving `T::default()`.
    ///
    /// # Safety
    /// [`mark_taken`](Self::mark_taken) was called on it, then [`barrier::heavy`] ran
    /// (where [`barrier::heavy_available`]), and no other thread takes it.
    pub(crate) unsafe fn take(&self) -> T
    where
        T: Default,
    {
        while self.busy.load(Ordering::Acquire) {
            crate::sync::yield_now();
        }
        self.value.get_mut().with(|value| {
            // SAFETY: `taken` was set before the heavy fence (the caller's promise), so
            // every use either began before it (and `busy`, set then, has since read
            // false with acquire: the use is over and its writes seen) or sees `taken`
            // and leaves the value; no other taker (the caller's promise).
            std::mem::take(unsafe { &mut *value })
        })
    }
}

#[cfg(all(test, memres_loom))]
mod loom_models {
    use loom::sync::Arc;
    use loom::thread;

    use super::*;

    /// The owner pushes twice while a taker takes: every item is either in what was taken
    /// or kept by the owner (its use saw `taken`), never both, never lost; loom reports a
    /// data race on the value if the protocol lets both touch it at once.
    #[test]
    fn loom_a_value_is_taken_or_kept_never_both() {
        loom::model(|| {
            let value = Arc::new(Takeable::new(Vec::<u32>::new()));
            let owner = Arc::clone(&value);
            let t = thread::spawn(move || {
                let mut kept = 0;
                for i in 0..2 {
                    if owner.with(|v| v.push(i)).is_none() {
                        kept += 1;
                    }
                }
                kept
            });
            value.mark_taken();
            barrier::heavy();
            // SAFETY: marked, then the heavy fence; this thread is the only taker.
            let taken = unsafe { value.take() };
            let kept = t.join().unwrap();
            assert_eq!(taken.len() + kept, 2);
        });
    }
}
