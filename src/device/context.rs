//! Primary contexts, and making one current for the length of a call.

use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::DeviceId;
use crate::driver::report;
use crate::error::Error;
use crate::platform::{Active, Platform};

/// Devices whose primary context is found without a lock.
const FAST_DEVICES: usize = 64;

/// A device's primary context, retained once for the life of the process (so the handle
/// never dangles), kept as an integer so that resources holding it are `Send + Sync`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Context {
    raw: usize,
    device: DeviceId,
}

impl Context {
    /// The primary context of `device`, retained on first use.
    ///
    /// The cache is a table of atomics for the first 64 devices, read without a lock, and
    /// a plain `std` mutex behind it taken the first time a device is seen; it is a cache
    /// (an entry goes from empty to its one value once), not a protocol to model-check.
    pub(crate) fn primary(device: DeviceId) -> Result<Context, Error> {
        // Lock-free for the first devices (containers look their context up on every
        // copy and drop): a non-zero entry is a context retained below, never released.
        static FAST: [AtomicUsize; FAST_DEVICES] = [const { AtomicUsize::new(0) }; FAST_DEVICES];
        static PRIMARY: Mutex<Option<HashMap<DeviceId, usize>>> = Mutex::new(None);
        let fast = usize::try_from(device.ordinal())
            .ok()
            .and_then(|i| FAST.get(i));
        if let Some(raw) = fast
            .map(|f| f.load(Ordering::Acquire))
            .filter(|&raw| raw != 0)
        {
            return Ok(Context { raw, device });
        }
        let dev = device.handle()?;
        let mut map = crate::sync::lock_std(&PRIMARY);
        let map = map.get_or_insert_with(HashMap::new);
        if let Some(&raw) = map.get(&device) {
            return Ok(Context { raw, device });
        }
        // The retain is never released: the context lives as long as the process.
        let ctx = Active::primary_context(dev)?;
        map.insert(device, ctx);
        if let Some(f) = fast {
            f.store(ctx, Ordering::Release);
        }
        Ok(Context { raw: ctx, device })
    }

    /// The context of the current device.
    pub(crate) fn current() -> Result<Context, Error> {
        Context::primary(DeviceId::current()?)
    }

    /// The primary context of the device that CUDA stream `raw` belongs to
    /// (`cuStreamGetCtx`). memres works with primary contexts throughout; a stream of
    /// another context of the same device maps to that device's primary context.
    pub(crate) fn of_stream(raw: usize) -> Result<Context, Error> {
        crate::driver::init()?;
        // SAFETY: the driver is initialised; `raw` names a live stream that is no default
        // stream (the promise of the `StreamRef` it came from).
        let dev = unsafe { Active::stream_device(raw) }?;
        Context::primary(DeviceId::new(dev))
    }

    /// Waits until all work on every stream of the context is complete
    /// (`cuCtxSynchronize`), with the context current for the call.
    pub(crate) fn synchronize(self) -> Result<(), Error> {
        let _current = bind(self)?;
        Active::synchronize_context()
    }

    pub(crate) fn device(self) -> DeviceId {
        self.device
    }

    fn raw(self) -> usize {
        self.raw
    }
}

/// Makes `ctx` current on this thread until the returned guard drops. Where it already is
/// current (the common case) this costs one `cuCtxGetCurrent` and nothing else.
#[inline]
pub(crate) fn bind(ctx: Context) -> Result<Bound, Error> {
    // `ctx` exists only once the driver is initialised.
    let current = Active::current_context()?;
    if current == ctx.raw() {
        return Ok(Bound {
            previous: None,
            thread: PhantomData,
        });
    }
    // SAFETY: `ctx` is a primary context retained for the life of the process.
    unsafe { Active::set_current_context(ctx.raw()) }?;
    // A thread with nothing current keeps `ctx` afterwards, so its next call takes the
    // fast path (the CUDA runtime likewise makes device 0 current on first use).
    Ok(Bound {
        previous: (current != 0).then_some(current),
        thread: PhantomData,
    })
}

/// Restores the context that was current before [`bind`] switched it.
#[must_use]
pub(crate) struct Bound {
    previous: Option<usize>,
    /// The current context is per thread: the guard must drop on the thread that made it.
    thread: PhantomData<*const ()>,
}

impl Drop for Bound {
    fn drop(&mut self) {
        if let Some(previous) = self.previous {
            // SAFETY: `previous` was current on this thread a moment ago, so it is a live
            // context (the thread that made it current keeps it alive while current).
            report("restoring the current context", unsafe {
                Active::set_current_context(previous)
            });
        }
    }
}

/// Makes a device current on this thread for a scope and restores the previous one when
/// dropped (RMM's `cuda_set_device_raii`). A thread that had no context current keeps the
/// device current afterwards, as the CUDA runtime would.
///
/// ```no_run
/// use memres::device::{DeviceGuard, DeviceId};
/// {
///     let _on_1 = DeviceGuard::new(DeviceId::new(1))?;
///     assert_eq!(DeviceId::current()?, DeviceId::new(1));
/// }
/// # Ok::<(), memres::Error>(())
/// ```
#[must_use = "the device is current only while the guard lives"]
pub struct DeviceGuard {
    _bound: Bound,
}

impl DeviceGuard {
    /// Makes `device` (its primary context) current until the guard drops.
    pub fn new(device: DeviceId) -> Result<Self, Error> {
        Ok(DeviceGuard {
            _bound: bind(Context::primary(device)?)?,
        })
    }
}

impl std::fmt::Debug for DeviceGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DeviceGuard")
    }
}
