//! Compile-time properties of memory: where it may be accessed from, and anything else a
//! user wants the type system to track.
//!
//! A *property* is a type ([`DeviceAccessible`], [`HostAccessible`], or one of your own).
//! A *property set* is a property, a tuple of sets (`(HostAccessible, DeviceAccessible)`),
//! or `()` for none. Each set has a [`typenum`] bit mask; a resource names its set in
//! `type Properties`, and an adaptor forwards every property of its upstream, including
//! properties it has never heard of, with `type Properties = U::Properties;`.
//!
//! Code states what it needs with [`Has`](crate::Has):
//!
//! ```
//! use memres::{DeviceAccessible, Has, HostAccessible, HostHeap, SyncResource};
//!
//! fn fill_on_host<R: Has<HostAccessible>>(r: &R) { /* may write through host pointers */ }
//! fill_on_host(&HostHeap::new());
//! ```
//!
//! and a resource without the property is rejected at compile time with a readable error:
//!
//! ```compile_fail,E0277
//! use memres::{DeviceAccessible, Has, HostHeap};
//!
//! fn launch_kernel<R: Has<DeviceAccessible>>(r: &R) {}
//! launch_kernel(&HostHeap::new()); // error: a memory resource lacks a property ...
//! ```
//!
//! # Your own properties
//! Give the property a bit of its own. Bits 0 to 7 are memres's; use bit 8 (`U256`) and
//! above, one bit per property.
//!
//! ```
//! use memres::property::{Property, PropertySet};
//! use memres::Has;
//! use memres::{Error, HostAccessible, HostHeap, StreamRef, upstream::Callback};
//! use std::alloc::Layout;
//! use std::ptr::NonNull;
//!
//! /// Memory that is zeroed when it is handed out.
//! struct Zeroed;
//! // SAFETY: bit 8 is not used by any other property in this program.
//! unsafe impl PropertySet for Zeroed { type Mask = typenum::U256; }
//! impl Property for Zeroed {}
//!
//! fn needs_zeroed<R: Has<Zeroed>>(_: &R) {}
//!
//! let heap = HostHeap::new();
//! let allocate = |l: Layout, _: StreamRef<'_>| {
//!     // SAFETY: `Callback` never passes a zero-size layout to its closures.
//!     let p = unsafe { std::alloc::alloc_zeroed(l) };
//!     NonNull::new(p).ok_or(Error::out_of_memory(l.size()))
//! };
//! // SAFETY: `Callback` passes back only blocks from `allocate`, with their layout.
//! let free = |p: NonNull<u8>, l: Layout, _: StreamRef<'_>| unsafe { std::alloc::dealloc(p.as_ptr(), l) };
//! // SAFETY: zeroed heap memory: host-accessible, usable at once, and zeroed as declared.
//! let zeroing = unsafe { Callback::<(HostAccessible, Zeroed)>::new(allocate, free) };
//! needs_zeroed(&zeroing);
//! // needs_zeroed(&heap); // does not compile: HostHeap does not declare `Zeroed`
//! # let _ = heap;
//! ```
//!
//! # How the check reads
//! `R: Has<P>` holds when `R::Properties: Contains<P>`, which holds when
//! `mask(R::Properties) & mask(P) == mask(P)`. typenum computes that as `True` or `False`,
//! and only `True` implements the sealed marker [`Holds`], whose
//! `#[diagnostic::on_unimplemented]` message is what a misuse shows; the compiler's notes
//! then name the resource and the property ("required for `HostHeap` to implement
//! `Has<DeviceAccessible>`").

use std::ops::{BitAnd, BitOr};

use typenum::{And, Eq, IsEqual, Or, U0, U1, U2, Unsigned};

/// A set of properties, with its bit mask.
///
/// Implemented by every [`Property`], by `()` (no property), and by tuples of up to six
/// sets (their union).
///
/// # Safety
/// Code relies on the masks to decide what it may do with memory (write to it from the
/// host, hand it to a kernel), so a mask must not claim bits it has no right to. For a
/// property of your own: its mask is a single bit of 8 or above (`U256`, `U512`, ...),
/// and no other property in the program uses that bit. Bits 0 to 7 belong to memres.
pub unsafe trait PropertySet: 'static {
    /// The set as a type-level bit mask: one bit per property.
    type Mask: Unsigned;
}

/// One property: a set with a single bit. See the [module docs](self) for how to define
/// your own.
pub trait Property: PropertySet {}

/// Memory that kernels on the device may access.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct DeviceAccessible;

/// Memory that host code may read and write.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct HostAccessible;

// SAFETY: bit 0 is memres's `DeviceAccessible`.
unsafe impl PropertySet for DeviceAccessible {
    type Mask = U1;
}
impl Property for DeviceAccessible {}

// SAFETY: bit 1 is memres's `HostAccessible`.
unsafe impl PropertySet for HostAccessible {
    type Mask = U2;
}
impl Property for HostAccessible {}

/// The set of device-accessible memory (`ResourceRef<'_, Device>`, `AnyResource<Device>`).
pub type Device = DeviceAccessible;
/// The set of host-accessible memory.
pub type Host = HostAccessible;
/// The set of memory both the host and the device may access (pinned or managed memory).
pub type HostDevice = (HostAccessible, DeviceAccessible);

// SAFETY: the empty set claims nothing.
unsafe impl PropertySet for () {
    type Mask = U0;
}

// SAFETY: the same bits as `A`.
unsafe impl<A: PropertySet> PropertySet for (A,) {
    type Mask = A::Mask;
}

/// Tuples are unions: the mask of `(A, B, ..)` is the mask of `(A, ..)` or-ed with `B`'s.
macro_rules! tuple_union {
    ($(($($head:ident),+) + $last:ident;)*) => {$(
        // SAFETY: the union of the members' bits, each of which is rightly claimed.
        unsafe impl<$($head: PropertySet,)+ $last: PropertySet> PropertySet for ($($head,)+ $last)
        where
            ($($head,)+): PropertySet,
            <($($head,)+) as PropertySet>::Mask: BitOr<$last::Mask>,
            Or<<($($head,)+) as PropertySet>::Mask, $last::Mask>: Unsigned,
        {
            type Mask = Or<<($($head,)+) as PropertySet>::Mask, $last::Mask>;
        }
    )*};
}

tuple_union! {
    (A) + B;
    (A, B) + C;
    (A, B, C) + D;
    (A, B, C, D) + E;
    (A, B, C, D, E) + F;
}

/// The bit mask of a property set, at run time (for code that picks a path by property
/// where the type system cannot, such as copies between memory of two resources).
pub(crate) const fn mask_of<S: PropertySet>() -> usize {
    <S::Mask as Unsigned>::USIZE
}

/// The seal of the type-level `true` markers ([`Holds`] here, and
/// [`AlignmentHolds`](crate::adaptor::AlignmentHolds)): only `typenum::True` has it.
pub(crate) mod sealed {
    pub trait Sealed {}
    impl Sealed for typenum::True {}
}

/// The type-level `true`: the end of every property check.
///
/// Only [`typenum::True`] implements it, and nothing else can (it is sealed), so a failed
/// check reads as the message below instead of a typenum type mismatch.
#[diagnostic::on_unimplemented(
    message = "a memory resource lacks a property it is required to have",
    label = "this needs a property that the resource's `type Properties` does not list",
    note = "the notes below name the resource (or property set) and the missing property",
    note = "use a resource whose memory has the property, or narrow to a set it does have"
)]
pub trait Holds: sealed::Sealed {}

#[diagnostic::do_not_recommend]
impl Holds for typenum::True {}

/// `Self` contains every property of the set `Q`: the subset relation of property sets.
///
/// Implemented for every pair where it holds; it cannot be implemented by hand.
///
/// ```
/// use memres::property::{Contains, HostDevice};
/// use memres::{DeviceAccessible, HostAccessible};
///
/// fn subset<S: Contains<Q>, Q: memres::property::PropertySet>() {}
/// subset::<HostDevice, DeviceAccessible>();
/// subset::<HostDevice, (DeviceAccessible, HostAccessible)>(); // order does not matter
/// subset::<HostAccessible, ()>();
/// ```
pub trait Contains<Q: PropertySet>: PropertySet {}

impl<S, Q> Contains<Q> for S
where
    S: PropertySet,
    Q: PropertySet,
    S::Mask: BitAnd<Q::Mask>,
    And<S::Mask, Q::Mask>: IsEqual<Q::Mask>,
    Eq<And<S::Mask, Q::Mask>, Q::Mask>: Holds,
{
}

#[cfg(test)]
mod tests {
    use super::*;
    use static_assertions::{assert_impl_all, assert_not_impl_any};
    use typenum::{U3, U256, Unsigned};

    struct Custom;
    // SAFETY: bit 8 is used by no other property in this crate's tests.
    unsafe impl PropertySet for Custom {
        type Mask = U256;
    }
    impl Property for Custom {}

    #[test]
    fn masks() {
        assert_eq!(<() as PropertySet>::Mask::USIZE, 0);
        assert_eq!(<Device as PropertySet>::Mask::USIZE, 1);
        assert_eq!(<Host as PropertySet>::Mask::USIZE, 2);
        assert_eq!(<HostDevice as PropertySet>::Mask::USIZE, 3);
        assert_eq!(
            <(DeviceAccessible, HostAccessible, Custom) as PropertySet>::Mask::USIZE,
            0x103
        );
        // Duplicates and nesting change nothing: sets are sets.
        assert_eq!(
            <(Device, (Device, Host), ()) as PropertySet>::Mask::USIZE,
            3
        );
    }

    // Subsets, as the compiler sees them.
    assert_impl_all!(HostDevice: Contains<Device>, Contains<Host>, Contains<HostDevice>, Contains<()>);
    assert_impl_all!((DeviceAccessible, HostAccessible): Contains<HostDevice>);
    assert_impl_all!((Host, Device, Custom): Contains<(Custom, Host)>);
    assert_impl_all!(Device: Contains<Device>, Contains<()>, Contains<(Device,)>);
    assert_impl_all!((): Contains<()>);
    assert_not_impl_any!(Device: Contains<Host>, Contains<HostDevice>, Contains<Custom>);
    assert_not_impl_any!(Host: Contains<Device>);
    assert_not_impl_any!((): Contains<Host>);
    assert_not_impl_any!(HostDevice: Contains<Custom>);

    #[test]
    fn mask_of_union_is_or() {
        fn mask<S: PropertySet>() -> usize {
            S::Mask::USIZE
        }
        assert_eq!(mask::<(Host, Device)>(), U3::USIZE);
        assert_eq!(mask::<(Custom,)>(), 256);
    }
}
