//! Adaptors: layers that wrap an upstream resource and add one behaviour each.
//!
//! Every adaptor owns its upstream by value (`Statistics<Pool<Cuda>>`; use `&R`, `Arc<R>`
//! or [`Shared`](crate::erased::Shared) to share one), keeps every property of its upstream
//! (`type Properties = U::Properties;`), implements both [`SyncResource`] and
//! [`Resource`], and hands its upstream back with `upstream()`, `upstream_mut()` and
//! `into_inner()` ([`ThreadSafe`], whose upstream need not be `Sync`, gives `lock()`
//! instead of `upstream()`).
//!
//! [`SyncResource`]: crate::SyncResource
//! [`Resource`]: crate::Resource

use std::alloc::Layout;
use std::ptr::NonNull;

use crate::error::Error;

mod aligned;
mod failure_retry;
mod fallback;
mod guard;
mod limiting;
mod logging;
mod owners;
mod prefetch;
mod profiling;
mod router;
mod statistics;
mod stream_use;
mod thread_safe;
mod tracking;

pub use aligned::{Aligned, AlignmentHolds};
pub use failure_retry::FailureRetry;
pub use fallback::Fallback;
pub use guard::{CANARY, Guard, Overrun, Side};
pub use limiting::Limiting;
pub use logging::{LOG_FILE_VARIABLE, Logging};
pub use owners::Owners;
pub use prefetch::Prefetch;
pub use profiling::Profiling;
pub use router::{Member, Route, Router};
pub use statistics::{Counter, ExactCounter, Statistics, StatisticsSnapshot};
pub use stream_use::StreamUse;
pub use thread_safe::ThreadSafe;
pub use tracking::{Outstanding, Tracking};

/// `upstream()`, `upstream_mut()` and `into_inner()` for an adaptor whose upstream is in
/// the field `upstream`.
macro_rules! upstream_access {
    ($ty:ident<$u:ident $(, $rest:ident)*>) => {
        impl<$u $(, $rest)*> $ty<$u $(, $rest)*> {
            /// The wrapped resource.
            pub fn upstream(&self) -> &$u {
                &self.upstream
            }

            /// The wrapped resource, mutably.
            pub fn upstream_mut(&mut self) -> &mut $u {
                &mut self.upstream
            }

            /// Unwraps the adaptor, returning the upstream.
            pub fn into_inner(self) -> $u {
                self.upstream
            }
        }
    };
}

pub(crate) use upstream_access;

/// `PartialEq` for an adaptor that hands memory to and from its upstream unchanged: equal
/// when the upstreams are.
macro_rules! eq_by_upstream {
    ($ty:ident<$u:ident $(, $rest:ident)*>) => {
        impl<$u: PartialEq $(, $rest)*> PartialEq for $ty<$u $(, $rest)*> {
            /// Equal when the upstreams are: memory goes to and from the upstream
            /// unchanged, so each may free the other's.
            fn eq(&self, other: &Self) -> bool {
                self.upstream == other.upstream
            }
        }
    };
}

pub(crate) use eq_by_upstream;

/// [`Resource::deallocate_used_on`](crate::Resource::deallocate_used_on) for an adaptor
/// that hands blocks to and from its `upstream` unchanged: runs its bookkeeping (the
/// block, given the names of the call's arguments), then passes the free on with the
/// streams that used the block, so that a sub-allocator below holds it for them.
macro_rules! deallocate_used_on_upstream {
    (|$this:ident, $stream:ident, $ptr:ident, $layout:ident| $before:block) => {
        #[inline]
        unsafe fn deallocate_used_on(
            &$this,
            $stream: $crate::stream::StreamRef<'_>,
            $ptr: std::ptr::NonNull<u8>,
            $layout: std::alloc::Layout,
            used_on: &[$crate::stream::StreamRef<'_>],
        ) {
            $before
            // SAFETY: the caller's promise, for the upstream that allocated the block.
            unsafe { $this.upstream.deallocate_used_on($stream, $ptr, $layout, used_on) }
        }
    };
}

pub(crate) use deallocate_used_on_upstream;

/// An upstream out-of-memory for a padded request (of `Aligned` or `Guard`), reported for the size the caller
/// asked for.
pub(crate) fn as_asked(
    result: Result<NonNull<u8>, Error>,
    layout: Layout,
) -> Result<NonNull<u8>, Error> {
    result.map_err(|e| match e {
        Error::OutOfMemory { limit, .. } => Error::OutOfMemory {
            requested: layout.size(),
            limit,
        },
        e => e,
    })
}
