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
/// - `P` is the property set the closures' memory has; you are the one who knows it, and
///   the type system takes your word.
/// - The closures never see a zero-byte request: `Callback` answers those itself, per the
///   contract.
/// - The allocate closure returns `Ok(pointer)` or an error (`Error::out_of_memory(size)`
///   when the memory is not there). Its memory must be usable at once; stream-ordered
///   calls forward to the same closures (the stream is not passed on).
/// - A pointer that is not aligned to the layout's alignment is never passed on: it is
///   handed straight back to the deallocate closure and the call fails with
///   [`Error::Misaligned`].
/// - Equality is identity, as RMM's default: a `Callback` equals only itself (closures
///   cannot be compared). Share one through `&`, `Arc` or [`Shared`](crate::Shared).
///
/// ```
/// use memres::{Callback, Error, Host, HostHeap, SyncResource, layout};
/// use std::alloc::Layout;
/// use std::ptr::NonNull;
/// use std::sync::atomic::{AtomicUsize, Ordering};
///
/// let heap = HostHeap::new();
/// let live = AtomicUsize::new(0);
/// let counted = Callback::<Host>::new(
///     |l: Layout| {
///         let p = heap.allocate_sync(l)?;
///         live.fetch_add(l.size(), Ordering::Relaxed);
///         Ok(p)
///     },
///     |p: NonNull<u8>, l: Layout| {
///         live.fetch_sub(l.size(), Ordering::Relaxed);
///         // SAFETY: `p` came from `heap` with `l` in the closure above.
///         unsafe { heap.deallocate_sync(p, l) }
///     },
/// );
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
    pub fn new<A, D>(allocate: A, deallocate: D) -> Callback<P, A, D>
    where
        A: Fn(Layout) -> Result<NonNull<u8>, Error>,
        D: Fn(NonNull<u8>, Layout),
    {
        Callback {
            allocate,
            deallocate,
            properties: PhantomData,
        }
    }
}

impl<P, A, D> SyncResource for Callback<P, A, D>
where
    P: PropertySet,
    A: Fn(Layout) -> Result<NonNull<u8>, Error>,
    D: Fn(NonNull<u8>, Layout),
{
    type Properties = P;

    fn allocate_sync(&self, layout: Layout) -> Result<NonNull<u8>, Error> {
        if layout.size() == 0 {
            return Ok(dangling(layout));
        }
        let ptr = (self.allocate)(layout)?;
        let address = ptr.as_ptr() as usize;
        if !address.is_multiple_of(layout.align()) {
            tracing::warn!(
                address,
                align = layout.align(),
                "memres::Callback: the allocate closure returned misaligned memory"
            );
            (self.deallocate)(ptr, layout);
            return Err(Error::Misaligned {
                align: layout.align(),
                address,
            });
        }
        Ok(ptr)
    }

    unsafe fn deallocate_sync(&self, ptr: NonNull<u8>, layout: Layout) {
        if layout.size() != 0 {
            (self.deallocate)(ptr, layout);
        }
    }
}

impl<P, A, D> Resource for Callback<P, A, D>
where
    P: PropertySet,
    A: Fn(Layout) -> Result<NonNull<u8>, Error>,
    D: Fn(NonNull<u8>, Layout),
{
    fn allocate(&self, _stream: StreamRef<'_>, layout: Layout) -> Result<NonNull<u8>, Error> {
        self.allocate_sync(layout)
    }

    unsafe fn deallocate(&self, _stream: StreamRef<'_>, ptr: NonNull<u8>, layout: Layout) {
        // SAFETY: `deallocate`'s contract includes `deallocate_sync`'s: the pointer came
        // from this resource with `layout`, and no work uses the memory any more.
        unsafe { self.deallocate_sync(ptr, layout) }
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
