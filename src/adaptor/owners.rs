//! [`Owners`]: which member of a resource built over several (a [`Router`]'s members, a
//! [`Fallback`]'s tiers, the C ABI's segment pools) served a block, told by its address:
//! ranges that hold every block of a member (a virtual pool's reservation, kept for
//! good; a pool's segment, removed when it goes), else a record per block.
//!
//! [`Router`]: super::Router
//! [`Fallback`]: super::Fallback

use std::collections::BTreeMap;

use crate::addr_map::AddrMap;
use crate::error::Error;
use crate::sync::atomic::{AtomicUsize, Ordering};
use crate::sync::{AppendOnly, Mutex, lock};

/// An address range that holds every block of one member.
#[derive(Debug, Clone, Copy)]
struct Range {
    base: usize,
    len: usize,
    member: usize,
}

/// Which member served a block, told by its address (see the module). Members are
/// numbers given by whoever keeps the table: a [`Router`](super::Router)'s and a
/// [`Fallback`](super::Fallback)'s own, or the C ABI's table of which segment pool holds
/// an address (`memres_segment_pool_holding`, the PyTorch backend's frees of graph and
/// `MemPool` pools' blocks).
///
/// - **Ranges** are added once each and never removed, and read without a lock (an
///   append-only list): a free inside one costs a load and a compare per range.
/// - **Removable ranges** ([`insert_range`](Self::insert_range),
///   [`remove_range`](Self::remove_range)) are for members whose memory comes and goes
///   in pieces (a segment pool's segments): a map by first address under a lock, found
///   in a search of it; while none is listed a lookup reads one counter and skips the
///   lock. Each is disjoint from every other removable range.
/// - **Records** are for members whose blocks lie in no known range: each block's start
///   is noted at its allocation and taken by its free, under a lock; while no block is
///   recorded a lookup reads one counter and skips the lock, so a program whose blocks
///   all come from ranged members (or a default member, which is never recorded) pays
///   no lock on its frees.
///
/// The protocol of records (as `Fallback`'s was): a record is inserted, then the counter
/// raised (release); a free of that block comes after its allocation in the program, so
/// it reads the counter (acquire) nonzero and finds the record. Removable ranges keep
/// theirs the same way, their counter changed under their lock, by one, so that it
/// never reads 0 while a range is listed (a count set from the map's length outside the
/// lock could be overwritten by a stale one; model:
/// `loom_a_removable_range_is_found_beside_others_coming_and_going`).
#[derive(Default)]
pub struct Owners {
    ranges: AppendOnly<Range>,
    /// Removable ranges: first address -> (length, member).
    removable: Mutex<BTreeMap<usize, (usize, usize)>>,
    /// How many removable ranges are listed: 0 lets a lookup skip the lock.
    removable_count: AtomicUsize,
    /// Recorded blocks: start -> member.
    blocks: Mutex<AddrMap<usize>>,
    /// How many blocks are recorded: 0 lets a lookup skip the lock.
    recorded: AtomicUsize,
}

impl Owners {
    /// Notes that every block `member` hands out lies in `base..base + len`, and no other
    /// member's does (the caller's promise: a free there goes to `member`).
    pub fn add_range(&self, base: usize, len: usize, member: usize) {
        self.ranges.push(Range { base, len, member });
    }

    /// The member whose range (removable or not) holds `address`.
    #[inline]
    pub fn in_range(&self, address: usize) -> Option<usize> {
        self.ranges
            .iter()
            .find(|r| address.wrapping_sub(r.base) < r.len)
            .map(|r| r.member)
            .or_else(|| self.in_removable_range(address))
    }

    /// The member whose removable range holds `address`.
    #[inline]
    fn in_removable_range(&self, address: usize) -> Option<usize> {
        // A range listed before the block at `address` was handed out has been counted
        // (the caller's hand-off orders this after the insertion).
        if self.removable_count.load(Ordering::Acquire) == 0 {
            return None;
        }
        let map = lock(&self.removable);
        let (&base, &(len, member)) = map.range(..=address).next_back()?;
        (address - base < len).then_some(member)
    }

    /// Notes that every block `member` hands out from `base..base + len` is its own, until
    /// [`remove_range`](Self::remove_range) takes the range back (a pool's segment: added
    /// before any block of it is handed out, removed once none is live).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`], nothing listed, for an empty range, one past the end
    /// of the address space, or one that overlaps a removable range listed now.
    pub fn insert_range(&self, base: usize, len: usize, member: usize) -> Result<(), Error> {
        let end = base.checked_add(len).filter(|_| len > 0).ok_or_else(|| {
            Error::invalid_argument(format!(
                "Owners::insert_range: an empty or wrapping range of {len} bytes at {base:#x}"
            ))
        })?;
        let mut map = lock(&self.removable);
        let before = map.range(..end).next_back();
        if let Some((&b, &(l, _))) = before
            && b + l > base
        {
            return Err(Error::invalid_argument(format!(
                "Owners::insert_range: {len} bytes at {base:#x} overlap the range of {l} bytes \
                 at {b:#x}"
            )));
        }
        map.insert(base, (len, member));
        // Under the lock, after the insertion: see the type's protocol.
        self.removable_count.fetch_add(1, Ordering::Release);
        Ok(())
    }

    /// Takes back `member`'s removable range that starts at `base`: its length, or `None`
    /// (nothing removed) when no range of `member` starts there. No block of it may be
    /// looked up any more (the caller's promise: none is live).
    pub fn remove_range(&self, base: usize, member: usize) -> Option<usize> {
        let mut map = lock(&self.removable);
        let len = match map.get(&base) {
            Some(&(len, m)) if m == member => len,
            _ => return None,
        };
        map.remove(&base);
        // Under the lock: see the type's protocol.
        self.removable_count.fetch_sub(1, Ordering::Relaxed);
        Some(len)
    }

    /// How many removable ranges are listed now.
    pub fn removable_ranges(&self) -> usize {
        self.removable_count.load(Ordering::Relaxed)
    }

    /// Every range that is never removed, as `(base, len, member)`, in the order they
    /// were added.
    pub fn ranges(&self) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
        self.ranges.iter().map(|r| (r.base, r.len, r.member))
    }

    /// Notes that the block starting at `address` is `member`'s (a member without a
    /// range); before the block is handed out.
    pub fn record(&self, address: usize, member: usize) {
        lock(&self.blocks).insert(address, member);
        // After the insertion: a free that reads the count nonzero finds the block.
        self.recorded.fetch_add(1, Ordering::Release);
    }

    /// The member that served the live block at `address`, by range or record, the
    /// record kept.
    pub fn owner(&self, address: usize) -> Option<usize> {
        self.in_range(address).or_else(|| {
            if self.recorded.load(Ordering::Acquire) == 0 {
                return None;
            }
            lock(&self.blocks).get(&address).copied()
        })
    }

    /// The member that served the block at `address`, which the caller is freeing (so no
    /// other thread frees it meanwhile), by range or record, its record taken; `None`
    /// when neither knows it (a default member's block).
    #[inline]
    pub fn take(&self, address: usize) -> Option<usize> {
        if let Some(member) = self.in_range(address) {
            return Some(member);
        }
        // The block's allocation happened before its free (the caller's contract hands
        // the pointer over with that order), so a recorded block has been counted.
        if self.recorded.load(Ordering::Acquire) == 0 {
            return None;
        }
        let member = lock(&self.blocks).remove(&address);
        if member.is_some() {
            self.recorded.fetch_sub(1, Ordering::Relaxed);
        }
        member
    }

    /// How many blocks are recorded now.
    pub fn recorded(&self) -> usize {
        self.recorded.load(Ordering::Relaxed)
    }
}

impl std::fmt::Debug for Owners {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Owners")
            .field("ranges", &self.ranges().count())
            .field("removable_ranges", &self.removable_ranges())
            .field("recorded", &self.recorded())
            .finish()
    }
}

#[cfg(all(test, not(memres_loom)))]
mod tests {
    use super::*;

    /// A range answers for every address in it and none outside, records for their
    /// block's start only, and a free takes a record once.
    #[test]
    fn ranges_and_records_tell_the_member() {
        let owners = Owners::default();
        owners.add_range(0x10_000, 0x1000, 1);
        owners.add_range(0x20_000, 0x1000, 2);
        assert_eq!(owners.in_range(0x10_000), Some(1));
        assert_eq!(owners.in_range(0x10_fff), Some(1));
        assert_eq!(owners.in_range(0x11_000), None);
        assert_eq!(owners.in_range(0x0_ffff), None);
        assert_eq!(owners.take(0x20_800), Some(2), "a range is never taken");
        assert_eq!(owners.owner(0x20_800), Some(2));
        assert_eq!(owners.take(0x50_000), None, "nothing recorded: no lock");
        owners.record(0x50_000, 3);
        assert_eq!(owners.recorded(), 1);
        assert_eq!(owners.owner(0x50_000), Some(3));
        assert_eq!(owners.owner(0x50_010), None, "a record is for the start");
        assert_eq!(owners.take(0x50_000), Some(3));
        assert_eq!(owners.take(0x50_000), None, "taken once");
        assert_eq!(owners.recorded(), 0);
        assert_eq!(
            owners.ranges().collect::<Vec<_>>(),
            [(0x10_000, 0x1000, 1), (0x20_000, 0x1000, 2)]
        );
    }

    /// Removable ranges answer for their addresses until removed, overlaps and empty
    /// ranges are refused with nothing listed, and ranges that never go come first.
    #[test]
    fn removable_ranges_come_and_go() {
        let owners = Owners::default();
        assert_eq!(owners.in_range(0x10_000), None, "none listed: no lock");
        owners.insert_range(0x10_000, 0x1000, 1).unwrap();
        owners.insert_range(0x12_000, 0x1000, 2).unwrap();
        owners.insert_range(0x11_000, 0x1000, 3).unwrap(); // between, touching both
        assert_eq!(owners.removable_ranges(), 3);
        assert_eq!(owners.in_range(0x10_fff), Some(1));
        assert_eq!(owners.in_range(0x11_000), Some(3));
        assert_eq!(owners.owner(0x12_800), Some(2));
        assert_eq!(owners.take(0x12_800), Some(2), "a range is never taken");
        assert_eq!(owners.in_range(0x13_000), None);
        assert_eq!(owners.in_range(0xf_fff), None);
        for (base, len) in [(0x10_800, 0x1000), (0xf_800, 0x1000), (0x12_fff, 1)] {
            assert!(
                matches!(
                    owners.insert_range(base, len, 9),
                    Err(Error::InvalidArgument(_))
                ),
                "{base:#x}+{len:#x} overlaps"
            );
        }
        for (base, len) in [(0x20_000, 0), (usize::MAX - 10, 0x100)] {
            assert!(
                owners.insert_range(base, len, 9).is_err(),
                "{base:#x}+{len:#x}"
            );
        }
        assert_eq!(owners.removable_ranges(), 3, "nothing refused was listed");
        assert_eq!(owners.remove_range(0x11_000, 1), None, "member 3's");
        assert_eq!(owners.remove_range(0x11_000, 3), Some(0x1000));
        assert_eq!(owners.remove_range(0x11_000, 3), None, "removed once");
        assert_eq!(owners.in_range(0x11_800), None);
        assert_eq!(owners.in_range(0x10_800), Some(1));
        owners.add_range(0x10_000, 0x800, 7);
        assert_eq!(owners.in_range(0x10_100), Some(7), "a lasting range first");
        assert_eq!(owners.remove_range(0x10_000, 1), Some(0x1000));
        assert_eq!(owners.remove_range(0x12_000, 2), Some(0x1000));
        assert_eq!(owners.removable_ranges(), 0);
        assert_eq!(owners.in_range(0x12_800), None);
        assert_eq!(owners.ranges().count(), 1, "the lasting range stays");
    }
}

#[cfg(all(test, memres_loom))]
mod loom_models {
    use super::*;
    use crate::sync::Arc;
    use crate::sync::atomic::AtomicBool;
    use loom::thread;

    /// A range listed on one thread, whose block another thread frees (it learns of the
    /// block through the program, here a flag), while a third lists and removes a range
    /// of its own: the free finds the first range's member. Fails if the count of
    /// removable ranges is set from the map's length after the lock is let go: a stale 0
    /// then hides a listed range.
    #[test]
    fn loom_a_removable_range_is_found_beside_others_coming_and_going() {
        loom::model(|| {
            let owners = Arc::new(Owners::default());
            let handed = Arc::new(AtomicBool::new(false));
            let pool = {
                let (owners, handed) = (Arc::clone(&owners), Arc::clone(&handed));
                thread::spawn(move || {
                    owners.insert_range(0x1000, 0x1000, 1).unwrap();
                    handed.store(true, Ordering::Release); // hands out 0x1800
                })
            };
            let other = {
                let owners = Arc::clone(&owners);
                thread::spawn(move || {
                    owners.insert_range(0x4000, 0x1000, 2).unwrap();
                    assert_eq!(owners.remove_range(0x4000, 2), Some(0x1000));
                })
            };
            let freer = {
                let (owners, handed) = (Arc::clone(&owners), Arc::clone(&handed));
                thread::spawn(move || {
                    if handed.load(Ordering::Acquire) {
                        assert_eq!(owners.in_range(0x1800), Some(1), "the free finds it");
                    }
                })
            };
            pool.join().unwrap();
            other.join().unwrap();
            freer.join().unwrap();
            assert_eq!(owners.in_range(0x1800), Some(1));
            assert_eq!(owners.in_range(0x4800), None);
            assert_eq!(owners.removable_ranges(), 1);
        });
    }
}
