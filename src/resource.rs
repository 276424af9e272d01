//! The two traits every memory resource implements, and the contract they keep.
//!
//! # The contract
//! Every resource in memres, and every resource a user writes, keeps these rules; the
//! conformance suite in `tests/conformance/` checks them.
//!
//! - **Alignment.** The returned pointer is aligned to at least `layout.align()`, or the
//!   call fails; never less. A resource that cannot honour an alignment returns
//!   [`Error::InvalidArgument`]. Build layouts with [`layout`], which uses
//!   [`DEFAULT_ALIGNMENT`] (256 bytes, what CUDA and RMM give), or with
//!   [`layout_with_alignment`].
//! - **Zero bytes.** A request for zero bytes succeeds with a dangling pointer aligned to
//!   the layout's alignment and costs nothing; freeing it is a no-op. The pointer must not
//!   be dereferenced, and it may equal another zero-byte allocation's.
//! - **Out of memory** is `Err(`[`Error::OutOfMemory`]`)`, never a panic or an abort, and
//!   the resource stays usable.
//! - **Freeing** takes the same layout that allocated the memory, on a resource equal to
//!   the one that allocated it (see below); it cannot fail.
//! - **Equality.** Two resources are equal (`==`) when memory allocated by one may be
//!   freed by the other, as RMM's `is_equal`. Stateless resources are always equal;
//!   resources with state (a pool) are equal only to themselves or to handles sharing
//!   that state.
//! - **Threads.** A resource shared across threads (`Sync`) may be called from all of them
//!   at once; memory may be freed on another thread than the one that allocated it.
//! - memres never reads or writes the memory it hands out.
//!
//! # Sync and stream-ordered allocation
//! [`SyncResource`] memory is usable as soon as the call returns, from the host or any
//! stream (where the resource's properties allow). [`Resource`] adds stream-ordered
//! allocation, with RMM's rules: memory from `allocate(s, ..)` is usable by work on `s`
//! enqueued after the call; using it on another stream needs synchronisation with `s`
//! first; `deallocate(s, ..)` means the memory may be reused by work on `s` enqueued after
//! the call, so all work that touches it must be ordered before that point on `s`.

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::error::Error;
use crate::property::{Contains, DeviceAccessible, HostAccessible, PropertySet, mask_of};
use crate::stream::StreamRef;

// Written in `device`, the lowest layer that uses it (device sits below resources).
#[doc(inline)]
pub use crate::device::DEFAULT_ALIGNMENT;

/// A [`Layout`] of `size` bytes aligned to [`DEFAULT_ALIGNMENT`].
///
/// Returns [`Error::InvalidArgument`] when `size` rounded up to the alignment would
/// overflow `isize`.
///
/// ```
/// let l = memres::layout(1000)?;
/// assert_eq!((l.size(), l.align()), (1000, 256));
/// assert!(memres::layout(usize::MAX).is_err());
/// # Ok::<(), memres::Error>(())
/// ```
#[inline]
pub fn layout(size: usize) -> Result<Layout, Error> {
    layout_with_alignment(size, DEFAULT_ALIGNMENT)
}

/// A [`Layout`] of `size` bytes aligned to `align`.
///
/// Returns [`Error::InvalidArgument`] when `align` is not a power of two or `size`
/// rounded up to `align` would overflow `isize`.
///
/// ```
/// let l = memres::resource::layout_with_alignment(64, 4096)?;
/// assert_eq!(l.align(), 4096);
/// let err = memres::resource::layout_with_alignment(64, 3).unwrap_err();
/// assert!(err.to_string().contains("power of two"));
/// # Ok::<(), memres::Error>(())
/// ```
#[inline]
pub fn layout_with_alignment(size: usize, align: usize) -> Result<Layout, Error> {
    // The checks inline into a caller's loop; the errors' text is built out of line.
    match Layout::from_size_align(size, align) {
        Ok(l) => Ok(l),
        Err(_) => Err(layout_error(size, align)),
    }
}

/// Why `Layout::from_size_align(size, align)` refused.
#[cold]
#[inline(never)]
fn layout_error(size: usize, align: usize) -> Error {
    if !align.is_power_of_two() {
        Error::invalid_argument(format!("alignment {align} is not a power of two"))
    } else {
        Error::invalid_argument(format!(
            "a size of {size} bytes aligned to {align} overflows the address space"
        ))
    }
}

/// The pointer a zero-byte request returns: non-null, aligned to `layout.align()`, and
/// never to be dereferenced.
#[inline]
pub(crate) fn dangling(layout: Layout) -> NonNull<u8> {
    // An alignment is never zero, so the address is non-null; it carries no provenance,
    // which is right for a pointer that may not be dereferenced.
    NonNull::new(std::ptr::without_provenance_mut(layout.align()))
        .expect("an alignment is never zero")
}

/// Memory that is usable as soon as it is returned.
///
/// See the [module docs](self) for the contract. `type Properties` says where the memory
/// may be accessed from; code that needs, say, device-accessible memory bounds
/// `R: Has<DeviceAccessible>` and the compiler rejects other resources.
///
/// # Safety
/// The trait is `unsafe` to implement (like `allocator_api2::Allocator`) because safe code
/// relies on what an implementation promises: memory returned by `allocate_sync` is a
/// block of at least `layout.size()` bytes, aligned to `layout.align()`, that overlaps no
/// other live block and stays valid until it is freed; it is accessible wherever
/// `Properties` says (host code may read and write `HostAccessible` memory, kernels
/// `DeviceAccessible` memory); and `==` holds only between resources that may free each
/// other's memory.
///
/// ```
/// use memres::{HostHeap, SyncResource, layout};
///
/// let heap = HostHeap::new();
/// let l = layout(4096)?;
/// let p = heap.allocate_sync(l)?;
/// assert_eq!(p.as_ptr() as usize % 256, 0);
/// // SAFETY: `p` came from `heap` with layout `l` and is not used afterwards.
/// unsafe { heap.deallocate_sync(p, l) };
/// # Ok::<(), memres::Error>(())
/// ```
pub unsafe trait SyncResource: PartialEq {
    /// The set of properties of the memory this resource returns, for example
    /// [`HostAccessible`] or `(`[`HostAccessible`]`, `[`DeviceAccessible`]`)`.
    type Properties: PropertySet;

    /// Allocates memory for `layout`, usable at once.
    ///
    /// # Errors
    /// [`Error::OutOfMemory`] when the memory is not there; [`Error::InvalidArgument`] for
    /// an alignment the resource cannot honour; others as the resource documents.
    fn allocate_sync(&self, layout: Layout) -> Result<NonNull<u8>, Error>;

    /// Frees memory from [`allocate_sync`](SyncResource::allocate_sync).
    ///
    /// # Safety
    /// `ptr` was returned by `allocate_sync(layout)` on this resource or on one equal to
    /// it, with the same `layout`, and has not been freed since. No work that accesses the
    /// memory (on the host or on any stream) may still be running or be started later.
    unsafe fn deallocate_sync(&self, ptr: NonNull<u8>, layout: Layout);
}

/// A resource that also allocates in stream order.
///
/// See the [module docs](self) for the stream-ordering rules.
///
/// # Safety
/// As [`SyncResource`], for memory from `allocate`, with its stream-ordering rules: the
/// block is valid for work on `stream` enqueued after `allocate` returns, and is not reused
/// by the resource before the work that `deallocate`'s caller ordered before the free on
/// its stream is complete.
///
/// ```
/// use memres::{HostHeap, Resource, StreamRef, layout};
///
/// let heap = HostHeap::new();
/// let s = StreamRef::HOST;
/// let l = layout(1 << 20)?;
/// let p = heap.allocate(s, l)?;
/// // SAFETY: `p` came from `heap` with `l`; all work using it is done (host streams are
/// // always complete).
/// unsafe { heap.deallocate(s, p, l) };
/// # Ok::<(), memres::Error>(())
/// ```
pub unsafe trait Resource: SyncResource {
    /// Allocates memory for `layout`, usable by work on `stream` enqueued after this call.
    ///
    /// # Errors
    /// As [`SyncResource::allocate_sync`].
    fn allocate(&self, stream: StreamRef<'_>, layout: Layout) -> Result<NonNull<u8>, Error>;

    /// Frees memory in stream order: it may be reused by work on `stream` enqueued after
    /// this call.
    ///
    /// # Safety
    /// `ptr` was returned by [`allocate`](Resource::allocate) or
    /// [`allocate_sync`](SyncResource::allocate_sync) with the same `layout` on this
    /// resource or one equal to it, and has not been freed since. Every use of the memory
    /// is ordered before this point on `stream` (enqueued on `stream` earlier, or on
    /// another stream that `stream` has been made to wait for), and none is started later.
    unsafe fn deallocate(&self, stream: StreamRef<'_>, ptr: NonNull<u8>, layout: Layout);

    /// Frees memory that work on other streams also used (PyTorch's `record_stream`): it
    /// is not handed out again before the work that `used_on`'s streams had enqueued at
    /// the time of this call is complete, nor before `stream`'s, as for
    /// [`deallocate`](Resource::deallocate). Host streams in `used_on` (always complete)
    /// and `stream` itself add nothing; an empty `used_on` is a plain `deallocate`.
    ///
    /// The sub-allocators ([`Pool`](crate::Pool), [`Arena`](crate::suballoc::Arena),
    /// [`FixedSize`](crate::suballoc::FixedSize), [`Binning`](crate::suballoc::Binning))
    /// record an event on each of those streams and hold the block back until the events
    /// complete: no stream waits for another, and the allocation fast path never waits on
    /// the host (held blocks are looked at on each such free and on the slow path, before
    /// the resource grows; `Pool`'s and `VirtualPool`'s fast paths also look once a
    /// millisecond at most, and give a block whose events completed back to `stream`'s
    /// own list when `stream` allocates, so that its next allocation of the size gets it,
    /// as under PyTorch's caching allocator). Adaptors and erased handles forward the call. Any other
    /// resource gets this default: `stream` is made to wait for the work enqueued so far
    /// on each of `used_on` (an event recorded there, waited for on the device), then the
    /// block is freed on `stream`: correct for every resource, at the price of ordering
    /// `stream`'s later work after the other streams'. Where no event can be recorded
    /// (a broken context) the other stream is synchronised on the host; where even that
    /// fails the block is never freed (leaked, with an error logged) rather than
    /// handed out while in use.
    ///
    /// ```
    /// use memres::{HostHeap, Pool, PoolConfig, Resource, StreamRef, layout};
    ///
    /// let pool = Pool::new(HostHeap::new(), PoolConfig::new())?;
    /// let l = layout(1 << 20)?;
    /// let p = pool.allocate(StreamRef::host(1), l)?;
    /// // ... work on host stream 1 and on host stream 2 used the block ...
    /// // SAFETY: allocated above with `l`; no use of it is started after this.
    /// unsafe { pool.deallocate_used_on(StreamRef::host(1), p, l, &[StreamRef::host(2)]) };
    /// # Ok::<(), memres::Error>(())
    /// ```
    ///
    /// # Safety
    /// As [`deallocate`](Resource::deallocate), except that uses of the memory may also
    /// be enqueued on the streams of `used_on` before this call (and none started later).
    /// The streams of `used_on` are live during the call.
    unsafe fn deallocate_used_on(
        &self,
        stream: StreamRef<'_>,
        ptr: NonNull<u8>,
        layout: Layout,
        used_on: &[StreamRef<'_>],
    ) {
        for &other in used_on {
            if !order_after(stream, other) {
                return;
            }
        }
        // SAFETY: the caller's promise, with every use on `used_on` now ordered before
        // this point on `stream` (or complete).
        unsafe { self.deallocate(stream, ptr, layout) }
    }
}

/// Makes work enqueued on `stream` from now on wait for the work enqueued on `other` so
/// far (on the device; on the host where that fails). False when neither worked: the
/// block must then never be freed.
#[inline(never)]
fn order_after(stream: StreamRef<'_>, other: StreamRef<'_>) -> bool {
    let Err(e) = stream.wait_for_stream(other) else {
        return true;
    };
    match other.synchronize() {
        Ok(()) => true,
        Err(e2) => {
            tracing::error!(
                "memres: a block used on another stream is leaked: its stream could not be \
                 waited for ({e}; {e2})"
            );
            false
        }
    }
}

/// Forwards every call of a handle (`&R`, `Box<R>`, `Arc<R>`) to the resource it points
/// at, so that handles are resources with the same properties.
macro_rules! forward_resource {
    ($(impl[$($gen:tt)*] for $handle:ty;)*) => {$(
        // SAFETY: every call goes to the resource the handle points at, which keeps the
        // contract; handles compare by comparing what they point at.
        unsafe impl<$($gen)*> SyncResource for $handle {
            type Properties = R::Properties;

            #[inline]
            fn allocate_sync(&self, layout: Layout) -> Result<NonNull<u8>, Error> {
                (**self).allocate_sync(layout)
            }

            #[inline]
            unsafe fn deallocate_sync(&self, ptr: NonNull<u8>, layout: Layout) {
                // SAFETY: the caller keeps `deallocate_sync`'s contract, which is the
                // same for the handle and the resource it points at.
                unsafe { (**self).deallocate_sync(ptr, layout) }
            }
        }

        // SAFETY: as above.
        unsafe impl<$($gen)*> Resource for $handle where R: Resource {
            #[inline]
            fn allocate(&self, stream: StreamRef<'_>, layout: Layout) -> Result<NonNull<u8>, Error> {
                (**self).allocate(stream, layout)
            }

            #[inline]
            unsafe fn deallocate(&self, stream: StreamRef<'_>, ptr: NonNull<u8>, layout: Layout) {
                // SAFETY: the caller keeps `deallocate`'s contract, which is the same for
                // the handle and the resource it points at.
                unsafe { (**self).deallocate(stream, ptr, layout) }
            }

            #[inline]
            unsafe fn deallocate_used_on(
                &self,
                stream: StreamRef<'_>,
                ptr: NonNull<u8>,
                layout: Layout,
                used_on: &[StreamRef<'_>],
            ) {
                // SAFETY: as above.
                unsafe { (**self).deallocate_used_on(stream, ptr, layout, used_on) }
            }
        }
    )*};
}

forward_resource! {
    impl['a, R: SyncResource] for &'a R;
    impl[R: SyncResource] for Box<R>;
    impl[R: SyncResource] for Arc<R>;
}

/// A resource whose memory has every property of the set `P` (its
/// [`Properties`](SyncResource::Properties) [`Contains`] them).
///
/// This is the bound to write: `R: Has<DeviceAccessible>` for code that hands memory to a
/// kernel, `R: Has<HostAccessible>` for code that touches it from the host.
pub trait Has<P: PropertySet>: SyncResource {}

impl<R, P> Has<P> for R
where
    R: SyncResource + ?Sized,
    P: PropertySet,
    R::Properties: Contains<P>,
{
}

/// Whether memory of resource `R` may be read and written by host code.
pub(crate) const fn is_host_accessible<R: SyncResource + ?Sized>() -> bool {
    mask_of::<R::Properties>() & mask_of::<HostAccessible>() != 0
}

/// Whether memory of resource `R` may be accessed by kernels (and CUDA's memset).
pub(crate) const fn is_device_accessible<R: SyncResource + ?Sized>() -> bool {
    mask_of::<R::Properties>() & mask_of::<DeviceAccessible>() != 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_are_checked() {
        assert_eq!(layout(0).unwrap().align(), DEFAULT_ALIGNMENT);
        assert!(matches!(
            layout_with_alignment(8, 0),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            layout_with_alignment(8, 48),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            layout(isize::MAX as usize),
            Err(Error::InvalidArgument(_))
        ));
    }

    #[test]
    fn dangling_is_aligned() {
        for align in [1, 8, 256, 1 << 20] {
            let l = Layout::from_size_align(0, align).unwrap();
            assert_eq!(dangling(l).as_ptr() as usize, align);
        }
    }
}
