//! Type erasure, for API boundaries only.
//!
//! Inside a stack every call is static (`Pool<Statistics<Cuda>>`). Where a function or a
//! struct must not be generic over the resource, erase it:
//!
//! | type | owns | `Send + Sync` | `Clone` |
//! | --- | --- | --- | --- |
//! | [`ResourceRef<'a, P>`] / [`SyncResourceRef<'a, P>`] | no (borrows, two words) | yes | `Copy` |
//! | [`AnyResource<P>`] / [`AnySyncResource<P>`] | yes | yes | shares the resource |
//! | [`Shared<R>`] | yes, not erased | if `R` is | shares the resource |
//!
//! `P` is the property set the erased handle promises; it is built from any resource whose
//! set contains `P`, may be narrowed to a subset with `narrow`, and can never be widened.
//! Every erased type is itself a resource, with `type Properties = P`.
//!
//! # How erasure is done
//! With `dyn` traits (a private `DynSyncResource` and its stream-ordered extension),
//! not a hand-rolled vtable: a `&dyn` is two words and a call through it is one indirect
//! call, the same as a vtable of `unsafe fn`s, and the compiler builds and checks the
//! vtable. Equality needs the concrete type: the erased `==` compares `TypeId`s (through
//! `Any`) and then calls the concrete `==`. That is why erased resources must be
//! `'static` types (a borrowed `&'a R` is fine, `R` itself may not hold borrows): a stack
//! that borrows its upstream (`Binning<&Pool<..>>`) is erased by owning an `Arc` or a
//! [`Shared`] upstream instead.
//!
//! Erased handles require `Sync` resources so that they are `Send + Sync` themselves;
//! a resource that is not thread-safe must be made so before it is erased.

/// The trait impls every erased handle shares: `SyncResource` (and `Resource` when the
/// handle is stream-ordered) forwarding to `self.inner`, the erased `==`, and `Debug`.
macro_rules! impl_erased {
    ([$($gen:tt)*] $ty:ty, $name:literal) => {
        // SAFETY: every call goes to the erased resource, which keeps the contract (it was
        // a `SyncResource` when erased); `P` is a subset of its set, checked at erasure.
        unsafe impl<$($gen)*> crate::resource::SyncResource for $ty {
            type Properties = P;

            #[inline]
            fn allocate_sync(
                &self,
                layout: std::alloc::Layout,
            ) -> Result<std::ptr::NonNull<u8>, crate::error::Error> {
                self.inner.dyn_allocate_sync(layout)
            }

            #[inline]
            unsafe fn deallocate_sync(&self, ptr: std::ptr::NonNull<u8>, layout: std::alloc::Layout) {
                // SAFETY: the caller keeps `deallocate_sync`'s contract for this handle,
                // which is the contract of the erased resource it calls.
                unsafe { self.inner.dyn_deallocate_sync(ptr, layout) }
            }
        }

        impl<$($gen)*> PartialEq for $ty {
            /// Equal when the erased resources have the same concrete type and are equal
            /// as that type (memory from one may be freed by the other).
            fn eq(&self, other: &Self) -> bool {
                self.inner.dyn_eq(&*other.inner)
            }
        }

        impl<$($gen)*> std::fmt::Debug for $ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(
                    f,
                    "{}<{}>({})",
                    $name,
                    std::any::type_name::<P>(),
                    self.inner.type_name()
                )
            }
        }
    };
    ([$($gen:tt)*] $ty:ty, $name:literal, stream_ordered) => {
        impl_erased!([$($gen)*] $ty, $name);

        // SAFETY: as for `SyncResource` above.
        unsafe impl<$($gen)*> crate::resource::Resource for $ty {
            #[inline]
            fn allocate(
                &self,
                stream: crate::stream::StreamRef<'_>,
                layout: std::alloc::Layout,
            ) -> Result<std::ptr::NonNull<u8>, crate::error::Error> {
                self.inner.dyn_allocate(stream, layout)
            }

            #[inline]
            unsafe fn deallocate(
                &self,
                stream: crate::stream::StreamRef<'_>,
                ptr: std::ptr::NonNull<u8>,
                layout: std::alloc::Layout,
            ) {
                // SAFETY: the caller keeps `deallocate`'s contract for this handle, which
                // is the contract of the erased resource it calls.
                unsafe { self.inner.dyn_deallocate(stream, ptr, layout) }
            }

            #[inline]
            unsafe fn deallocate_used_on(
                &self,
                stream: crate::stream::StreamRef<'_>,
                ptr: std::ptr::NonNull<u8>,
                layout: std::alloc::Layout,
                used_on: &[crate::stream::StreamRef<'_>],
            ) {
                // SAFETY: as in `deallocate`.
                unsafe { self.inner.dyn_deallocate_used_on(stream, ptr, layout, used_on) }
            }
        }
    };
}

mod any;
mod dyn_resource;
mod resource_ref;
mod shared;

pub use any::{AnyResource, AnySyncResource};
pub use resource_ref::{ResourceRef, SyncResourceRef};
pub use shared::Shared;
