//! Type erasure: equality, narrowing, sharing, and erased handles as resources.

use std::alloc::Layout;
use std::ptr::NonNull;

use memres::adaptor::Statistics;
use memres::{
    AnyResource, Has, Host, HostAccessible, HostDevice, HostHeap, Resource, ResourceExt,
    ResourceRef, StreamRef, SyncResource,
    erased::{AnySyncResource, Shared, SyncResourceRef},
    layout,
    upstream::Callback,
};

static HEAP: HostHeap = HostHeap::new();

mod common;

/// A stateful resource: equal only to resources with the same `id`. Claims both host and
/// device access; the tests never hand its memory to a kernel.
type Tagged = common::HeapAs<HostDevice>;

#[test]
fn equality_compares_type_then_value() {
    let (a, a2, b) = (Tagged::new(1), Tagged::new(1), Tagged::new(2));
    let ra = ResourceRef::<Host>::new(&a);
    assert_eq!(ra, ResourceRef::new(&a2), "same type, equal values");
    assert_ne!(ra, ResourceRef::new(&b), "same type, different values");
    assert_ne!(
        ra,
        ResourceRef::new(&HEAP),
        "different types never compare equal"
    );
    assert_eq!(
        ResourceRef::<Host>::new(&HEAP),
        ResourceRef::new(&HostHeap::new())
    );
}

#[test]
fn any_resource_equality_and_clones() {
    let a = AnyResource::<Host>::new(Tagged::new(7));
    let clone = a.clone();
    assert_eq!(a, clone);
    assert_eq!(a, AnyResource::new(Tagged::new(7)));
    assert_ne!(a, AnyResource::new(Tagged::new(8)));
    assert_ne!(a, AnyResource::new(HostHeap::new()));
    // A borrowed view of an AnyResource is the inner resource, not a second layer.
    assert_eq!(a.as_resource_ref(), ResourceRef::new(&Tagged::new(7)));
    assert_eq!(a.downcast_ref::<Tagged>(), Some(&Tagged::new(7)));
    assert_eq!(a.downcast_ref::<HostHeap>(), None);
}

#[test]
fn narrowing_keeps_the_resource() {
    // Counted, so that every narrowed handle shows it reaches the same resource.
    let t = Statistics::new(Tagged::new(3));
    let made = || t.snapshot().allocations.total;
    let l = layout(512).unwrap();
    let both: ResourceRef<'_, HostDevice> = ResourceRef::new(&t);
    let device: ResourceRef<'_, memres::Device> = both.narrow();
    let none: ResourceRef<'_, ()> = device.narrow();
    assert_eq!(none, ResourceRef::new(&t));
    // Allocated through the narrowed handles, freed through the wide one (equal: the same
    // resource).
    for narrowed in [
        device.allocate(StreamRef::HOST, l),
        none.allocate(StreamRef::HOST, l),
    ] {
        let p = narrowed.unwrap();
        // SAFETY: allocated just above through a handle of the same resource, with `l`.
        unsafe { both.deallocate(StreamRef::HOST, p, l) };
    }
    assert_eq!(made(), 2);

    let any = AnyResource::<HostDevice>::new(Tagged::new(3)).narrow::<Host>();
    let p = any.allocate_sync(l).unwrap();
    // SAFETY: host-accessible (the narrowed set says so), 512 bytes, ours.
    unsafe { p.as_ptr().write_bytes(0xAB, 512) };
    // SAFETY: allocated above through `any` with `l`.
    unsafe { any.deallocate_sync(p, l) };
    assert_eq!(
        any.as_resource_ref(),
        ResourceRef::<Host>::new(&Tagged::new(3))
    );

    let sync: SyncResourceRef<'_, HostDevice> = both.as_sync();
    let narrowed = sync.narrow::<()>();
    assert_eq!(narrowed, SyncResourceRef::new(&t));
    let p = narrowed.allocate_sync(l).unwrap();
    // SAFETY: allocated just above through a handle of `t`, with `l`.
    unsafe { sync.deallocate_sync(p, l) };
    assert_eq!(made(), 3);
}

#[test]
fn erased_handles_are_resources_with_their_set() {
    fn needs_host<R: Has<HostAccessible>>(r: &R) -> usize {
        let l = layout(300).unwrap();
        let p = r.allocate_sync(l).unwrap();
        // SAFETY: allocated above with `l`.
        unsafe { r.deallocate_sync(p, l) };
        p.as_ptr() as usize % 256
    }
    let any = AnyResource::<Host>::new(HostHeap::new());
    assert_eq!(needs_host(&any), 0);
    assert_eq!(needs_host(&any.as_resource_ref()), 0);
    assert_eq!(needs_host(&any.as_sync_resource_ref()), 0);
    assert_eq!(
        needs_host(&AnySyncResource::<Host>::new(HostHeap::new())),
        0
    );
    // Erasing an erased handle again yields the same handle, not a second layer.
    let twice = AnyResource::<Host>::new(any.clone());
    assert_eq!(needs_host(&twice), 0);
    assert_eq!(twice, any, "one resource behind both");
    assert_eq!(ResourceRef::<Host>::new(&any), any.as_resource_ref());
    assert_eq!(any.as_resource_ref(), any.as_resource_ref());
    // Narrowed, it is a different handle type, so it is erased again: still usable.
    let narrowed = AnyResource::<()>::new(any.clone());
    assert_eq!(needs_host(&AnyResource::<Host>::new(HostHeap::new())), 0);
    let _ = narrowed;
}

#[test]
fn memory_moves_between_clones_and_threads() {
    let any = HostHeap::new().shared().into_any::<Host>();
    let l = layout(1 << 16).unwrap();
    let p = any.allocate(StreamRef::HOST, l).unwrap().as_ptr() as usize;
    let other = any.clone();
    std::thread::spawn(move || {
        // SAFETY: `p` came from a clone of `other`'s resource with `l`.
        unsafe { other.deallocate(StreamRef::HOST, NonNull::new(p as *mut u8).unwrap(), l) }
    })
    .join()
    .unwrap();
}

#[test]
fn shared_clones_share_state() {
    let a = Shared::new(Tagged::new(1));
    let b = a.clone();
    assert!(Shared::ptr_eq(&a, &b));
    assert_eq!(Shared::owners(&a), 2);
    assert_eq!(a, b);
    assert_eq!(a, Shared::new(Tagged::new(1)), "equal resources are equal");
    assert_ne!(a, Shared::new(Tagged::new(2)));
    drop(b);
    assert_eq!(Shared::owners(&a), 1);
    assert_eq!(a.id, 1, "Shared derefs to the resource");
}

#[test]
fn callbacks_erase_too() {
    let allocate = |l: Layout, _: StreamRef<'_>| HEAP.allocate_sync(l);
    // SAFETY: `Callback` passes back only blocks from `allocate`, from `HEAP`.
    let deallocate =
        |p: NonNull<u8>, l: Layout, _: StreamRef<'_>| unsafe { HEAP.deallocate_sync(p, l) };
    // SAFETY: heap memory, host-accessible and usable at once on any stream.
    let cb = unsafe { Callback::<Host>::new(allocate, deallocate) };
    let r = cb.as_resource_ref::<Host>();
    assert_eq!(r, ResourceRef::new(&cb));
    let any = cb.into_any::<Host>();
    assert_eq!(any, any.clone());
}

#[test]
fn debug_names_the_erased_type() {
    let any = AnyResource::<Host>::new(HostHeap::new());
    let s = format!("{any:?}");
    assert!(
        s.starts_with("AnyResource<") && s.contains("HostHeap"),
        "{s}"
    );
    let s = format!("{:?}", ResourceRef::<Host>::new(&HEAP));
    assert!(
        s.starts_with("ResourceRef<") && s.contains("HostAccessible"),
        "{s}"
    );
}

static_assertions::assert_impl_all!(AnyResource<HostDevice>: Send, Sync, Clone, Resource);
static_assertions::assert_impl_all!(ResourceRef<'static, HostDevice>: Send, Sync, Copy, Resource);
static_assertions::assert_impl_all!(Shared<HostHeap>: Send, Sync, Clone, Resource);
static_assertions::assert_not_impl_any!(SyncResourceRef<'static, Host>: Resource);
static_assertions::assert_not_impl_any!(AnySyncResource<Host>: Resource);
