//! [`SegmentPool`]: whole segments from the upstream, split into blocks best-fit, with
//! the table of segments and blocks readable and restorable: the shape of PyTorch's
//! private pools (CUDA graph pools and `torch.cuda.MemPool`), which the C ABI builds
//! from this type for memres's PyTorch backend.
//!
//! Each segment belongs to the stream it was taken for; a block is handed out only to
//! allocations on its segment's stream (another stream would need to wait for that one
//! first). A free merges the block with its free neighbours at once. A segment goes back
//! to the upstream only when it is wholly free and the owner asks
//! ([`SegmentPool::release_free_segments`]) or the pool is dropped. The table is what
//! snapshots draw ([`SegmentPool::blocks`]) and what a checkpoint saves and later puts
//! back ([`SegmentPool::restore`]), the segments staying where they are.

use std::alloc::Layout;
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::ptr::NonNull;

use super::core::held::Deferred;
use crate::device::{Context, DEFAULT_ALIGNMENT};
use crate::error::Error;
use crate::resource::Resource;
use crate::stream::{Frontier, Recorded, StreamRef};
use crate::sync::{Mutex, lock};

const MIB: usize = 1 << 20;

/// How a [`SegmentPool`] sizes its blocks and segments.
///
/// ```
/// use memres::suballoc::SegmentPoolConfig;
///
/// // PyTorch's user pools: 512-byte blocks, 2 MiB segments, 20 MiB ones for 1-10 MiB.
/// let config = SegmentPoolConfig::new().medium_segments(1 << 20, 10 << 20, 20 << 20);
/// assert_eq!(config.segment_size(3 << 20), 20 << 20);
/// assert_eq!(config.segment_size(11 << 20), 12 << 20);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct SegmentPoolConfig {
    /// Every block's size is a multiple of this (a power of two; 512 by default).
    pub block_rounding: usize,
    /// A new segment's size is a multiple of this (2 MiB by default).
    pub segment_rounding: usize,
    /// Requests above `.0` and below `.1` bytes get segments of `.2` bytes (so that
    /// several share one), if set.
    pub medium: Option<(usize, usize, usize)>,
    /// A block is handed out whole, never split: one block per segment.
    pub no_split: bool,
    /// A segment whose size is a multiple of this is taken aligned to it (a power of two,
    /// at least [`DEFAULT_ALIGNMENT`], which it is by default).
    pub segment_alignment: usize,
}

impl SegmentPoolConfig {
    /// 512-byte blocks in 2 MiB-rounded segments, split as needed.
    pub const fn new() -> Self {
        SegmentPoolConfig {
            block_rounding: 512,
            segment_rounding: 2 * MIB,
            medium: None,
            no_split: false,
            segment_alignment: DEFAULT_ALIGNMENT,
        }
    }

    /// Blocks' sizes rounded up to a multiple of `bytes` (a power of two).
    pub const fn block_rounding(mut self, bytes: usize) -> Self {
        self.block_rounding = bytes;
        self
    }

    /// New segments' sizes rounded up to a multiple of `bytes`.
    pub const fn segment_rounding(mut self, bytes: usize) -> Self {
        self.segment_rounding = bytes;
        self
    }

    /// Requests of more than `above` and less than `below` bytes get segments of
    /// `segment` bytes.
    pub const fn medium_segments(mut self, above: usize, below: usize, segment: usize) -> Self {
        self.medium = Some((above, below, segment));
        self
    }

    /// Each block is a segment of its own, never split (PyTorch's `MemPool(no_split=True)`).
    pub const fn no_split(mut self, yes: bool) -> Self {
        self.no_split = yes;
        self
    }

    /// Segments whose size is a multiple of `bytes` (a power of two, at least
    /// [`DEFAULT_ALIGNMENT`]) are taken from the upstream aligned to it. Over an in-place
    /// pool, its granule: a segment of whole granules then covers whole granules, not
    /// the free end of one that the pool's small blocks use (as a PyTorch private pool's
    /// segments, `cudaMalloc`'d, never share memory with the default pool's), so the
    /// default pool's blocks stay together around it.
    ///
    /// ```
    /// use memres::suballoc::SegmentPoolConfig;
    ///
    /// let config = SegmentPoolConfig::new().segment_alignment(2 << 20);
    /// assert_eq!(config.alignment_of(4 << 20), 2 << 20);
    /// assert_eq!(config.alignment_of(3 << 10), 256); // not whole granules: as before
    /// ```
    pub const fn segment_alignment(mut self, bytes: usize) -> Self {
        self.segment_alignment = bytes;
        self
    }

    /// The alignment a segment of `size` bytes is taken with (see
    /// [`segment_alignment`](Self::segment_alignment)).
    pub const fn alignment_of(&self, size: usize) -> usize {
        if size.is_multiple_of(self.segment_alignment) {
            self.segment_alignment
        } else {
            DEFAULT_ALIGNMENT
        }
    }

    /// The size of the segment made for a block of `size` bytes (rounded as a block).
    pub fn segment_size(&self, size: usize) -> usize {
        if self.no_split {
            return size;
        }
        match self.medium {
            Some((above, below, segment)) if size > above && size < below && segment >= size => {
                segment
            }
            _ => size.div_ceil(self.segment_rounding) * self.segment_rounding,
        }
    }

    fn check(&self) -> Result<(), Error> {
        if !self.block_rounding.is_power_of_two() {
            return Err(Error::invalid_argument(format!(
                "a segment pool's block rounding of {} bytes is not a power of two",
                self.block_rounding
            )));
        }
        if self.segment_rounding == 0 || !self.segment_rounding.is_multiple_of(self.block_rounding)
        {
            return Err(Error::invalid_argument(format!(
                "a segment pool's segment rounding of {} bytes is not a positive multiple of \
                 its block rounding ({})",
                self.segment_rounding, self.block_rounding
            )));
        }
        if !self.segment_alignment.is_power_of_two() || self.segment_alignment < DEFAULT_ALIGNMENT {
            return Err(Error::invalid_argument(format!(
                "a segment pool's segment alignment of {} bytes is not a power of two of at \
                 least {DEFAULT_ALIGNMENT}",
                self.segment_alignment
            )));
        }
        if let Some((_, _, segment)) = self.medium
            && !segment.is_multiple_of(self.block_rounding)
        {
            return Err(Error::invalid_argument(format!(
                "a segment pool's medium segments of {segment} bytes are not a multiple of its \
                 block rounding ({})",
                self.block_rounding
            )));
        }
        Ok(())
    }
}

impl Default for SegmentPoolConfig {
    fn default() -> Self {
        SegmentPoolConfig::new()
    }
}

/// One block of a [`SegmentPool`]'s table, with its segment: what [`SegmentPool::blocks`]
/// lists and [`SegmentPool::restore`] takes back. The blocks of a segment tile it, in
/// address order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockEntry {
    /// The segment's first address.
    pub segment: usize,
    /// The segment's size in bytes.
    pub segment_size: usize,
    /// The block's offset in its segment.
    pub offset: usize,
    /// The block's size in bytes.
    pub size: usize,
    /// Handed out (not free).
    pub allocated: bool,
    /// Freed by its owner, held for other streams' work ([`SegmentPool::free_used`]):
    /// allocated in the table, no longer live for its owner. [`SegmentPool::restore`]
    /// reads `allocated` only: a saved held block comes back live (as PyTorch's own
    /// pools restore a block still waiting for its streams).
    pub held: bool,
    /// The raw handle of the stream the block's segment belongs to (`None`: a host
    /// stream), so that a listing needs no lookup per segment.
    /// [`SegmentPool::restore`] does not read it: segments keep their streams.
    pub stream: Option<usize>,
}

impl BlockEntry {
    /// The block's first address.
    pub fn address(&self) -> usize {
        self.segment + self.offset
    }
}

/// What [`SegmentPool::restore`] changed: the blocks it freed and those it made live,
/// by address. It may say more later, so only memres makes one.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Restored {
    /// Blocks allocated before (live, or held for other streams), freed by the restore.
    pub freed: Vec<usize>,
    /// Blocks live after (the saved table's allocated blocks).
    pub allocated: Vec<usize>,
}

/// A segment's blocks by offset, tiling it: (size, allocated).
type Blocks = BTreeMap<usize, (usize, bool)>;

struct Segment {
    /// Its first address (provenance exposed when it was taken, as the other
    /// sub-allocators keep their chunks).
    base: usize,
    size: usize,
    /// The stream it was taken for, kept as its key past the borrow (see
    /// [`SegmentPool::allocate`]'s stream contract).
    stream: StreamRef<'static>,
    /// That stream's device's context (none for a host stream): current while events of
    /// its held blocks are recorded, so a default-stream handle names that device's.
    ctx: Option<Context>,
    /// The alignment it was taken with.
    align: usize,
    blocks: Blocks,
}

impl Segment {
    fn contains(&self, address: usize) -> bool {
        address.wrapping_sub(self.base) < self.size
    }

    /// A pointer to the byte at `offset` (inside the segment).
    fn at(&self, offset: usize) -> NonNull<u8> {
        NonNull::new(std::ptr::with_exposed_provenance_mut(self.base + offset))
            .expect("segment addresses are not null")
    }

    fn layout(&self) -> Layout {
        // Checked when the segment was taken with it.
        Layout::from_size_align(self.size, self.align).expect("a segment's layout")
    }
}

#[derive(Default)]
struct Table {
    /// In the order they were taken (the order [`SegmentPool::blocks`] lists them).
    segments: Vec<Segment>,
    /// Each segment's position in `segments`, by its first address: a lookup by address
    /// costs a search of this map, not a scan of the segments, so listing or restoring a
    /// table of n segments is linear in its entries (issue 47: the C ABI's listing asked
    /// for each segment's stream by a scan, quadratic in the segments).
    by_base: BTreeMap<usize, usize>,
    live: usize,
    /// Streams recorded for live blocks ([`SegmentPool::record_stream`]), by address.
    recorded: HashMap<usize, Recorded>,
    /// Live blocks allocated during a capture, with the capture's id.
    captured_in: HashMap<usize, u64>,
}

/// What [`SegmentPool::settle`] does with held blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Settle {
    /// Frees those whose streams' work is complete; never waits. Streams captured now get
    /// their events later. (A caller that knows a capture is underway on the device, as
    /// PyTorch's backend does, does not poll then.)
    Poll,
    /// Waits for every held block's streams, then frees it.
    Wait,
    /// Forgets every held block without freeing it (inside a capture, where nothing may
    /// wait, before [`SegmentPool::restore`] replaces the table they would free into).
    Forget,
}

/// A pool of whole upstream segments split into blocks best-fit, whose table of
/// segments and blocks can be read and restored (PyTorch's private pools' shape).
///
/// ```
/// use memres::suballoc::{SegmentPool, SegmentPoolConfig};
/// use memres::{HostHeap, Resource, StreamRef, layout};
///
/// # fn main() -> Result<(), memres::Error> {
/// let pool = SegmentPool::new(HostHeap::new(), SegmentPoolConfig::new())?;
/// let s = StreamRef::host(1);
/// let a = pool.allocate(s, layout(1000)?)?;
/// let b = pool.allocate(s, layout(1000)?)?;
/// // One 2 MiB segment: two 1024-byte blocks and the free rest.
/// let table = pool.blocks();
/// assert_eq!(table.len(), 3);
/// assert_eq!(table[1].address(), b.as_ptr() as usize);
/// let saved = pool.blocks();
/// unsafe { pool.deallocate(s, b, layout(1000)?) };
/// // SAFETY: `a` is still live in the saved table and `b` becomes live again, as before.
/// let restored = unsafe { pool.restore(&saved)? };
/// assert_eq!(restored.allocated, [a.as_ptr() as usize, b.as_ptr() as usize]);
/// # unsafe { pool.deallocate(s, a, layout(1000)?); pool.deallocate(s, b, layout(1000)?) };
/// # Ok(()) }
/// ```
pub struct SegmentPool<U: Resource> {
    upstream: U,
    config: SegmentPoolConfig,
    table: Mutex<Table>,
    /// Blocks freed while recorded streams may still use them (the core's held blocks,
    /// [`Deferred::hold_later`]): allocated in the table until they go back. Locked after
    /// `table`, never before.
    held: Deferred,
}

impl<U: Resource> SegmentPool<U> {
    /// A pool over `upstream`, empty until its first allocation;
    /// [`Error::InvalidArgument`] for a config whose sizes do not fit together.
    pub fn new(upstream: U, config: SegmentPoolConfig) -> Result<Self, Error> {
        config.check()?;
        Ok(SegmentPool {
            upstream,
            config,
            table: Mutex::new(Table::default()),
            held: Deferred::default(),
        })
    }

    /// The resource the segments come from.
    pub fn upstream(&self) -> &U {
        &self.upstream
    }

    /// How blocks and segments are sized.
    pub fn config(&self) -> &SegmentPoolConfig {
        &self.config
    }

    /// A block for `layout` on `stream` from the free blocks of `stream`'s segments only
    /// (the pool does not grow): [`Error::OutOfMemory`] when none fits. PyTorch's
    /// `use_on_oom` pools lend their free blocks so.
    pub fn allocate_from_free(
        &self,
        stream: StreamRef<'_>,
        layout: Layout,
    ) -> Result<NonNull<u8>, Error> {
        self.take(stream, layout, false)
    }

    /// Frees the block at `ptr`, merging it with its free neighbours; its size, or
    /// [`Error::InvalidArgument`] (nothing changed) where `ptr` is not the start of a live
    /// block of the pool.
    ///
    /// # Safety
    /// Every use of the block is ordered before this point on its segment's stream (the
    /// stream it was allocated on), or complete.
    pub unsafe fn release(&self, ptr: NonNull<u8>) -> Result<usize, Error> {
        let address = ptr.as_ptr() as usize;
        let mut table = lock(&self.table);
        live_block(&table, &self.held, address)?;
        table.recorded.remove(&address);
        table.captured_in.remove(&address);
        Ok(table.release(address))
    }

    /// Records that work on `stream` uses the live block at `ptr` (PyTorch's
    /// `Tensor.record_stream`): its [`free_used`](Self::free_used) holds it until the work
    /// `stream` has enqueued by then is complete. The stream of the block's segment, or a
    /// stream recorded already, adds nothing. [`Error::InvalidArgument`] for what is not
    /// the start of a live block.
    ///
    /// # Safety
    /// `stream` stays valid until the block's free has completed (or, where a
    /// [`restore`](Self::restore) makes the block live again, its free after that).
    pub unsafe fn record_stream(
        &self,
        ptr: NonNull<u8>,
        stream: StreamRef<'_>,
    ) -> Result<(), Error> {
        let address = ptr.as_ptr() as usize;
        let mut table = lock(&self.table);
        if live_block(&table, &self.held, address)? == stream {
            return Ok(());
        }
        // SAFETY: the caller's promise: valid until the free completes, when the record
        // goes.
        let stream = unsafe { stream.detach() };
        table.recorded.entry(address).or_default().add(stream);
        Ok(())
    }

    /// Frees the block at `ptr` as PyTorch frees a tensor's: with no stream recorded for
    /// it, at once (as [`release`](Self::release)); else it is held, and goes back to the
    /// table once the work its recorded streams have enqueued by now is complete.
    /// `capturing`: a capture is underway on the device, so no event is recorded or
    /// queried until [`settle`](Self::settle) is called after it; a block made in that
    /// same capture notes instead where the graph has reached on each of its streams,
    /// and [`allocate_ordered`](Self::allocate_ordered) takes it back once the graph
    /// orders those points first. Its size, or [`Error::InvalidArgument`] (nothing
    /// changed) where `ptr` is not the start of a live block.
    ///
    /// # Safety
    /// As for [`release`](Self::release), for the block's segment's stream; the other
    /// streams that used it are recorded for it.
    pub unsafe fn free_used(&self, ptr: NonNull<u8>, capturing: bool) -> Result<usize, Error> {
        let address = ptr.as_ptr() as usize;
        let mut table = lock(&self.table);
        let own = live_block(&table, &self.held, address)?;
        let made_in = table.captured_in.remove(&address);
        let Some(streams) = table.recorded.remove(&address) else {
            return Ok(table.release(address));
        };
        let size = table.size_of(address);
        let in_capture = match made_in {
            Some(capture) if capturing => frontier_of_all(streams.streams(), own, capture),
            _ => None,
        };
        let ctx = table.segment(address).and_then(|s| s.ctx);
        self.held.hold_later(
            address,
            block_layout(size),
            ctx,
            streams.into_streams(),
            in_capture,
        );
        if !capturing {
            self.poll(&mut table);
        }
        Ok(size)
    }

    /// Settles the held blocks (those [`free_used`](Self::free_used) held for other
    /// streams) as `how` says.
    pub fn settle(&self, how: Settle) {
        let mut table = lock(&self.table);
        match how {
            Settle::Poll => self.poll(&mut table),
            Settle::Wait => {
                self.poll(&mut table);
                let (waited, unwaited): (Vec<_>, Vec<_>) =
                    self.held.drain().into_iter().partition(|h| h.wait());
                for held in waited {
                    table.release(held.addr());
                }
                if !unwaited.is_empty() {
                    // Never handed out while it may be in use: kept held (not live for
                    // its owner, listed as held), and said so.
                    tracing::error!(
                        "a segment pool could not wait for {} held block(s); they stay held",
                        unwaited.len()
                    );
                    self.held.restore(unwaited);
                }
            }
            Settle::Forget => self.held.forget_all(),
        }
    }

    /// Frees the held blocks whose streams' work is complete (recording the events of
    /// streams no longer captured first); `table` is the pool's, locked.
    fn poll(&self, table: &mut Table) {
        for (address, _) in self.held.take_ready() {
            table.release(address);
        }
    }

    /// A block as [`allocate`](Resource::allocate) gives one (`may_grow`) or
    /// [`allocate_from_free`](Self::allocate_from_free), after freeing the held blocks
    /// whose streams' work is complete (unless `capturing`: a capture is underway on the
    /// device) and, while `stream` is captured, taking back the blocks freed earlier in
    /// the same capture on `stream`'s own segments whose streams' captured work the graph
    /// orders before `stream`'s next work (replays keep that order). A block allocated
    /// during a capture is noted with it.
    pub fn allocate_ordered(
        &self,
        stream: StreamRef<'_>,
        layout: Layout,
        may_grow: bool,
        capturing: bool,
    ) -> Result<NonNull<u8>, Error> {
        let frontier = stream.capture_frontier();
        {
            let mut table = lock(&self.table);
            if !capturing {
                self.poll(&mut table);
            }
            if let Some(frontier) = &frontier {
                // The blocks of `stream`'s own segments freed earlier in this capture
                // whose streams' captured work the graph orders first.
                let own = |a: usize| table.segment(a).is_some_and(|s| s.stream == stream);
                for address in self.held.take_ordered(frontier, own) {
                    table.release(address);
                }
            }
        }
        let ptr = self.take(stream, layout, may_grow)?;
        if let Some(frontier) = frontier {
            lock(&self.table)
                .captured_in
                .insert(ptr.as_ptr() as usize, frontier.capture);
        }
        Ok(ptr)
    }

    /// The table: every segment's blocks in address order, segments in the order they
    /// were taken; linear in its entries.
    pub fn blocks(&self) -> Vec<BlockEntry> {
        let table = lock(&self.table);
        let held = self.held.addresses();
        let mut out = Vec::new();
        for segment in &table.segments {
            let base = segment.base;
            let stream = segment.stream.as_raw().map(|raw| raw as usize);
            out.extend(
                segment
                    .blocks
                    .iter()
                    .map(|(&offset, &(size, allocated))| BlockEntry {
                        segment: base,
                        segment_size: segment.size,
                        offset,
                        size,
                        allocated,
                        held: held.contains(&(base + offset)),
                        stream,
                    }),
            );
        }
        out
    }

    /// The live blocks (handed out, not freed).
    pub fn live_blocks(&self) -> usize {
        lock(&self.table).live
    }

    /// The segments held: (first address, size), in the order they were taken.
    pub fn segments(&self) -> Vec<(usize, usize)> {
        let table = lock(&self.table);
        table.segments.iter().map(|s| (s.base, s.size)).collect()
    }

    /// The segment holding `address` (its first address and size) and the raw handle of
    /// the stream it belongs to (`None`: a host stream), if the pool holds it.
    pub fn segment_of(&self, address: usize) -> Option<(usize, usize, Option<usize>)> {
        let table = lock(&self.table);
        table
            .segment(address)
            .map(|s| (s.base, s.size, s.stream.as_raw().map(|raw| raw as usize)))
    }

    /// Puts back a table that [`blocks`](Self::blocks) listed: every block allocated now
    /// (live, or held for other streams: their holds are dropped unwaited, so
    /// [`settle`](Self::settle) them first where that matters) is freed, then the saved
    /// table's blocks are laid out again in their segments (which must all still be the
    /// pool's; a segment the table does not name becomes one free block), its allocated
    /// blocks live. [`Error::InvalidArgument`], with nothing changed, for a table naming a
    /// segment the pool does not hold, or whose blocks do not tile their segment on the
    /// block grid.
    ///
    /// # Safety
    /// The blocks allocated now are no longer used (as for [`release`](Self::release);
    /// held ones included), and the memory of the saved table's allocated blocks is again
    /// its owners' (what they hold there is theirs to read). Streams recorded for a block
    /// the restore makes live again stay recorded: they must stay valid until its next
    /// free completes.
    pub unsafe fn restore(&self, saved: &[BlockEntry]) -> Result<Restored, Error> {
        let mut table = lock(&self.table);
        let layouts = group(&table, saved, self.config.block_rounding)?;
        let mut restored = Restored::default();
        for segment in &mut table.segments {
            let base = segment.base;
            restored.freed.extend(
                segment
                    .blocks
                    .iter()
                    .filter(|(_, (_, allocated))| *allocated)
                    .map(|(&offset, _)| base + offset),
            );
            segment.blocks = layouts
                .get(&base)
                .cloned()
                .unwrap_or_else(|| BTreeMap::from([(0, (segment.size, false))]));
            restored.allocated.extend(
                segment
                    .blocks
                    .iter()
                    .filter(|(_, (_, allocated))| *allocated)
                    .map(|(&offset, _)| base + offset),
            );
        }
        table.live = restored.allocated.len();
        // Held blocks (the caller settles them first) are gone with the table they would
        // free into; records stay for the blocks live again only.
        self.held.forget_all();
        table.captured_in.clear();
        let live: std::collections::HashSet<usize> = restored.allocated.iter().copied().collect();
        table.recorded.retain(|address, _| live.contains(address));
        Ok(restored)
    }

    /// Gives every wholly free segment back to the upstream, freed on `stream`; the bytes
    /// given back.
    ///
    /// # Safety
    /// Every use of those segments' memory is ordered before this point on `stream`, or
    /// complete (a graph replay may have used a segment on any stream: wait for the
    /// device first).
    pub unsafe fn release_free_segments(&self, stream: StreamRef<'_>) -> usize {
        let free: Vec<Segment> = {
            let mut table = lock(&self.table);
            let (free, kept) = std::mem::take(&mut table.segments)
                .into_iter()
                .partition(|s| s.blocks.len() == 1 && !s.blocks[&0].1);
            table.segments = kept;
            table.index();
            free
        };
        let mut bytes = 0;
        for segment in free {
            bytes += segment.size;
            // SAFETY: taken from the upstream with this layout; the caller orders every
            // use before this point on `stream`.
            unsafe {
                self.upstream
                    .deallocate(stream, segment.at(0), segment.layout())
            };
        }
        bytes
    }

    /// A block for `layout` on `stream`: the smallest free block of `stream`'s segments
    /// that fits, else (`may_grow`) a new segment.
    fn take(
        &self,
        stream: StreamRef<'_>,
        layout: Layout,
        may_grow: bool,
    ) -> Result<NonNull<u8>, Error> {
        let rounding = self.config.block_rounding;
        // Blocks lie at multiples of the rounding from segments aligned to
        // `DEFAULT_ALIGNMENT`.
        let aligned = rounding.min(DEFAULT_ALIGNMENT);
        if layout.align() > aligned {
            return Err(Error::invalid_argument(format!(
                "a segment pool's blocks are aligned to {aligned} bytes, not {}",
                layout.align()
            )));
        }
        let size = layout
            .size()
            .max(1)
            .checked_next_multiple_of(rounding)
            .ok_or_else(|| Error::invalid_argument(format!("{} bytes", layout.size())))?;
        let mut table = lock(&self.table);
        if let Some(ptr) = best_fit(&mut table, stream, size, self.config.no_split, rounding) {
            return Ok(ptr);
        }
        if !may_grow {
            return Err(Error::out_of_memory(size));
        }
        let segment_size = self.config.segment_size(size);
        let align = self.config.alignment_of(segment_size);
        let segment_layout = Layout::from_size_align(segment_size, align)
            .map_err(|_| Error::invalid_argument(format!("a segment of {segment_size} bytes")))?;
        let base = self.upstream.allocate(stream, segment_layout)?;
        // SAFETY: `stream` is valid while its segment lives, as this type's users promise
        // (the stream contract of `allocate`): it is kept as the segment's key and the
        // stream its memory goes back on at drop.
        let stream = unsafe { stream.detach() };
        let ctx = if stream.is_host() {
            None
        } else {
            stream.context().ok()
        };
        table.push(Segment {
            base: base.as_ptr().expose_provenance(),
            size: segment_size,
            stream,
            ctx,
            align,
            blocks: BTreeMap::from([(0, (segment_size, false))]),
        });
        let ptr = best_fit(&mut table, stream, size, self.config.no_split, rounding);
        Ok(ptr.expect("a new segment holds the block it was made for"))
    }
}

impl Table {
    /// The position in `segments` of the segment holding `address`.
    fn position(&self, address: usize) -> Option<usize> {
        let (_, &i) = self.by_base.range(..=address).next_back()?;
        self.segments[i].contains(address).then_some(i)
    }

    /// The segment holding `address`.
    fn segment(&self, address: usize) -> Option<&Segment> {
        self.position(address).map(|i| &self.segments[i])
    }

    /// Lists a new segment, after the others.
    fn push(&mut self, segment: Segment) {
        self.by_base.insert(segment.base, self.segments.len());
        self.segments.push(segment);
    }

    /// Indexes `segments` again after some left.
    fn index(&mut self) {
        self.by_base = self
            .segments
            .iter()
            .enumerate()
            .map(|(i, s)| (s.base, i))
            .collect();
    }

    /// Frees the allocated block at `address` (a live or held one), merging it.
    fn release(&mut self, address: usize) -> usize {
        let Some(i) = self.position(address) else {
            return 0;
        };
        let segment = &mut self.segments[i];
        let offset = address - segment.base;
        let size = match segment.blocks.get_mut(&offset) {
            Some((size, allocated)) if *allocated => {
                *allocated = false;
                *size
            }
            _ => return 0,
        };
        self.live -= 1;
        merge_free(&mut segment.blocks, offset);
        size
    }

    /// The size of the block at `address` (0 if none starts there).
    fn size_of(&self, address: usize) -> usize {
        self.segment(address)
            .and_then(|s| s.blocks.get(&(address - s.base)))
            .map_or(0, |&(size, _)| size)
    }
}

/// The stream of the segment holding the live block at `address` (allocated, not held),
/// or [`Error::InvalidArgument`].
fn live_block(table: &Table, held: &Deferred, address: usize) -> Result<StreamRef<'static>, Error> {
    let segment = table.segment(address).ok_or_else(|| not_live(address))?;
    match segment.blocks.get(&(address - segment.base)) {
        Some(&(_, true)) if !held.is_held(address) => Ok(segment.stream),
        _ => Err(not_live(address)),
    }
}

/// Where the captured work of each of `streams` and `own` has reached, if every one of
/// them is in the capture `capture` (one outside it, or in another, leaves the block to
/// events after the capture).
fn frontier_of_all(
    streams: &[StreamRef<'static>],
    own: StreamRef<'static>,
    capture: u64,
) -> Option<Frontier> {
    let mut nodes = Vec::new();
    for stream in streams.iter().copied().chain([own]) {
        let frontier = stream.capture_frontier().filter(|f| f.capture == capture)?;
        nodes.extend(frontier.nodes);
    }
    Some(Frontier { capture, nodes })
}

/// The layout a held block of `size` bytes is counted with (its size is all that is
/// read: the segment pool frees held blocks into its table, not to a resource).
fn block_layout(size: usize) -> Layout {
    Layout::from_size_align(size, 1).unwrap_or(Layout::new::<u8>())
}

/// The smallest free block of `stream`'s segments holding `size` bytes, split (unless
/// `no_split`) and marked live.
fn best_fit(
    table: &mut Table,
    stream: StreamRef<'_>,
    size: usize,
    no_split: bool,
    rounding: usize,
) -> Option<NonNull<u8>> {
    let mut best: Option<(usize, usize, usize)> = None; // (block size, segment, offset)
    for (i, segment) in table.segments.iter().enumerate() {
        if segment.stream != stream {
            continue;
        }
        for (&offset, &(block, allocated)) in &segment.blocks {
            if !allocated && block >= size && best.is_none_or(|(b, ..)| block < b) {
                best = Some((block, i, offset));
            }
        }
    }
    let (block, i, offset) = best?;
    let segment = &mut table.segments[i];
    if !no_split && block - size >= rounding {
        segment.blocks.insert(offset + size, (block - size, false));
        segment.blocks.insert(offset, (size, true));
    } else {
        segment.blocks.insert(offset, (block, true));
    }
    table.live += 1;
    Some(segment.at(offset))
}

/// Merges the free block at `offset` with a free next and a free previous block.
fn merge_free(blocks: &mut Blocks, offset: usize) {
    let mut size = blocks[&offset].0;
    if let Some((&next, &(next_size, false))) = blocks.range(offset + 1..).next() {
        blocks.remove(&next);
        size += next_size;
        blocks.insert(offset, (size, false));
    }
    if let Some((&prev, &(prev_size, false))) = blocks.range(..offset).next_back() {
        blocks.remove(&offset);
        blocks.insert(prev, (prev_size + size, false));
    }
}

/// The saved table's blocks by segment, checked against the pool's segments.
fn group(
    table: &Table,
    saved: &[BlockEntry],
    rounding: usize,
) -> Result<BTreeMap<usize, Blocks>, Error> {
    let mut layouts: BTreeMap<usize, Blocks> = BTreeMap::new();
    for entry in saved {
        let held = table
            .segment(entry.segment)
            .is_some_and(|s| s.base == entry.segment && s.size == entry.segment_size);
        if !held {
            return Err(Error::invalid_argument(format!(
                "a saved table names a segment of {} bytes at {:#x} that the pool does not hold",
                entry.segment_size, entry.segment
            )));
        }
        layouts
            .entry(entry.segment)
            .or_default()
            .insert(entry.offset, (entry.size, entry.allocated));
    }
    for (&base, blocks) in &layouts {
        // Every entry naming `base` gave its size, checked above to be the segment's.
        let size = table.segment(base).map(|s| s.size);
        let mut at = 0usize;
        for (&offset, &(block, _)) in blocks {
            // Each block starts where the last ended, on the rounding, and ends inside
            // the segment (checked arithmetic: a table may come from C).
            let end = at.checked_add(block);
            let fits = offset == at
                && block != 0
                && block.is_multiple_of(rounding)
                && end.is_some_and(|end| Some(end) <= size);
            if !fits {
                return Err(Error::invalid_argument(format!(
                    "a saved table's blocks do not tile the segment at {base:#x}"
                )));
            }
            at = end.unwrap_or(at);
        }
        if Some(at) != size {
            return Err(Error::invalid_argument(format!(
                "a saved table's blocks do not tile the segment at {base:#x}"
            )));
        }
    }
    Ok(layouts)
}

#[cold]
fn not_live(address: usize) -> Error {
    Error::invalid_argument(format!(
        "{address:#x} is not the start of a live block of the segment pool"
    ))
}

// SAFETY: every block lies inside one segment taken from `upstream` (so it has the
// upstream's properties), aligned to the block rounding from a segment base aligned to
// `DEFAULT_ALIGNMENT` (requests aligned to more are refused); a block is live for one
// owner at a time (the table marks it), and memory freed on a stream other than its
// segment's is handed out again only once that segment's stream waits for it.
unsafe impl<U: Resource> Resource for SegmentPool<U> {
    /// A block on `stream`: segments belong to the stream they were taken for, which stays
    /// valid while the pool holds them (as [`StreamRef::from_raw`]'s contract asks of a
    /// sub-allocator's streams).
    fn allocate(&self, stream: StreamRef<'_>, layout: Layout) -> Result<NonNull<u8>, Error> {
        if layout.size() == 0 {
            return Ok(crate::resource::dangling(layout));
        }
        self.take(stream, layout, true)
    }

    unsafe fn deallocate(&self, stream: StreamRef<'_>, ptr: NonNull<u8>, layout: Layout) {
        if layout.size() == 0 {
            return;
        }
        let address = ptr.as_ptr() as usize;
        let own = lock(&self.table).segment(address).map(|s| s.stream);
        let Some(own) = own else {
            debug_assert!(false, "{}", not_live(address));
            return;
        };
        // The block is reused on its segment's stream: that stream first waits for the
        // work `stream` has enqueued (the free's order); if it cannot, the host waits; if
        // that fails too, the block is never freed (leaked, said so) rather than handed
        // out while in use.
        if own != stream
            && own.wait_for_stream(stream).is_err()
            && let Err(e) = stream.synchronize()
        {
            tracing::error!("a segment pool could not order a free on another stream, leaked: {e}");
            return;
        }
        // Streams recorded for the block hold it; their events cannot be recorded while
        // `stream` is captured.
        let recorded = !lock(&self.table).recorded.is_empty();
        let capturing = recorded && stream.is_capturing().unwrap_or(true);
        // SAFETY: the caller's promise (every use ordered before this point on `stream`),
        // and the segment's stream now comes after it; other streams are recorded.
        let freed = unsafe { self.free_used(ptr, capturing) };
        debug_assert!(freed.is_ok(), "{freed:?}");
    }

    /// Records `stream` and each of `used_on` for the block (as
    /// [`record_stream`](SegmentPool::record_stream)) and frees it: held until the events
    /// recorded on them now complete. While any of them is captured (no event may be
    /// recorded then), `stream` waits for the others instead and the block is freed on it.
    unsafe fn deallocate_used_on(
        &self,
        stream: StreamRef<'_>,
        ptr: NonNull<u8>,
        layout: Layout,
        used_on: &[StreamRef<'_>],
    ) {
        if layout.size() == 0 {
            return;
        }
        let capturing = [stream]
            .iter()
            .chain(used_on)
            .any(|s| s.is_capturing().unwrap_or(true));
        if capturing {
            for &other in used_on {
                if stream.wait_for_stream(other).is_err()
                    && let Err(e) = other.synchronize()
                {
                    tracing::error!(
                        "a segment pool could not order a free after a stream, leaked: {e}"
                    );
                    return;
                }
            }
            // SAFETY: the caller's promise; `stream` now comes after every use.
            unsafe { self.deallocate(stream, ptr, layout) };
            return;
        }
        for &other in [stream].iter().chain(used_on) {
            // SAFETY: the streams are live during this call, and the free below records
            // their events before it returns (no capture is underway on them).
            let recorded = unsafe { self.record_stream(ptr, other) };
            debug_assert!(recorded.is_ok(), "{recorded:?}");
        }
        // SAFETY: the caller's promise; every other stream's use is recorded.
        let freed = unsafe { self.free_used(ptr, false) };
        debug_assert!(freed.is_ok(), "{freed:?}");
    }
}

sync_on_the_host_stream!(SegmentPool);

impl<U: Resource> PartialEq for SegmentPool<U> {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self, other)
    }
}

impl<U: Resource> Drop for SegmentPool<U> {
    fn drop(&mut self) {
        // Held blocks' streams may still use them: their work first.
        self.settle(Settle::Wait);
        let table = std::mem::take(&mut *lock(&self.table));
        // The segments' streams may be gone by now (a program destroys a stream once its
        // own work is done, and a segment outlives the blocks made on it): the devices
        // are waited for instead, once each, and the segments go back on the host stream.
        // A device that cannot be waited for keeps its segments (leaked, never freed
        // while work may use them).
        let mut waited: Vec<(Context, bool)> = Vec::new();
        for segment in table.segments {
            let done = match segment.ctx {
                None => true,
                Some(ctx) => match waited.iter().find(|(c, _)| *c == ctx) {
                    Some(&(_, done)) => done,
                    None => {
                        let done = ctx.synchronize().is_ok();
                        waited.push((ctx, done));
                        done
                    }
                },
            };
            if !done {
                tracing::error!(
                    "a segment pool could not wait for its device at drop: a segment of {} \
                     bytes is left to the process",
                    segment.size
                );
                continue;
            }
            // SAFETY: taken from the upstream with this layout; no work uses it any more
            // (the held blocks were settled above and its device waited for), so it may
            // be freed on the host stream.
            unsafe {
                self.upstream
                    .deallocate(StreamRef::HOST, segment.at(0), segment.layout())
            };
        }
    }
}

impl<U: Resource> fmt::Debug for SegmentPool<U> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let table = lock(&self.table);
        f.debug_struct("SegmentPool")
            .field("config", &self.config)
            .field("segments", &table.segments.len())
            .field("live", &table.live)
            .finish_non_exhaustive()
    }
}

#[cfg(all(test, not(memres_loom)))]
mod tests {
    use super::*;
    use crate::suballoc::core::held::Mark;
    use crate::upstream::HostHeap;

    /// `settle(Wait)` releases the held blocks it could wait for and keeps held one whose
    /// wait fails (a broken context): not live for its owner (a release is refused) and
    /// listed as held. Fails if the block is dropped from the held list (it would then
    /// read as live, and a stray release or a restore would take it).
    #[test]
    fn a_held_block_whose_wait_fails_stays_held() {
        let pool = SegmentPool::new(HostHeap::new(), SegmentPoolConfig::new()).unwrap();
        let s = StreamRef::host(1);
        let l = crate::layout(1024).unwrap();
        let (a, b) = (pool.allocate(s, l).unwrap(), pool.allocate(s, l).unwrap());
        let at = |p: NonNull<u8>| p.as_ptr() as usize;
        pool.held.push_marked(at(a), l, Vec::new());
        pool.held.push_marked(at(b), l, vec![Mark::Broken]);
        pool.settle(Settle::Wait);
        let held: Vec<_> = pool.blocks().into_iter().filter(|e| e.held).collect();
        assert_eq!(held.len(), 1);
        assert_eq!(held[0].address(), at(b));
        // SAFETY: `b` is held, not live: the release is refused and changes nothing.
        assert!(unsafe { pool.release(b) }.is_err());
        assert!(
            pool.blocks()
                .iter()
                .all(|e| e.address() != at(a) || !e.allocated)
        );
        pool.settle(Settle::Forget);
    }
}
