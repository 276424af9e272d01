//! [`ThreadSafe`]: a lock around a resource that is not `Sync`.

use std::alloc::Layout;
use std::fmt;
use std::ptr::NonNull;

use crate::error::Error;
use crate::resource::{Resource, SyncResource};
use crate::stream::StreamRef;
use crate::sync::lock;
use crate::sync::{Mutex, MutexGuard};

/// Makes a resource that is `Send` but not `Sync` shareable between threads by taking a
/// lock around every call (RMM's `thread_safe_resource_adaptor`). The one adaptor whose job
/// is a lock: everything else in memres is thread-safe without one.
///
/// ```
/// use memres::adaptor::ThreadSafe;
/// use memres::{AnyResource, Host, HostHeap};
/// # use std::{alloc::Layout, cell::Cell, ptr::NonNull};
/// # use memres::{Error, Resource, StreamRef, SyncResource};
/// /// Counts in a `Cell`: `Send`, not `Sync`.
/// #[derive(PartialEq)]
/// struct Counting { calls: Cell<usize> }
/// // SAFETY: forwards to the heap.
/// unsafe impl SyncResource for Counting {
///     type Properties = Host;
///     fn allocate_sync(&self, l: Layout) -> Result<NonNull<u8>, Error> {
///         self.calls.set(self.calls.get() + 1);
///         HostHeap.allocate_sync(l)
///     }
///     unsafe fn deallocate_sync(&self, p: NonNull<u8>, l: Layout) {
///         // SAFETY: forwards the caller's promise.
///         unsafe { HostHeap.deallocate_sync(p, l) }
///     }
/// }
/// // SAFETY: as above.
/// unsafe impl Resource for Counting {
///     fn allocate(&self, _: StreamRef<'_>, l: Layout) -> Result<NonNull<u8>, Error> {
///         self.allocate_sync(l)
///     }
///     unsafe fn deallocate(&self, _: StreamRef<'_>, p: NonNull<u8>, l: Layout) {
///         // SAFETY: forwards the caller's promise.
///         unsafe { self.deallocate_sync(p, l) }
///     }
/// }
///
/// // `AnyResource::new(Counting { .. })` does not compile; with the lock it does:
/// let shared: AnyResource<Host> = AnyResource::new(ThreadSafe::new(Counting { calls: Cell::new(0) }));
/// ```
pub struct ThreadSafe<U> {
    upstream: Mutex<U>,
}

impl<U> ThreadSafe<U> {
    /// Puts `upstream` behind a lock.
    pub fn new(upstream: U) -> Self {
        ThreadSafe {
            upstream: Mutex::new(upstream),
        }
    }

    /// The wrapped resource, locked for as long as the guard lives. Do not allocate or free
    /// through this adaptor while holding the guard on the same thread: that waits for
    /// the lock the guard holds (a deadlock), as with any mutex.
    pub fn lock(&self) -> MutexGuard<'_, U> {
        // A panic inside the upstream leaves it as the upstream left it; the lock adds no
        // state of its own, so a poisoned lock is passed through.
        lock(&self.upstream)
    }

    /// The wrapped resource, mutably (no lock needed: `&mut self` is exclusive).
    pub fn upstream_mut(&mut self) -> &mut U {
        self.upstream
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Unwraps the adaptor, returning the upstream.
    pub fn into_inner(self) -> U {
        self.upstream
            .into_inner()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl<U: PartialEq> PartialEq for ThreadSafe<U> {
    /// The same adaptor, or equal upstreams. Both locks are taken in address order, so two
    /// threads comparing `a == b` and `b == a` at once cannot deadlock.
    fn eq(&self, other: &Self) -> bool {
        if std::ptr::eq(self, other) {
            return true;
        }
        let (low, high) = if (self as *const Self) < (other as *const Self) {
            (self, other)
        } else {
            (other, self)
        };
        let low = low.lock();
        let high = high.lock();
        *low == *high
    }
}

impl<U: fmt::Debug> fmt::Debug for ThreadSafe<U> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("ThreadSafe").field(&*self.lock()).finish()
    }
}

// SAFETY: every call goes to the upstream under the lock, which keeps the contract.
unsafe impl<U: SyncResource> SyncResource for ThreadSafe<U> {
    type Properties = U::Properties;

    fn allocate_sync(&self, layout: Layout) -> Result<NonNull<u8>, Error> {
        self.lock().allocate_sync(layout)
    }

    unsafe fn deallocate_sync(&self, ptr: NonNull<u8>, layout: Layout) {
        // SAFETY: the caller's promise, for the upstream that allocated the block.
        unsafe { self.lock().deallocate_sync(ptr, layout) }
    }
}

// SAFETY: as for `SyncResource`.
unsafe impl<U: Resource> Resource for ThreadSafe<U> {
    fn allocate(&self, stream: StreamRef<'_>, layout: Layout) -> Result<NonNull<u8>, Error> {
        self.lock().allocate(stream, layout)
    }

    unsafe fn deallocate(&self, stream: StreamRef<'_>, ptr: NonNull<u8>, layout: Layout) {
        // SAFETY: the caller's promise, for the upstream that allocated the block.
        unsafe { self.lock().deallocate(stream, ptr, layout) }
    }

    #[inline]
    unsafe fn deallocate_used_on(
        &self,
        stream: StreamRef<'_>,
        ptr: NonNull<u8>,
        layout: Layout,
        used_on: &[StreamRef<'_>],
    ) {
        // SAFETY: the caller's promise, for the upstream that allocated the block.
        unsafe { self.lock().deallocate_used_on(stream, ptr, layout, used_on) }
    }
}
