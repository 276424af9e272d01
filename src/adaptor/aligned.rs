//! [`Aligned`]: larger alignment than the upstream gives, by over-allocating.

use std::alloc::Layout;
use std::fmt;
use std::ops::{BitAnd, Sub};
use std::ptr::NonNull;

use typenum::{And, B1, Eq, GrEq, IsEqual, IsGreaterOrEqual, Sub1, U0, U256, Unsigned};

use super::{as_asked, upstream_access};
use crate::addr_map::AddrMap;
use crate::error::Error;
use crate::resource::{DEFAULT_ALIGNMENT, Resource, SyncResource};
use crate::stream::StreamRef;
use crate::sync::Mutex;

/// Aligns allocations of at least `threshold` bytes to `alignment` (RMM's
/// `aligned_resource_adaptor`), for upstreams that only guarantee 256 bytes.
///
/// - Requests below the threshold whose own alignment is at most 256 bytes, and all
///   requests when the effective alignment is 256, pass straight through with their own
///   layout.
/// - Larger ones are served by asking the upstream for `size + alignment - 256` bytes at
///   256-byte alignment and aligning up; the original pointer is remembered (a locked map
///   from aligned to original address) so the free goes back whole.
/// - Unlike RMM, a per-call alignment larger than the adaptor's own is honoured too: the
///   effective alignment is the larger of the two.
///
/// ```
/// use memres::adaptor::Aligned;
/// use memres::{HostHeap, SyncResource, layout};
///
/// let aligned = Aligned::new(HostHeap::new(), 4096, 0)?;
/// let l = layout(100)?;
/// let p = aligned.allocate_sync(l)?;
/// assert_eq!(p.as_ptr() as usize % 4096, 0);
/// // SAFETY: allocated above with `l`.
/// unsafe { aligned.deallocate_sync(p, l) };
/// assert!(Aligned::new(HostHeap::new(), 3000, 0).is_err()); // not a power of two
/// # Ok::<(), memres::Error>(())
/// ```
pub struct Aligned<U> {
    upstream: U,
    alignment: usize,
    threshold: usize,
    /// Aligned address -> original address, for the blocks that were realigned.
    originals: Mutex<AddrMap<usize>>,
}

upstream_access!(Aligned<U>);

impl<U> Aligned<U> {
    /// RMM's default threshold: 64 KiB.
    pub const DEFAULT_THRESHOLD: usize = 64 << 10;

    /// Aligns requests of at least `threshold` bytes to `alignment`, a power of two of at
    /// least 256 (else [`Error::InvalidArgument`]).
    pub fn new(upstream: U, alignment: usize, threshold: usize) -> Result<Self, Error> {
        if !alignment.is_power_of_two() || alignment < DEFAULT_ALIGNMENT {
            return Err(Error::invalid_argument(format!(
                "Aligned: the alignment must be a power of two of at least 256; {alignment} is not"
            )));
        }
        Ok(Aligned {
            upstream,
            alignment,
            threshold,
            originals: Mutex::new(AddrMap::default()),
        })
    }

    /// As [`new`](Self::new), with the alignment checked by the compiler: a power of two of
    /// at least 256, as a typenum number (`typenum::U4096`). Anything else does not compile.
    ///
    /// ```
    /// use memres::adaptor::Aligned;
    /// use memres::HostHeap;
    /// let a = Aligned::with_alignment::<typenum::U4096>(HostHeap::new(), 0);
    /// assert_eq!(a.alignment(), 4096);
    /// ```
    ///
    /// ```compile_fail,E0277
    /// use memres::adaptor::Aligned;
    /// let a = Aligned::with_alignment::<typenum::U1000>(memres::HostHeap::new(), 0);
    /// ```
    pub fn with_alignment<A>(upstream: U, threshold: usize) -> Self
    where
        A: Unsigned + Sub<B1> + IsGreaterOrEqual<U256>,
        A: BitAnd<Sub1<A>>,
        And<A, Sub1<A>>: IsEqual<U0>,
        Eq<And<A, Sub1<A>>, U0>: BitAnd<GrEq<A, U256>>,
        And<Eq<And<A, Sub1<A>>, U0>, GrEq<A, U256>>: AlignmentHolds,
    {
        Aligned {
            upstream,
            alignment: A::USIZE,
            threshold,
            originals: Mutex::new(AddrMap::default()),
        }
    }

    /// The alignment large requests get.
    pub fn alignment(&self) -> usize {
        self.alignment
    }

    /// Requests below this many bytes pass straight through.
    pub fn threshold(&self) -> usize {
        self.threshold
    }

    /// `None` when `layout` passes through; else the alignment it gets and the layout asked
    /// of the upstream.
    fn plan(&self, layout: Layout) -> Result<Option<(usize, Layout)>, Error> {
        let align = if layout.size() >= self.threshold {
            self.alignment.max(layout.align())
        } else {
            layout.align()
        };
        if align <= DEFAULT_ALIGNMENT || layout.size() == 0 {
            return Ok(None);
        }
        let padded = layout
            .size()
            .checked_add(align - DEFAULT_ALIGNMENT)
            .ok_or(Error::out_of_memory(layout.size()))?;
        let upstream = Layout::from_size_align(padded, DEFAULT_ALIGNMENT)
            .map_err(|_| Error::out_of_memory(layout.size()))?;
        Ok(Some((align, upstream)))
    }

    fn originals(&self) -> crate::sync::MutexGuard<'_, AddrMap<usize>> {
        // Each update is one insert or remove: a poisoned map is still consistent.
        crate::sync::lock(&self.originals)
    }

    /// Aligns `original` (from the upstream) up to `align` and remembers it.
    fn realign(&self, original: NonNull<u8>, align: usize) -> NonNull<u8> {
        let address = original.as_ptr() as usize;
        let aligned = address.next_multiple_of(align);
        self.originals().insert(aligned, address);
        // The offset is below `align - 256` (the upstream block is 256-aligned), inside
        // the padding asked for, so the aligned block lies within the upstream block.
        original.map_addr(|a| a.saturating_add(aligned - address))
    }

    /// The upstream's pointer and layout for a block handed out with `layout`.
    fn original(&self, ptr: NonNull<u8>, layout: Layout) -> (NonNull<u8>, Layout) {
        match self.plan(layout) {
            Ok(Some((_, upstream))) => {
                let aligned = ptr.as_ptr() as usize;
                match self.originals().remove(&aligned) {
                    Some(original) => (ptr.with_addr(non_zero(original)), upstream),
                    None => {
                        tracing::error!(
                            address = aligned,
                            "memres::Aligned: freeing a block it did not align; passed on as is"
                        );
                        (ptr, layout)
                    }
                }
            }
            _ => (ptr, layout),
        }
    }
}

/// The type-level check of [`Aligned::with_alignment`]: only `typenum::True` has it.
#[diagnostic::on_unimplemented(
    message = "an alignment must be a power of two of at least 256",
    label = "this alignment is not",
    note = "use typenum::U256, U512, U4096, ..."
)]
pub trait AlignmentHolds: crate::property::sealed::Sealed {}

#[diagnostic::do_not_recommend]
impl AlignmentHolds for typenum::True {}

fn non_zero(address: usize) -> std::num::NonZeroUsize {
    std::num::NonZeroUsize::new(address).expect("upstream blocks are never null")
}

impl<U> PartialEq for Aligned<U> {
    /// Identity: only this adaptor knows where its realigned blocks began.
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self, other)
    }
}

impl<U: fmt::Debug> fmt::Debug for Aligned<U> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Aligned")
            .field("upstream", &self.upstream)
            .field("alignment", &self.alignment)
            .field("threshold", &self.threshold)
            .finish()
    }
}

// SAFETY: pass-through blocks come from the upstream unchanged; realigned blocks lie inside
// an upstream block padded by `align - 256` bytes (see `realign`), and go back whole.
unsafe impl<U: SyncResource> SyncResource for Aligned<U> {
    type Properties = U::Properties;

    fn allocate_sync(&self, layout: Layout) -> Result<NonNull<u8>, Error> {
        match self.plan(layout)? {
            None => self.upstream.allocate_sync(layout),
            Some((align, upstream)) => {
                let original = self.upstream.allocate_sync(upstream);
                Ok(self.realign(as_asked(original, layout)?, align))
            }
        }
    }

    unsafe fn deallocate_sync(&self, ptr: NonNull<u8>, layout: Layout) {
        let (ptr, layout) = self.original(ptr, layout);
        // SAFETY: `ptr` and `layout` are what the upstream handed out (recovered above);
        // the caller promises nothing uses the block any more.
        unsafe { self.upstream.deallocate_sync(ptr, layout) }
    }
}

// SAFETY: as for `SyncResource`.
unsafe impl<U: Resource> Resource for Aligned<U> {
    fn allocate(&self, stream: StreamRef<'_>, layout: Layout) -> Result<NonNull<u8>, Error> {
        match self.plan(layout)? {
            None => self.upstream.allocate(stream, layout),
            Some((align, upstream)) => {
                let original = self.upstream.allocate(stream, upstream);
                Ok(self.realign(as_asked(original, layout)?, align))
            }
        }
    }

    unsafe fn deallocate(&self, stream: StreamRef<'_>, ptr: NonNull<u8>, layout: Layout) {
        let (ptr, layout) = self.original(ptr, layout);
        // SAFETY: as in `deallocate_sync`, in the caller's stream order.
        unsafe { self.upstream.deallocate(stream, ptr, layout) }
    }

    #[inline]
    unsafe fn deallocate_used_on(
        &self,
        stream: StreamRef<'_>,
        ptr: NonNull<u8>,
        layout: Layout,
        used_on: &[StreamRef<'_>],
    ) {
        let (ptr, layout) = self.original(ptr, layout);
        // SAFETY: as in `deallocate_sync`, in the caller's stream order and `used_on`'s.
        unsafe {
            self.upstream
                .deallocate_used_on(stream, ptr, layout, used_on)
        }
    }
}
