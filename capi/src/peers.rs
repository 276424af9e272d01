//! Which devices may reach the memory of memres's in-place pools on each device.
//!
//! A `CudaVirtual` leaf gives access to the devices it names on every map and unmap,
//! and each one costs those calls (on two H200s, `cuMemSetAccess` for two devices takes
//! about three times what one takes; `BENCHMARKS.md`). So, as PyTorch's expandable
//! segments do, a leaf starts with its own device alone, and a peer is added when the
//! program asks for it (`memres_enable_peer_access`, which PyTorch's `enablePeerAccess`
//! reaches before its first copy or kernel between the two devices): the leaves that
//! exist grant it at once, those made later from the start. `MEMRES_PEER_ACCESS=all`
//! gives every peer-capable device access from the start instead.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

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

/// The peers a new leaf on `device` gives access to from the start: those granted so
/// far, or every device that can reach it under `MEMRES_PEER_ACCESS=all`.
pub(crate) fn of_new_leaf(device: DeviceId) -> Result<Vec<DeviceId>, Error> {
    if every_peer() {
        return Ok(DeviceId::all()?
            .into_iter()
            .filter(|&peer| peer.can_access_peer(device).unwrap_or(false))
            .collect());
    }
    let granted = index(device).map_or(0, |d| GRANTED[d].load(Ordering::Acquire));
    Ok((0..MAX_DEVICES)
        .filter(|&p| granted & (1 << p) != 0)
        .map(|p| DeviceId::new(p as i32))
        .collect())
}

/// `MEMRES_PEER_ACCESS=all`, read once.
fn every_peer() -> bool {
    static ALL: OnceLock<bool> = OnceLock::new();
    *ALL.get_or_init(|| std::env::var("MEMRES_PEER_ACCESS").is_ok_and(|v| v == "all"))
}

/// `device`'s place in [`GRANTED`], if it has one.
fn index(device: DeviceId) -> Option<usize> {
    usize::try_from(device.ordinal())
        .ok()
        .filter(|&i| i < MAX_DEVICES)
}

#[cfg(test)]
mod tests {
    use super::{MAX_DEVICES, of_new_leaf, record};
    use mr::Error;
    use mr::device::DeviceId;

    #[test]
    fn a_grant_reaches_the_leaves_made_later_on_that_device_only() {
        // Devices no other test grants on (the table is the process's).
        let (on, by, other) = (DeviceId::new(41), DeviceId::new(7), DeviceId::new(42));
        assert!(of_new_leaf(on).unwrap().is_empty(), "none at first");
        record(on, by).unwrap();
        record(on, by).unwrap();
        record(on, DeviceId::new(63)).unwrap();
        assert_eq!(of_new_leaf(on).unwrap(), [by, DeviceId::new(63)]);
        assert!(of_new_leaf(other).unwrap().is_empty());
        for (d, p) in [
            (DeviceId::new(MAX_DEVICES as i32), by),
            (on, DeviceId::new(-1)),
        ] {
            assert!(matches!(record(d, p), Err(Error::InvalidArgument(_))));
        }
        assert!(of_new_leaf(DeviceId::new(-1)).unwrap().is_empty());
    }
}
