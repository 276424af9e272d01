//! Property sets through adaptors: forwarding, unions, user-defined properties, and the
//! builder that stacks them.

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};

use memres::property::{Contains, Property, PropertySet};
use memres::{
    AnyResource, Device, DeviceAccessible, Has, Host, HostAccessible, HostDevice, HostHeap,
    Resource, ResourceExt, ResourceRef, StreamRef, SyncResource, layer::Layer, layout,
    upstream::Callback,
};
use static_assertions::{assert_impl_all, assert_not_impl_any};
use typenum::Unsigned;

/// A property of the user's: memory that is counted.
struct Counted;
// SAFETY: bit 8 is used by no other property in this test.
unsafe impl PropertySet for Counted {
    type Mask = typenum::U256;
}
impl Property for Counted {}

/// Another: memory from a particular NUMA node (only to show two user bits together).
struct NumaLocal;
// SAFETY: bit 9 is used by no other property in this test.
unsafe impl PropertySet for NumaLocal {
    type Mask = typenum::U512;
}
impl Property for NumaLocal {}

/// A forwarding adaptor, as every memres adaptor is: it keeps its upstream's set whatever
/// is in it, with one line.
#[derive(PartialEq)]
struct Forward<U>(U);

// SAFETY: every call goes to the upstream, whose set it keeps.
unsafe impl<U: SyncResource> SyncResource for Forward<U> {
    type Properties = U::Properties;
    fn allocate_sync(&self, l: Layout) -> Result<NonNull<u8>, memres::Error> {
        self.0.allocate_sync(l)
    }
    unsafe fn deallocate_sync(&self, p: NonNull<u8>, l: Layout) {
        // SAFETY: forwards the caller's promise to the upstream.
        unsafe { self.0.deallocate_sync(p, l) }
    }
}

/// An adaptor that adds a property: its set is the union of its upstream's and `Counted`.
struct Counting<U> {
    upstream: U,
    live: AtomicUsize,
}

impl<U: PartialEq> PartialEq for Counting<U> {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self, other)
    }
}

// SAFETY: every block comes from the upstream; `Counted` (counting) is what it adds.
unsafe impl<U: SyncResource> SyncResource for Counting<U>
where
    (U::Properties, Counted): PropertySet,
{
    type Properties = (U::Properties, Counted);
    fn allocate_sync(&self, l: Layout) -> Result<NonNull<u8>, memres::Error> {
        let p = self.upstream.allocate_sync(l)?;
        self.live.fetch_add(l.size(), Ordering::Relaxed);
        Ok(p)
    }
    unsafe fn deallocate_sync(&self, p: NonNull<u8>, l: Layout) {
        self.live.fetch_sub(l.size(), Ordering::Relaxed);
        // SAFETY: forwards the caller's promise to the upstream.
        unsafe { self.upstream.deallocate_sync(p, l) }
    }
}

// SAFETY: as for `SyncResource`.
unsafe impl<U: Resource> Resource for Counting<U>
where
    (U::Properties, Counted): PropertySet,
{
    fn allocate(&self, s: StreamRef<'_>, l: Layout) -> Result<NonNull<u8>, memres::Error> {
        let p = self.upstream.allocate(s, l)?;
        self.live.fetch_add(l.size(), Ordering::Relaxed);
        Ok(p)
    }
    unsafe fn deallocate(&self, s: StreamRef<'_>, p: NonNull<u8>, l: Layout) {
        self.live.fetch_sub(l.size(), Ordering::Relaxed);
        // SAFETY: forwards the caller's promise to the upstream.
        unsafe { self.upstream.deallocate(s, p, l) }
    }
}

/// The layers, for the builder.
struct ForwardLayer;
impl<U> Layer<U> for ForwardLayer {
    type Resource = Forward<U>;
    fn layer(self, upstream: U) -> Forward<U> {
        Forward(upstream)
    }
}
struct CountingLayer;
impl<U> Layer<U> for CountingLayer {
    type Resource = Counting<U>;
    fn layer(self, upstream: U) -> Counting<U> {
        Counting {
            upstream,
            live: AtomicUsize::new(0),
        }
    }
}

/// A device-and-host resource made up for the type checks (never allocated from).
type Pinnedish = Callback<
    HostDevice,
    fn(Layout, StreamRef<'_>) -> Result<NonNull<u8>, memres::Error>,
    fn(NonNull<u8>, Layout, StreamRef<'_>),
>;

// Forwarding keeps the set, whatever it holds.
assert_impl_all!(Forward<HostHeap>: Has<Host>);
assert_not_impl_any!(Forward<HostHeap>: Has<Device>);
assert_impl_all!(Forward<Forward<Pinnedish>>: Has<Host>, Has<Device>, Has<HostDevice>);
assert_impl_all!(Forward<Counting<HostHeap>>: Has<Counted>, Has<(Counted, Host)>);
assert_not_impl_any!(Forward<Counting<HostHeap>>: Has<Device>, Has<NumaLocal>);

// Adding a property is a union.
assert_impl_all!(Counting<HostHeap>: Has<Host>, Has<Counted>, Has<(HostAccessible, Counted)>);
assert_impl_all!(Counting<Pinnedish>: Has<(Counted, DeviceAccessible, HostAccessible)>);
assert_impl_all!(Counting<Counting<HostHeap>>: Has<Counted>);
assert_not_impl_any!(Counting<HostHeap>: Has<Device>);

// Handles forward too.
assert_impl_all!(&'static Counting<HostHeap>: Has<Counted>);
assert_impl_all!(std::sync::Arc<Counting<HostHeap>>: Has<Counted>);
assert_impl_all!(Box<Forward<Pinnedish>>: Has<HostDevice>);

// Subsets among user bits.
assert_impl_all!((Counted, NumaLocal, Host): Contains<(NumaLocal, Counted)>);
assert_not_impl_any!((Counted, Host): Contains<NumaLocal>);

#[test]
fn mask_of_a_stack_is_the_union() {
    fn mask<R: SyncResource>() -> usize {
        <<R::Properties as PropertySet>::Mask as Unsigned>::USIZE
    }
    assert_eq!(mask::<HostHeap>(), 0b10);
    assert_eq!(mask::<Forward<HostHeap>>(), 0b10);
    assert_eq!(mask::<Counting<HostHeap>>(), 0x100 | 0b10);
    assert_eq!(mask::<Counting<Pinnedish>>(), 0x100 | 0b11);
    assert_eq!(mask::<Counting<Counting<Pinnedish>>>(), 0x100 | 0b11);
}

#[test]
fn builder_stacks_read_top_down_and_keep_properties() {
    // HostHeap, then counting, then forwarding: the chain reads the way memory flows.
    let stack = HostHeap::new().with(CountingLayer).with(ForwardLayer);
    fn counted<R: Has<(Counted, Host)>>(r: &R) -> &R {
        r
    }
    let stack = counted(&stack);
    let l = layout(4096).unwrap();
    let p = stack.allocate_sync(l).unwrap();
    assert_eq!(stack.0.live.load(Ordering::Relaxed), 4096);
    // SAFETY: allocated above with `l`.
    unsafe { stack.deallocate_sync(p, l) };
    assert_eq!(stack.0.live.load(Ordering::Relaxed), 0);
}

#[test]
fn a_user_property_survives_erasure() {
    let stack = HostHeap::new().with(CountingLayer);
    // Narrow to the user's property alone, or keep it with others.
    let only: ResourceRef<'_, Counted> = ResourceRef::new(&stack);
    let both: ResourceRef<'_, (Counted, Host)> = stack.as_resource_ref();
    assert_eq!(only, both.narrow());
    let any: AnyResource<(Host, Counted)> = stack.into_any();
    fn needs_counted<R: Has<Counted>>(_: &R) {}
    needs_counted(&any);
}
