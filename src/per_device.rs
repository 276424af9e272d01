//! The resource each device uses by default (RMM's per-device resource).
//!
//! Code that allocates without being told which resource to use (containers made without
//! one, the C ABI) asks [`current_resource`]. Until someone sets one, that is a [`Cuda`]
//! resource for the device, made on first use. Setting, reading and resetting are
//! thread-safe with respect to each other; the handles are [`AnyResource`]s, so a reader
//! keeps the resource it got alive even if another thread replaces it meanwhile.
//!
//! Resources stored here live until the process exits; they are then dropped with
//! [`process_is_exiting`](crate::device::process_is_exiting) true, so their drops skip the driver.
//!
//! [`Cuda`]: crate::upstream::Cuda

use std::collections::HashMap;
use std::sync::OnceLock;

use crate::device::DeviceId;
use crate::erased::AnyResource;
use crate::error::Error;
use crate::property::{Contains, Device};
use crate::resource::Resource;
use crate::sync::Mutex;

/// The map from device to resource: one lock, taken for a lookup or an update, never
/// while allocating. Its protocol is model-checked with loom (`tests` below).
pub(crate) struct DeviceMap {
    slots: Mutex<HashMap<DeviceId, AnyResource<Device>>>,
}

impl DeviceMap {
    pub(crate) fn new() -> Self {
        DeviceMap {
            slots: Mutex::new(HashMap::new()),
        }
    }

    fn lock(&self) -> crate::sync::MutexGuard<'_, HashMap<DeviceId, AnyResource<Device>>> {
        // A panic while the lock was held cannot leave the map half-updated (each update
        // is one `insert` or `remove`), so a poisoned lock is still good.
        crate::sync::lock(&self.slots)
    }

    /// The resource of `device`, made by `make` if there is none yet.
    pub(crate) fn get_or_make(
        &self,
        device: DeviceId,
        make: impl FnOnce() -> Result<AnyResource<Device>, Error>,
    ) -> Result<AnyResource<Device>, Error> {
        let mut slots = self.lock();
        if let Some(r) = slots.get(&device) {
            return Ok(r.clone());
        }
        let made = make()?;
        slots.insert(device, made.clone());
        Ok(made)
    }

    pub(crate) fn set(
        &self,
        device: DeviceId,
        resource: AnyResource<Device>,
    ) -> Option<AnyResource<Device>> {
        self.lock().insert(device, resource)
    }

    /// Installs every pair under one lock; returns what each replaced, in order.
    fn set_all(
        &self,
        pairs: Vec<(DeviceId, AnyResource<Device>)>,
    ) -> Vec<Option<AnyResource<Device>>> {
        let mut slots = self.lock();
        pairs
            .into_iter()
            .map(|(device, resource)| slots.insert(device, resource))
            .collect()
    }

    pub(crate) fn reset(&self, device: DeviceId) -> Option<AnyResource<Device>> {
        self.lock().remove(&device)
    }

    /// Everything in the map, taken out; `None` if the lock is held elsewhere (at exit,
    /// another thread may have been stopped while holding it: waiting would hang).
    fn take_all(&self) -> Option<HashMap<DeviceId, AnyResource<Device>>> {
        let mut slots = match self.slots.try_lock() {
            Ok(slots) => slots,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        Some(std::mem::take(&mut *slots))
    }
}

static MAP: OnceLock<DeviceMap> = OnceLock::new();

fn map() -> &'static DeviceMap {
    MAP.get_or_init(|| {
        crate::driver::exit::at_exit(drop_all_at_exit);
        DeviceMap::new()
    })
}

fn make_default(device: DeviceId) -> Result<AnyResource<Device>, Error> {
    Ok(AnyResource::new(crate::upstream::Cuda::on(device)?))
}

/// The resource of the current device.
///
/// ```no_run
/// use memres::{SyncResource, layout};
/// let mr = memres::per_device::current_resource()?; // a `Cuda` resource unless one was set
/// let l = layout(1 << 20)?;
/// let p = mr.allocate_sync(l)?;
/// // SAFETY: allocated just above with `l`.
/// unsafe { mr.deallocate_sync(p, l) };
/// # Ok::<(), memres::Error>(())
/// ```
pub fn current_resource() -> Result<AnyResource<Device>, Error> {
    per_device_resource(DeviceId::current()?)
}

/// The resource of `device`; a [`Cuda`](crate::upstream::Cuda) resource for it is made on
/// first use if none was set.
pub fn per_device_resource(device: DeviceId) -> Result<AnyResource<Device>, Error> {
    map().get_or_make(device, || make_default(device))
}

/// Makes `resource` the current device's resource; returns the one it replaces (`None`
/// where none had been made or set yet).
///
/// The resource must allocate on the current device: memres cannot check that.
pub fn set_current_resource(
    resource: AnyResource<Device>,
) -> Result<Option<AnyResource<Device>>, Error> {
    Ok(set_per_device_resource(DeviceId::current()?, resource))
}

/// Makes `resource` the resource of `device`; returns the one it replaces.
pub fn set_per_device_resource(
    device: DeviceId,
    resource: AnyResource<Device>,
) -> Option<AnyResource<Device>> {
    map().set(device, resource)
}

/// Builds a resource for each of `devices` with `make` and installs them as those devices'
/// resources in one step: RMM's `rmm.reinitialize(pool_allocator=True, devices=[0, 1])`.
/// Returns the resources replaced, in the order of `devices`.
///
/// All or nothing: every resource is built first (each call to `make` gets its device,
/// and should build on it, e.g. `Cuda::on(device)`); if one fails, those already built are
/// dropped (giving their memory back), nothing is installed, and that error is returned.
/// The installation itself takes the map's lock once, so no reader sees some devices
/// set up and others not. A device listed twice is [`Error::InvalidArgument`], before
/// anything is built.
/// [`DeviceId::all`] lists every device.
///
/// ```no_run
/// use memres::device::DeviceId;
/// use memres::per_device::set_per_device_resources;
/// use memres::{Cuda, PoolConfig, ResourceExt};
///
/// // A statistics-counted pool on every GPU, 1 GiB to start with.
/// set_per_device_resources(DeviceId::all()?, |device| {
///     let pool = Cuda::on(device)?.pool(PoolConfig::new().initial_size(1 << 30))?;
///     Ok(pool.with_statistics())
/// })?;
/// # Ok::<(), memres::Error>(())
/// ```
pub fn set_per_device_resources<R>(
    devices: impl IntoIterator<Item = DeviceId>,
    mut make: impl FnMut(DeviceId) -> Result<R, Error>,
) -> Result<Vec<Option<AnyResource<Device>>>, Error>
where
    R: Resource + Send + Sync + 'static,
    R::Properties: Contains<Device>,
{
    let devices: Vec<DeviceId> = devices.into_iter().collect();
    for (i, device) in devices.iter().enumerate() {
        if devices[..i].contains(device) {
            return Err(Error::invalid_argument(format!(
                "device {device} is listed twice"
            )));
        }
    }
    let built = devices
        .into_iter()
        .map(|device| Ok((device, AnyResource::new(make(device)?))))
        .collect::<Result<Vec<_>, Error>>()?;
    Ok(map().set_all(built))
}

/// Puts the current device back to its initial resource (a fresh `Cuda` resource, made on
/// next use); returns the one removed.
pub fn reset_current_resource() -> Result<Option<AnyResource<Device>>, Error> {
    Ok(reset_per_device_resource(DeviceId::current()?))
}

/// Puts `device` back to its initial resource; returns the one removed.
pub fn reset_per_device_resource(device: DeviceId) -> Option<AnyResource<Device>> {
    map().reset(device)
}

/// Drops every per-device resource; called from the exit handler, after the exiting flag
/// is set. Never unwinds (it runs inside an `extern "C"` callback).
fn drop_all_at_exit() {
    let _ = std::panic::catch_unwind(|| {
        if let Some(map) = MAP.get() {
            drop(map.take_all());
        }
    });
}

/// loom models of the map protocol: `RUSTFLAGS="--cfg memres_loom" cargo test --lib loom_`.
#[cfg(all(test, memres_loom))]
mod loom_tests {
    use std::alloc::Layout;
    use std::ptr::NonNull;

    use super::*;
    use crate::resource::{Resource, SyncResource};
    use crate::stream::StreamRef;
    use crate::sync::Arc;
    use crate::sync::atomic::{AtomicUsize, Ordering};

    /// A stand-in for a device resource: never allocates, tells instances apart by id.
    #[derive(Debug, PartialEq)]
    struct StandIn(u32);

    // SAFETY: it never hands out memory (every allocation fails).
    unsafe impl SyncResource for StandIn {
        type Properties = Device;
        fn allocate_sync(&self, l: Layout) -> Result<NonNull<u8>, Error> {
            Err(Error::out_of_memory(l.size()))
        }
        unsafe fn deallocate_sync(&self, _: NonNull<u8>, _: Layout) {}
    }

    // SAFETY: as above.
    unsafe impl Resource for StandIn {
        fn allocate(&self, _: StreamRef<'_>, l: Layout) -> Result<NonNull<u8>, Error> {
            Err(Error::out_of_memory(l.size()))
        }
        unsafe fn deallocate(&self, _: StreamRef<'_>, _: NonNull<u8>, _: Layout) {}
    }

    fn any(id: u32) -> AnyResource<Device> {
        AnyResource::new(StandIn(id))
    }

    fn id(r: &AnyResource<Device>) -> u32 {
        r.downcast_ref::<StandIn>().unwrap().0
    }

    const DEV: DeviceId = DeviceId::new(0);

    #[test]
    fn loom_the_default_is_made_once_when_two_threads_race_for_it() {
        loom::model(|| {
            let map = Arc::new(DeviceMap::new());
            let made = Arc::new(AtomicUsize::new(0));
            let get = |map: &DeviceMap, made: &AtomicUsize| {
                map.get_or_make(DEV, || {
                    made.fetch_add(1, Ordering::Relaxed);
                    Ok(any(9))
                })
                .unwrap()
            };
            let (m2, made2) = (map.clone(), made.clone());
            let t = loom::thread::spawn(move || get(&m2, &made2));
            let mine = get(&map, &made);
            let theirs = t.join().unwrap();
            assert_eq!(made.load(Ordering::Relaxed), 1, "made exactly once");
            assert_eq!(mine, theirs, "both threads got the one resource");
        });
    }

    #[test]
    fn loom_set_get_and_reset_see_a_consistent_slot() {
        loom::model(|| {
            let map = Arc::new(DeviceMap::new());
            assert!(map.set(DEV, any(1)).is_none());
            let m2 = map.clone();
            let setter = loom::thread::spawn(move || {
                let previous = m2.set(DEV, any(2)).map(|r| id(&r));
                // Either the first resource, or none if the reset ran first.
                assert!(matches!(previous, Some(1) | None), "{previous:?}");
            });
            let seen = id(&map.get_or_make(DEV, || Ok(any(3))).unwrap());
            assert!(matches!(seen, 1..=3), "{seen}");
            let removed = map.reset(DEV).map(|r| id(&r));
            setter.join().unwrap();
            let last = map.reset(DEV).map(|r| id(&r));
            // Whatever interleaving: every set is observed by exactly one remover, and
            // the map ends empty.
            match (removed, last) {
                (Some(_), Some(2)) | (Some(2), None) => {}
                other => panic!("inconsistent slot: {other:?}"),
            }
            assert!(map.reset(DEV).is_none());
        });
    }
}
