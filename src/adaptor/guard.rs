//! [`Guard`]: canary bytes around every block, checked when it is freed.

use std::alloc::Layout;
use std::backtrace::Backtrace;
use std::collections::VecDeque;
use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use super::{as_asked, upstream_access};
use crate::addr_map::AddrMap;
use crate::copy::{self, Access};
use crate::device::{Context, DeviceId, bind, process_is_exiting};
use crate::error::Error;
use crate::platform::{Active, Platform, StreamHandle};
use crate::resource::{DEFAULT_ALIGNMENT, Resource, SyncResource};
use crate::stream::{Event, StreamRef};
use crate::sync::Mutex;
use crate::sync::atomic::{AtomicU64, Ordering};
use crate::sync::lock;
use crate::upstream::PinnedHost;

/// The byte every canary is made of.
pub const CANARY: u8 = 0xCB;

/// The reports a [`Guard`] keeps for [`Guard::reports`]; later ones are only counted and
/// logged.
const KEPT_REPORTS: usize = 64;

/// Which side of a block a damaged canary was on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Side {
    /// Below the block: an underrun.
    Before,
    /// Above the block: an overrun.
    After,
}

/// A damaged canary: something wrote outside a block it was given.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Overrun {
    /// The block's address, as handed out.
    pub address: usize,
    /// The block's size in bytes.
    pub size: usize,
    /// Which side the damage is on.
    pub side: Side,
    /// How far from the block the nearest damaged byte is: 0 is the byte just past its
    /// end ([`Side::After`]) or just before its start ([`Side::Before`]).
    pub offset: usize,
    /// How many canary bytes on that side were changed.
    pub damaged: usize,
    /// The call stack that allocated the block, with [`Guard::with_backtraces`].
    pub backtrace: Option<String>,
}

impl fmt::Display for Overrun {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (what, edge) = match self.side {
            Side::Before => ("underrun", "before its start"),
            Side::After => ("overrun", "past its end"),
        };
        write!(
            f,
            "{what} of the block at {:#x} ({} B): {} canary byte(s) changed, the nearest {} B {edge}",
            self.address, self.size, self.damaged, self.offset
        )
    }
}

/// Pads every block with canary bytes on both sides and checks them when the block is
/// freed, to catch writes out of bounds that a pool would otherwise hide (a write past
/// one pooled block lands silently in the next). RMM lists such an adaptor as future
/// work; compute-sanitizer cannot see these writes, since the pool's memory is one valid
/// allocation to it.
///
/// - Each block gets `pad` bytes (default 256) of [`CANARY`] just before it and just
///   after it; the upstream is asked for the block plus both pads, the front one rounded
///   up to the block's alignment, of at least 256 bytes, which the upstream block has
///   too. Zero-byte requests pass straight through.
/// - **Host-accessible memory** freed on a host stream (or through `deallocate_sync`)
///   is checked at once, on the calling thread.
/// - **Device memory** freed on a CUDA stream is checked in stream order, without
///   waiting: the canaries are copied (`cuMemcpyAsync`) into pinned staging memory on
///   the free's stream, an event is recorded after the copy, the block goes back to the
///   upstream at once (the copy is ordered before any reuse), and the copies whose
///   event has completed are checked at the next free on any thread. The canaries are
///   written with `cuMemsetD8Async` on the allocation's stream. The free costs two
///   copies, an event and a lock; [`check_pending`](Guard::check_pending) waits for
///   every outstanding check (as dropping the guard does).
/// - Device-only memory freed through `deallocate_sync` or on a host stream is checked
///   with a copy on the legacy default stream of the block's device and a wait.
/// - A damaged canary is reported through `tracing::error!` (target `memres::guard`),
///   counted ([`found`](Guard::found)) and kept ([`reports`](Guard::reports), the first
///   64); the block still goes back to the upstream whole. With
///   [`with_backtraces`](Guard::with_backtraces) the report names the call stack that
///   allocated the block (costly: for hunting a bug, not for production).
/// - On a stream under capture (CUDA graphs) the canaries are written by captured sets
///   and frees are not checked: a check needs an event the host can wait for.
/// - A check the driver fails to make (for instance a sticky error after a kernel fault)
///   is logged, and the block is freed anyway.
/// - Equality: guards over equal upstreams with the same pad are equal; a block freed
///   through another guard than the one that allocated it is checked there (without its
///   backtrace).
///
/// ```
/// use memres::adaptor::{Guard, Side};
/// use memres::{HostHeap, SyncResource, layout};
///
/// let guarded = Guard::new(HostHeap::new());
/// let l = layout(100)?;
/// let p = guarded.allocate_sync(l)?;
/// // SAFETY: one byte past the end of the block: the bug the guard is there to catch
/// // (the byte is the guard's padding, so the write itself stays in allocated memory).
/// unsafe { p.as_ptr().add(100).write(0) };
/// // SAFETY: allocated above with `l`.
/// unsafe { guarded.deallocate_sync(p, l) };
/// assert_eq!(guarded.found(), 1);
/// let report = &guarded.reports()[0];
/// assert_eq!((report.side, report.offset, report.size), (Side::After, 0, 100));
/// # Ok::<(), memres::Error>(())
/// ```
pub struct Guard<U> {
    /// First, so that it drops first: its drop waits for the checks in flight, whose
    /// copies read memory the upstream may release when it drops.
    checks: Checks,
    upstream: U,
}

/// Everything of a guard but its upstream.
struct Checks {
    pad: usize,
    /// Block address -> the call stack that allocated it, with backtraces on.
    backtraces: Option<Mutex<AddrMap<Arc<Backtrace>>>>,
    found: AtomicU64,
    reports: Mutex<Vec<Overrun>>,
    device: Mutex<DeviceChecks>,
}

upstream_access!(Guard<U>);

/// The stream-ordered checks of device memory.
#[derive(Default)]
struct DeviceChecks {
    /// Checks whose copies are enqueued, oldest first.
    pending: VecDeque<Pending>,
    /// Pinned staging slots of `2 * pad` bytes, free for the next check.
    slots: Vec<Slot>,
    /// Where the slots come from, made on the first device check.
    pinned: Option<PinnedHost>,
}

/// One check in flight: the canaries of a freed block, on their way to `slot`.
struct Pending {
    event: Event,
    slot: Slot,
    address: usize,
    size: usize,
    backtrace: Option<Arc<Backtrace>>,
}

/// `2 * pad` bytes of pinned host memory: the front canary, then the back one.
struct Slot(NonNull<u8>);

// SAFETY: a slot is plain pinned host memory owned by one `Pending` or the free list at a
// time, always under the `DeviceChecks` lock.
unsafe impl Send for Slot {}

/// How the canaries of a block are reached.
enum Route {
    /// Host memory the host may touch now.
    Host,
    /// Device memory, in order on this CUDA stream of this context.
    Stream(Context, StreamHandle),
    /// Device memory nothing uses, on the legacy stream of its device, waited for.
    Legacy(Context),
    /// A stream under capture (CUDA graphs): the canaries are written by captured sets,
    /// and a free is not checked (the check's event could not be waited for).
    Captured(Context, StreamHandle),
}

impl<U> Guard<U> {
    /// Pads with 256 canary bytes on each side.
    pub fn new(upstream: U) -> Self {
        Guard {
            checks: Checks {
                pad: DEFAULT_ALIGNMENT,
                backtraces: None,
                found: AtomicU64::new(0),
                reports: Mutex::new(Vec::new()),
                device: Mutex::new(DeviceChecks::default()),
            },
            upstream,
        }
    }

    /// Pads with `pad` canary bytes on each side: at least 1 and at most 1 MiB, else
    /// [`Error::InvalidArgument`].
    pub fn with_pad(upstream: U, pad: usize) -> Result<Self, Error> {
        if pad == 0 || pad > 1 << 20 {
            return Err(Error::invalid_argument(format!(
                "Guard: the pad must be 1 B to 1 MiB; {pad} is not"
            )));
        }
        let mut guard = Guard::new(upstream);
        guard.checks.pad = pad;
        Ok(guard)
    }

    /// Also records the call stack of every allocation, for the reports.
    pub fn with_backtraces(mut self) -> Self {
        self.checks.backtraces = Some(Mutex::new(AddrMap::default()));
        self
    }

    /// The canary bytes on each side of a block.
    pub fn pad(&self) -> usize {
        self.checks.pad
    }

    /// Damaged canaries found so far (checks still in flight not included; see
    /// [`check_pending`](Self::check_pending)).
    pub fn found(&self) -> u64 {
        self.checks.found()
    }

    /// The first 64 damaged canaries found, oldest first.
    pub fn reports(&self) -> Vec<Overrun> {
        lock(&self.checks.reports).clone()
    }

    /// Waits for every stream-ordered check still in flight and makes it, then returns
    /// [`found`](Self::found).
    ///
    /// # Errors
    /// What the driver returns while waiting (the remaining checks are dropped, logged).
    pub fn check_pending(&self) -> Result<u64, Error> {
        self.checks.check_pending()
    }
}

impl Checks {
    /// A staging slot: both canaries.
    fn slot_layout(&self) -> Layout {
        Layout::from_size_align(2 * self.pad, DEFAULT_ALIGNMENT).expect("the pad is at most 1 MiB")
    }

    fn found(&self) -> u64 {
        self.found.load(Ordering::Relaxed)
    }

    fn check_pending(&self) -> Result<u64, Error> {
        let mut checks = lock(&self.device);
        let mut result = Ok(());
        while let Some(pending) = checks.pending.pop_front() {
            match pending.event.synchronize() {
                Ok(()) => self.finish(&mut checks, pending),
                Err(e) => {
                    tracing::error!(target: "memres::guard", error = %e, address = pending.address, "a canary check could not be made");
                    result = result.and(Err(e));
                    checks.slots.push(pending.slot);
                }
            }
        }
        result.map(|()| self.found())
    }

    /// The offset of the block in the upstream block, and the upstream's layout.
    fn plan(&self, layout: Layout) -> Result<(usize, Layout), Error> {
        let align = layout.align().max(DEFAULT_ALIGNMENT);
        let front = self.pad.next_multiple_of(align);
        let total = front
            .checked_add(layout.size())
            .and_then(|s| s.checked_add(self.pad))
            .ok_or(Error::out_of_memory(layout.size()))?;
        let upstream = Layout::from_size_align(total, align)
            .map_err(|_| Error::out_of_memory(layout.size()))?;
        Ok((front, upstream))
    }

    /// Checks the canaries copied to `bytes` (front, then back) of the block at
    /// `address`, and reports what is damaged.
    fn inspect(
        &self,
        front: &[u8],
        back: &[u8],
        address: usize,
        size: usize,
        backtrace: Option<&Backtrace>,
    ) {
        if intact(front) && intact(back) {
            return;
        }
        // The front canary ends at the block: its nearest byte is its last one.
        if let Some(nearest) = front.iter().rposition(|&b| b != CANARY) {
            self.report(Overrun {
                address,
                size,
                side: Side::Before,
                offset: front.len() - 1 - nearest,
                damaged: front.iter().filter(|&&b| b != CANARY).count(),
                backtrace: backtrace.map(Backtrace::to_string),
            });
        }
        if let Some(nearest) = back.iter().position(|&b| b != CANARY) {
            self.report(Overrun {
                address,
                size,
                side: Side::After,
                offset: nearest,
                damaged: back.iter().filter(|&&b| b != CANARY).count(),
                backtrace: backtrace.map(Backtrace::to_string),
            });
        }
    }

    fn report(&self, overrun: Overrun) {
        tracing::error!(
            target: "memres::guard",
            address = overrun.address,
            size = overrun.size,
            side = ?overrun.side,
            offset = overrun.offset,
            damaged = overrun.damaged,
            backtrace = overrun.backtrace.as_deref().unwrap_or("not captured"),
            "memres::Guard: {overrun}"
        );
        self.found.fetch_add(1, Ordering::Relaxed);
        let mut reports = lock(&self.reports);
        if reports.len() < KEPT_REPORTS {
            reports.push(overrun);
        }
    }

    /// Checks a pending block whose copies are complete, and recycles its slot.
    fn finish(&self, checks: &mut DeviceChecks, pending: Pending) {
        let (front, back) = self.slot_halves(&pending.slot);
        self.inspect(
            front,
            back,
            pending.address,
            pending.size,
            pending.backtrace.as_deref(),
        );
        checks.slots.push(pending.slot);
    }

    /// A slot's two canaries.
    fn slot_halves(&self, slot: &Slot) -> (&[u8], &[u8]) {
        // SAFETY: a slot is `2 * pad` bytes of host memory, and the copies into it are
        // complete (the caller waited for or queried its event).
        let bytes = unsafe { std::slice::from_raw_parts(slot.0.as_ptr(), 2 * self.pad) };
        bytes.split_at(self.pad)
    }

    /// Makes the checks whose copies are complete, without waiting.
    fn poll(&self, checks: &mut DeviceChecks) {
        let mut i = 0;
        while i < checks.pending.len() {
            match checks.pending[i].event.is_complete() {
                Ok(false) => i += 1,
                Ok(true) => {
                    let pending = checks.pending.remove(i).expect("i is in range");
                    self.finish(checks, pending);
                }
                Err(e) => {
                    let pending = checks.pending.remove(i).expect("i is in range");
                    tracing::error!(target: "memres::guard", error = %e, address = pending.address, "a canary check could not be made");
                    checks.slots.push(pending.slot);
                }
            }
        }
    }

    fn remember(&self, address: usize) {
        if let Some(map) = &self.backtraces {
            let trace = Arc::new(Backtrace::force_capture());
            lock(map).insert(address, trace);
        }
    }

    fn recall(&self, address: usize) -> Option<Arc<Backtrace>> {
        self.backtraces
            .as_ref()
            .and_then(|map| lock(map).remove(&address))
    }
}

/// True when `bytes` are all [`CANARY`] (compared a page at a time, as `memcmp`).
fn intact(bytes: &[u8]) -> bool {
    static PAGE: [u8; 4096] = [CANARY; 4096];
    bytes.chunks(PAGE.len()).all(|c| c == &PAGE[..c.len()])
}

impl<U: SyncResource> Guard<U> {
    /// How the canaries of a block of `U`'s memory are reached on `stream` (`None`: the
    /// synchronous API).
    fn route(&self, stream: Option<StreamRef<'_>>, block: usize) -> Result<Route, Error> {
        let access = Access::of::<U>();
        match stream.and_then(StreamRef::cu) {
            _ if !access.device() => Ok(Route::Host),
            None if access.host() => Ok(Route::Host),
            None => Ok(Route::Legacy(context_of_pointer(block)?)),
            Some(raw) => {
                let stream = stream.expect("a raw handle comes from a stream");
                let ctx = if stream.is_default() || stream.is_per_thread() {
                    context_of_pointer(block)?
                } else {
                    Context::of_stream(raw)?
                };
                if stream.is_capturing_in(ctx)? {
                    Ok(Route::Captured(ctx, raw))
                } else {
                    Ok(Route::Stream(ctx, raw))
                }
            }
        }
    }

    /// Writes both canaries of the block at `user` of `size` bytes.
    fn paint(&self, route: &Route, user: usize, size: usize) -> Result<(), Error> {
        let (before, after) = (user - self.checks.pad, user + size);
        match *route {
            Route::Host => {
                // SAFETY: both pads lie in the upstream block (see `plan`), host memory
                // that nothing else uses yet.
                unsafe {
                    std::ptr::write_bytes(before as *mut u8, CANARY, self.checks.pad);
                    std::ptr::write_bytes(after as *mut u8, CANARY, self.checks.pad);
                }
                Ok(())
            }
            Route::Stream(ctx, raw) | Route::Captured(ctx, raw) => {
                let _current = bind(ctx)?;
                // SAFETY: `raw` is live for this call (the caller's `StreamRef`); the pads
                // lie in the block, which is the caller's in order on that stream.
                let stream = unsafe { StreamRef::from_raw(raw as crate::stream::RawStream) };
                fill(before, after, self.checks.pad, stream)
            }
            Route::Legacy(ctx) => {
                let _current = bind(ctx)?;
                fill(before, after, self.checks.pad, StreamRef::DEFAULT)?;
                StreamRef::DEFAULT.synchronize_in(ctx)
            }
        }
    }

    /// Checks both canaries of a freed block, or enqueues their check; the block is the
    /// caller's until this returns.
    // long: one arm per route a block's pads are read on, each a straight line.
    fn check(&self, route: &Route, user: usize, size: usize) -> Result<(), Error> {
        let (before, after) = (user - self.checks.pad, user + size);
        let backtrace = self.checks.recall(user);
        match *route {
            Route::Host => {
                // SAFETY: both pads lie in the block, host memory that nothing uses any
                // more (the caller's promise).
                let (front, back) = unsafe {
                    (
                        std::slice::from_raw_parts(before as *const u8, self.checks.pad),
                        std::slice::from_raw_parts(after as *const u8, self.checks.pad),
                    )
                };
                self.checks
                    .inspect(front, back, user, size, backtrace.as_deref());
                Ok(())
            }
            Route::Legacy(ctx) => {
                let _current = bind(ctx)?;
                let mut bytes = vec![0u8; 2 * self.checks.pad];
                let (front, back) = bytes.split_at_mut(self.checks.pad);
                // SAFETY: the pads lie in the block, which nothing uses any more; the
                // destinations are ours; the legacy stream of the current context is
                // waited for before the buffers are read.
                unsafe {
                    fetch(front, before, back, after, StreamRef::DEFAULT)?;
                }
                StreamRef::DEFAULT.synchronize_in(ctx)?;
                let (front, back) = bytes.split_at(self.checks.pad);
                self.checks
                    .inspect(front, back, user, size, backtrace.as_deref());
                Ok(())
            }
            Route::Captured(..) => Ok(()),
            Route::Stream(ctx, raw) => {
                let _current = bind(ctx)?;
                let mut checks = lock(&self.checks.device);
                let slot = self.slot(&mut checks, ctx)?;
                // SAFETY: `raw` is live for this call (the caller's `StreamRef`).
                let stream = unsafe { StreamRef::from_raw(raw as crate::stream::RawStream) };
                let enqueued = (|| -> Result<Event, Error> {
                    // SAFETY: a slot is `2 * pad` bytes of pinned memory that stays
                    // ours until the event recorded after the copies completes.
                    let (front, back) = unsafe {
                        std::slice::from_raw_parts_mut(slot.0.as_ptr(), 2 * self.checks.pad)
                            .split_at_mut(self.checks.pad)
                    };
                    // SAFETY: the pads lie in the block, valid in order on `stream`
                    // until the caller's free, which comes after this.
                    unsafe { fetch(front, before, back, after, stream)? };
                    let event = Event::new_in(ctx)?;
                    event.record(stream)?;
                    Ok(event)
                })();
                match enqueued {
                    Ok(event) => {
                        checks.pending.push_back(Pending {
                            event,
                            slot,
                            address: user,
                            size,
                            backtrace,
                        });
                        Ok(())
                    }
                    // A copy into the slot may already be enqueued: the slot is left
                    // unused (2 * pad bytes of pinned memory) rather than reused under it.
                    Err(e) => Err(e),
                }
            }
        }
    }

    /// A free staging slot, made where none is.
    fn slot(&self, checks: &mut DeviceChecks, ctx: Context) -> Result<Slot, Error> {
        self.checks.poll(checks);
        if let Some(slot) = checks.slots.pop() {
            return Ok(slot);
        }
        let pinned = match checks.pinned {
            Some(p) => p,
            None => *checks.pinned.insert(PinnedHost::on(ctx.device())?),
        };
        pinned.allocate_sync(self.checks.slot_layout()).map(Slot)
    }

    /// Allocates through `allocate` (the upstream's, on some stream) and paints.
    fn guarded_allocate(
        &self,
        stream: Option<StreamRef<'_>>,
        layout: Layout,
        allocate: impl FnOnce(Layout) -> Result<NonNull<u8>, Error>,
        free: impl FnOnce(NonNull<u8>, Layout),
    ) -> Result<NonNull<u8>, Error> {
        let (front, up) = self.checks.plan(layout)?;
        let base = as_asked(allocate(up), layout)?;
        let user = base.map_addr(|a| a.saturating_add(front));
        let address = user.as_ptr() as usize;
        let painted = self
            .route(stream, address)
            .and_then(|route| self.paint(&route, address, layout.size()));
        match painted {
            Ok(()) => {
                self.checks.remember(address);
                Ok(user)
            }
            Err(e) => {
                free(base, up);
                Err(e)
            }
        }
    }

    /// Checks (or enqueues the check of) a block, then frees it through `free`.
    fn guarded_free(
        &self,
        stream: Option<StreamRef<'_>>,
        ptr: NonNull<u8>,
        layout: Layout,
        free: impl FnOnce(NonNull<u8>, Layout),
    ) {
        let (front, up) = match self.checks.plan(layout) {
            Ok(plan) => plan,
            Err(_) => {
                tracing::error!(target: "memres::guard", address = ptr.as_ptr() as usize, "freeing a block with a layout no guarded block has; passed on as is");
                return free(ptr, layout);
            }
        };
        let address = ptr.as_ptr() as usize;
        let checked = self
            .route(stream, address)
            .and_then(|route| self.check(&route, address, layout.size()));
        if let Err(e) = checked {
            tracing::error!(target: "memres::guard", error = %e, address, "a canary check could not be made; the block is freed unchecked");
        }
        free(ptr.map_addr(|a| non_zero(a.get() - front)), up);
    }
}

fn non_zero(address: usize) -> std::num::NonZeroUsize {
    std::num::NonZeroUsize::new(address).expect("a guarded block lies above its front pad")
}

/// The primary context of the device whose memory `address` is.
fn context_of_pointer(address: usize) -> Result<Context, Error> {
    crate::driver::init()?;
    Context::primary(DeviceId::new(Active::pointer_device(address)?))
}

/// Sets both pads to the canary, in order on `stream`.
fn fill(before: usize, after: usize, pad: usize, stream: StreamRef<'_>) -> Result<(), Error> {
    let device = Access::DEVICE;
    // SAFETY: the callers pass pads inside a device-accessible block that is theirs in
    // order on `stream`, with the stream's context current.
    unsafe {
        copy::fill(before as *mut u8, CANARY, device, pad, stream)?;
        copy::fill(after as *mut u8, CANARY, device, pad, stream)
    }
}

/// Copies both pads into `front` and `back`, in order on `stream`.
///
/// # Safety
/// The pads are device-accessible and valid in order on `stream` until the copies are
/// done, as are `front` and `back`; the stream's context is current.
unsafe fn fetch(
    front: &mut [u8],
    before: usize,
    back: &mut [u8],
    after: usize,
    stream: StreamRef<'_>,
) -> Result<(), Error> {
    let (to, from) = (Access::HOST, Access::DEVICE);
    // SAFETY: the caller's promise; the lengths are the slices'.
    unsafe {
        copy::copy(
            front.as_mut_ptr(),
            to,
            before as *const u8,
            from,
            front.len(),
            stream,
        )?;
        copy::copy(
            back.as_mut_ptr(),
            to,
            after as *const u8,
            from,
            back.len(),
            stream,
        )
    }
}

impl<U: PartialEq> PartialEq for Guard<U> {
    /// Equal when the upstreams are and the pads match: each may then free the other's
    /// blocks.
    fn eq(&self, other: &Self) -> bool {
        self.upstream == other.upstream && self.checks.pad == other.checks.pad
    }
}

impl<U: fmt::Debug> fmt::Debug for Guard<U> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Guard")
            .field("upstream", &self.upstream)
            .field("pad", &self.checks.pad)
            .field("found", &self.found())
            .finish()
    }
}

impl Drop for Checks {
    fn drop(&mut self) {
        if process_is_exiting() {
            // The driver may be gone: the pinned slots go with the process.
            std::mem::forget(std::mem::take(&mut *lock(&self.device)));
            return;
        }
        // Waits for the checks in flight and makes them (a failure is logged there).
        let _ = self.check_pending();
        let mut checks = std::mem::take(&mut *lock(&self.device));
        if let Some(pinned) = checks.pinned {
            let layout = self.slot_layout();
            for slot in checks.slots.drain(..) {
                // SAFETY: every slot came from `pinned` with this layout; no copy into it
                // is in flight (`check_pending` waited for them all).
                unsafe { pinned.deallocate_sync(slot.0, layout) };
            }
        }
    }
}

// SAFETY: every block is a part of an upstream block asked for with room for both pads
// (`plan`), aligned as asked (the front pad is a multiple of the alignment), and goes
// back to the upstream whole with the layout it was asked for.
unsafe impl<U: SyncResource> SyncResource for Guard<U> {
    type Properties = U::Properties;

    fn allocate_sync(&self, layout: Layout) -> Result<NonNull<u8>, Error> {
        if layout.size() == 0 {
            return self.upstream.allocate_sync(layout);
        }
        self.guarded_allocate(
            None,
            layout,
            |up| self.upstream.allocate_sync(up),
            // SAFETY: just allocated with `up`, never handed out.
            |base, up| unsafe { self.upstream.deallocate_sync(base, up) },
        )
    }

    unsafe fn deallocate_sync(&self, ptr: NonNull<u8>, layout: Layout) {
        if layout.size() == 0 {
            // SAFETY: passed through whole at allocation.
            return unsafe { self.upstream.deallocate_sync(ptr, layout) };
        }
        // SAFETY: `guarded_free` hands back the upstream block and layout of a block
        // this guard handed out (the caller's promise), which nothing uses any more.
        self.guarded_free(None, ptr, layout, |base, up| unsafe {
            self.upstream.deallocate_sync(base, up)
        });
    }
}

// SAFETY: as for `SyncResource`; in stream order, the canary copies are enqueued on the
// free's stream before the block goes back to the upstream on that stream.
unsafe impl<U: Resource> Resource for Guard<U> {
    fn allocate(&self, stream: StreamRef<'_>, layout: Layout) -> Result<NonNull<u8>, Error> {
        if layout.size() == 0 {
            return self.upstream.allocate(stream, layout);
        }
        self.guarded_allocate(
            Some(stream),
            layout,
            |up| self.upstream.allocate(stream, up),
            // SAFETY: just allocated with `up` on `stream`, never handed out.
            |base, up| unsafe { self.upstream.deallocate(stream, base, up) },
        )
    }

    unsafe fn deallocate(&self, stream: StreamRef<'_>, ptr: NonNull<u8>, layout: Layout) {
        if layout.size() == 0 {
            // SAFETY: passed through whole at allocation.
            return unsafe { self.upstream.deallocate(stream, ptr, layout) };
        }
        // SAFETY: as in `deallocate_sync`, in the caller's stream order.
        self.guarded_free(Some(stream), ptr, layout, |base, up| unsafe {
            self.upstream.deallocate(stream, base, up)
        });
    }
}
