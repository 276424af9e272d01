//! Blocks freed while work on other streams may still use them
//! ([`Resource::deallocate_used_on`], PyTorch's `record_stream`): each is held back, with
//! an event recorded on every stream that used it, until all its events are complete;
//! then its owner frees it: a sub-allocator on the stream that freed it when that stream
//! is the one allocating (its next allocation of the size finds it, as under PyTorch's
//! caching allocator), else on a host stream (free for every stream, no work uses it any
//! more). This is the library's one home of `record_stream`'s hold: the
//! stream-ordered sub-allocators (`Pool`, `VirtualPool`, `Arena`, `FixedSize`, ...) keep
//! their held blocks here, and so does [`SegmentPool`](crate::suballoc::SegmentPool)
//! (PyTorch's graph pools and `MemPool`s).
//!
//! The protocol: a freer records its events and pushes the block under the list's lock,
//! then sets `any`; an owner that looks at held blocks (at each such free, on its slow
//! path before it grows, and for `Pool` and `VirtualPool` on the allocation fast path
//! once a millisecond at most, [`free_ready_now_and_then`]) reads `any` first, and only
//! then takes the lock, moves the blocks whose events are complete out of the list, and
//! clears `any` when the list is empty, all under the lock. Every block is therefore
//! freed once, by one thread, and only after its events complete. Checking an event is
//! `cuEventQuery`: the host never waits. While nothing is held the fast path's look is
//! one load.
//!
//! Under stream capture no event can be queried later (it would be a node of the
//! graph). Two ways out, one per owner:
//! - A sub-allocator's block freed on or used on a capturing stream gets
//!   [`Mark::Capture`]: held until the sub-allocator next waits for every stream it has
//!   seen ([`free_all`], from `trim`), or its drop. (Its `used_on` streams are live only
//!   during the free, [`Resource::deallocate_used_on`]'s contract: none may be kept to
//!   record an event on later.)
//! - A segment pool's block freed while a capture is underway keeps its streams
//!   ([`Deferred::hold_later`]; its `record_stream` contract keeps them valid until the
//!   block's free completes) and gets their events at the first look once no capture is
//!   underway on them, as PyTorch's caching allocator defers those events. A block freed
//!   in the capture that made it also notes where the graph had reached on each of its
//!   streams: [`Deferred::take_ordered`] gives it back in that capture once the graph
//!   orders those points first.

use std::alloc::Layout;
use std::collections::HashSet;
use std::ptr::NonNull;

use super::stream_key::StreamKey;
use crate::device::{Context, bind};
use crate::error::Error;
use crate::resource::Resource;
use crate::stream::{Event, Frontier, StreamRef, ancestors};
use crate::sync::Mutex;
use crate::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::sync::lock;

/// Events kept for reuse, at most.
const SPARE_EVENTS: usize = 64;

/// What one held block waits for.
pub(crate) enum Mark {
    /// An event recorded on a stream that used the block.
    Event(Event),
    /// The block was freed during a stream capture: only a wait for every stream frees it.
    Capture,
    /// A stand-in for an event in the host tests and loom models: complete once set.
    #[cfg(test)]
    Flag(crate::sync::Arc<AtomicBool>),
    /// A stand-in for an event whose work completes only once the host waits for it (the
    /// host tests of the wait before out-of-memory): complete once set, and set by a
    /// wait.
    #[cfg(all(test, not(memres_loom)))]
    Waited(std::sync::Arc<AtomicBool>),
    /// A stand-in for an event of a broken context (the host tests of a failed wait):
    /// never complete, and its wait fails.
    #[cfg(all(test, not(memres_loom)))]
    Broken,
}

impl Mark {
    /// Whether the work the mark stands for is complete. A query that fails (while a
    /// capture is underway the driver refuses it) counts as not complete: the block stays
    /// held, and the next look asks again.
    fn is_complete(&self) -> bool {
        match self {
            Mark::Event(event) => event.is_complete().unwrap_or(false),
            Mark::Capture => false,
            #[cfg(test)]
            Mark::Flag(done) => done.load(Ordering::Acquire),
            #[cfg(all(test, not(memres_loom)))]
            Mark::Waited(done) => done.load(Ordering::Acquire),
            #[cfg(all(test, not(memres_loom)))]
            Mark::Broken => false,
        }
    }

    /// Waits on the host for the work the mark stands for (an event's
    /// `cuEventSynchronize`); nothing for the other marks. False when the wait failed.
    fn wait(&self) -> bool {
        match self {
            Mark::Event(event) => match event.synchronize() {
                Ok(()) => true,
                Err(e) => {
                    tracing::error!("memres: could not wait for a held block's event: {e}");
                    false
                }
            },
            #[cfg(all(test, not(memres_loom)))]
            Mark::Waited(done) => {
                done.store(true, Ordering::Release);
                true
            }
            #[cfg(all(test, not(memres_loom)))]
            Mark::Broken => false,
            _ => true,
        }
    }
}

/// One held block.
pub(crate) struct Held {
    addr: usize,
    layout: Layout,
    /// The stream that freed it (a sub-allocator's hold): once its marks complete, an
    /// allocation on that stream takes it back into the stream's own list.
    owner: Option<StreamKey>,
    marks: Vec<Mark>,
    /// Streams whose events are still to be recorded (a segment pool's block freed while
    /// a capture was underway): recorded at a look once their stream is not captured.
    pending: Vec<StreamRef<'static>>,
    /// The context current while events of `pending` are recorded (so that a
    /// default-stream handle names its device's stream); none for host streams.
    ctx: Option<Context>,
    /// Freed in the capture that made it, with every stream in that capture: where each
    /// stream's captured work had reached then (see [`Deferred::take_ordered`]).
    in_capture: Option<Frontier>,
}

impl Held {
    /// A block freed on `stream` (its owner) that waits for `marks`.
    fn freed_on(stream: StreamRef<'_>, addr: usize, layout: Layout, marks: Vec<Mark>) -> Held {
        Held {
            addr,
            layout,
            owner: Some(StreamKey::of(stream).stream()),
            marks,
            pending: Vec::new(),
            ctx: None,
            in_capture: None,
        }
    }

    /// The block's address.
    pub(crate) fn addr(&self) -> usize {
        self.addr
    }

    /// Waits on the host for the block's events and for its streams whose events are
    /// not recorded yet; false when any wait failed (the block may still be in use).
    pub(crate) fn wait(&self) -> bool {
        let current = self.ctx.map(bind).transpose();
        let mut waited = self.wait_marks();
        if self.pending.is_empty() {
            return waited;
        }
        // A default-stream handle names the current context's stream: where the block's
        // context cannot be made current, its pending streams cannot be named, so the
        // wait fails (the block stays held).
        if current.is_err() {
            return false;
        }
        for stream in &self.pending {
            waited &= stream.synchronize().is_ok();
        }
        waited
    }

    /// Records the events of the streams of `pending` not captured now (`spare`: events
    /// to reuse). A stream no event can be recorded on is waited for on the host instead
    /// (a broken stream or context); if even that fails, it stays pending, so the block
    /// is never handed out while it may be in use.
    fn record_pending(&mut self, spare: &mut Vec<Event>) {
        // Without the block's context current an event could land on another device's
        // default stream: the streams stay pending until a later look can bind it.
        let _current = match self.ctx.map(bind).transpose() {
            Ok(current) => current,
            Err(e) => {
                tracing::warn!("memres: a held block's streams stay pending (its context: {e})");
                return;
            }
        };
        for stream in std::mem::take(&mut self.pending) {
            // A stream captured now (elsewhere) gets its event after the capture.
            if !matches!(stream.is_capturing(), Ok(false)) {
                self.pending.push(stream);
                continue;
            }
            match record_on(stream, spare) {
                Ok(Some(event)) => self.marks.push(Mark::Event(event)),
                Ok(None) => {} // a host stream: its work is complete
                Err(e) => {
                    tracing::warn!("memres: waiting for a stream no event can be recorded on: {e}");
                    if stream.synchronize().is_err() {
                        self.pending.push(stream);
                    }
                }
            }
        }
    }

    /// Waits on the host for every mark's work (each one, even after a failure); false
    /// when any wait failed.
    fn wait_marks(&self) -> bool {
        self.marks
            .iter()
            .fold(true, |waited, mark| mark.wait() & waited)
    }

    /// Whether every stream's work (at the free) is complete.
    fn is_complete(&self) -> bool {
        self.pending.is_empty() && self.marks.iter().all(Mark::is_complete)
    }
}

/// An event recorded on `stream` now (`None` for a host stream), one of `spare` of its
/// context if there is one.
fn record_on(stream: StreamRef<'_>, spare: &mut Vec<Event>) -> Result<Option<Event>, Error> {
    if stream.is_host() {
        return Ok(None);
    }
    let ctx = stream.context()?;
    let event = match spare.iter().position(|e| e.context() == ctx) {
        Some(i) => spare.swap_remove(i),
        None => Event::new_in(ctx)?,
    };
    event.record(stream)?;
    Ok(Some(event))
}

/// The blocks an owner holds back for other streams (see the module docs).
#[derive(Default)]
pub(crate) struct Deferred {
    /// Set just after a block is pushed (the lock released), cleared under the lock when
    /// the list is found empty. A look that empties the list between a push and its set
    /// leaves it set with nothing held: harmless, the next look clears it.
    any: AtomicBool,
    lists: Mutex<Lists>,
}

#[derive(Default)]
struct Lists {
    held: Vec<Held>,
    /// Events of released blocks, for the next ones (creating one is a driver call).
    spare: Vec<Event>,
}

impl Deferred {
    /// Holds the block at `addr` back until the work enqueued so far on `stream` and on
    /// each of `used_on` is complete. False when nothing needs holding (every stream of
    /// `used_on` is a host stream or `stream` itself): the caller frees the block on
    /// `stream` as usual.
    pub(crate) fn hold(
        &self,
        stream: StreamRef<'_>,
        addr: usize,
        layout: Layout,
        used_on: &[StreamRef<'_>],
    ) -> bool {
        let others = || used_on.iter().filter(|o| !o.is_host() && **o != stream);
        if others().next().is_none() {
            return false;
        }
        let mut marks = Vec::with_capacity(used_on.len() + 1);
        for s in std::iter::once(&stream).chain(others()) {
            match self.mark(*s) {
                Ok(Some(mark)) => marks.push(mark),
                Ok(None) => {}
                Err(e) => {
                    // No event: wait for the stream on the host instead (a broken context,
                    // rare); if even that fails, the block is never freed.
                    if let Err(e2) = s.synchronize() {
                        tracing::error!(
                            "memres: a block used on another stream is leaked: its stream \
                             could not be waited for ({e}; {e2})"
                        );
                        return true;
                    }
                }
            }
        }
        self.push(Held::freed_on(stream, addr, layout, marks));
        true
    }

    /// Holds the block at `addr` until the work enqueued on each of `streams` by the
    /// first look at it when no capture is underway on that stream is complete (a
    /// segment pool's free, [`hold`](Self::hold)'s events recorded later): nothing is
    /// recorded now. `ctx` is made current while the events are recorded; `in_capture`,
    /// where the block was freed in the capture that made it, where each stream's
    /// captured work had reached ([`take_ordered`](Self::take_ordered)).
    pub(crate) fn hold_later(
        &self,
        addr: usize,
        layout: Layout,
        ctx: Option<Context>,
        streams: Vec<StreamRef<'static>>,
        in_capture: Option<Frontier>,
    ) {
        self.push(Held {
            addr,
            layout,
            owner: None,
            marks: Vec::new(),
            pending: streams,
            ctx,
            in_capture,
        });
    }

    /// An event recorded on `stream` now (`None` for a host stream), or
    /// [`Mark::Capture`] when the stream is being captured.
    fn mark(&self, stream: StreamRef<'_>) -> Result<Option<Mark>, Error> {
        if stream.is_host() {
            return Ok(None);
        }
        let ctx = stream.context()?;
        if stream.is_capturing_in(ctx)? {
            return Ok(Some(Mark::Capture));
        }
        let event = match self.spare_event(ctx) {
            Some(event) => event,
            None => Event::new_in(ctx)?,
        };
        event.record(stream)?;
        Ok(Some(Mark::Event(event)))
    }

    fn spare_event(&self, ctx: Context) -> Option<Event> {
        let spare = &mut lock(&self.lists).spare;
        let i = spare.iter().position(|e| e.context() == ctx)?;
        Some(spare.swap_remove(i))
    }

    /// Holds a block freed on `stream` with marks made by the caller (the host tests).
    #[cfg(all(test, not(memres_loom)))]
    pub(crate) fn push_marked_by(
        &self,
        stream: StreamRef<'_>,
        addr: usize,
        layout: Layout,
        marks: Vec<Mark>,
    ) {
        self.push(Held::freed_on(stream, addr, layout, marks));
    }

    /// Holds a block with marks made by the caller (the host tests and loom models).
    #[cfg(test)]
    pub(crate) fn push_marked(&self, addr: usize, layout: Layout, marks: Vec<Mark>) {
        self.push(Held {
            addr,
            layout,
            owner: None,
            marks,
            pending: Vec::new(),
            ctx: None,
            in_capture: None,
        });
    }

    fn push(&self, held: Held) {
        lock(&self.lists).held.push(held);
        self.any.store(true, Ordering::Release);
    }

    /// Whether any block is held (one load: the slow paths' test).
    #[inline]
    pub(crate) fn any(&self) -> bool {
        self.any.load(Ordering::Acquire)
    }

    /// Bytes held back now.
    pub(crate) fn bytes(&self) -> usize {
        if !self.any() {
            return 0;
        }
        lock(&self.lists).held.iter().map(|h| h.layout.size()).sum()
    }

    /// Whether the block at `addr` is held.
    pub(crate) fn is_held(&self, addr: usize) -> bool {
        self.any() && lock(&self.lists).held.iter().any(|h| h.addr == addr)
    }

    /// The addresses of the held blocks (for a listing).
    pub(crate) fn addresses(&self) -> HashSet<usize> {
        if !self.any() {
            return HashSet::new();
        }
        lock(&self.lists).held.iter().map(|h| h.addr).collect()
    }

    /// Takes the blocks whose events are all complete out of the list, for the caller to
    /// free, after recording the events of streams no longer captured
    /// ([`hold_later`](Self::hold_later)). Never waits (but for a stream no event can be
    /// recorded on). The queries run in the relaxed capture mode, which a capture
    /// underway on another thread would otherwise forbid.
    pub(crate) fn take_ready(&self) -> Vec<(usize, Layout)> {
        self.take_ready_with_owners()
            .into_iter()
            .map(|(addr, layout, _)| (addr, layout))
            .collect()
    }

    /// [`take_ready`](Self::take_ready), with the stream that freed each block where a
    /// sub-allocator held it.
    fn take_ready_with_owners(&self) -> Vec<(usize, Layout, Option<StreamKey>)> {
        if !self.any() {
            return Vec::new();
        }
        #[cfg(not(memres_loom))]
        let _relaxed = crate::driver::is_present()
            .then(crate::stream::Relaxed::new)
            .and_then(Result::ok);
        let mut lists = lock(&self.lists);
        let Lists { held, spare } = &mut *lists;
        let mut ready = Vec::new();
        held.retain_mut(|h| {
            if !h.pending.is_empty() {
                h.record_pending(spare);
            }
            if !h.is_complete() {
                return true;
            }
            ready.push((h.addr, h.layout, h.owner));
            for mark in h.marks.drain(..) {
                if let Mark::Event(e) = mark
                    && spare.len() < SPARE_EVENTS
                {
                    spare.push(e);
                }
            }
            false
        });
        self.settle(held);
        ready
    }

    /// Takes out the blocks freed in `frontier`'s capture (none of their events recorded
    /// yet) for which `own` holds (a segment pool: blocks of the capturing stream's own
    /// segments) and whose streams' captured work at the free the graph orders before
    /// `frontier` (it is among the frontier's nodes and their ancestors): work captured
    /// next on the frontier's stream comes after every use, in every replay. Their
    /// addresses, for the caller to free in the capture.
    pub(crate) fn take_ordered(
        &self,
        frontier: &Frontier,
        own: impl Fn(usize) -> bool,
    ) -> Vec<usize> {
        let of_this_capture = |h: &Held| {
            h.marks.is_empty()
                && h.in_capture
                    .as_ref()
                    .is_some_and(|f| f.capture == frontier.capture)
        };
        if !self.any() {
            return Vec::new();
        }
        let mut lists = lock(&self.lists);
        if !lists.held.iter().any(of_this_capture) {
            return Vec::new();
        }
        // The frontier and its ancestors, once.
        let Some(before) = ancestors(&frontier.nodes) else {
            return Vec::new();
        };
        let mut taken = Vec::new();
        lists.held.retain(|h| {
            let ordered = of_this_capture(h)
                && own(h.addr)
                && h.in_capture
                    .as_ref()
                    .is_some_and(|f| f.nodes.iter().all(|n| before.contains(n)));
            if ordered {
                taken.push(h.addr);
            }
            !ordered
        });
        self.settle(&lists.held);
        taken
    }

    /// Takes every block out of the list, with its marks, in one critical section.
    pub(crate) fn drain(&self) -> Vec<Held> {
        if !self.any() {
            return Vec::new();
        }
        let mut lists = lock(&self.lists);
        let all: Vec<Held> = lists.held.drain(..).collect();
        self.settle(&lists.held);
        all
    }

    /// Forgets every held block: its owner neither waits for nor frees it (a segment
    /// pool's restore replaces the table it would free into).
    pub(crate) fn forget_all(&self) {
        drop(self.drain());
    }

    /// Puts blocks taken with [`drain`](Self::drain) back.
    pub(crate) fn restore(&self, blocks: Vec<Held>) {
        if blocks.is_empty() {
            return;
        }
        lock(&self.lists).held.extend(blocks);
        self.any.store(true, Ordering::Release);
    }

    /// Under the lock: clears `any` if the list is empty.
    fn settle(&self, held: &[Held]) {
        if held.is_empty() {
            self.any.store(false, Ordering::Release);
        }
    }

    /// Waits on the host for every held block's events (for a resource's drop, which
    /// returns the blocks' memory to its upstream).
    pub(crate) fn wait_all(&self) {
        if !self.any() || crate::device::process_is_exiting() {
            return;
        }
        for held in lock(&self.lists).held.iter() {
            for mark in &held.marks {
                mark.wait();
            }
        }
    }
}

/// [`Resource::deallocate_used_on`] of a sub-allocator `r` whose held blocks are `held`:
/// the block is held if another stream used it, else freed on `stream`; then the held
/// blocks that are ready are freed.
///
/// # Safety
/// As [`Resource::deallocate_used_on`] on `r`; `held` is `r`'s own.
#[inline]
pub(crate) unsafe fn deallocate_used_on<R: Resource + ?Sized>(
    r: &R,
    held: &Deferred,
    stream: StreamRef<'_>,
    ptr: NonNull<u8>,
    layout: Layout,
    used_on: &[StreamRef<'_>],
) {
    if layout.size() != 0 && !held.hold(stream, ptr.as_ptr().expose_provenance(), layout, used_on) {
        // SAFETY: the caller's promise; no other stream's use is pending.
        unsafe { r.deallocate(stream, ptr, layout) };
    }
    free_ready(r, held, stream);
}

/// Frees the blocks of `held` (`r`'s own) whose streams' work is complete: on `stream`
/// those it freed (into its own list, where its next allocation of their size finds them,
/// as PyTorch's caching allocator gives a block back to its stream), the others on the
/// host stream (no work uses them any more). Never waits. Not while `stream` (the
/// caller's) is being captured: a free may release memory to the upstream past a
/// threshold, which waits for streams.
pub(crate) fn free_ready<R: Resource + ?Sized>(r: &R, held: &Deferred, stream: StreamRef<'_>) {
    if !held.any() || !matches!(stream.is_capturing(), Ok(false)) {
        return;
    }
    let own = StreamKey::of(stream).stream();
    for (addr, layout, owner) in held.take_ready_with_owners() {
        let on = if owner == Some(own) {
            stream
        } else {
            StreamRef::HOST
        };
        // SAFETY: a block of `r`, freed by its caller with `layout` (on `stream` where
        // `owner` says so: it is free in that stream's order); every stream that used it
        // has completed the work it had at the free.
        unsafe { r.deallocate(on, crate::suballoc::to_ptr(addr), layout) };
    }
}

/// How often, at most, an allocation's fast path looks at the held blocks: 1 ms.
/// PyTorch's caching allocator looks at every allocation (its blocks freed with
/// `record_stream` come back at the first allocation after their streams' work), which
/// costs an event query each time something is held (DDP holds blocks for NCCL's stream
/// through most of a step); once a millisecond bounds that to one look per millisecond
/// while a block still comes back within a millisecond of its streams' work.
const LOOK_EVERY_NS: u64 = 1_000_000;

/// An allocation's fast path: when blocks are held and no allocation of `r` looked at them
/// in the last [`LOOK_EVERY_NS`], frees those whose streams' work is complete
/// ([`free_ready`]), so that a stream's next allocation finds its blocks as under
/// PyTorch's allocator. One load when nothing is held. `last_look` is the owner's: when
/// it last looked (nanoseconds, from one period on).
#[inline]
pub(crate) fn free_ready_now_and_then<R: Resource + ?Sized>(
    r: &R,
    held: &Deferred,
    last_look: &AtomicU64,
    stream: StreamRef<'_>,
) {
    if held.any() {
        look_if_due(r, held, last_look, stream);
    }
}

#[cold]
#[inline(never)]
fn look_if_due<R: Resource + ?Sized>(
    r: &R,
    held: &Deferred,
    last_look: &AtomicU64,
    stream: StreamRef<'_>,
) {
    static EPOCH: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    let epoch = EPOCH.get_or_init(std::time::Instant::now);
    // (From one period on, so that the first look is due at once.)
    let now = u64::try_from(epoch.elapsed().as_nanos())
        .unwrap_or(u64::MAX)
        .saturating_add(LOOK_EVERY_NS);
    let last = last_look.load(Ordering::Relaxed);
    // One thread looks per period: the others go on (the look is a courtesy, not a need).
    if now.saturating_sub(last) < LOOK_EVERY_NS
        || last_look
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_err()
    {
        return;
    }
    free_ready(r, held, stream);
}

/// Runs `attempt`; when it runs out of memory while blocks are held for other streams,
/// waits on the host for those streams' events, frees the blocks and runs it once more
/// (PyTorch's caching allocator also synchronises and frees before it reports out of
/// memory). Only on the failure path, and not under stream capture (`ctx`: the stream's
/// context, `None` for host streams), where no wait is allowed and blocks held for a
/// capture stay.
#[inline]
pub(crate) fn retry_after_waiting<R: Resource + ?Sized, T>(
    r: &R,
    held: &Deferred,
    stream: StreamRef<'_>,
    ctx: Option<Context>,
    mut attempt: impl FnMut() -> Result<T, Error>,
) -> Result<T, Error> {
    match attempt() {
        Err(Error::OutOfMemory { .. })
            if held.any()
                && ctx.is_none_or(|ctx| matches!(stream.is_capturing_in(ctx), Ok(false))) =>
        {
            held.wait_all();
            free_ready(r, held, stream);
            attempt()
        }
        result => result,
    }
}

/// Takes every held block, then runs `wait_for_streams` (which waits for every stream
/// the caller has seen: blocks freed under a capture go back only here) and waits for
/// the blocks' own events, then frees them on the host stream (a `trim`). Blocks held
/// after the take stay held. If the wait for the streams fails, the blocks go back to the
/// list; so does each block whose own events cannot be waited for (never freed while
/// its work may be pending).
pub(crate) fn free_all<R: Resource + ?Sized>(
    r: &R,
    held: &Deferred,
    wait_for_streams: impl FnOnce() -> Result<(), Error>,
) -> Result<(), Error> {
    let taken = held.drain();
    if taken.is_empty() {
        return Ok(());
    }
    if let Err(e) = wait_for_streams() {
        held.restore(taken);
        return Err(e);
    }
    let (ready, unwaited): (Vec<Held>, Vec<Held>) = taken.into_iter().partition(Held::wait_marks);
    if !unwaited.is_empty() {
        tracing::error!(
            "memres: {} held block(s) stay held: their events could not be waited for",
            unwaited.len()
        );
        held.restore(unwaited);
    }
    for block in ready {
        // SAFETY: as in `free_ready`: their events were waited for just above, and the
        // caller waited for every stream (blocks of a capture).
        unsafe {
            r.deallocate(
                StreamRef::HOST,
                crate::suballoc::to_ptr(block.addr),
                block.layout,
            )
        };
    }
    Ok(())
}

#[cfg(all(test, not(memres_loom)))]
mod tests {
    use std::sync::Arc;

    use super::*;

    fn l(size: usize) -> Layout {
        Layout::from_size_align(size, 256).unwrap()
    }

    #[test]
    fn host_streams_and_the_freeing_stream_hold_nothing() {
        let d = Deferred::default();
        let s = StreamRef::host(1);
        assert!(!d.hold(s, 0x1000, l(256), &[]));
        assert!(!d.hold(s, 0x1000, l(256), &[StreamRef::host(2), s]));
        assert!(!d.any());
    }

    #[test]
    fn a_block_is_ready_once_all_its_marks_are_complete() {
        let d = Deferred::default();
        let (a, b) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicBool::new(false)),
        );
        d.push_marked(
            0x1000,
            l(512),
            vec![Mark::Flag(a.clone()), Mark::Flag(b.clone())],
        );
        d.push_marked(0x2000, l(256), vec![Mark::Flag(b.clone())]);
        assert_eq!(d.bytes(), 768);
        assert!(d.take_ready().is_empty());
        b.store(true, Ordering::Release);
        assert_eq!(d.take_ready(), vec![(0x2000, l(256))]);
        assert!(d.any());
        a.store(true, Ordering::Release);
        assert_eq!(d.take_ready(), vec![(0x1000, l(512))]);
        assert!(!d.any());
        assert_eq!(d.bytes(), 0);
    }

    #[test]
    fn capture_marks_wait_for_a_drain() {
        let d = Deferred::default();
        d.push_marked(0x1000, l(256), vec![Mark::Capture]);
        assert!(d.take_ready().is_empty());
        let taken = d.drain();
        assert_eq!(taken.iter().map(|h| h.addr).collect::<Vec<_>>(), [0x1000]);
        assert!(!d.any());
        d.restore(taken);
        assert!(d.any() && d.bytes() == 256);
    }

    /// A block held for later (a segment pool's free) gets its streams' events at the
    /// first look: a host stream's work is complete, so the block is ready then, and is
    /// listed as held until it is taken.
    #[test]
    fn a_block_held_for_later_is_ready_once_its_streams_are_recorded() {
        let d = Deferred::default();
        d.hold_later(0x1000, l(512), None, vec![StreamRef::host(2)], None);
        d.hold_later(0x2000, l(256), None, Vec::new(), None);
        assert!(d.is_held(0x1000) && !d.is_held(0x1100));
        assert_eq!(d.addresses(), HashSet::from([0x1000, 0x2000]));
        assert_eq!(d.bytes(), 768);
        let mut ready = d.take_ready();
        ready.sort_unstable_by_key(|r| r.0);
        assert_eq!(ready, vec![(0x1000, l(512)), (0x2000, l(256))]);
        assert!(!d.any() && d.addresses().is_empty() && !d.is_held(0x1000));
    }

    /// In a capture, the blocks freed in that same capture, of the caller's own, whose
    /// streams' work at the free the graph orders before the frontier are given back;
    /// those of another capture, with events recorded, not the caller's own, or noted at
    /// a node the frontier does not follow, stay. (Frontiers with no node: the graph's
    /// ancestors need no driver.)
    #[test]
    fn take_ordered_gives_back_what_the_graph_orders_first() {
        let d = Deferred::default();
        let at = |capture, nodes: Vec<usize>| Some(Frontier { capture, nodes });
        d.hold_later(
            0x1000,
            l(256),
            None,
            vec![StreamRef::host(2)],
            at(7, vec![]),
        );
        d.hold_later(
            0x2000,
            l(256),
            None,
            vec![StreamRef::host(2)],
            at(8, vec![]),
        );
        d.hold_later(
            0x3000,
            l(256),
            None,
            vec![StreamRef::host(2)],
            at(7, vec![0x10]),
        );
        d.hold_later(
            0x4000,
            l(256),
            None,
            vec![StreamRef::host(2)],
            at(7, vec![]),
        );
        d.hold_later(0x5000, l(256), None, vec![StreamRef::host(2)], None);
        let done = Arc::new(AtomicBool::new(false));
        d.push_marked(0x6000, l(256), vec![Mark::Flag(done)]);
        let frontier = Frontier {
            capture: 7,
            nodes: vec![],
        };
        let own = |a: usize| a != 0x4000;
        assert_eq!(d.take_ordered(&frontier, own), [0x1000]);
        assert_eq!(d.take_ordered(&frontier, own), Vec::<usize>::new());
        assert_eq!(
            d.addresses(),
            HashSet::from([0x2000, 0x3000, 0x4000, 0x5000, 0x6000])
        );
    }

    /// Forgotten blocks are neither freed nor waited for; a waited block's marks are
    /// waited for.
    #[test]
    fn forget_all_drops_every_block_and_wait_waits_for_its_marks() {
        let d = Deferred::default();
        let waited = Arc::new(AtomicBool::new(false));
        d.push_marked(0x1000, l(256), vec![Mark::Waited(waited.clone())]);
        let taken = d.drain();
        assert!(taken[0].wait() && waited.load(Ordering::Acquire));
        assert_eq!(taken[0].addr(), 0x1000);
        d.hold_later(0x2000, l(256), None, vec![StreamRef::host(2)], None);
        d.forget_all();
        assert!(!d.any() && d.take_ready().is_empty());
    }
}

/// Held blocks in each sub-allocator: not handed out again until their marks complete,
/// then reused; counted as waiting, not free or live.
#[cfg(all(test, not(memres_loom)))]
mod held_in_suballocators {
    use std::sync::Arc;

    use super::*;
    use crate::suballoc::{Arena, FixedSize, Pool, PoolConfig};
    use crate::upstream::HostHeap;

    /// Frees `n` blocks of `r` as if another stream still used them (marks that complete
    /// when `done` is set), then checks that `n` new blocks avoid them until then, and
    /// that the blocks come back once it is.
    fn held_until_done<R: Resource>(r: &R, held: &Deferred, size: usize, n: usize) {
        let l = Layout::from_size_align(size, 256).unwrap();
        let s = StreamRef::host(3);
        let done = Arc::new(AtomicBool::new(false));
        let first: Vec<_> = (0..n).map(|_| r.allocate(s, l).unwrap()).collect();
        for p in &first {
            held.push_marked(p.as_ptr() as usize, l, vec![Mark::Flag(done.clone())]);
        }
        // Blocks freed on `s` while their other stream's work is pending are not reused.
        let second: Vec<_> = (0..n).map(|_| r.allocate(s, l).unwrap()).collect();
        for p in &second {
            assert!(!first.contains(p), "a held block was handed out again");
        }
        assert_eq!(held.bytes(), n * size);
        done.store(true, Ordering::Release);
        for p in second {
            // SAFETY: allocated above with `l` on `s`; unused.
            unsafe { r.deallocate_used_on(s, p, l, &[StreamRef::host(4)]) };
        }
        // The free above looked at the held blocks: theirs are complete now.
        assert!(!held.any());
        assert_eq!(held.bytes(), 0);
    }

    /// A block freed on a stream while another stream's work may still use it comes back,
    /// once that work is done, to its own stream's next allocation of its size (whose fast
    /// path looks at the held blocks once a millisecond at most), even where the stream's
    /// list holds other free memory: as under PyTorch's caching allocator (its
    /// `test_record_stream`). Fails where the block goes back to the host stream's list,
    /// or is looked at only on the slow path.
    fn held_block_returns_to_its_stream<R: Resource>(r: &R, held: &Deferred) {
        let (s0, s1) = (StreamRef::host(1), StreamRef::host(2));
        let l = Layout::from_size_align(512, 256).unwrap();
        let big = Layout::from_size_align(1 << 20, 256).unwrap();
        let other = r.allocate(s0, l).unwrap();
        // `s1`'s list holds free memory besides the block to be held.
        let b = r.allocate(s1, big).unwrap();
        // SAFETY: allocated above with `big` on `s1`; unused.
        unsafe { r.deallocate(s1, b, big) };
        let tmp = r.allocate(s1, l).unwrap();
        let done = Arc::new(AtomicBool::new(false));
        held.push_marked_by(s1, tmp.as_ptr() as usize, l, vec![Mark::Flag(done.clone())]);
        let tmp2 = r.allocate(s1, l).unwrap();
        assert_ne!(tmp2, tmp, "a held block handed out before its work is done");
        done.store(true, Ordering::Release);
        std::thread::sleep(std::time::Duration::from_millis(2));
        let tmp3 = r.allocate(s1, l).unwrap();
        assert_eq!(tmp3, tmp, "the held block did not come back to its stream");
        assert!(!held.any());
        for (p, s) in [(tmp2, s1), (tmp3, s1), (other, s0)] {
            // SAFETY: allocated above with `l` on `s`; unused.
            unsafe { r.deallocate(s, p, l) };
        }
    }

    #[test]
    fn a_held_block_comes_back_to_its_streams_next_allocation() {
        use crate::suballoc::VirtualPoolConfig;
        use crate::upstream::HostVirtual;

        let pool = HostVirtual::new(1 << 30, 2 << 20)
            .and_then(|v| v.virtual_pool(VirtualPoolConfig::new()))
            .unwrap();
        held_block_returns_to_its_stream(&pool, pool.held());
        let pool = Pool::new(HostHeap::new(), PoolConfig::new()).unwrap();
        held_block_returns_to_its_stream(&pool, pool.held());
    }

    #[test]
    fn pool() {
        let pool = Pool::new(HostHeap::new(), PoolConfig::new()).unwrap();
        held_until_done(&pool, pool.held(), 1 << 20, 4);
        let stats = pool.stats();
        assert_eq!((stats.live_bytes(), stats.waiting_bytes), (0, 0));
    }

    #[test]
    fn fixed_size() {
        let fixed = FixedSize::with_block_size(HostHeap::new(), 4096, 8).unwrap();
        held_until_done(&fixed, fixed.held(), 4096, 8);
        assert_eq!(
            fixed.upstream_allocations(),
            2,
            "held blocks made it grow once"
        );
        assert_eq!(fixed.free_blocks(), 16);
    }

    #[test]
    fn arena() {
        let arena = Arena::with_size(HostHeap::new(), 16 << 20).unwrap();
        held_until_done(&arena, arena.held(), 64 << 10, 8);
    }

    /// A trim frees the held blocks whose events it waited for and keeps held a block
    /// whose events cannot be waited for (a broken context): its work may be pending, so
    /// it is neither freed nor handed out. Fails if `free_all` frees it regardless.
    #[test]
    fn a_trim_keeps_a_block_whose_wait_fails_held() {
        let pool = Pool::new(HostHeap::new(), PoolConfig::new().initial_size(4 << 20)).unwrap();
        let l = Layout::from_size_align(1 << 20, 256).unwrap();
        let (a, b) = (
            pool.allocate(StreamRef::HOST, l).unwrap(),
            pool.allocate(StreamRef::HOST, l).unwrap(),
        );
        let done = Arc::new(AtomicBool::new(true));
        pool.held()
            .push_marked(a.as_ptr() as usize, l, vec![Mark::Flag(done)]);
        pool.held()
            .push_marked(b.as_ptr() as usize, l, vec![Mark::Broken]);
        pool.trim().unwrap();
        assert_eq!(pool.held().bytes(), 1 << 20, "the broken block stays held");
        assert_eq!(pool.stats().waiting_bytes, 1 << 20);
        let again: Vec<_> = (0..3)
            .map(|_| pool.allocate(StreamRef::HOST, l).unwrap())
            .collect();
        assert!(
            !again.contains(&b),
            "a block whose wait failed was handed out"
        );
    }

    /// A pool's statistics count held bytes as waiting: neither free nor live.
    #[test]
    fn pool_stats_count_held_bytes_as_waiting() {
        let pool = Pool::new(HostHeap::new(), PoolConfig::new().initial_size(4 << 20)).unwrap();
        let l = Layout::from_size_align(1 << 20, 256).unwrap();
        let p = pool.allocate(StreamRef::HOST, l).unwrap();
        let done = Arc::new(AtomicBool::new(false));
        pool.held()
            .push_marked(p.as_ptr() as usize, l, vec![Mark::Flag(done.clone())]);
        let stats = pool.stats();
        assert_eq!(
            (stats.waiting_bytes, stats.live_bytes(), stats.free_bytes),
            (1 << 20, 0, 3 << 20)
        );
        done.store(true, Ordering::Release);
        assert_eq!(pool.trim().map(|_| pool.stats().free_bytes).ok(), Some(0));
    }

    /// A request that finds no memory while blocks are held waits for their marks, frees
    /// them and tries again, in each sub-allocator: the held blocks' work here completes
    /// only once the host waits for it (as a GPU stream's would), so the first try fails
    /// and the retry must be served from them. Fails if the retry frees nothing (issue
    /// 49: no CPU test noticed).
    fn retried_after_waiting<R: Resource>(r: &R, held: &Deferred, size: usize, n: usize) {
        let l = Layout::from_size_align(size, 256).unwrap();
        let s = StreamRef::host(3);
        let all: Vec<_> = (0..n).map(|_| r.allocate(s, l).unwrap()).collect();
        assert!(
            r.allocate(s, l).is_err(),
            "the resource holds {n} blocks of {size} bytes at most"
        );
        let done = Arc::new(AtomicBool::new(false));
        for p in &all {
            held.push_marked(p.as_ptr() as usize, l, vec![Mark::Waited(done.clone())]);
        }
        let again: Vec<_> = (0..n)
            .map(|_| {
                r.allocate(s, l)
                    .expect("served after the wait for held blocks")
            })
            .collect();
        assert!(done.load(Ordering::Acquire), "the failure path waited");
        assert!(!held.any());
        for p in again {
            // SAFETY: allocated above with `l` on `s`; unused.
            unsafe { r.deallocate(s, p, l) };
        }
    }

    #[test]
    fn a_pool_retries_after_waiting_for_held_blocks() {
        let config = PoolConfig::new()
            .initial_size(4 << 20)
            .maximum_size(4 << 20);
        let pool = Pool::new(HostHeap::new(), config).unwrap();
        retried_after_waiting(&pool, pool.held(), 1 << 20, 4);
    }

    #[test]
    fn a_fixed_size_retries_after_waiting_for_held_blocks() {
        let limited = crate::adaptor::Limiting::new(HostHeap::new(), 8 * 4096);
        let fixed = FixedSize::with_block_size(limited, 4096, 8).unwrap();
        retried_after_waiting(&fixed, fixed.held(), 4096, 8);
    }

    #[test]
    fn an_arena_retries_after_waiting_for_held_blocks() {
        let arena = Arena::with_size(HostHeap::new(), 4 << 20).unwrap();
        retried_after_waiting(&arena, arena.held(), 1 << 20, 4);
    }
}
