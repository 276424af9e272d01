//! The blocks `memres_malloc` handed out on a device and not yet freed, each with the
//! streams `memres_record_stream` (PyTorch's `Tensor.record_stream`) recorded for it,
//! which its free consumes.
//!
//! No layer under the C ABI can say cheaply whether an address starts a live block: the
//! pools keep their free blocks, not the live ones; a statistics layer counts bytes; an
//! arena, `fixed_size` and the CUDA leaves keep no table at all; `Tracking` is not part
//! of the stacks a spec builds. So the C ABI keeps its own, and keeps the recorded
//! streams in it: a record is part of its block's entry, which the block's free removes,
//! so it can never outlive the block (before, a record for an address inside a block or
//! for a freed block waited for whatever block started there later), and a record racing
//! the free either lands before the removal (the free takes it) or finds no block.
//!
//! Cost: one insert on every `memres_malloc` and one removal on every `memres_free`, each
//! under the lock of one of 64 shards (chosen by address; each on cache lines of its own,
//! so threads rarely meet) in std's hash table keyed by one multiply of the address.
//! About 30 ns the pair on the 2-core VM, one thread (`tests::live_blocks_cost`, beside
//! 22-37 ns for an in-place pool's own allocate and free there): a third the two lock
//! pairs, the rest the table (a hand-written linear-probing table measured 7 ns less the
//! pair; std's is kept). It is what a check of every record needs: no cheaper source of
//! "a live block starts here" exists below (above). PyTorch's pluggable allocator pays a
//! mutex and a map of its own per call around it. The counter the free path read before
//! (to skip the recorded streams' lock) is gone.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::PoisonError;

use crate::sync::{Mutex, MutexGuard};

/// Shards of the table: a power of two (fewer under loom, whose models stay small).
const SHARDS: usize = if cfg!(memres_loom) { 2 } else { 64 };

/// The streams recorded for a live block (raw handles): `None` for nearly every block,
/// which keeps an entry at 16 bytes.
type Streams = Option<Box<Vec<usize>>>;

type Map = HashMap<usize, Streams, BuildHasherDefault<AddressHasher>>;

/// One shard, alone on its cache lines (two: the adjacent-line prefetcher pairs them).
#[repr(align(128))]
#[derive(Default)]
struct Shard(Mutex<Map>);

/// Per device: the start address of every live block of `memres_malloc`, with the
/// streams recorded for it.
pub(crate) struct LiveBlocks {
    shards: Box<[Shard]>,
}

impl Default for LiveBlocks {
    fn default() -> Self {
        LiveBlocks {
            shards: (0..SHARDS).map(|_| Shard::default()).collect(),
        }
    }
}

impl LiveBlocks {
    /// The locked shard that holds `address`, if it is live.
    fn shard(&self, address: usize) -> MutexGuard<'_, Map> {
        // Bits 32.. of the hash: the table indexes by the low bits and tags by the top 7.
        let i = (fold(address as u64) >> 32) as usize % SHARDS;
        self.shards[i]
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// A block `memres_malloc` handed out at `address`: live, with no stream recorded.
    pub(crate) fn insert(&self, address: usize) {
        // An entry already there (a block at this address freed around the C ABI) is
        // replaced: its streams are not the new block's.
        self.shard(address).insert(address, None);
    }

    /// Records that work on `stream` (a raw handle) uses the live block that starts at
    /// `address`. False, and nothing recorded, when no live block starts there.
    #[must_use]
    pub(crate) fn record(&self, address: usize, stream: usize) -> bool {
        let mut map = self.shard(address);
        let Some(streams) = map.get_mut(&address) else {
            return false;
        };
        let streams = streams.get_or_insert_with(Box::default);
        if !streams.contains(&stream) {
            streams.push(stream);
        }
        true
    }

    /// The block at `address` is being freed: it is no longer live. Returns the streams
    /// recorded for it, if any (none too for an address memres did not hand out).
    #[inline]
    pub(crate) fn remove(&self, address: usize) -> Option<Vec<usize>> {
        let streams = self.shard(address).remove(&address)?;
        streams.map(|s| *s)
    }

    /// Whether a live block starts at `address`.
    #[cfg(test)]
    pub(crate) fn is_live(&self, address: usize) -> bool {
        self.shard(address).contains_key(&address)
    }
}

/// `x` times a 64-bit odd constant, the 128-bit product's halves folded: every bit of
/// `x` reaches both the low and the high bits (blocks are aligned, so an address's low
/// bits alone say nothing).
#[inline]
fn fold(x: u64) -> u64 {
    let m = u128::from(x) * 0x9e37_79b9_7f4a_7c15;
    (m as u64) ^ ((m >> 64) as u64)
}

/// The table's hasher: [`fold`] of the address.
#[derive(Default)]
struct AddressHasher(u64);

impl Hasher for AddressHasher {
    fn write(&mut self, bytes: &[u8]) {
        // Keys are `usize`s (`write_usize`); any other bytes are folded in one by one.
        for &b in bytes {
            self.0 = fold(self.0 ^ u64::from(b));
        }
    }

    #[inline]
    fn write_usize(&mut self, n: usize) {
        self.0 = fold(n as u64);
    }

    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
}

#[cfg(all(test, not(memres_loom)))]
mod tests {
    use super::*;

    #[test]
    fn only_a_live_blocks_start_takes_a_record_and_its_free_takes_it_once() {
        let live = LiveBlocks::default();
        assert!(!live.record(0x1000, 7), "never handed out");
        assert_eq!(live.remove(0x1000), None);
        live.insert(0x1000);
        live.insert(0x2000);
        assert!(live.is_live(0x1000));
        assert!(!live.record(0x1100, 7), "inside the block");
        assert!(live.record(0x1000, 7));
        assert!(live.record(0x1000, 7));
        assert!(live.record(0x1000, 9));
        assert_eq!(live.remove(0x2000), None, "live, nothing recorded");
        assert!(!live.record(0x2000, 7), "freed");
        assert_eq!(live.remove(0x1000), Some(vec![7, 9]));
        assert_eq!(live.remove(0x1000), None);
        assert!(!live.is_live(0x1000));
        // A new block at a freed block's address starts with no stream.
        live.insert(0x1000);
        assert_eq!(live.remove(0x1000), None);
    }

    /// Aligned addresses, the way pools hand them out (256-byte steps, 2 MiB steps), use
    /// every shard.
    #[test]
    fn aligned_addresses_spread_over_the_shards() {
        for step in [256usize, 2 << 20] {
            let mut used = [0usize; SHARDS];
            for i in 0..64 * SHARDS {
                used[(fold((0x7f00_0000_0000 + i * step) as u64) >> 32) as usize % SHARDS] += 1;
            }
            assert!(used.iter().all(|&n| n > 16), "step {step}: {used:?}");
        }
    }
}
