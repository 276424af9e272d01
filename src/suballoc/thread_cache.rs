//! Per-thread caches ("magazines") of free fixed-size blocks: a free pushes onto the
//! calling thread's magazine for (resource, stream) and an allocation pops from it, with
//! no atomic operation at all. A magazine trades blocks with its stream's shared list in
//! batches (when it runs empty or overflows), and gives everything back when its thread
//! exits.
//!
//! Safety rests on one rule: a magazine's shard pointer is dereferenced only (1) inside a
//! call on the resource that owns it (the magazine is found by the owner's id, unique for
//! the life of the process, so the owner is alive and borrowed for the call), or (2) at
//! thread exit while holding the registry lock, after checking that the owner is still
//! registered; an owner leaves the registry (under that lock) before it frees anything.
//! Magazines of owners that are gone hold plain addresses that are never handed out.

use std::cell::RefCell;
use std::collections::HashSet;
use std::sync::PoisonError;
use std::sync::atomic::{AtomicU64, Ordering};

use super::shards::{Shard, StreamKey};
use crate::sync::Mutex;

// Owners alive now. Taken only when an owner comes or goes and when a thread exits.
// (Under loom, a lazy static, which each model execution builds afresh.)
#[cfg(not(memres_loom))]
static LIVE: Mutex<Option<HashSet<u64>>> = Mutex::new(None);
#[cfg(memres_loom)]
loom::lazy_static! {
    static ref LIVE: Mutex<Option<HashSet<u64>>> = Mutex::new(None);
}

/// Owner ids, never reused (they only need to be unique, so no model checks them).
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// A resource's identity for the caches, registered while it lives.
#[derive(Debug)]
pub(crate) struct Owner {
    id: u64,
    retired: bool,
}

impl Owner {
    pub(crate) fn new() -> Owner {
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        let mut live = LIVE.lock().unwrap_or_else(PoisonError::into_inner);
        live.get_or_insert_with(HashSet::new).insert(id);
        Owner { id, retired: false }
    }

    /// Leaves the registry: no thread's exit touches the owner's shards afterwards. The
    /// owner calls it first thing in its drop, before freeing anything.
    pub(crate) fn retire(&mut self) {
        if !self.retired {
            let mut live = LIVE.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(live) = live.as_mut() {
                live.remove(&self.id);
            }
            self.retired = true;
        }
    }
}

impl Drop for Owner {
    fn drop(&mut self) {
        self.retire();
    }
}

struct Magazine {
    owner: u64,
    key: StreamKey,
    shard: *const Shard<Vec<usize>>,
    blocks: Vec<usize>,
}

#[derive(Default)]
struct Magazines(Vec<Magazine>);

impl Drop for Magazines {
    fn drop(&mut self) {
        if self.0.iter().all(|m| m.blocks.is_empty()) {
            return;
        }
        let live = LIVE.lock().unwrap_or_else(PoisonError::into_inner);
        for m in self.0.drain(..) {
            if !m.blocks.is_empty() && live.as_ref().is_some_and(|l| l.contains(&m.owner)) {
                // SAFETY: the owner is registered and the registry is locked, so it has
                // not begun to drop (it retires first) and cannot until we unlock; its
                // shards live as long as it does.
                let shard = unsafe { &*m.shard };
                shard.state.lock().extend(m.blocks);
            }
        }
    }
}

/// A thread with this many magazines drops those of owners that are gone.
const PRUNE_AT: usize = 16;

/// Drops the magazines of owners that are gone (their blocks are only addresses).
fn prune(list: &mut Vec<Magazine>) {
    let live = LIVE.lock().unwrap_or_else(PoisonError::into_inner);
    list.retain(|m| live.as_ref().is_some_and(|l| l.contains(&m.owner)));
}

#[cfg(not(memres_loom))]
thread_local! {
    static MAGAZINES: RefCell<Magazines> = const { RefCell::new(Magazines(Vec::new())) };
}

#[cfg(memres_loom)]
loom::thread_local! {
    static MAGAZINES: RefCell<Magazines> = RefCell::new(Magazines(Vec::new()));
}

/// What a thread's exit does to its magazines, called by a loom model's thread as its
/// last act: loom's `join` returns before a thread's thread-locals are dropped, and its
/// lazy statics (the registry) are gone when the model's main thread ends, so a model
/// cannot leave the drop to the thread's exit.
#[cfg(memres_loom)]
pub(crate) fn exit_thread() {
    let magazines = MAGAZINES.with(|m| std::mem::take(&mut m.borrow_mut().0));
    drop(Magazines(magazines));
}

/// The calling thread's magazines for one resource, within one call on it.
pub(crate) struct Cache<'a> {
    pub(crate) owner: &'a Owner,
    /// Most blocks one magazine holds.
    pub(crate) capacity: usize,
}

impl Cache<'_> {
    /// Runs `f` on this thread's magazine for (owner, key), if the thread still has its
    /// magazines (not during its exit) and `f` finds or makes one.
    #[inline]
    fn with<R>(&self, key: StreamKey, f: impl FnOnce(&mut Vec<Magazine>, usize) -> R) -> Option<R> {
        MAGAZINES
            .try_with(|m| {
                let mut m = m.try_borrow_mut().ok()?;
                let list = &mut m.0;
                let at = list
                    .iter()
                    .position(|g| g.owner == self.owner.id && g.key == key)
                    .unwrap_or(usize::MAX);
                Some(f(list, at))
            })
            .ok()
            .flatten()
    }

    /// A block from the thread's magazine, if it has one.
    #[inline]
    pub(crate) fn pop(&self, key: StreamKey) -> Option<usize> {
        self.with(key, |list, at| list.get_mut(at)?.blocks.pop())
            .flatten()
    }

    /// Puts a freed block in the thread's magazine; when the magazine overflows, half of
    /// it goes to the stream's list. Returns the block if there is no magazine to take it.
    ///
    /// # Safety
    /// `shard` returns the owner's shard for `key` (a new magazine keeps a pointer to it,
    /// which later calls on the owner dereference).
    #[inline]
    pub(crate) unsafe fn push<'s>(
        &self,
        key: StreamKey,
        shard: impl FnOnce() -> &'s Shard<Vec<usize>>,
        addr: usize,
    ) -> Option<usize> {
        let capacity = self.capacity;
        let done = self.with(key, |list, at| {
            let m = match list.get_mut(at) {
                Some(m) => m,
                None => {
                    if list.len() >= PRUNE_AT {
                        prune(list);
                    }
                    list.push(Magazine {
                        owner: self.owner.id,
                        key,
                        shard: shard(),
                        blocks: Vec::with_capacity(capacity),
                    });
                    list.last_mut().expect("just pushed")
                }
            };
            if m.blocks.len() >= capacity {
                // SAFETY: the magazine (found by the owner's id) points at the owner's
                // shard (`push`/`refill` made it so), alive during this call on the owner.
                let shard = unsafe { &*m.shard }; // (rule (1) of the module)
                let keep = capacity / 2;
                shard.state.lock().extend(m.blocks.drain(keep..));
            }
            m.blocks.push(addr);
        });
        match done {
            Some(()) => None,
            None => Some(addr),
        }
    }

    /// Takes a block from `shard`'s list and moves up to half a magazine more into the
    /// thread's magazine, under one lock; `None` if the list is empty.
    ///
    /// # Safety
    /// `shard` is the owner's shard for `key`, as for [`push`](Self::push).
    #[inline]
    pub(crate) unsafe fn refill(&self, key: StreamKey, shard: &Shard<Vec<usize>>) -> Option<usize> {
        let more = (self.capacity / 2).saturating_sub(1);
        let capacity = self.capacity;
        let refilled = self.with(key, |list, at| {
            let m = match list.get_mut(at) {
                Some(m) => m,
                None => {
                    if list.len() >= PRUNE_AT {
                        prune(list);
                    }
                    list.push(Magazine {
                        owner: self.owner.id,
                        key,
                        shard,
                        blocks: Vec::with_capacity(capacity),
                    });
                    list.last_mut().expect("just pushed")
                }
            };
            let mut from = shard.state.lock();
            let first = from.pop()?;
            let n = more.min(from.len());
            let start = from.len() - n;
            m.blocks.extend(from.drain(start..));
            Some(first)
        });
        match refilled {
            Some(got) => got,
            // No magazines (the thread is exiting): straight from the list.
            None => shard.state.lock().pop(),
        }
    }

    /// Gives every block of the owner's magazines on this thread back to their lists.
    pub(crate) fn flush(&self) {
        self.with(StreamKey::host(0), |list, _| {
            for m in list.iter().filter(|m| m.owner == self.owner.id) {
                if !m.blocks.is_empty() {
                    // SAFETY: as in `push`: the owner's magazine, holding the owner's
                    // shard, inside a call on the owner, so the shard is alive.
                    let shard = unsafe { &*m.shard };
                    shard.state.lock().extend(m.blocks.iter().copied());
                }
            }
            list.retain(|m| m.owner != self.owner.id);
        });
    }

    /// Blocks of the owner in this thread's magazines.
    pub(crate) fn cached_here(&self) -> usize {
        self.with(StreamKey::host(0), |list, _| {
            list.iter()
                .filter(|m| m.owner == self.owner.id)
                .map(|m| m.blocks.len())
                .sum()
        })
        .unwrap_or(0)
    }
}
