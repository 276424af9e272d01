//! [`AddrMap`]: a hash map keyed by address, for the hot paths of the sub-allocators and
//! the adaptors that remember blocks (the pool's neighbour maps, `Tracking`'s live blocks).
//!
//! Open addressing with linear probing and backward-shift deletion (no tombstones, so a
//! map that sees millions of inserts and removes never slows down or needs a rehash to
//! clean up), at most half full (or a quarter: [`SparseAddrMap`]). Keys are addresses:
//! multiples of the alignment, so the hash is a multiply that carries every bit up to the
//! top bits the index is cut from.
//! A lookup is a multiply, a shift and, nearly always, one or two compares in one cache
//! line. Against std's `HashMap` (SwissTable, with a multiply-fold hasher) it cut the
//! instructions of `random` over `Pool<HostHeap>` by 13% and those `Tracking` adds on
//! top by 29% (callgrind, 3 x 200,000 ops, loop included).

/// Where an entry sits in an [`AddrMap`] (see [`AddrMap::find_slot`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Slot(usize);

/// The fewest slots a map at most a quarter full (or sparser: [`SparseAddrMap`]) has once
/// it holds anything; a map at most half full has half as many (4 would do, but maps of a
/// few entries are many: a stream list of a pool keeps a copy of the pool's chunk starts,
/// and 16 slots of 24 bytes were a third of what a list of a stream cost).
const MIN_SLOTS: usize = 16;

/// A map from addresses to `V` (see the module docs), at most one slot in `2^SPREAD`
/// full: half by default, an eighth for [`SparseAddrMap`]. At its fewest slots a map is
/// at most a quarter full however sparse it is otherwise, so that maps of a few entries
/// (a stream list's, of which a program may have thousands) cost no more than that.
pub(crate) struct AddrMap<V, const SPREAD: u32 = 1> {
    /// `None`: a free slot. An entry sits at its key's home slot or after it, with no
    /// free slot between (linear probing).
    slots: Vec<Option<(usize, V)>>,
    /// The number of entries.
    len: usize,
}

/// An [`AddrMap`] at most an eighth full (a quarter at its fewest slots), for maps on an
/// allocation path that change with nearly every call (a free list's neighbour maps): a
/// probe then nearly always ends at its first slot, so its branches are predicted
/// (`random` over `Pool<HostHeap>`: `BENCHMARKS.md`, "Speed against RMM"; an eighth
/// rather than a quarter, issue 51: on the 2-core VM 25 alternating runs each, 46.1 ->
/// 44.6 ns by the minimum, 46.6 -> 45.2 by the median, callgrind's simulated mispredicted
/// branches 1.95 M -> 1.78 M over 4 x 200,000 steps; a sixteenth gave 44.0 / 45.3 for
/// twice the slots again). It costs four times the slots of a half-full map (16 bytes
/// each for a free list's node numbers), which a free list's few hundred to few thousand
/// blocks afford; maps of live blocks (`Tracking`), which can hold millions, stay half
/// full.
pub(crate) type SparseAddrMap<V> = AddrMap<V, 3>;

impl<V, const SPREAD: u32> Default for AddrMap<V, SPREAD> {
    fn default() -> Self {
        AddrMap {
            slots: Vec::new(),
            len: 0,
        }
    }
}

impl<'a, V, const SPREAD: u32> IntoIterator for &'a AddrMap<V, SPREAD> {
    type Item = (&'a usize, &'a V);
    type IntoIter = std::iter::Map<
        std::iter::Flatten<std::slice::Iter<'a, Option<(usize, V)>>>,
        fn(&'a (usize, V)) -> (&'a usize, &'a V),
    >;

    fn into_iter(self) -> Self::IntoIter {
        let pair: fn(&'a (usize, V)) -> (&'a usize, &'a V) = |(k, v)| (k, v);
        self.slots.iter().flatten().map(pair)
    }
}

impl<V, const SPREAD: u32> FromIterator<(usize, V)> for AddrMap<V, SPREAD> {
    fn from_iter<I: IntoIterator<Item = (usize, V)>>(entries: I) -> Self {
        let mut map = AddrMap::default();
        for (k, v) in entries {
            map.insert(k, v);
        }
        map
    }
}

impl<V, const SPREAD: u32> AddrMap<V, SPREAD> {
    /// The number of entries.
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Removes every entry, and the slots with them: clearing costs what the entries do,
    /// not what the largest the map ever was does (lists are drained into others while
    /// they are large), and the map regrows with its next entries.
    pub(crate) fn clear(&mut self) {
        if self.len > 0 {
            self.slots = Vec::new();
            self.len = 0;
        }
    }

    /// Whether the map holds heap memory (slots, even with no entry in them).
    #[inline]
    pub(crate) fn holds_slots(&self) -> bool {
        self.slots.capacity() > 0
    }

    /// The entries, in no particular order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&usize, &V)> {
        self.into_iter()
    }

    /// The values, in no particular order.
    pub(crate) fn values(&self) -> impl Iterator<Item = &V> {
        self.iter().map(|(_, v)| v)
    }

    /// The home slot of `key` (the table is not empty).
    #[inline]
    fn home(&self, key: usize) -> usize {
        // Fibonacci hashing: the top bits of the product depend on every bit of the key,
        // the alignment's zero bits included. `slots.len()` is a power of two.
        let bits = self.slots.len().trailing_zeros();
        ((key as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (u64::BITS - bits)) as usize
    }

    /// The slot holding `key`, if any.
    #[inline]
    fn find(&self, key: usize) -> Option<usize> {
        if self.len == 0 {
            return None;
        }
        let mask = self.slots.len() - 1;
        let mut i = self.home(key);
        // The table is at most half full, so a free slot ends every probe.
        loop {
            match &self.slots[i] {
                Some((k, _)) if *k == key => return Some(i),
                Some(_) => i = (i + 1) & mask,
                None => return None,
            }
        }
    }

    /// The value of `key`.
    #[inline]
    pub(crate) fn get(&self, key: &usize) -> Option<&V> {
        let i = self.find(*key)?;
        self.slots[i].as_ref().map(|(_, v)| v)
    }

    /// Sets `key`'s value; returns the one it replaced.
    #[inline]
    pub(crate) fn insert(&mut self, key: usize, value: V) -> Option<V> {
        // At least one free slot ends every probe, and one doubling restores the bound.
        const { assert!(SPREAD >= 1 && SPREAD <= 4) };
        if !Self::fits(self.len + 1, self.slots.len()) {
            self.grow();
        }
        let mask = self.slots.len() - 1;
        let mut i = self.home(key);
        loop {
            match &mut self.slots[i] {
                Some((k, v)) if *k == key => return Some(std::mem::replace(v, value)),
                Some(_) => i = (i + 1) & mask,
                free @ None => {
                    *free = Some((key, value));
                    self.len += 1;
                    return None;
                }
            }
        }
    }

    /// Removes `key`'s entry; returns its value.
    #[inline(always)]
    pub(crate) fn remove(&mut self, key: &usize) -> Option<V> {
        let slot = self.find(*key)?;
        self.remove_at(Slot(slot))
    }

    /// Where `key`'s entry is, with its value: for a caller that looks a key up and may
    /// then remove it ([`remove_at`](Self::remove_at)) without a second probe. The slot
    /// is valid until the map next changes.
    #[inline]
    pub(crate) fn find_slot(&self, key: usize) -> Option<(Slot, &V)> {
        let i = self.find(key)?;
        self.slots[i].as_ref().map(|(_, v)| (Slot(i), v))
    }

    /// Removes the entry at `slot` (from [`find_slot`](Self::find_slot), with no change
    /// to the map since); returns its value.
    #[inline(always)]
    pub(crate) fn remove_at(&mut self, slot: Slot) -> Option<V> {
        let mut hole = slot.0;
        let (_, value) = self.slots.get_mut(hole)?.take()?;
        self.len -= 1;
        // Backward shift: entries after the hole that may live there (their home is not
        // between the hole and where they are) move up, so no probe meets a gap.
        let mask = self.slots.len() - 1;
        let mut i = hole;
        loop {
            i = (i + 1) & mask;
            let Some((k, _)) = &self.slots[i] else {
                return Some(value);
            };
            let from_home = i.wrapping_sub(self.home(*k)) & mask;
            let from_hole = i.wrapping_sub(hole) & mask;
            if from_home >= from_hole {
                self.slots[hole] = self.slots[i].take();
                hole = i;
            }
        }
    }

    /// Moves the entry at `slot` (from [`find_slot`](Self::find_slot), with no change to
    /// the map since) to `key`, which the map must not hold: a free list's block whose
    /// start or end moves (a cut, a merge with one neighbour). The entry count does not
    /// change, so, unlike a removal and an insert, there is no room to check and no key
    /// to compare on the way to the free slot.
    #[inline(always)]
    pub(crate) fn rekey(&mut self, slot: Slot, key: usize) {
        debug_assert!(self.find(key).is_none(), "{key:#x} is already in the map");
        let Some(value) = self.remove_at(slot) else {
            return;
        };
        // (At least one free slot: `remove_at` just made one.)
        let mask = self.slots.len() - 1;
        let mut i = self.home(key);
        while self.slots[i].is_some() {
            i = (i + 1) & mask;
        }
        self.slots[i] = Some((key, value));
        self.len += 1;
    }

    /// Whether `entries` entries may share `slots` slots: at most one slot in
    /// `2^SPREAD` full, or a quarter at [`MIN_SLOTS`] and below (see [`AddrMap`]).
    #[inline]
    fn fits(entries: usize, slots: usize) -> bool {
        let spread = if slots <= MIN_SLOTS {
            SPREAD.min(2)
        } else {
            SPREAD
        };
        entries << spread <= slots
    }

    /// Doubles the slots (or makes the first), more than once if the map then still
    /// lacks room for one more entry (past [`MIN_SLOTS`], a sparser map), and puts every
    /// entry back.
    #[cold]
    #[inline(never)]
    fn grow(&mut self) {
        let mut slots = (self.slots.len() * 2).max(MIN_SLOTS >> (2 - SPREAD.min(2)));
        while !Self::fits(self.len + 1, slots) {
            slots *= 2;
        }
        let old = std::mem::replace(&mut self.slots, (0..slots).map(|_| None).collect());
        self.len = 0;
        for (k, v) in old.into_iter().flatten() {
            self.insert(k, v);
        }
    }
}

#[cfg(all(test, not(memres_loom)))]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;

    /// A sparse map holds up to 4 entries in its first 16 slots (as a quarter-full map
    /// does: a stream list's few blocks cost no more), and past that stays at most an
    /// eighth full.
    #[test]
    fn a_sparse_map_is_a_quarter_full_at_its_fewest_slots_and_an_eighth_after() {
        let mut m: SparseAddrMap<u32> = AddrMap::default();
        for i in 0..4 {
            m.insert(256 * (i + 1), i as u32);
        }
        assert_eq!(m.slots.len(), MIN_SLOTS);
        m.insert(256 * 5, 4);
        assert_eq!(m.slots.len(), 64, "5 entries: 40 slots or more");
        for i in 5..200 {
            m.insert(256 * (i + 1), i as u32);
            assert!(m.len() * 8 <= m.slots.len());
        }
        for i in 0..200 {
            assert_eq!(m.get(&(256 * (i + 1))), Some(&(i as u32)));
        }
    }

    #[test]
    fn inserts_replaces_and_removes() {
        let mut m: AddrMap<_> = AddrMap::default();
        assert_eq!(m.get(&256), None);
        assert_eq!(m.remove(&256), None);
        assert_eq!(m.insert(256, 'a'), None);
        assert_eq!(m.insert(256, 'b'), Some('a'));
        assert_eq!(m.get(&256), Some(&'b'));
        assert!(m.get(&256).is_some());
        assert_eq!(m.len(), 1);
        assert_eq!(m.remove(&256), Some('b'));
        assert_eq!(m.len(), 0);
        assert!(m.get(&256).is_none());
        // Address 0 and the largest key are keys like any other.
        m.insert(0, 'z');
        m.insert(usize::MAX, 'm');
        assert_eq!((m.get(&0), m.get(&usize::MAX)), (Some(&'z'), Some(&'m')));
        m.clear();
        assert_eq!((m.len(), m.iter().count(), m.get(&0)), (0, 0, None));
    }

    /// Keys that all want the same home slot, removed from the middle of their run: the
    /// backward shift keeps every later one findable.
    #[test]
    fn a_removal_inside_a_run_of_collisions_keeps_the_run_findable() {
        let mut m: AddrMap<_> = AddrMap::default();
        m.insert(1, 0); // sizes the table
        let home = m.home(1 << 20);
        let same: Vec<usize> = (1..)
            .map(|k| k << 8)
            .filter(|&k| m.home(k) == home)
            .take(5)
            .collect();
        for (i, &k) in same.iter().enumerate() {
            m.insert(k, i);
        }
        assert_eq!(m.remove(&same[1]), Some(1));
        for (i, &k) in same.iter().enumerate() {
            assert_eq!(m.get(&k), (i != 1).then_some(&i), "key {k:#x}");
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(usize, u32),
        Remove(usize),
        /// Moves the first key's entry to the second key, if the first is held and the
        /// second is not.
        Rekey(usize, usize),
        Clear,
    }

    fn op() -> impl Strategy<Value = Op> {
        // Few distinct keys (so inserts replace and removes hit), multiples of 256 as
        // addresses are, and some around the top of the address space.
        let key = prop_oneof![
            (0usize..64).prop_map(|k| k << 8),
            (0usize..4).prop_map(|k| usize::MAX - k),
        ];
        prop_oneof![
            10 => (key.clone(), any::<u32>()).prop_map(|(k, v)| Op::Insert(k, v)),
            8 => key.clone().prop_map(Op::Remove),
            4 => (key.clone(), key).prop_map(|(k, to)| Op::Rekey(k, to)),
            1 => Just(Op::Clear),
        ]
    }

    /// Runs `ops` on an `AddrMap<_, SPREAD>` and on std's `HashMap`: every call returns
    /// what std's returns, and the maps end equal.
    fn check_against_std<const SPREAD: u32>(ops: Vec<Op>) -> Result<(), TestCaseError> {
        let mut ours = AddrMap::<u32, SPREAD>::default();
        let mut std_map = HashMap::new();
        for op in ops {
            match op {
                Op::Insert(k, v) => prop_assert_eq!(ours.insert(k, v), std_map.insert(k, v)),
                Op::Remove(k) => prop_assert_eq!(ours.remove(&k), std_map.remove(&k)),
                Op::Rekey(k, to) => {
                    if let Some((slot, _)) = ours.find_slot(k)
                        && !std_map.contains_key(&to)
                    {
                        ours.rekey(slot, to);
                        let v = std_map.remove(&k).expect("held by both");
                        std_map.insert(to, v);
                    }
                }
                Op::Clear => {
                    ours.clear();
                    std_map.clear();
                }
            }
            prop_assert_eq!(ours.len(), std_map.len());
            prop_assert!(AddrMap::<u32, SPREAD>::fits(ours.len(), ours.slots.len()));
        }
        for (k, v) in &std_map {
            prop_assert_eq!(ours.get(k), Some(v));
        }
        let mut listed: Vec<_> = ours.iter().map(|(&k, &v)| (k, v)).collect();
        let mut expected: Vec<_> = std_map.into_iter().collect();
        listed.sort_unstable();
        expected.sort_unstable();
        prop_assert_eq!(listed, expected);
        Ok(())
    }

    proptest! {
        /// Every sequence of operations leaves the map equal to std's `HashMap` after the
        /// same operations, each returning what std's returns.
        #[test]
        fn behaves_as_std_hash_map(ops in prop::collection::vec(op(), 0..400)) {
            check_against_std::<1>(ops)?;
        }

        /// The same for a quarter-full map and for the sparse map (an eighth), which also
        /// stay as sparse as they should.
        #[test]
        fn a_sparse_map_behaves_as_std_hash_map(ops in prop::collection::vec(op(), 0..400)) {
            check_against_std::<2>(ops.clone())?;
            check_against_std::<3>(ops)?;
        }
    }
}
