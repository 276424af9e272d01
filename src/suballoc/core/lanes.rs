//! Lanes: the lists of one stream that threads sharing it use (lane 0 for all until they
//! run into each other, then up to 16 of their own; see `StreamKey::of_lane` and
//! `sync::threads`), so that they do not all wait for one lock. Lanes of one stream are one
//! stream to the device: memory moves between them without a wait. These are the moves
//! between the lanes of a pool's or an arena's lists ([`FreeList`]s).

use super::free_list::FreeList;
use super::list_table::{List, ListTable};
use crate::sync::atomic::Ordering;

/// A block of `size` bytes aligned to `align` from another lane of `own`'s stream, as
/// that lane's list has it (its caches not flushed): cheap enough to try before the
/// growth lock, so that threads sharing a stream whose lanes trade blocks do not queue
/// for that lock (16 threads on one stream on the H100 spent most of their time there).
pub(crate) fn take_fit(
    lists: &ListTable<FreeList>,
    own: &List<FreeList>,
    size: usize,
    align: usize,
) -> Option<usize> {
    lists
        .other_lanes(own)
        .filter(|lane| lane.holds_free.load(Ordering::Relaxed))
        .find_map(|lane| lane.state.lock().take(size, align))
}

/// Free memory of the other lanes of `own`'s stream: a fitting block from one lane
/// (flushed), else all their free memory moved into `own`'s list, where neighbours
/// coalesce (blocks freed by other threads, a producer on one thread and a consumer on
/// another, come back together). The caller holds the growth lock. With `release`, the
/// lanes so emptied give up the heap memory of their index and caches (an arena's: a
/// lane's index is about 8 KiB, and an arena's lists hold little once their superblock
/// is gone; a pool's lanes keep theirs for the blocks their threads free next).
pub(crate) fn take_all(
    lists: &ListTable<FreeList>,
    own: &List<FreeList>,
    size: usize,
    align: usize,
    release: bool,
) -> Option<usize> {
    let lanes: Vec<_> = lists
        .other_lanes(own)
        .filter(|s| s.holds_free.load(Ordering::Relaxed))
        .collect();
    for lane in &lanes {
        let mut s = lane.state.lock();
        let found = s.take(size, align).or_else(|| {
            s.flush();
            s.free.take(size, align)
        });
        if found.is_some() {
            return found;
        }
    }
    move_all(lists, own, &lanes, size, align, release)
}

/// All the free memory of `from` moved into `own`'s list, where neighbours coalesce, then
/// a block of `size` aligned to `align` from it; `None` (and nothing moved) when `from`
/// holds nothing. With `release`, the lists emptied give up the heap memory of their
/// index and caches. The caller holds the growth lock.
pub(crate) fn move_all(
    lists: &ListTable<FreeList>,
    own: &List<FreeList>,
    from: &[&List<FreeList>],
    size: usize,
    align: usize,
    release: bool,
) -> Option<usize> {
    let mut moved = Vec::new();
    for list in from {
        let mut s = list.state.lock();
        moved.extend(s.drain());
        if release {
            s.release_memory();
        }
        list.holds_free.store(false, Ordering::Relaxed);
    }
    if moved.is_empty() {
        return None;
    }
    let found = {
        let mut s = own.state.lock();
        s.absorb(moved);
        s.free.take(size, align)
    };
    lists.note_free(own);
    found
}
