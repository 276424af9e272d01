//! [`Owners`]: which member of a resource built over several (a [`Router`]'s members, a
//! [`Fallback`]'s tiers) served a block, told by its address: ranges that hold every
//! block of a member (a virtual pool's reservation), else a record per block.
//!
//! [`Router`]: super::Router
//! [`Fallback`]: super::Fallback

use crate::addr_map::AddrMap;
use crate::sync::atomic::{AtomicUsize, Ordering};
use crate::sync::{AppendOnly, Mutex, lock};

/// An address range that holds every block of one member.
#[derive(Debug, Clone, Copy)]
struct Range {
    base: usize,
    len: usize,
    member: usize,
}

/// See the module. Members are numbers given by the resource that keeps this table.
///
/// - **Ranges** are added once each and never removed, and read without a lock (an
///   [`AppendOnly`] list): a free inside one costs a load and a compare per range.
/// - **Records** are for members whose blocks lie in no known range: each block's start
///   is noted at its allocation and taken by its free, under a lock; while no block is
///   recorded a lookup reads one counter and skips the lock, so a program whose blocks
///   all come from ranged members (or a default member, which is never recorded) pays
///   no lock on its frees.
///
/// The protocol of records (as `Fallback`'s was): a record is inserted, then the counter
/// raised (release); a free of that block comes after its allocation in the program, so
/// it reads the counter (acquire) nonzero and finds the record.
#[derive(Default)]
pub(crate) struct Owners {
    ranges: AppendOnly<Range>,
    /// Recorded blocks: start -> member.
    blocks: Mutex<AddrMap<usize>>,
    /// How many blocks are recorded: 0 lets a lookup skip the lock.
    recorded: AtomicUsize,
}

impl Owners {
    /// Notes that every block `member` hands out lies in `base..base + len`, and no other
    /// member's does (the caller's promise: a free there goes to `member`).
    pub(crate) fn add_range(&self, base: usize, len: usize, member: usize) {
        self.ranges.push(Range { base, len, member });
    }

    /// The member whose range holds `address`.
    #[inline]
    pub(crate) fn in_range(&self, address: usize) -> Option<usize> {
        self.ranges
            .iter()
            .find(|r| address.wrapping_sub(r.base) < r.len)
            .map(|r| r.member)
    }

    /// Every range, as `(base, len, member)`, in the order they were added.
    pub(crate) fn ranges(&self) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
        self.ranges.iter().map(|r| (r.base, r.len, r.member))
    }

    /// Notes that the block starting at `address` is `member`'s (a member without a
    /// range); before the block is handed out.
    pub(crate) fn record(&self, address: usize, member: usize) {
        lock(&self.blocks).insert(address, member);
        // After the insertion: a free that reads the count nonzero finds the block.
        self.recorded.fetch_add(1, Ordering::Release);
    }

    /// The member that served the live block at `address`, by range or record, the
    /// record kept.
    pub(crate) fn owner(&self, address: usize) -> Option<usize> {
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
    pub(crate) fn take(&self, address: usize) -> Option<usize> {
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
    pub(crate) fn recorded(&self) -> usize {
        self.recorded.load(Ordering::Relaxed)
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
}
