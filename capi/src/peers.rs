//! Which devices may reach the memory of memres's in-place pools and driver pools
//! (`cuda_async`) on each device. A driver pool's memory, like a virtual leaf's, is not
//! reached through the contexts' peer access: each names its peers (`cuMemPoolSetAccess`,
//! which also makes the pool's growth map for them), by the rule below.
//!
//! A `CudaVirtual` leaf gives access to the devices it names on every map and unmap,
//! and each one costs those calls (on two H200s, `cuMemSetAccess` for two devices takes
//! about three times what one takes; `BENCHMARKS.md`). By default a leaf names every
//! device that can reach its memory, so that kernels on a peer work over memres's memory
//! as over `cudaMalloc` memory with the contexts' peer access on. A caller that tells
//! memres when a peer needs access (`memres_enable_peer_access`) can switch to peers on
//! demand (`memres_peer_access_on_demand`), as PyTorch's expandable segments add a peer:
//! the native PyTorch backend does, since torch's `enablePeerAccess` comes before its
//! first copy or kernel between two devices. Then a leaf starts with its own device, the
//! leaves that exist grant a peer when it is asked for, and those made later name it from
//! the start. `MEMRES_PEER_ACCESS=all` or `=on_demand` chooses for the whole process,
//! whatever the callers ask.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use mr::Error;
use mr::device::DeviceId;

/// Devices with an ordinal below this can be granted (one bit each).
pub(crate) const MAX_DEVICES: usize = 64;

/// Bit `p` of entry `d`: device `p` may reach the memory of device `d`.
static GRANTED: [AtomicU64; MAX_DEVICES] = [const { AtomicU64::new(0) }; MAX_DEVICES];

/// Records that `peer` may reach `device`'s memory, for the leaves made from now on
/// (the caller grants it on those that exist). Both ordinals are below [`MAX_DEVICES`]
/// ([`Error::InvalidArgument`] otherwise).
pub(crate) fn record(device: DeviceId, peer: DeviceId) -> Result<(), Error> {
    match (index(device), index(peer)) {
        (Some(d), Some(p)) => {
            GRANTED[d].fetch_or(1 << p, Ordering::AcqRel);
            Ok(())
        }
        _ => Err(Error::invalid_argument(format!(
            "peer access between {device} and {peer}: memres keeps it for ordinals below \
             {MAX_DEVICES}"
        ))),
    }
}

/// Set by `memres_peer_access_on_demand`: leaves made from then on name only the peers
/// granted (unless `MEMRES_PEER_ACCESS` says otherwise).
static ON_DEMAND: AtomicBool = AtomicBool::new(false);

/// Leaves made from now on give access to the peers granted only (see the module's
/// docs).
pub(crate) fn on_demand() {
    ON_DEMAND.store(true, Ordering::Release);
}

/// The peers a new leaf on `device` gives access to from the start: every device that
/// can reach its memory, or only those granted so far where peers come on demand.
pub(crate) fn of_new_leaf(device: DeviceId) -> Result<Vec<DeviceId>, Error> {
    if every_peer()? {
        return Ok(DeviceId::all()?
            .into_iter()
            .filter(|&peer| peer.can_access_peer(device).unwrap_or(false))
            .collect());
    }
    Ok(granted(device))
}

/// The peers granted access to `device`'s memory so far.
fn granted(device: DeviceId) -> Vec<DeviceId> {
    let bits = index(device).map_or(0, |d| GRANTED[d].load(Ordering::Acquire));
    (0..MAX_DEVICES)
        .filter(|&p| bits & (1 << p) != 0)
        .map(|p| DeviceId::new(p as i32))
        .collect()
}

/// Whether new leaves name every peer: `MEMRES_PEER_ACCESS` (read once) where set, else
/// unless a caller asked for peers on demand. A value other than `all` and `on_demand` is
/// [`Error::InvalidArgument`] (the stack is not built).
pub(crate) fn every_peer() -> Result<bool, Error> {
    static SET: OnceLock<Option<String>> = OnceLock::new();
    let set = SET.get_or_init(|| std::env::var("MEMRES_PEER_ACCESS").ok());
    choice(set.as_deref(), ON_DEMAND.load(Ordering::Acquire)).map_err(Error::invalid_argument)
}

/// Whether new leaves name every peer, given `MEMRES_PEER_ACCESS` (`set`) and whether a
/// caller asked for peers on demand: the variable wins.
fn choice(set: Option<&str>, on_demand: bool) -> Result<bool, String> {
    match set {
        Some("all") => Ok(true),
        Some("on_demand") => Ok(false),
        Some(other) => Err(format!(
            "MEMRES_PEER_ACCESS={other}: use `all` (every peer from the start) or `on_demand`"
        )),
        None => Ok(!on_demand),
    }
}

/// `device`'s place in [`GRANTED`], if it has one.
fn index(device: DeviceId) -> Option<usize> {
    usize::try_from(device.ordinal())
        .ok()
        .filter(|&i| i < MAX_DEVICES)
}

#[cfg(test)]
mod tests {
    use super::{MAX_DEVICES, choice, granted, record};
    use mr::Error;
    use mr::device::DeviceId;

    #[test]
    fn a_grant_is_kept_for_the_leaves_made_later_on_that_device_only() {
        // Devices no other test grants on (the table is the process's).
        let (on, by, other) = (DeviceId::new(41), DeviceId::new(7), DeviceId::new(42));
        assert!(granted(on).is_empty(), "none at first");
        record(on, by).unwrap();
        record(on, by).unwrap();
        record(on, DeviceId::new(63)).unwrap();
        assert_eq!(granted(on), [by, DeviceId::new(63)]);
        assert!(granted(other).is_empty());
        for (d, p) in [
            (DeviceId::new(MAX_DEVICES as i32), by),
            (on, DeviceId::new(-1)),
        ] {
            assert!(matches!(record(d, p), Err(Error::InvalidArgument(_))));
        }
        assert!(granted(DeviceId::new(-1)).is_empty());
    }

    #[test]
    fn the_variable_wins_over_the_callers_switch() {
        assert_eq!(choice(None, false), Ok(true), "every peer by default");
        assert_eq!(
            choice(None, true),
            Ok(false),
            "on demand once a caller asks"
        );
        for on_demand in [false, true] {
            assert_eq!(choice(Some("all"), on_demand), Ok(true));
            assert_eq!(choice(Some("on_demand"), on_demand), Ok(false));
            let bad = choice(Some("ALL"), on_demand).unwrap_err();
            assert!(bad.contains("MEMRES_PEER_ACCESS=ALL"), "{bad}");
        }
    }
}
