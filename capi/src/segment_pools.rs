//! Segment pools behind the C ABI (`memres_segment_pool_*`): the library's
//! [`SegmentPool`] over a device's stack or over another allocator's two functions. The
//! PyTorch backend builds its CUDA graph pools and `torch.cuda.MemPool`s from them, and
//! keeps only torch's side (which pool a capture routes to, streams recorded for blocks,
//! checkpoints as saved tables). Which pool holds an address is the library's
//! [`Owners`] over every pool's segments ([`SEGMENTS`], `memres_segment_pool_holding`):
//! the backend keeps no table of blocks.

use std::alloc::Layout;
use std::ffi::{c_int, c_void};
use std::ptr::NonNull;
use std::sync::LazyLock;
use std::sync::atomic::{AtomicUsize, Ordering};

use mr::adaptor::Owners;
use mr::suballoc::{BlockEntry, SegmentPool, SegmentPoolConfig, Settle};
use mr::{Device, Error, Resource, StreamRef, SyncResource};

use crate::stack::DeviceStack;
use crate::{Failure, MEMRES_OK, allocate_on, deallocate_on, guarded, stack};

/// `flags`: each block is a segment of its own (`MemPool(no_split=True)`).
pub const MEMRES_SEGMENTS_NO_SPLIT: c_int = 1;
/// `flags`: requests of 1 to 10 MiB get 20 MiB segments (PyTorch's user `MemPool`s).
pub const MEMRES_SEGMENTS_MEDIUM: c_int = 2;

/// `memres_segment_pool_settle`: frees the held blocks whose streams' work is complete.
pub const MEMRES_SETTLE_POLL: c_int = 0;
/// `memres_segment_pool_settle`: waits for every held block's streams, then frees it.
pub const MEMRES_SETTLE_WAIT: c_int = 1;
/// `memres_segment_pool_settle`: forgets every held block without freeing it.
pub const MEMRES_SETTLE_FORGET: c_int = 2;

const MIB: usize = 1 << 20;

/// Another allocator's segment allocation: a segment of `size` bytes for `stream`, or
/// null (its reason the caller's to keep).
#[allow(non_camel_case_types)]
pub type memres_segment_alloc_fn =
    Option<unsafe extern "C" fn(ctx: *mut c_void, size: usize, stream: *mut c_void) -> *mut c_void>;
/// Another allocator's segment free.
#[allow(non_camel_case_types)]
pub type memres_segment_free_fn =
    Option<unsafe extern "C" fn(ctx: *mut c_void, ptr: *mut c_void, size: usize)>;

/// One block of a segment pool's table (the header's `memres_block_t`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub struct memres_block_t {
    /// The segment's first address.
    pub segment: u64,
    /// The segment's size in bytes.
    pub segment_size: u64,
    /// The block's offset in its segment.
    pub offset: u64,
    /// The block's size in bytes.
    pub size: u64,
    /// The stream the segment belongs to (its raw handle).
    pub stream: *mut c_void,
    /// 1 when handed out, 0 when free.
    pub allocated: i32,
    /// 1 when freed by its owner but held for other streams' work (allocated stays 1).
    pub held: i32,
}

/// Every segment of every segment pool, as a removable range whose member is its pool's
/// handle (its address): listed as the segment is taken, before any block of it is
/// handed out, and removed before it is given back. Its lock is taken under a pool's
/// table lock (a segment taken) and under the backend's locks, and nothing is called
/// while it is held.
static SEGMENTS: LazyLock<Owners> = LazyLock::new(Owners::default);

/// Where a segment pool's segments come from, listing each in [`SEGMENTS`] under its pool.
pub(crate) struct Source {
    origin: Origin,
    /// The handle of the pool (its address) the segments are listed under: set once the
    /// handle is boxed, before its first segment is taken.
    handle: AtomicUsize,
}

/// Where the memory comes from.
enum Origin {
    /// The device's stack, as `memres_malloc` (counted in its figures).
    Stack(&'static DeviceStack),
    /// Another allocator's functions (a `MemPool(allocator)`'s).
    Foreign {
        alloc: unsafe extern "C" fn(*mut c_void, usize, *mut c_void) -> *mut c_void,
        free: unsafe extern "C" fn(*mut c_void, *mut c_void, usize),
        ctx: *mut c_void,
    },
}

// SAFETY: `ctx` is the caller's, who promises (`memres_segment_pool_new`) that the
// functions may be called with it from any thread.
unsafe impl Send for Source {}
// SAFETY: as above.
unsafe impl Sync for Source {}

impl PartialEq for Source {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self, other)
    }
}

// SAFETY: device memory of the stack (whose contract the stack keeps) or of another
// allocator, whose functions the caller vouches for (`memres_segment_pool_new`); a
// segment goes back to the source it came from.
unsafe impl SyncResource for Source {
    type Properties = Device;

    fn allocate_sync(&self, layout: Layout) -> Result<NonNull<u8>, Error> {
        self.allocate(StreamRef::DEFAULT, layout)
    }

    unsafe fn deallocate_sync(&self, ptr: NonNull<u8>, layout: Layout) {
        // SAFETY: the caller's promise; the default stream comes after the legacy work.
        unsafe { self.deallocate(StreamRef::DEFAULT, ptr, layout) }
    }
}

// SAFETY: as above.
unsafe impl Resource for Source {
    fn allocate(&self, stream: StreamRef<'_>, layout: Layout) -> Result<NonNull<u8>, Error> {
        let ptr = match self.origin {
            Origin::Stack(stack) => allocate_on(stack, stream, layout)?,
            Origin::Foreign { alloc, ctx, .. } => {
                let raw = stream.as_raw().unwrap_or(std::ptr::null_mut());
                // SAFETY: the caller's functions and context (`memres_segment_pool_new`).
                let ptr = unsafe { alloc(ctx, layout.size(), raw.cast()) };
                NonNull::new(ptr.cast()).ok_or(Error::out_of_memory(layout.size()))?
            }
        };
        let listed = SEGMENTS.insert_range(ptr.as_ptr().addr(), layout.size(), self.handle());
        if let Err(e) = listed {
            // Memory another pool's segment holds (a foreign allocator's mistake): given
            // back, never handed out twice.
            // SAFETY: just taken with `layout`, unused; `stream` orders nothing yet.
            unsafe { self.give_back(stream, ptr, layout) };
            return Err(e);
        }
        Ok(ptr)
    }

    unsafe fn deallocate(&self, stream: StreamRef<'_>, ptr: NonNull<u8>, layout: Layout) {
        // Unlisted first: once given back, the memory may be another pool's segment.
        SEGMENTS.remove_range(ptr.as_ptr().addr(), self.handle());
        // SAFETY: the caller's promise, passed on.
        unsafe { self.give_back(stream, ptr, layout) };
    }
}

impl Source {
    /// Segments from `origin`, listed under the handle set later ([`Source::listed_under`]).
    fn new(origin: Origin) -> Source {
        Source {
            origin,
            handle: AtomicUsize::new(0),
        }
    }

    /// Lists the segments taken from now on under `handle`.
    fn listed_under(&self, handle: *mut SegmentPoolHandle) {
        // Read by the pool's allocations, which come after the handle is returned.
        self.handle
            .store(handle.expose_provenance(), Ordering::Relaxed);
    }

    /// The handle the segments are listed under.
    fn handle(&self) -> usize {
        self.handle.load(Ordering::Relaxed)
    }

    /// Gives a segment back to where it came from.
    ///
    /// # Safety
    /// As for [`Resource::deallocate`]: `ptr` came from this source with `layout`, and
    /// every use is ordered before this point on `stream`.
    unsafe fn give_back(&self, stream: StreamRef<'_>, ptr: NonNull<u8>, layout: Layout) {
        match self.origin {
            // SAFETY: the caller's promise: from `allocate_on` with `layout`, ordered.
            Origin::Stack(stack) => unsafe { deallocate_on(stack, stream, ptr, layout) },
            // SAFETY: from `alloc` with this size (the foreign allocator frees it in its
            // own order, as torch's `raw_delete` does).
            Origin::Foreign { free, ctx, .. } => unsafe {
                free(ctx, ptr.as_ptr().cast(), layout.size())
            },
        }
    }
}

/// A segment pool of the C ABI (the header's opaque `memres_segment_pool_t`).
pub struct SegmentPoolHandle {
    pool: SegmentPool<Source>,
}

/// A segment pool on `device` (flags: `MEMRES_SEGMENTS_*`): with `alloc` null, its
/// segments come from the device's stack (counted as `memres_malloc` blocks), else from
/// `alloc(ctx, size, stream)` and go back to `free(ctx, ptr, size)`. 512-byte blocks in
/// 2 MiB-rounded segments, taken from the stack aligned to its in-place pool's granule
/// where that pool is its base (`DeviceStack::segment_alignment`). Null on failure
/// (`memres_last_error`).
///
/// # Safety
/// `alloc` and `free` are both null or both functions that may be called with `ctx` from
/// any thread while the pool lives: `alloc` gives device memory of `device` of the size
/// asked for, or null; `free` takes back what `alloc` gave.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memres_segment_pool_new(
    device: c_int,
    flags: c_int,
    alloc: memres_segment_alloc_fn,
    free: memres_segment_free_fn,
    ctx: *mut c_void,
) -> *mut SegmentPoolHandle {
    guarded(
        |_| std::ptr::null_mut(),
        || {
            if flags & !(MEMRES_SEGMENTS_NO_SPLIT | MEMRES_SEGMENTS_MEDIUM) != 0 {
                return Err(Failure::invalid(format!(
                    "memres_segment_pool_new: unknown flags {flags:#x}"
                )));
            }
            let mut alignment = mr::device::DEFAULT_ALIGNMENT;
            let origin = match (alloc, free) {
                (None, None) => {
                    let stack = stack(device)?;
                    alignment = stack.segment_alignment();
                    Origin::Stack(stack)
                }
                (Some(alloc), Some(free)) => Origin::Foreign { alloc, free, ctx },
                _ => {
                    return Err(Failure::invalid(
                        "memres_segment_pool_new: alloc and free are both given or both null",
                    ));
                }
            };
            let mut config = SegmentPoolConfig::new()
                .no_split(flags & MEMRES_SEGMENTS_NO_SPLIT != 0)
                .segment_alignment(alignment);
            if flags & MEMRES_SEGMENTS_MEDIUM != 0 {
                config = config.medium_segments(MIB, 10 * MIB, 20 * MIB);
            }
            let pool = SegmentPool::new(Source::new(origin), config)?;
            let handle = Box::into_raw(Box::new(SegmentPoolHandle { pool }));
            // SAFETY: just boxed, not handed out yet.
            unsafe { &*handle }.pool.upstream().listed_under(handle);
            Ok(handle)
        },
    )
}

/// The pool behind a handle, or a failure naming the call for null.
///
/// # Safety
/// `pool` is null or from `memres_segment_pool_new`, not destroyed.
unsafe fn handle<'a>(
    pool: *mut SegmentPoolHandle,
    what: &str,
) -> Result<&'a SegmentPool<Source>, Failure> {
    // SAFETY: the caller's promise.
    unsafe { pool.as_ref() }
        .map(|h| &h.pool)
        .ok_or_else(|| Failure::invalid(format!("{what}: the pool is null")))
}

/// A block of `size` bytes for `stream`: the smallest free block of the pool's segments
/// for that stream that fits, else (`may_grow` nonzero) a new segment. Held blocks whose
/// streams' work is complete are freed first (unless `capturing`: a capture is underway
/// on the device); while `stream` is captured, blocks freed earlier in the same capture
/// on its own segments come back once the graph orders their streams' work first. Null,
/// with `memres_last_error`, when there is none (out of memory, or `size` 0).
///
/// # Safety
/// `pool` is from `memres_segment_pool_new`, not destroyed; `stream` is a live stream of
/// the pool's device (or a default-stream handle) that stays live while the pool holds a
/// segment taken for it.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memres_segment_pool_malloc(
    pool: *mut SegmentPoolHandle,
    size: usize,
    stream: *mut c_void,
    may_grow: c_int,
    capturing: c_int,
) -> *mut c_void {
    guarded(
        |_| std::ptr::null_mut(),
        || {
            // SAFETY: the caller's promise.
            let pool = unsafe { handle(pool, "memres_segment_pool_malloc") }?;
            if size == 0 {
                return Err(Failure::invalid("memres_segment_pool_malloc: a size of 0"));
            }
            let layout = mr::layout(size)?;
            // SAFETY: the caller's promise about `stream`.
            let stream = unsafe { StreamRef::from_raw(stream.cast()) };
            let ptr = pool.allocate_ordered(stream, layout, may_grow != 0, capturing != 0)?;
            Ok(ptr.as_ptr().cast())
        },
    )
}

/// Frees the block at `ptr`, merging it with its free neighbours; a block other streams
/// were recorded for (`memres_segment_pool_record_stream`) is held until their work is
/// complete (`capturing`: a capture is underway on the device, so its events wait for
/// `memres_segment_pool_settle` after it). `MEMRES_OK`, or
/// `MEMRES_ERROR_INVALID_ARGUMENT` (nothing freed) where `ptr` is not the start of a live
/// block of the pool.
///
/// # Safety
/// `pool` is from `memres_segment_pool_new`, not destroyed; every use of the block is
/// ordered before this point on its segment's stream or on a stream recorded for it.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memres_segment_pool_free(
    pool: *mut SegmentPoolHandle,
    ptr: *mut c_void,
    capturing: c_int,
) -> c_int {
    guarded(
        |code| code,
        || {
            // SAFETY: the caller's promise.
            let pool = unsafe { handle(pool, "memres_segment_pool_free") }?;
            let ptr = NonNull::new(ptr.cast())
                .ok_or_else(|| Failure::invalid("memres_segment_pool_free: a null pointer"))?;
            // SAFETY: the caller's promise about the block's uses.
            unsafe { pool.free_used(ptr, capturing != 0) }
                .map_err(|e| Failure::from(e).within("memres_segment_pool_free"))?;
            Ok(MEMRES_OK)
        },
    )
}

/// Records that work on `stream` uses the live block at `ptr` (PyTorch's
/// `Tensor.record_stream`): its free holds it until that work (enqueued by the free) is
/// complete. `MEMRES_OK`, or `MEMRES_ERROR_INVALID_ARGUMENT` for what is not the start
/// of a live block of the pool.
///
/// # Safety
/// `pool` is from `memres_segment_pool_new`, not destroyed; `stream` stays live until the
/// block's free has completed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memres_segment_pool_record_stream(
    pool: *mut SegmentPoolHandle,
    ptr: *mut c_void,
    stream: *mut c_void,
) -> c_int {
    guarded(
        |code| code,
        || {
            // SAFETY: the caller's promise.
            let pool = unsafe { handle(pool, "memres_segment_pool_record_stream") }?;
            let ptr = NonNull::new(ptr.cast()).ok_or_else(|| {
                Failure::invalid("memres_segment_pool_record_stream: a null pointer")
            })?;
            // SAFETY: the caller's promise about `stream`.
            unsafe { pool.record_stream(ptr, StreamRef::from_raw(stream.cast())) }
                .map_err(|e| Failure::from(e).within("memres_segment_pool_record_stream"))?;
            Ok(MEMRES_OK)
        },
    )
}

/// Settles the held blocks: `MEMRES_SETTLE_POLL` frees those whose streams' work is
/// complete (never waiting; not during a capture on the device), `MEMRES_SETTLE_WAIT`
/// waits for all and frees them, `MEMRES_SETTLE_FORGET` forgets them unfreed (inside a
/// capture, before a restore replaces the table). `MEMRES_OK` or a negative code.
///
/// # Safety
/// `pool` is from `memres_segment_pool_new`, not destroyed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memres_segment_pool_settle(
    pool: *mut SegmentPoolHandle,
    how: c_int,
) -> c_int {
    guarded(
        |code| code,
        || {
            // SAFETY: the caller's promise.
            let pool = unsafe { handle(pool, "memres_segment_pool_settle") }?;
            let how = match how {
                MEMRES_SETTLE_POLL => Settle::Poll,
                MEMRES_SETTLE_WAIT => Settle::Wait,
                MEMRES_SETTLE_FORGET => Settle::Forget,
                other => {
                    return Err(Failure::invalid(format!(
                        "memres_segment_pool_settle: unknown mode {other}"
                    )));
                }
            };
            pool.settle(how);
            Ok(MEMRES_OK)
        },
    )
}

/// Writes the pool's table (each segment's blocks in address order, segments in the
/// order they were taken) into `out`, at most `capacity` entries (`out` may be null with
/// `capacity` 0), and returns how many there are, or a negative code. Linear in the
/// table's entries.
///
/// # Safety
/// `pool` is from `memres_segment_pool_new`, not destroyed; `out` is null or has room
/// for `capacity` entries.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memres_segment_pool_blocks(
    pool: *mut SegmentPoolHandle,
    out: *mut memres_block_t,
    capacity: usize,
) -> i64 {
    guarded(i64::from, || {
        // SAFETY: the caller's promise.
        let pool = unsafe { handle(pool, "memres_segment_pool_blocks") }?;
        // One pass over the table, which names each block's stream (issue 47: a lookup
        // per segment, by a scan of the segments, made this quadratic in them).
        let blocks = pool.blocks();
        if !out.is_null() {
            for (i, entry) in blocks.iter().take(capacity).enumerate() {
                let block = memres_block_t {
                    segment: entry.segment as u64,
                    segment_size: entry.segment_size as u64,
                    offset: entry.offset as u64,
                    size: entry.size as u64,
                    stream: entry.stream.unwrap_or(0) as *mut c_void,
                    allocated: i32::from(entry.allocated),
                    held: i32::from(entry.held),
                };
                // SAFETY: `i` is below `capacity`, which `out` has room for.
                unsafe { out.add(i).write(block) };
            }
        }
        Ok(blocks.len() as i64)
    })
}

/// The segment of the pool holding `ptr`: writes its first address, size and stream and
/// returns 1; 0 (nothing written) when no segment of the pool holds `ptr`; a negative
/// code on failure.
///
/// # Safety
/// `pool` is from `memres_segment_pool_new`, not destroyed; `base`, `size` and `stream`
/// are each null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memres_segment_pool_segment_of(
    pool: *mut SegmentPoolHandle,
    ptr: *const c_void,
    base: *mut u64,
    size: *mut u64,
    stream: *mut *mut c_void,
) -> c_int {
    guarded(
        |code| code,
        || {
            // SAFETY: the caller's promise.
            let pool = unsafe { handle(pool, "memres_segment_pool_segment_of") }?;
            let Some((first, bytes, raw)) = pool.segment_of(ptr as usize) else {
                return Ok(0);
            };
            // SAFETY: each is null or writable (the caller's promise).
            unsafe {
                if let Some(base) = base.as_mut() {
                    *base = first as u64;
                }
                if let Some(size) = size.as_mut() {
                    *size = bytes as u64;
                }
                if let Some(stream) = stream.as_mut() {
                    *stream = raw.unwrap_or(0) as *mut c_void;
                }
            }
            Ok(1)
        },
    )
}

/// The segment pool (of any device) one of whose segments holds `ptr`, or null for
/// memory no segment pool holds. While no pool holds a segment the answer costs one
/// load; else a search of every pool's segments by address, under a lock. The handle
/// returned may be used only while the caller keeps the pool from being destroyed
/// (another thread may destroy it right after the answer).
#[unsafe(no_mangle)]
pub extern "C" fn memres_segment_pool_holding(ptr: *const c_void) -> *mut SegmentPoolHandle {
    guarded(
        |_| std::ptr::null_mut(),
        || {
            let handle = SEGMENTS.in_range(ptr.addr()).unwrap_or(0);
            Ok(std::ptr::with_exposed_provenance_mut(handle))
        },
    )
}

/// Puts back a table `memres_segment_pool_blocks` wrote (`count` entries): every block
/// live now is freed, the table's blocks laid out again in their segments, its allocated
/// blocks live. `MEMRES_OK`, or `MEMRES_ERROR_INVALID_ARGUMENT` with nothing changed for
/// a table naming a segment the pool no longer holds or whose blocks do not tile their
/// segments.
///
/// # Safety
/// `pool` is from `memres_segment_pool_new`, not destroyed; `blocks` has `count` entries
/// (or is null with `count` 0); the blocks live now are no longer used, and the table's
/// allocated blocks are again their owners'.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memres_segment_pool_restore(
    pool: *mut SegmentPoolHandle,
    blocks: *const memres_block_t,
    count: usize,
) -> c_int {
    guarded(
        |code| code,
        || {
            // SAFETY: the caller's promise.
            let pool = unsafe { handle(pool, "memres_segment_pool_restore") }?;
            let table: &[memres_block_t] = if count == 0 {
                &[]
            } else if blocks.is_null() {
                return Err(Failure::invalid(
                    "memres_segment_pool_restore: a null table",
                ));
            } else {
                // SAFETY: `count` entries (the caller's promise).
                unsafe { std::slice::from_raw_parts(blocks, count) }
            };
            let entries: Vec<BlockEntry> = table
                .iter()
                .map(|b| BlockEntry {
                    segment: b.segment as usize,
                    segment_size: b.segment_size as usize,
                    offset: b.offset as usize,
                    size: b.size as usize,
                    allocated: b.allocated != 0,
                    held: false,
                    // Not read: segments keep their streams.
                    stream: None,
                })
                .collect();
            // SAFETY: the caller's promise about the blocks live now and the table's.
            unsafe { pool.restore(&entries) }
                .map_err(|e| Failure::from(e).within("memres_segment_pool_restore"))?;
            Ok(MEMRES_OK)
        },
    )
}

/// Gives every wholly free segment back to where it came from, freed on `stream`; the
/// bytes given back, or a negative code.
///
/// # Safety
/// `pool` is from `memres_segment_pool_new`, not destroyed; every use of those
/// segments' memory is ordered before this point on `stream`, or complete (wait for the
/// device first: graph replays may have used them on any stream).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memres_segment_pool_release_free(
    pool: *mut SegmentPoolHandle,
    stream: *mut c_void,
) -> i64 {
    guarded(i64::from, || {
        // SAFETY: the caller's promise.
        let pool = unsafe { handle(pool, "memres_segment_pool_release_free") }?;
        // SAFETY: the caller's promise about `stream` and the segments' uses.
        let bytes = unsafe { pool.release_free_segments(StreamRef::from_raw(stream.cast())) };
        Ok(bytes as i64)
    })
}

/// Destroys the pool, giving every segment back (each freed on its own stream). Null is
/// ignored.
///
/// # Safety
/// `pool` is null or from `memres_segment_pool_new`, not destroyed; no block of it is
/// used any more.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memres_segment_pool_destroy(pool: *mut SegmentPoolHandle) {
    guarded(
        |_| (),
        || {
            if !pool.is_null() {
                // SAFETY: from `Box::into_raw` in `memres_segment_pool_new` (the caller's
                // promise), destroyed once.
                let handle = unsafe { Box::from_raw(pool) };
                // Unlisted before the handle is freed: once it is, a pool made meanwhile
                // on another thread may get the same address, and its own segments would
                // be unlisted in its place. (The drop's give-backs then find their ranges
                // gone; a segment it cannot give back, its device not waited for, stays
                // the process's, named by no lookup.)
                for (base, _) in handle.pool.segments() {
                    SEGMENTS.remove_range(base, pool.addr());
                }
                drop(handle);
            }
            Ok(())
        },
    )
}
