//! [`Callback`]: a resource made of two closures.

use std::alloc::Layout;
use std::fmt;
use std::marker::PhantomData;
use std::ptr::NonNull;

use crate::error::Error;
use crate::property::PropertySet;
use crate::resource::{Resource, SyncResource, dangling};
use crate::stream::StreamRef;

/// A resource whose allocate and deallocate are closures you supply, with the properties
/// you declare in its type (RMM's `callback_memory_resource`).
///
/// Good for wrapping an allocator memres does not know, and for tests that must break
/// assumptions: fail on the Nth call, count bytes, hand out odd addresses.
///
/// - `P` is the property set of the closures' memory. Only you know it, so
///   [`Callback::new`] is `unsafe`: you promise the memory has those properties.
/// - The closures get the stream of the call and keep RMM's stream-ordering rules for it.
///   The sync calls (`allocate_sync`, `deallocate_sync`) pass [`StreamRef::HOST`], whose
///   work is always complete: memory allocated for it must be usable at once, and memory
///   freed on it is no longer in use.
/// - The closures never see a zero-byte request: `Callback` answers those itself, per the
///   contract.
/// - The allocate closure returns `Ok(pointer)` or an error (`Error::out_of_memory(size)`
///   when the memory is not there).
/// - A pointer that is not aligned to the layout's alignment is never passed on: it is
///   handed straight back to the deallocate closure and the call fails with
///   [`Error::Misaligned`].
/// - Equality is identity, as RMM's default: a `Callback` equals only itself (closures
///   cannot be compared). Share one through `&`, `Arc` or [`Shared`](crate::erased::Shared).
///
/// ```
/// use memres::{Error, Host, HostHeap, StreamRef, SyncResource, layout, upstream::Callback};
/// use std::alloc::Layout;
/// use std::ptr::NonNull;
/// use std::sync::atomic::{AtomicUsize, Ordering};
///
/// let heap = HostHeap::new();
/// let live = AtomicUsize::new(0);
/// let allocate = |l: Layout, _: StreamRef<'_>| {
///     let p = heap.allocate_sync(l)?;
///     live.fetch_add(l.size(), Ordering::Relaxed);
///     Ok(p)
/// };
/// let deallocate = |p: NonNull<u8>, l: Layout, _: StreamRef<'_>| {
///     live.fetch_sub(l.size(), Ordering::Relaxed);
///     // SAFETY: `Callback` passes back only blocks `allocate` returned, from `heap`.
///     unsafe { heap.deallocate_sync(p, l) }
/// };
/// // SAFETY: the closures hand out and take back heap memory, which is host-accessible
/// // and usable at once on any stream.
/// let counted = unsafe { Callback::<Host>::new(allocate, deallocate) };
/// let l = layout(1000)?;
/// let p = counted.allocate_sync(l)?;
/// assert_eq!(live.load(Ordering::Relaxed), 1000);
/// // SAFETY: allocated above with `l`.
/// unsafe { counted.deallocate_sync(p, l) };
/// assert_eq!(live.load(Ordering::Relaxed), 0);
/// # Ok::<(), Error>(())
/// ```
pub struct Callback<P, A = (), D = ()> {
    allocate: A,
    deallocate: D,
    properties: PhantomData<fn() -> P>,
}

impl<P: PropertySet> Callback<P> {
    /// A resource with properties `P` that allocates with `allocate` and frees with
    /// `deallocate`. Write it `Callback::<Host>::new(..)`.
    ///
    /// # Safety
    /// The closures together keep the resource contract of [`Resource`] for every stream
    /// they are given ([`StreamRef::HOST`] for the sync calls): a block from `allocate` holds
    /// at least `layout.size()` bytes, overlaps no other live block, is accessible wherever
    /// `P` says, and stays valid until it is given to `deallocate`; `deallocate` accepts
    /// every block `allocate` handed out (including ones `Callback` hands back at once
    /// because they were misaligned) and does not let it be reused before the work ordered
    /// before the free on the given stream is done.
    pub unsafe fn new<A, D>(allocate: A, deallocate: D) -> Callback<P, A, D>
    where
        A: Fn(Layout, StreamRef<'_>) -> Result<NonNull<u8>, Error>,
        D: Fn(NonNull<u8>, Layout, StreamRef<'_>),
    {
        Callback {
            allocate,
            deallocate,
            properties: PhantomData,
        }
    }
}

// SAFETY: the closures keep the contract (the promise of `Callback::new`); `Callback` adds
// the zero-size rule and refuses misaligned blocks, and equality is identity.
unsafe impl<P, A, D> SyncResource for Callback<P, A, D>
where
    P: PropertySet,
    A: Fn(Layout, StreamRef<'_>) -> Result<NonNull<u8>, Error>,
    D: Fn(NonNull<u8>, Layout, StreamRef<'_>),
{
    type Properties = P;

    fn allocate_sync(&self, layout: Layout) -> Result<NonNull<u8>, Error> {
        self.allocate(StreamRef::HOST, layout)
    }

    unsafe fn deallocate_sync(&self, ptr: NonNull<u8>, layout: Layout) {
        // SAFETY: `deallocate_sync`'s caller promises nothing uses the memory any more,
        // which is what a free on the host stream (always complete) means.
        unsafe { self.deallocate(StreamRef::HOST, ptr, layout) }
    }
}

// SAFETY: as for `SyncResource`.
unsafe impl<P, A, D> Resource for Callback<P, A, D>
where
    P: PropertySet,
    A: Fn(Layout, StreamRef<'_>) -> Result<NonNull<u8>, Error>,
    D: Fn(NonNull<u8>, Layout, StreamRef<'_>),
{
    fn allocate(&self, stream: StreamRef<'_>, layout: Layout) -> Result<NonNull<u8>, Error> {
        if layout.size() == 0 {
            return Ok(dangling(layout));
        }
        let ptr = (self.allocate)(layout, stream)?;
        let address = ptr.as_ptr() as usize;
        if !address.is_multiple_of(layout.align()) {
            tracing::warn!(
                address,
                align = layout.align(),
                "memres::upstream::Callback: the allocate closure returned misaligned memory"
            );
            // Never used: it goes back on the same stream at once.
            (self.deallocate)(ptr, layout, stream);
            return Err(Error::Misaligned {
                align: layout.align(),
                address,
            });
        }
        Ok(ptr)
    }

    unsafe fn deallocate(&self, stream: StreamRef<'_>, ptr: NonNull<u8>, layout: Layout) {
        if layout.size() != 0 {
            (self.deallocate)(ptr, layout, stream);
        }
    }
}

impl<P, A, D> PartialEq for Callback<P, A, D> {
    /// Identity: a `Callback` may free only its own memory.
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self, other)
    }
}

impl<P, A, D> fmt::Debug for Callback<P, A, D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Callback<{}>", std::any::type_name::<P>())
    }
}
