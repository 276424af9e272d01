//! What the CUDA leaf resources share: the contract checks before a driver call, and the
//! resource impls of a leaf that allocates synchronously (`Cuda`, `Managed`, `PinnedHost`).

use std::alloc::Layout;
use std::ptr::NonNull;

use crate::error::Error;
use crate::resource::dangling;

/// The contract's rules before any driver call: `Ok(Some(dangling))` for zero bytes,
/// [`Error::InvalidArgument`] for an alignment above what the resource guarantees,
/// `Ok(None)` to go ahead.
#[inline]
pub(crate) fn admit(
    layout: Layout,
    max_alignment: usize,
    resource: &'static str,
) -> Result<Option<NonNull<u8>>, Error> {
    if layout.size() == 0 {
        return Ok(Some(dangling(layout)));
    }
    if layout.align() > max_alignment {
        return Err(Error::invalid_argument(format!(
            "{resource} guarantees alignment up to {max_alignment} bytes; {} was asked",
            layout.align()
        )));
    }
    Ok(None)
}

/// A pointer the driver returned, checked against the layout: never null, never less
/// aligned than asked (it is freed with `free` and reported otherwise).
#[inline]
pub(crate) fn accept(
    address: usize,
    layout: Layout,
    free: impl FnOnce(),
) -> Result<NonNull<u8>, Error> {
    match NonNull::new(address as *mut u8) {
        Some(p) if address.is_multiple_of(layout.align()) => Ok(p),
        Some(_) => {
            free();
            Err(Error::Misaligned {
                align: layout.align(),
                address,
            })
        }
        None => Err(Error::out_of_memory(layout.size())),
    }
}

/// Implements `new`, `on`, `device`, equality (always equal), and `SyncResource` and
/// `Resource`, for a leaf
/// struct holding its context in `ctx`, whose `alloc(&self, layout)` and
/// `free(&self, address, layout)` methods call the driver synchronously, with the context in
/// `self.ctx` current. Stream-ordered `allocate` is the sync allocation (memory usable at
/// once is usable in any stream order); stream-ordered `deallocate` first synchronises the
/// stream, so that work enqueued on it before the free is done when the memory goes back.
macro_rules! sync_driver_leaf {
    ($ty:ident, $props:ty, $max_align:expr, $name:literal) => {
        impl $ty {
            #[doc = concat!("A `", $name, "` resource for the current device.")]
            pub fn new() -> Result<$ty, $crate::error::Error> {
                Ok($ty {
                    ctx: $crate::device::Context::current()?,
                })
            }

            #[doc = concat!("A `", $name, "` resource for `device`.")]
            pub fn on(device: $crate::device::DeviceId) -> Result<$ty, $crate::error::Error> {
                Ok($ty {
                    ctx: $crate::device::Context::primary(device)?,
                })
            }

            /// The device the resource belongs to.
            pub fn device(&self) -> $crate::device::DeviceId {
                self.ctx.device()
            }
        }

        impl PartialEq for $ty {
            /// Always: a stateless leaf may free any block of its kind (RMM's rule).
            fn eq(&self, _: &Self) -> bool {
                true
            }
        }

        impl Eq for $ty {}

        // SAFETY: blocks come from the driver with at least `layout.size()` bytes, checked
        // to be aligned (`accept`), and stay valid until freed; the properties are the
        // driver's for this kind of memory (see the type's docs); equal resources use the
        // same device's context, whose memory they may free.
        unsafe impl $crate::resource::SyncResource for $ty {
            type Properties = $props;

            fn allocate_sync(
                &self,
                layout: std::alloc::Layout,
            ) -> Result<std::ptr::NonNull<u8>, $crate::error::Error> {
                if let Some(empty) = $crate::upstream::driver_leaf::admit(layout, $max_align, $name)? {
                    return Ok(empty);
                }
                let _current = $crate::device::bind(self.ctx)?;
                let address = self.alloc(layout)?;
                $crate::upstream::driver_leaf::accept(address, layout, || self.free(address, layout))
            }

            unsafe fn deallocate_sync(&self, ptr: std::ptr::NonNull<u8>, layout: std::alloc::Layout) {
                if layout.size() == 0 || $crate::device::process_is_exiting() {
                    return;
                }
                match $crate::device::bind(self.ctx) {
                    Ok(_current) => self.free(ptr.as_ptr() as usize, layout),
                    Err(e) => tracing::error!(%e, concat!("memres: ", $name, ": cannot free")),
                }
            }
        }

        // SAFETY: as for `SyncResource`; the stream-ordered free waits for the stream first.
        unsafe impl $crate::resource::Resource for $ty {
            fn allocate(
                &self,
                _stream: $crate::stream::StreamRef<'_>,
                layout: std::alloc::Layout,
            ) -> Result<std::ptr::NonNull<u8>, $crate::error::Error> {
                $crate::resource::SyncResource::allocate_sync(self, layout)
            }

            unsafe fn deallocate(
                &self,
                stream: $crate::stream::StreamRef<'_>,
                ptr: std::ptr::NonNull<u8>,
                layout: std::alloc::Layout,
            ) {
                if layout.size() == 0 || $crate::device::process_is_exiting() {
                    return;
                }
                if let Err(e) = stream.synchronize_in(self.ctx) {
                    // The stream is broken (a failed kernel): freeing now could hand memory
                    // to the driver while work still uses it, so it is leaked instead.
                    tracing::error!(%e, concat!("memres: ", $name, ": stream failed; block leaked"));
                    return;
                }
                // SAFETY: the caller's promise, plus the synchronisation above: the work
                // ordered before this free on `stream` is done, so nothing uses the memory.
                unsafe { $crate::resource::SyncResource::deallocate_sync(self, ptr, layout) }
            }
        }
    };
}

pub(crate) use sync_driver_leaf;
