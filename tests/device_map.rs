//! The per-device default resource: set, get and reset from many threads. The explicit
//! per-device calls need no driver, so most of this runs in CI with stand-in resources;
//! the current-device calls and the lazily made `Cuda` default need a GPU.

use memres::device::DeviceId;
use memres::per_device::{
    self, per_device_resource, reset_per_device_resource, set_per_device_resource,
};
use memres::{AnyResource, Device, SyncResource};

mod common;

/// Heap memory claiming device access (never handed to a kernel), with an id.
type StandIn = common::HeapAs<Device>;

fn id_of(r: &AnyResource<Device>) -> u32 {
    r.downcast_ref::<StandIn>().expect("a stand-in").id
}

/// Device ordinals no real machine has, so these tests never meet a real default.
const FAKE: [DeviceId; 2] = [DeviceId::new(1000), DeviceId::new(1001)];

#[test]
fn set_get_reset_from_many_threads() {
    let dev = FAKE[0];
    assert!(set_per_device_resource(dev, AnyResource::new(StandIn::new(0))).is_none());
    std::thread::scope(|s| {
        for t in 1..=8u32 {
            s.spawn(move || {
                for i in 0..200u32 {
                    let mine = t * 1000 + i;
                    let previous =
                        set_per_device_resource(dev, AnyResource::new(StandIn::new(mine)))
                            .expect("the slot is never empty while the threads run");
                    // What was there is some thread's resource, alive and usable.
                    let l = memres::layout(64).unwrap();
                    let p = previous.allocate_sync(l).unwrap();
                    // SAFETY: allocated just above from `previous`.
                    unsafe { previous.deallocate_sync(p, l) };
                    let now = per_device_resource(dev).unwrap();
                    let _ = id_of(&now);
                }
            });
        }
    });
    let last = reset_per_device_resource(dev).expect("the last resource set");
    assert!(id_of(&last) >= 1000);
    assert!(
        reset_per_device_resource(dev).is_none(),
        "reset leaves it empty"
    );
}

#[test]
fn devices_are_independent() {
    set_per_device_resource(FAKE[1], AnyResource::new(StandIn::new(7)));
    let other = DeviceId::new(1002);
    set_per_device_resource(other, AnyResource::new(StandIn::new(8)));
    assert_eq!(id_of(&per_device_resource(FAKE[1]).unwrap()), 7);
    assert_eq!(id_of(&per_device_resource(other).unwrap()), 8);
    assert_eq!(id_of(&reset_per_device_resource(other).unwrap()), 8);
    assert_eq!(id_of(&per_device_resource(FAKE[1]).unwrap()), 7);
    reset_per_device_resource(FAKE[1]);
}

/// The tests that change the current device's resource run one at a time: they share it.
fn current_device_tests() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_current_device_starts_with_a_cuda_resource() {
    let _serial = current_device_tests();
    // All `Cuda` resources compare equal, so identity is checked by address: an
    // `AnyResource` shares one allocation among its clones.
    fn address(r: &AnyResource<Device>) -> *const memres::Cuda {
        r.downcast_ref::<memres::Cuda>().expect("a Cuda resource")
    }
    let _ = per_device::reset_current_resource().unwrap();
    let first = per_device::current_resource().unwrap();
    let again = per_device::current_resource().unwrap();
    assert_eq!(address(&first), address(&again), "made once, then shared");
    let pool = AnyResource::<Device>::new(memres::upstream::CudaAsync::new().unwrap());
    let previous = per_device::set_current_resource(pool.clone())
        .unwrap()
        .unwrap();
    assert_eq!(
        address(&previous),
        address(&first),
        "set returns what it replaced"
    );
    assert_eq!(per_device::current_resource().unwrap(), pool);
    // From other threads too (each starts with no context current: device 0).
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| assert_eq!(per_device::current_resource().unwrap(), pool));
        }
    });
    assert_eq!(per_device::reset_current_resource().unwrap(), Some(pool));
    let fresh = per_device::current_resource().unwrap();
    assert_ne!(
        address(&fresh),
        address(&first),
        "after a reset a new default is made"
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn set_get_reset_on_the_current_device_from_many_threads() {
    let _serial = current_device_tests();
    std::thread::scope(|s| {
        for t in 0..4u32 {
            s.spawn(move || {
                for i in 0..50u32 {
                    let mine = AnyResource::<Device>::new(StandIn::new(t * 100 + i));
                    per_device::set_current_resource(mine).unwrap();
                    let now = per_device::current_resource().unwrap();
                    // Whatever is current (a stand-in or a fresh `Cuda`) serves memory.
                    let l = memres::layout(256).unwrap();
                    let p = now.allocate_sync(l).unwrap();
                    // SAFETY: allocated just above from `now`.
                    unsafe { now.deallocate_sync(p, l) };
                    if i % 10 == 0 {
                        per_device::reset_current_resource().unwrap();
                    }
                }
            });
        }
    });
    per_device::reset_current_resource().unwrap();
    let made = per_device::current_resource().unwrap();
    assert!(made.downcast_ref::<memres::Cuda>().is_some(), "{made:?}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn every_device_has_its_own_default() {
    let n = DeviceId::count().unwrap();
    if n < 2 {
        println!("memres-skip: only {n} GPU here: the two-device case needs two");
        return;
    }
    let (d0, d1) = (DeviceId::new(0), DeviceId::new(1));
    let a = per_device_resource(d0).unwrap();
    let b = per_device_resource(d1).unwrap();
    assert_eq!(a.downcast_ref::<memres::Cuda>().unwrap().device(), d0);
    assert_eq!(b.downcast_ref::<memres::Cuda>().unwrap().device(), d1);
}

/// One call sets up several devices, all or nothing.
#[test]
fn several_devices_in_one_call_all_or_nothing() {
    let devs = [
        DeviceId::new(1010),
        DeviceId::new(1011),
        DeviceId::new(1012),
    ];
    let replaced =
        per_device::set_per_device_resources(devs, |d| Ok(StandIn::new(d.ordinal() as u32)))
            .unwrap();
    assert!(replaced.iter().all(Option::is_none));
    for d in devs {
        assert_eq!(id_of(&per_device_resource(d).unwrap()), d.ordinal() as u32);
    }
    // The third fails: nothing changes on the first two.
    let mut made = 0;
    let e = per_device::set_per_device_resources(devs, |d| {
        made += 1;
        if d == devs[2] {
            Err(memres::Error::out_of_memory(1 << 30))
        } else {
            Ok(StandIn::new(7))
        }
    })
    .unwrap_err();
    assert!(matches!(e, memres::Error::OutOfMemory { .. }), "{e:?}");
    assert_eq!(made, 3);
    for d in devs {
        assert_eq!(id_of(&per_device_resource(d).unwrap()), d.ordinal() as u32);
    }
    // A device listed twice is refused before anything is built.
    let e = per_device::set_per_device_resources([devs[0], devs[0]], |_| Ok(StandIn::new(9)))
        .unwrap_err();
    assert!(e.to_string().contains("listed twice"), "{e}");
    assert_eq!(id_of(&per_device_resource(devs[0]).unwrap()), 1010);
    // What the next call replaces comes back in order.
    let replaced = per_device::set_per_device_resources(devs, |_| Ok(StandIn::new(3))).unwrap();
    let ids: Vec<u32> = replaced
        .iter()
        .map(|r| id_of(r.as_ref().unwrap()))
        .collect();
    assert_eq!(ids, [1010, 1011, 1012]);
    for d in devs {
        reset_per_device_resource(d);
    }
}
