//! Per-stream state of the sub-allocators ("shards"), found without taking a lock.
//!
//! Every stream a sub-allocator sees gets one shard: its free list behind its own mutex.
//! Threads on different streams therefore never wait for each other on the allocation
//! path. The map from stream to shard is an insert-only open-addressing table of atomic
//! pointers: lookups are lock-free (acquire loads), insertions are serialised by a mutex
//! and publish a fully built shard with a release store. Shards live until the map drops.

use std::cell::Cell;
use std::fmt;
use std::ptr;
use std::sync::PoisonError;

use super::spin::SpinLock;
use crate::device::Context;
use crate::driver;
use crate::error::Error;
use crate::stream::StreamRef;
use crate::sync::atomic::{AtomicPtr, Ordering};
use crate::sync::{Mutex, MutexGuard};

/// Slots in the lock-free table; streams beyond it go to a list behind a mutex. (Few
/// under loom, where every slot read is a step to explore; the models then also cover
/// the overflow list.)
const SLOTS: usize = if cfg!(memres_loom) { 2 } else { 64 };

/// Locks a mutex, ignoring poisoning: the sub-allocators' critical sections leave their
/// state consistent at every point a panic could leave them.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What identifies a stream's free list: the stream's kind in the top two bits, its
/// handle, host id or thread number below (one word, so that comparing and hashing keys
/// costs next to nothing on the allocation path).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct StreamKey(u64);

const KIND_SHIFT: u32 = 62;
const CUDA: u64 = 0;
const HOST: u64 = 1;
const PER_THREAD: u64 = 2;

impl StreamKey {
    #[inline]
    pub(crate) fn of(stream: StreamRef<'_>) -> StreamKey {
        if let Some(id) = stream.host_id() {
            StreamKey::host(id)
        } else if stream.is_per_thread() {
            StreamKey((PER_THREAD << KIND_SHIFT) | thread_number() as u64)
        } else if stream.is_default() {
            StreamKey(CUDA << KIND_SHIFT)
        } else {
            // CUDA stream handles are pointers, far below 2^62.
            StreamKey(stream.as_raw().map_or(0, |raw| raw as u64))
        }
    }

    /// The key of host stream `id`.
    pub(crate) const fn host(id: u32) -> StreamKey {
        StreamKey((HOST << KIND_SHIFT) | id as u64)
    }

    /// The handle of an explicit CUDA stream (not a default or per-thread one).
    fn explicit_stream(self) -> Option<usize> {
        (self.0 >> KIND_SHIFT == CUDA && self.0 != 0).then_some(self.0 as usize)
    }

    /// Blocks freed on a host stream may be taken by any stream without waiting.
    #[inline]
    pub(crate) fn is_host(self) -> bool {
        self.0 >> KIND_SHIFT == HOST
    }

    #[inline]
    fn slot(self) -> usize {
        let h = self.0.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        (h >> 58) as usize % SLOTS
    }
}

impl fmt::Debug for StreamKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.0 & ((1 << KIND_SHIFT) - 1);
        match self.0 >> KIND_SHIFT {
            HOST => write!(f, "host stream {n}"),
            PER_THREAD => write!(f, "per-thread stream of thread {n}"),
            _ => write!(f, "CUDA stream {n:#x}"),
        }
    }
}

/// A number for the calling thread, unique for the life of the process (unlike the
/// thread's OS id, which may be reused).
fn thread_number() -> usize {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(1);
    thread_local!(static NUMBER: Cell<usize> = const { Cell::new(0) });
    NUMBER.with(|n| {
        if n.get() == 0 {
            n.set(NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
        }
        n.get()
    })
}

/// One stream's state.
pub(crate) struct Shard<S> {
    pub(crate) key: StreamKey,
    /// For CUDA streams, the context whose synchronisation completes the stream's work
    /// (the stream's own device's; `None` without a driver, where no GPU work can be
    /// pending).
    pub(crate) ctx: Option<Context>,
    pub(crate) state: SpinLock<S>,
}

impl<S> Shard<S> {
    fn new(key: StreamKey, state: S) -> Shard<S> {
        let ctx = if key.is_host() || !driver::is_present() {
            None
        } else {
            // An explicit stream's own device; the default and per-thread streams name
            // the current device's (the pool's, by RMM's rule that a resource is used
            // with its device current).
            match key.explicit_stream() {
                Some(raw) => Context::of_stream(raw).or_else(|_| Context::current()).ok(),
                None => Context::current().ok(),
            }
        };
        Shard {
            key,
            ctx,
            state: SpinLock::new(state),
        }
    }
}

/// The map from stream to shard.
pub(crate) struct ShardMap<S> {
    slots: Box<[AtomicPtr<Shard<S>>; SLOTS]>,
    /// Serialises insertions; holds the shards that found no free slot.
    overflow: Mutex<Vec<*mut Shard<S>>>,
}

// SAFETY: the map owns its shards (boxed, freed only in `drop`); sending it sends them.
unsafe impl<S: Send> Send for ShardMap<S> {}
// SAFETY: shared access hands out `&Shard<S>`, whose state is behind a `SpinLock` (which
// shares `S` the way `Mutex<S>` does: safe when `S: Send`); its other fields (a key and a
// `Context`, plain integers) are `Send + Sync`.
unsafe impl<S: Send> Sync for ShardMap<S> {}

impl<S> Default for ShardMap<S> {
    fn default() -> Self {
        ShardMap {
            slots: Box::new(std::array::from_fn(|_| AtomicPtr::new(ptr::null_mut()))),
            overflow: Mutex::new(Vec::new()),
        }
    }
}

impl<S> ShardMap<S> {
    /// A shard of this map from its pointer.
    ///
    /// # Safety
    /// `p` was read from one of this map's slots or its overflow list.
    #[inline]
    unsafe fn at(&self, p: *mut Shard<S>) -> &Shard<S> {
        // Every pointer in a slot or the overflow list was made by `Box::into_raw` and
        // published with a release store or under the insertion lock (seen fully built).
        // SAFETY: (the caller's promise) `p` is such a pointer; shards are freed only
        // when the map drops, which `&self` outlives.
        unsafe { &*p }
    }

    /// The shard of `key`, if it exists; lock-free unless the table has overflowed.
    #[inline]
    pub(crate) fn get(&self, key: StreamKey) -> Option<&Shard<S>> {
        let start = key.slot();
        let p = self.slots[start].load(Ordering::Acquire);
        if p.is_null() {
            return None;
        }
        // SAFETY: read from a slot.
        let shard = unsafe { self.at(p) };
        if shard.key == key {
            return Some(shard);
        }
        self.probe(key, start)
    }

    /// `get` past the first slot.
    #[cold]
    fn probe(&self, key: StreamKey, start: usize) -> Option<&Shard<S>> {
        for i in 1..SLOTS {
            let p = self.slots[(start + i) % SLOTS].load(Ordering::Acquire);
            if p.is_null() {
                return None;
            }
            // SAFETY: read from a slot.
            let shard = unsafe { self.at(p) };
            if shard.key == key {
                return Some(shard);
            }
        }
        let overflow = lock(&self.overflow);
        // SAFETY: read from the overflow list.
        overflow
            .iter()
            .map(|&p| unsafe { self.at(p) })
            .find(|s| s.key == key)
    }

    /// The shard of `key`, made with `state` if there is none yet.
    pub(crate) fn get_or_insert_with(
        &self,
        key: StreamKey,
        state: impl FnOnce() -> S,
    ) -> &Shard<S> {
        let mut overflow = lock(&self.overflow);
        let start = key.slot();
        for i in 0..SLOTS {
            let slot = &self.slots[(start + i) % SLOTS];
            let p = slot.load(Ordering::Acquire);
            if p.is_null() {
                let new = Box::into_raw(Box::new(Shard::new(key, state())));
                slot.store(new, Ordering::Release);
                // SAFETY: just published in a slot.
                return unsafe { self.at(new) };
            }
            // SAFETY: read from a slot.
            let shard = unsafe { self.at(p) };
            if shard.key == key {
                return shard;
            }
        }
        // SAFETY: read from the overflow list.
        if let Some(&p) = overflow.iter().find(|&&p| unsafe { self.at(p) }.key == key) {
            // SAFETY: as above.
            return unsafe { self.at(p) };
        }
        let new = Box::into_raw(Box::new(Shard::new(key, state())));
        overflow.push(new);
        // SAFETY: just pushed on the overflow list.
        unsafe { self.at(new) }
    }

    /// Every shard so far.
    pub(crate) fn all(&self) -> Vec<&Shard<S>> {
        let mut out = Vec::new();
        for slot in self.slots.iter() {
            let p = slot.load(Ordering::Acquire);
            if !p.is_null() {
                // SAFETY: read from a slot.
                out.push(unsafe { self.at(p) });
            }
        }
        // SAFETY: read from the overflow list.
        out.extend(lock(&self.overflow).iter().map(|&p| unsafe { self.at(p) }));
        out
    }

    /// Moves the free items of every shard but `into` into `into`, once the work of the
    /// CUDA streams they were freed on is complete (one `cuCtxSynchronize` per context).
    /// `drain` empties a shard; `absorb` adds items to one. If the wait fails, the items
    /// go back where they came from and the error is returned. Returns whether anything
    /// moved.
    pub(crate) fn merge_into<T>(
        &self,
        into: &Shard<S>,
        drain: impl Fn(&mut S) -> Vec<T>,
        absorb: impl Fn(&mut S, Vec<T>),
    ) -> Result<bool, Error> {
        let mut moved = Vec::new();
        for other in self.all() {
            if !ptr::eq(other, into) {
                let items = drain(&mut other.state.lock());
                if !items.is_empty() {
                    moved.push((other, items));
                }
            }
        }
        if let Err(e) = synchronize(moved.iter().filter_map(|(s, _)| s.ctx)) {
            // Their streams may still be using them.
            for (shard, items) in moved {
                absorb(&mut shard.state.lock(), items);
            }
            return Err(e);
        }
        let any = !moved.is_empty();
        let mut target = into.state.lock();
        for (_, items) in moved {
            absorb(&mut target, items);
        }
        Ok(any)
    }

    /// Waits for the work of every CUDA stream seen so far (once per context).
    pub(crate) fn synchronize_streams(&self) -> Result<(), Error> {
        synchronize(self.all().iter().filter_map(|s| s.ctx))
    }
}

/// Synchronises each distinct context once.
fn synchronize(ctxs: impl Iterator<Item = Context>) -> Result<(), Error> {
    let mut done: Vec<Context> = Vec::new();
    for ctx in ctxs {
        if !done.contains(&ctx) {
            ctx.synchronize()?;
            done.push(ctx);
        }
    }
    Ok(())
}

impl<S> Drop for ShardMap<S> {
    fn drop(&mut self) {
        for slot in self.slots.iter() {
            let p = slot.load(Ordering::Acquire);
            if !p.is_null() {
                // SAFETY: made by `Box::into_raw` in `get_or_insert_with`; `&mut self`
                // means no reference handed out by `get` is still alive.
                drop(unsafe { Box::from_raw(p) });
            }
        }
        for &p in lock(&self.overflow).iter() {
            // SAFETY: as above.
            drop(unsafe { Box::from_raw(p) });
        }
    }
}
