//! The stream-ordered core: what every sub-allocator with per-stream lists shares, written
//! once over hooks that [`Pool`](crate::suballoc::Pool) and
//! [`VirtualPool`](crate::suballoc::VirtualPool) (their body, `Coalescing`),
//! [`Arena`](crate::suballoc::Arena) and [`FixedSize`](crate::suballoc::FixedSize) fill
//! in (RMM's `stream_ordered_memory_resource` and its hooks, as a trait: monomorphised,
//! no dynamic dispatch). [`Binning`](crate::suballoc::Binning) has no lists of its own:
//! its bins are these.
//!
//! The core owns a stream's list lookup ([`list_of`]), the slow path ([`allocate_slow`],
//! read top to bottom below), the blocks held for other streams' work (the retry after
//! waiting for them, [`deallocate_used_on`], [`free_all`](held::free_all) for `trim`) and the list
//! table's waits and retirement (`ListTable::merge_into`, [`trim`], [`retire_empty_lists`]). The
//! hooks say where each sub-allocator finds memory at each stage of the slow path.
//!
//! # The slow path
//! A request the stream's own list cannot serve (the fast path, each sub-allocator's own)
//! goes through these stages, the first that finds memory ending it:
//! 1. the held blocks whose events completed are freed (no wait);
//! 2. [`take_before_lock`](StreamOrdered::take_before_lock): memory found without the
//!    growth lock (a pool: a fit in another lane of the stream);
//! 3. the growth lock; [`take_without_wait`](StreamOrdered::take_without_wait): memory
//!    that needs no wait (the own list's caches, host streams' lists, other lanes);
//! 4. under stream capture no wait is allowed: [`grow`](StreamOrdered::grow) on the host
//!    stream in the relaxed capture mode, else out of memory;
//! 5. [`take_after_wait`](StreamOrdered::take_after_wait): memory freed on other streams,
//!    after waiting for them (a merge of lists);
//! 6. [`grow`](StreamOrdered::grow) from the upstream;
//! 7. [`take_last`](StreamOrdered::take_last): what is left (give memory back and grow
//!    again, every other list's last blocks, other threads' caches);
//! 8. out of memory: if blocks are held for other streams, the host waits for them, frees
//!    them and runs stages 1-7 once more (`held::retry_after_waiting`).

use std::alloc::Layout;
use std::ops::DerefMut;
use std::ptr::NonNull;

use super::held::{self, Deferred};
use super::list_table::{List, ListTable};
use super::stream_key::StreamKey;
use crate::error::Error;
use crate::resource::Resource;
use crate::stream::{Relaxed, StreamRef};

/// What a list holds, as the core moves it: a merge drains lists into one, a `trim`
/// shrinks them and frees those that hold nothing.
pub(crate) trait Contents: Send {
    /// What moves from list to list (a free block, or a block's address).
    type Item;

    /// Whether the list holds no free memory.
    fn holds_nothing(&self) -> bool;

    /// Takes every item out of the list.
    fn drain(&mut self) -> Vec<Self::Item>;

    /// Puts items into the list.
    fn absorb(&mut self, items: Vec<Self::Item>);

    /// Gives back the heap memory of a list that a `trim` emptied.
    fn shrink(&mut self);
}

/// `FixedSize`'s lists: the free blocks' addresses.
impl Contents for Vec<usize> {
    type Item = usize;

    fn holds_nothing(&self) -> bool {
        self.is_empty()
    }

    fn drain(&mut self) -> Vec<usize> {
        std::mem::take(self)
    }

    fn absorb(&mut self, mut items: Vec<usize>) {
        self.append(&mut items);
    }

    fn shrink(&mut self) {
        if self.is_empty() {
            *self = Vec::new();
        }
    }
}

/// A sub-allocator with per-stream lists, as the stream-ordered core sees it: where its
/// lists and held blocks are, and the stages of its slow path (see the module docs).
pub(crate) trait StreamOrdered: Resource + Sized {
    /// A stream's free memory: a `FreeList` for the pools and the arena, the free blocks'
    /// addresses for `FixedSize`.
    type Free: Contents;
    /// What the growth lock guards: the memory held from the upstream (a pool's chunks,
    /// an arena's global arena, `FixedSize`'s chunks).
    type Growth;
    /// The growth lock, held.
    type Locked<'a>: DerefMut<Target = Self::Growth>
    where
        Self: 'a;
    /// A request as the slow path's stages see it (the size and alignment, with what
    /// earlier stages learnt).
    type Request;
    /// What a `trim` returns from under the growth lock.
    type Trimmed;

    /// The per-stream lists.
    fn lists(&self) -> &ListTable<Self::Free>;

    /// The blocks held for other streams' work.
    fn held(&self) -> &Deferred;

    /// Makes the list of a stream seen for the first time (`lists().get_or_insert_with`,
    /// under whatever lock the new list's contents need).
    fn new_list(&self, key: StreamKey) -> &List<Self::Free>;

    /// Makes the new list of a retired list's stream, with its context and owner (for
    /// the items freed into the retired one while it went: see [`retire_empty_lists`]).
    fn new_list_like(&self, old: &List<Self::Free>) -> &List<Self::Free>;

    /// Whether `trim` keeps `list` even when it is empty (the host stream's lists, which
    /// paths holding the growth lock use).
    fn keeps_list(&self, list: &List<Self::Free>) -> bool {
        list.key.stream() == StreamKey::host(0)
    }

    /// `trim`'s work under the growth lock: every list merged into one after a wait for
    /// their streams, and what can go given back to the upstream.
    fn trim_locked(&self, growth: &mut Self::Growth) -> Result<Self::Trimmed, Error>;

    /// Lists `trim` retires, by address, have left the table: whatever outlives a call
    /// and may point at them lets go of them (before they are freed).
    fn retired(&self, _lists: &[usize]) {}

    /// Takes the growth lock, which serialises the slow path; `capturing`: the caller's
    /// stream is being captured (an unlock must then not wait for streams).
    fn growth_lock(&self, capturing: bool) -> Self::Locked<'_>;

    /// Stage 2: memory found without the growth lock.
    fn take_before_lock(&self, _own: &List<Self::Free>, _req: &mut Self::Request) -> Option<usize> {
        None
    }

    /// Stage 3: memory that needs no wait for other streams.
    fn take_without_wait(
        &self,
        growth: &mut Self::Growth,
        own: &List<Self::Free>,
        req: &mut Self::Request,
    ) -> Result<Option<usize>, Error>;

    /// Stage 5: memory freed on other streams, after waiting for their work.
    fn take_after_wait(
        &self,
        _growth: &mut Self::Growth,
        _own: &List<Self::Free>,
        _req: &mut Self::Request,
    ) -> Result<Option<usize>, Error> {
        Ok(None)
    }

    /// Stages 4 and 6: grows from the upstream (allocating on `stream`) and takes the
    /// block from the new memory in the same critical section; `Ok(None)` when the
    /// maximum or the upstream allows no growth. Without `may_wait` (under capture) it
    /// must not wait for any stream.
    fn grow(
        &self,
        growth: &mut Self::Growth,
        stream: StreamRef<'_>,
        own: &List<Self::Free>,
        req: &mut Self::Request,
        may_wait: bool,
    ) -> Result<Option<usize>, Error>;

    /// Stage 7: the last places to look, after growth failed.
    fn take_last(
        &self,
        _growth: &mut Self::Growth,
        _stream: StreamRef<'_>,
        _own: &List<Self::Free>,
        _req: &mut Self::Request,
    ) -> Result<Option<usize>, Error> {
        Ok(None)
    }

    /// The error of a request of `requested` bytes that nothing could serve (given the
    /// growth lock, to read what it needs and unlock before it reports).
    fn out_of_memory(&self, growth: Self::Locked<'_>, requested: usize) -> Error;
}

/// The list of `stream` (in the calling thread's lane), made on first use. The caller is
/// pinned in the list table's grace domain.
#[inline(always)]
pub(crate) fn list_of<'a, R: StreamOrdered>(r: &'a R, stream: StreamRef<'_>) -> &'a List<R::Free> {
    list_for(r, StreamKey::of_lane(stream))
}

/// The list of `key`, made on first use. The caller is pinned in the list table's grace
/// domain.
#[inline(always)]
pub(crate) fn list_for<R: StreamOrdered>(r: &R, key: StreamKey) -> &List<R::Free> {
    match r.lists().get(key) {
        Some(list) => list,
        None => r.new_list(key),
    }
}

/// The slow path (see the module docs): `own` (`stream`'s list) has no fit for `req`, a
/// request of `requested` bytes. Returns the block's address. A call of its own, so that
/// the fast path saves few registers.
#[inline(never)]
pub(crate) fn allocate_slow<R: StreamOrdered>(
    r: &R,
    stream: StreamRef<'_>,
    own: &List<R::Free>,
    req: &mut R::Request,
    requested: usize,
) -> Result<usize, Error> {
    held::retry_after_waiting(r, r.held(), stream, context(stream, own), || {
        stages(r, stream, own, req, requested)
    })
}

/// The context of `own`, `stream`'s list: none for a host stream, whose list has none,
/// without reading the list's context (on the line of the list that other threads'
/// searches read, cold when the list is: a miss on most slow paths at 16,384 host
/// streams, issue 49).
#[inline]
fn context<F>(stream: StreamRef<'_>, own: &List<F>) -> Option<crate::device::Context> {
    if stream.is_host() { None } else { own.ctx }
}

/// Stages 1 to 7 of the slow path, in the order tried.
#[cold]
fn stages<R: StreamOrdered>(
    r: &R,
    stream: StreamRef<'_>,
    own: &List<R::Free>,
    req: &mut R::Request,
    requested: usize,
) -> Result<usize, Error> {
    held::free_ready(r, r.held(), stream);
    if let Some(addr) = r.take_before_lock(own, req) {
        return Ok(addr);
    }
    let capturing = match context(stream, own) {
        Some(ctx) => stream.is_capturing_in(ctx)?,
        None => false,
    };
    let mut growth = r.growth_lock(capturing);
    if let Some(addr) = r.take_without_wait(&mut growth, own, req)? {
        return Ok(addr);
    }
    if capturing {
        // Grown "on the host stream": memory usable at once, whatever the upstream (on
        // the captured stream a stream-ordered upstream would make its allocation a node
        // of the graph, memory that exists only while the graph runs), in the relaxed
        // capture mode so that the driver allows the upstream's calls.
        let _relaxed = Relaxed::new()?;
        return match r.grow(&mut growth, StreamRef::HOST, own, req, false)? {
            Some(addr) => Ok(addr),
            None => Err(r.out_of_memory(growth, requested)),
        };
    }
    if let Some(addr) = r.take_after_wait(&mut growth, own, req)? {
        return Ok(addr);
    }
    if let Some(addr) = r.grow(&mut growth, stream, own, req, true)? {
        return Ok(addr);
    }
    if let Some(addr) = r.take_last(&mut growth, stream, own, req)? {
        return Ok(addr);
    }
    Err(r.out_of_memory(growth, requested))
}

/// [`Resource::deallocate_used_on`] for a sub-allocator with the core: the block is held
/// if another stream used it, else freed on `stream`.
///
/// # Safety
/// As [`Resource::deallocate_used_on`] on `r`.
pub(crate) unsafe fn deallocate_used_on<R: StreamOrdered>(
    r: &R,
    stream: StreamRef<'_>,
    ptr: NonNull<u8>,
    layout: Layout,
    used_on: &[StreamRef<'_>],
) {
    let _pin = r.lists().pin(); // (see `ListTable::retire`)
    // SAFETY: the caller's promise; `held` is `r`'s.
    unsafe { held::deallocate_used_on(r, r.held(), stream, ptr, layout, used_on) }
}

/// `trim`: every held block freed (after a wait for every stream the sub-allocator has
/// seen: a block freed under a capture needs it), every list merged into one and memory
/// given back ([`StreamOrdered::trim_locked`]), then the emptied lists freed
/// ([`retire_empty_lists`]). The caller is not pinned and holds no lock.
pub(crate) fn trim<R: StreamOrdered>(r: &R) -> Result<R::Trimmed, Error> {
    let trimmed = {
        let _pin = r.lists().pin(); // (see `ListTable::retire`)
        if r.held().any() {
            held::free_all(r, r.held(), || r.lists().synchronize_streams())?;
        }
        let trimmed = r.trim_locked(&mut r.growth_lock(false))?;
        // What emptied lists cost on the heap goes too (where they cannot be freed below,
        // a stream used once and never again then costs its inline fields only).
        for list in r.lists().all() {
            list.state.lock().shrink();
        }
        trimmed
    };
    retire_empty_lists(r);
    // The emptied lists' indexes this thread kept for later lists go too.
    super::free_blocks::FreeBlocks::release_spares();
    Ok(trimmed)
}

/// Frees every list that holds no free memory, but those [`StreamOrdered::keeps_list`]
/// keeps; returns how many went. The caller is not pinned and holds no lock.
pub(crate) fn retire_empty_lists<R: StreamOrdered>(r: &R) -> usize {
    let lists = r.lists();
    // SAFETY: every use of `r`'s lists is inside a pin (its entry points pin before they
    // look one up, and hold no list between calls; what keeps a list across calls lets go
    // of it in `retired`); this thread is not pinned and holds no lock; `home` pins while
    // it looks up and fills the stream's new list (the retirement's late items go there).
    // Late items move under the growth lock, which every search of other lists holds
    // (the slow path, merges, releases), pinned (a pool's unlock may run a pending
    // release).
    unsafe {
        lists.retire(
            |list| !r.keeps_list(list) && list.state.lock().holds_nothing(),
            |free| free.holds_nothing(),
            |old| {
                let _pin = lists.pin();
                match lists.find(old.key) {
                    Some(list) => list,
                    None => r.new_list_like(old),
                }
            },
            R::Free::drain,
            R::Free::absorb,
            |retired| r.retired(retired),
            || (r.growth_lock(false), lists.pin()),
        )
    }
}
