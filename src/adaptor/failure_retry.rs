//! [`FailureRetry`]: on out-of-memory, let a callback free something and try again.

use std::alloc::Layout;
use std::fmt;
use std::ptr::NonNull;

use super::{deallocate_used_on_upstream, eq_by_upstream, upstream_access};
use crate::error::Error;
use crate::resource::{Resource, SyncResource};
use crate::stream::StreamRef;

/// Retries allocations that fail with [`Error::OutOfMemory`] while a callback says it
/// freed something (RMM's `failure_callback_resource_adaptor`).
///
/// The callback gets the size of the failed request and returns whether to try again: a
/// typical one drops a cache or trims a pool and returns whether that released anything.
/// A callback that always returns `true` retries forever, as RMM's would. Other errors
/// pass through untouched.
///
/// ```
/// use memres::adaptor::{FailureRetry, Limiting};
/// use memres::{HostHeap, SyncResource, layout};
/// use std::sync::atomic::{AtomicUsize, Ordering};
///
/// let calls = AtomicUsize::new(0);
/// let retrying = FailureRetry::new(Limiting::new(HostHeap::new(), 256), |_bytes| {
///     calls.fetch_add(1, Ordering::Relaxed) == 0 // one more try, the first time
/// });
/// assert!(retrying.allocate_sync(layout(512)?).is_err());
/// assert_eq!(calls.load(Ordering::Relaxed), 2); // retried once, then gave up
/// # Ok::<(), memres::Error>(())
/// ```
pub struct FailureRetry<U, F> {
    upstream: U,
    on_failure: F,
}

upstream_access!(FailureRetry<U, F>);

impl<U, F: Fn(usize) -> bool> FailureRetry<U, F> {
    /// Calls `on_failure(bytes)` when `upstream` runs out of memory, and retries while it
    /// returns `true`.
    pub fn new(upstream: U, on_failure: F) -> Self {
        FailureRetry {
            upstream,
            on_failure,
        }
    }

    fn retry(
        &self,
        layout: Layout,
        mut attempt: impl FnMut() -> Result<NonNull<u8>, Error>,
    ) -> Result<NonNull<u8>, Error> {
        loop {
            match attempt() {
                Err(e @ Error::OutOfMemory { .. }) => {
                    if !(self.on_failure)(layout.size()) {
                        return Err(e);
                    }
                }
                other => return other,
            }
        }
    }
}

eq_by_upstream!(FailureRetry<U, F>);

impl<U: fmt::Debug, F> fmt::Debug for FailureRetry<U, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FailureRetry")
            .field("upstream", &self.upstream)
            .finish_non_exhaustive()
    }
}

// SAFETY: every block comes from the upstream unchanged.
unsafe impl<U: SyncResource, F: Fn(usize) -> bool> SyncResource for FailureRetry<U, F> {
    type Properties = U::Properties;

    fn allocate_sync(&self, layout: Layout) -> Result<NonNull<u8>, Error> {
        self.retry(layout, || self.upstream.allocate_sync(layout))
    }

    unsafe fn deallocate_sync(&self, ptr: NonNull<u8>, layout: Layout) {
        // SAFETY: the caller's promise, for the upstream that allocated the block.
        unsafe { self.upstream.deallocate_sync(ptr, layout) }
    }
}

// SAFETY: as for `SyncResource`.
unsafe impl<U: Resource, F: Fn(usize) -> bool> Resource for FailureRetry<U, F> {
    fn allocate(&self, stream: StreamRef<'_>, layout: Layout) -> Result<NonNull<u8>, Error> {
        self.retry(layout, || self.upstream.allocate(stream, layout))
    }

    unsafe fn deallocate(&self, stream: StreamRef<'_>, ptr: NonNull<u8>, layout: Layout) {
        // SAFETY: the caller's promise, for the upstream that allocated the block.
        unsafe { self.upstream.deallocate(stream, ptr, layout) }
    }

    deallocate_used_on_upstream!(|self, stream, ptr, layout| {});
}
