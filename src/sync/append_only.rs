//! [`AppendOnly`]: a list that only grows, read without a lock while one writer at a time
//! appends (the address router's members and ranges: read on every free, added to a few
//! times in a program's life).
//!
//! Each entry is boxed and its slot, a pointer, is set once; slots come in blocks, block
//! `k` holding `FIRST << k` slots, each block made once, when the first entry that falls in
//! it is pushed. Nothing moves or is freed before the list drops, so a reader holds a
//! plain `&T` for as long as it borrows the list. The blocks' sizes double, so the list
//! never runs out of room before memory does.
//!
//! Protocol: a push, under the list's lock, makes the block if needed, stores the entry's
//! pointer, then the length (release): the length publishes all of it. A reader loads
//! the length (acquire) and reads only entries under it, so an entry it reaches is seen
//! whole; the block and slot pointers are atomics only because a push writes other slots
//! of the same blocks meanwhile. An entry pushed before the reader learnt of it (through
//! the program: a block handed out after its member was pushed) is under the length the
//! reader loads. Model: `loom_a_reader_sees_each_entry_whole_or_not_at_all` (fails if the
//! length is stored or loaded with `Relaxed`).

use std::ptr;

use super::atomic::{AtomicPtr, AtomicUsize, Ordering};
use super::{Mutex, lock};

/// Slots of the first block; block `k` has `FIRST << k`.
const FIRST: usize = 8;

/// How many blocks: `FIRST * (2^BLOCKS - 1)` slots, about 8.8e12, whose last block alone
/// (64 TiB of slots) is past any memory: a push runs out of memory (and the process ends,
/// as on any failed `Box`) before it runs out of blocks.
const BLOCKS: usize = 40;

/// See the module.
pub(crate) struct AppendOnly<T> {
    /// Block `k`: a leaked `Box<[AtomicPtr<T>]>` of `FIRST << k` slots (its first
    /// element's address), null until made.
    blocks: [AtomicPtr<AtomicPtr<T>>; BLOCKS],
    /// Entries pushed, each stored before the length that counts it.
    len: AtomicUsize,
    /// Held by a push: one writer at a time.
    push: Mutex<()>,
}

// SAFETY: the list hands out `&T` to any thread (needs `T: Sync`) and drops its entries
// on the thread that drops it (needs `T: Send`); its own fields are atomics and a mutex.
unsafe impl<T: Send + Sync> Sync for AppendOnly<T> {}
// SAFETY: as above: moving the list moves its entries' ownership.
unsafe impl<T: Send + Sync> Send for AppendOnly<T> {}

impl<T> Default for AppendOnly<T> {
    fn default() -> Self {
        AppendOnly {
            blocks: std::array::from_fn(|_| AtomicPtr::new(ptr::null_mut())),
            len: AtomicUsize::new(0),
            push: Mutex::new(()),
        }
    }
}

/// The block of entry `index` and the entry's place in it.
fn place(index: usize) -> (usize, usize) {
    // Block k starts at FIRST * (2^k - 1).
    let k = (usize::BITS - 1 - (index / FIRST + 1).leading_zeros()) as usize;
    (k, index - FIRST * ((1 << k) - 1))
}

impl<T> AppendOnly<T> {
    /// How many entries the list has now.
    pub(crate) fn len(&self) -> usize {
        self.len.load(Ordering::Acquire)
    }

    /// Appends `value` and returns its index and the entry.
    pub(crate) fn push(&self, value: T) -> (usize, &T) {
        let _one_writer = lock(&self.push);
        let index = self.len.load(Ordering::Relaxed);
        let (k, at) = place(index);
        let mut block = self.blocks[k].load(Ordering::Relaxed);
        if block.is_null() {
            let slots: Box<[AtomicPtr<T>]> = (0..FIRST << k)
                .map(|_| AtomicPtr::new(ptr::null_mut()))
                .collect();
            block = Box::into_raw(slots).cast::<AtomicPtr<T>>();
            self.blocks[k].store(block, Ordering::Relaxed);
        }
        // SAFETY: `block` is block k, made above or by an earlier push (never freed before
        // the list drops), with `FIRST << k` slots, and `at` is below that (`place`).
        let slot = unsafe { &*block.add(at) };
        let entry = Box::into_raw(Box::new(value));
        slot.store(entry, Ordering::Relaxed);
        // Publishes the block, the slot and the entry (see the module).
        self.len.store(index + 1, Ordering::Release);
        // SAFETY: the box leaked above, never changed, freed only when the list drops.
        (index, unsafe { &*entry })
    }

    /// The entry at `index`, if the list has one there.
    pub(crate) fn get(&self, index: usize) -> Option<&T> {
        if index >= self.len() {
            return None;
        }
        self.entry(index)
    }

    /// The entries, in the order they were pushed (those pushed while the walk runs may
    /// be left out): one load of the length, then one of each block and slot.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &T> {
        (0..self.len()).filter_map(|i| self.entry(i))
    }

    /// The entry at `index`, below a length this thread loaded (acquire).
    fn entry(&self, index: usize) -> Option<&T> {
        let (k, at) = place(index);
        // Both ordered after their stores by the length's acquire (see the module).
        let block = self.blocks[k].load(Ordering::Relaxed);
        if block.is_null() {
            return None; // not reached: the block is stored before the length counting it
        }
        // SAFETY: a non-null block has `FIRST << k` slots and lives until the list drops;
        // `at` is below that.
        let entry = unsafe { &*block.add(at) }.load(Ordering::Relaxed);
        // SAFETY: a non-null slot under the length holds a leaked box, written before the
        // length was stored (release; loaded by the caller with acquire), never changed,
        // and freed only when the list drops, which `&self` rules out meanwhile.
        unsafe { entry.as_ref() }
    }
}

impl<T> Drop for AppendOnly<T> {
    fn drop(&mut self) {
        for (k, block) in self.blocks.iter_mut().enumerate() {
            let block = block.load(Ordering::Relaxed);
            if block.is_null() {
                continue;
            }
            // SAFETY: a non-null block is the leaked boxed slice of `FIRST << k` slots
            // that a push made; `&mut self`: no reader is left.
            let slots = unsafe { Box::from_raw(ptr::slice_from_raw_parts_mut(block, FIRST << k)) };
            for slot in slots.iter() {
                let entry = slot.load(Ordering::Relaxed);
                if !entry.is_null() {
                    // SAFETY: a non-null slot holds the box a push leaked, freed once here.
                    drop(unsafe { Box::from_raw(entry) });
                }
            }
        }
    }
}

#[cfg(all(test, not(memres_loom)))]
mod tests {
    use super::*;

    /// Indices map to blocks of doubling size, with no gap and no overlap.
    #[test]
    fn places_tile_the_blocks() {
        let mut expected = (0, 0);
        for index in 0..10_000 {
            assert_eq!(place(index), expected, "index {index}");
            expected.1 += 1;
            if expected.1 == FIRST << expected.0 {
                expected = (expected.0 + 1, 0);
            }
        }
        let last = FIRST * ((1 << BLOCKS) - 1) - 1;
        assert_eq!(place(last), (BLOCKS - 1, (FIRST << (BLOCKS - 1)) - 1));
    }

    /// Entries are kept in order across blocks and dropped once with the list.
    #[test]
    fn entries_are_kept_in_order_and_dropped_once() {
        let dropped = std::sync::Arc::new(());
        {
            let list = AppendOnly::default();
            for i in 0..100usize {
                assert_eq!(list.push((i, std::sync::Arc::clone(&dropped))).0, i);
            }
            assert_eq!(list.len(), 100);
            assert!(list.iter().map(|(i, _)| *i).eq(0..100));
            assert_eq!(list.get(57).map(|(i, _)| *i), Some(57));
            assert!(list.get(100).is_none());
            assert_eq!(std::sync::Arc::strong_count(&dropped), 101);
        }
        assert_eq!(
            std::sync::Arc::strong_count(&dropped),
            1,
            "each dropped once"
        );
    }
}

#[cfg(all(test, memres_loom))]
mod loom_models {
    use super::*;
    use crate::sync::Arc;
    use crate::sync::cell::UnsafeCell;
    use loom::thread;

    /// An entry whose value loom tracks: written after it is made, before its push.
    struct Tracked(UnsafeCell<usize>);

    impl Tracked {
        fn new(value: usize) -> Tracked {
            let cell = UnsafeCell::new(0);
            // SAFETY: the cell is this thread's alone until it is pushed.
            cell.get_mut().with(|p| unsafe { *p = value });
            Tracked(cell)
        }

        fn read(&self) -> usize {
            // SAFETY: entries are not written after their push (loom checks the order).
            self.0.get().with(|p| unsafe { *p })
        }
    }

    // SAFETY: the cell is written only before the entry is shared.
    unsafe impl Sync for Tracked {}

    /// One thread pushes entries across the first block's end (a new block is made)
    /// while another reads: the reader sees a prefix of the pushes, each entry's value
    /// whole (loom reports a read of the cell that is not ordered after its write). Fails
    /// if the length is stored or loaded with `Relaxed`.
    #[test]
    fn loom_a_reader_sees_each_entry_whole_or_not_at_all() {
        loom::model(|| {
            let list = Arc::new(AppendOnly::<Tracked>::default());
            for i in 0..FIRST - 1 {
                list.push(Tracked::new(i));
            }
            let writer = {
                let list = Arc::clone(&list);
                thread::spawn(move || {
                    list.push(Tracked::new(FIRST - 1));
                    list.push(Tracked::new(FIRST)); // the second block's first
                })
            };
            let reader = {
                let list = Arc::clone(&list);
                thread::spawn(move || {
                    let seen: Vec<usize> = list.iter().map(Tracked::read).collect();
                    assert!(seen.iter().copied().eq(0..seen.len()), "a prefix: {seen:?}");
                    if let Some(last) = list.get(FIRST) {
                        assert_eq!(last.read(), FIRST);
                    }
                })
            };
            writer.join().unwrap();
            reader.join().unwrap();
            assert_eq!(list.len(), FIRST + 1);
        });
    }
}
