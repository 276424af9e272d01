//! [`Profiling`]: counts what goes through it towards the open [`profile`]
//! scopes.

use std::alloc::Layout;
use std::fmt;
use std::ptr::NonNull;

use super::{deallocate_used_on_upstream, eq_by_upstream, upstream_access};
use crate::error::Error;
use crate::profile;
use crate::resource::{Resource, SyncResource};
use crate::stream::StreamRef;

/// Counts each allocation and free towards the [`profile`] scopes open
/// for the calling thread (RMM's profiler reads a statistics adaptor the same way).
///
/// With no scope open anywhere, the cost is one relaxed load and a branch per call. A
/// failed allocation counts nothing; a free is counted before the upstream frees.
/// Equality is the upstream's.
///
/// ```
/// use memres::adaptor::Profiling;
/// use memres::{HostHeap, ResourceExt, SyncResource, layout, profile};
///
/// let mr = HostHeap::new().with_profiling();
/// let p = {
///     let _load = profile::scope("load");
///     mr.allocate_sync(layout(1 << 20)?)?
/// };
/// assert_eq!(profile::report().get("load").unwrap().retained_bytes, 1 << 20);
/// // SAFETY: allocated above with this layout.
/// unsafe { mr.deallocate_sync(p, layout(1 << 20)?) };
/// # Ok::<(), memres::Error>(())
/// ```
pub struct Profiling<U> {
    upstream: U,
}

upstream_access!(Profiling<U>);
eq_by_upstream!(Profiling<U>);

impl<U> Profiling<U> {
    /// Counts what goes through to `upstream`.
    pub fn new(upstream: U) -> Self {
        Profiling { upstream }
    }
}

impl<U: fmt::Debug> fmt::Debug for Profiling<U> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Profiling")
            .field("upstream", &self.upstream)
            .finish()
    }
}

// SAFETY: every block comes from the upstream unchanged; counting has no effect on it.
unsafe impl<U: SyncResource> SyncResource for Profiling<U> {
    type Properties = U::Properties;

    #[inline(always)]
    fn allocate_sync(&self, layout: Layout) -> Result<NonNull<u8>, Error> {
        match self.upstream.allocate_sync(layout) {
            Ok(p) => {
                profile::count_allocation(layout.size());
                Ok(p)
            }
            Err(e) => Err(e),
        }
    }

    #[inline(always)]
    unsafe fn deallocate_sync(&self, ptr: NonNull<u8>, layout: Layout) {
        profile::count_free(layout.size());
        // SAFETY: the caller's promise, for the upstream that allocated the block.
        unsafe { self.upstream.deallocate_sync(ptr, layout) };
    }
}

// SAFETY: as for `SyncResource`.
unsafe impl<U: Resource> Resource for Profiling<U> {
    #[inline(always)]
    fn allocate(&self, stream: StreamRef<'_>, layout: Layout) -> Result<NonNull<u8>, Error> {
        match self.upstream.allocate(stream, layout) {
            Ok(p) => {
                profile::count_allocation(layout.size());
                Ok(p)
            }
            Err(e) => Err(e),
        }
    }

    #[inline(always)]
    unsafe fn deallocate(&self, stream: StreamRef<'_>, ptr: NonNull<u8>, layout: Layout) {
        profile::count_free(layout.size());
        // SAFETY: the caller's promise, for the upstream that allocated the block.
        unsafe { self.upstream.deallocate(stream, ptr, layout) };
    }

    deallocate_used_on_upstream!(|self, stream, ptr, layout| {
        profile::count_free(layout.size());
    });
}
