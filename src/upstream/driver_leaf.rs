//! What the CUDA leaf resources share: the contract checks before a driver call, and the
//! resource impls of a leaf that allocates synchronously (`Cuda`, `Managed`, `PinnedHost`).

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::device::{Context, process_is_exiting};
use crate::error::Error;
use crate::resource::dangling;
use crate::stream::{Relaxed, StreamRef, on_capture_path};
use crate::sync::lock_std;

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

/// A synchronous leaf's stream-ordered allocation: the synchronous one, made in the
/// relaxed capture mode when `stream` is under capture (where `cuMemAlloc` would
/// otherwise invalidate it in the global mode). The memory is ordinary memory, valid
/// outside the graph.
pub(crate) fn allocate_on(
    stream: StreamRef<'_>,
    ctx: Context,
    allocate: impl FnOnce() -> Result<NonNull<u8>, Error>,
) -> Result<NonNull<u8>, Error> {
    if stream.is_capturing_in(ctx)? {
        let _relaxed = Relaxed::new()?;
        return allocate();
    }
    settle();
    allocate()
}

/// A synchronous leaf's stream-ordered free: waits for `stream` (work enqueued before the
/// free may use the memory), then runs `free`. A stream under capture cannot be waited
/// for: the free is kept, and made by the next call of a synchronous leaf on a stream
/// that is not under capture, once every stream of `ctx` is done. A stream that fails
/// (a broken context) leaks the block rather than hand the driver memory still in use.
pub(crate) fn free_after(
    stream: StreamRef<'_>,
    ctx: Context,
    name: &'static str,
    free: impl FnOnce() + Send + 'static,
) {
    match stream.is_capturing_in(ctx) {
        Ok(true) => return defer(ctx, Box::new(free)),
        Ok(false) => {}
        Err(e) => return tracing::error!(%e, "memres: {name}: stream failed; block leaked"),
    }
    settle();
    match stream.synchronize_in(ctx) {
        Ok(()) => free(),
        Err(e) => tracing::error!(%e, "memres: {name}: stream failed; block leaked"),
    }
}

/// A free kept for later, with the context whose work must be done first.
type Deferred = (Context, Box<dyn FnOnce() + Send>);

/// Frees made on streams under capture, not yet carried out.
///
/// No loom model: every free moves in or out of the list under its mutex, and
/// `ANY_DEFERRED` is only a hint that lets the common call skip the lock. It is set after
/// a push (release) and cleared under the lock before the list is taken, so a reader that
/// misses a set flag only settles the frees at a later call: a free is delayed, never
/// lost or made twice. (Process-wide statics, which loom's types, made afresh in each
/// model run, cannot be.)
static DEFERRED: Mutex<Vec<Deferred>> = Mutex::new(Vec::new());
/// Set while `DEFERRED` may hold something: the common case costs one load.
static ANY_DEFERRED: AtomicBool = AtomicBool::new(false);

fn defer(ctx: Context, free: Box<dyn FnOnce() + Send>) {
    let mut deferred = lock_std(&DEFERRED);
    deferred.push((ctx, free));
    ANY_DEFERRED.store(true, Ordering::Release);
}

/// Carries out the deferred frees: waits for each context once, then frees. A context
/// that cannot be waited for keeps its frees for the next try.
pub(crate) fn settle() {
    // On a capture's slow path (a pool growing over this leaf under capture) the wait
    // below is forbidden: the frees stay deferred for a later call.
    if !ANY_DEFERRED.load(Ordering::Acquire) || process_is_exiting() || on_capture_path() {
        return;
    }
    let taken = {
        let mut deferred = lock_std(&DEFERRED);
        ANY_DEFERRED.store(false, Ordering::Relaxed);
        std::mem::take(&mut *deferred)
    };
    let mut contexts: Vec<(Context, bool)> = Vec::new();
    for (ctx, free) in taken {
        let done = match contexts.iter().find(|(c, _)| *c == ctx) {
            Some(&(_, done)) => done,
            None => {
                let done = ctx.synchronize().is_ok();
                contexts.push((ctx, done));
                done
            }
        };
        if done {
            free();
        } else {
            defer(ctx, free);
        }
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
                stream: $crate::stream::StreamRef<'_>,
                layout: std::alloc::Layout,
            ) -> Result<std::ptr::NonNull<u8>, $crate::error::Error> {
                $crate::upstream::driver_leaf::allocate_on(stream, self.ctx, || {
                    $crate::resource::SyncResource::allocate_sync(self, layout)
                })
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
                let (this, address) = (*self, ptr.as_ptr().expose_provenance());
                $crate::upstream::driver_leaf::free_after(stream, self.ctx, $name, move || {
                    let ptr = std::ptr::with_exposed_provenance_mut::<u8>(address);
                    let ptr = std::ptr::NonNull::new(ptr).expect("a freed block is not null");
                    // SAFETY: the caller's promise, plus `free_after`'s wait: the work
                    // ordered before this free on `stream` is done, so nothing uses the
                    // memory.
                    unsafe { $crate::resource::SyncResource::deallocate_sync(&this, ptr, layout) }
                });
            }
        }
    };
}

pub(crate) use sync_driver_leaf;
