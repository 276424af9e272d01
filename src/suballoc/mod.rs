//! Sub-allocators: resources that take large blocks from an upstream resource and hand
//! out pieces of them, much faster than the upstream could.
//!
//! - [`Pool`]: coalescing, any size, per-stream free lists (RMM's `pool_memory_resource`),
//!   taking chunks from any upstream.
//! - [`VirtualPool`]: the same pool growing in place over a reserved address range
//!   (holds least; can sleep and wake).
//! - [`FixedSize`]: blocks of one size in O(1) (RMM's `fixed_size_memory_resource`).
//! - [`Binning`]: requests sorted by size into bins of other resources, larger ones to the
//!   upstream (RMM's `binning_memory_resource`).
//! - [`Arena`]: one upstream allocation handed to per-stream arenas a superblock at a
//!   time (RMM's `arena_memory_resource`).
//! - [`SegmentPool`]: whole upstream segments split into blocks best-fit, its table of
//!   segments and blocks readable and restorable (PyTorch's CUDA graph and `MemPool`
//!   pools: the C ABI builds them from it).
//!
//! # Streams
//! Memory freed on stream S goes to S's list and is reused on S at once: work enqueued on
//! S later is ordered after the free. It reaches another stream T only after S's work is
//! waited for. No event is recorded when memory is freed (RMM records one per free); a
//! stream that cannot be served takes memory freed on host streams (always complete),
//! grows the pool, and only then merges the other streams' lists after one
//! `cuCtxSynchronize` per device, which covers every stream (including destroyed ones and
//! the per-thread streams of threads that have exited). Lazily recorded events would wait
//! for S alone, but a `StreamRef` does not keep its stream alive until a later
//! allocation on T, so the pool could not record on S safely then.
//!
//! Lists are found by the stream's handle. A destroyed stream's handle may be given to a
//! new stream, which then finds the old stream's list: so a stream must have no pending
//! work on freed memory when it is destroyed. memres's own [`Stream`](crate::stream::Stream)
//! synchronises itself on drop; a stream named by a raw handle
//! ([`StreamRef::from_raw`](crate::StreamRef::from_raw), whose safety contract says so)
//! or a cudarc `CudaStream` (whose drop does not wait) must be synchronised before it is
//! destroyed.
//!
//! # Threads sharing a stream
//! Threads that use one stream one after another (PyTorch's main thread and its autograd
//! thread; a producer and a consumer taking turns) share its list, so a block one of them
//! frees serves the other's next request at once. A thread that finds a list's lock held
//! a few times (threads running into each other on one stream) takes a lane of its own:
//! lists of the same stream, one per lane, so that such threads do not all wait for one
//! lock. Memory moves between the lanes of a stream without a wait (one stream to the
//! device) when a lane lacks it. [`own_lane`] gives the calling thread its lane at once
//! (a worker that knows it will run beside others), and the environment variable
//! `MEMRES_LANES=per-thread` gives every thread its own at its first call.
//!
//! All of them keep their upstream's properties (`Pool<Cuda>` is device memory,
//! `Pool<PinnedHost>` host-and-device), run on host memory as well as on a GPU, and are
//! safe to call from many threads at once: each stream has its own free list behind its
//! own lock, found without taking a shared lock.

/// `SyncResource` for a stream-ordered sub-allocator: its synchronous calls are its calls
/// on the host stream (whose work is always complete), and its properties its upstream's.
/// `$ty` is generic over its upstream `U`; another form names the type and its generic
/// parameters (`Coalescing<U, H>, U: Resource, H: Holding<U>`).
macro_rules! sync_on_the_host_stream {
    ($ty:ident) => {
        sync_on_the_host_stream!($ty<U>, U: crate::resource::Resource);
    };
    ($ty:ty, $($generics:tt)*) => {
        // SAFETY: the type's `Resource` impl (beside its use of this macro) keeps the
        // contract on every stream; these calls are that impl's on the host stream.
        unsafe impl<$($generics)*> crate::resource::SyncResource for $ty {
            type Properties = U::Properties;

            #[inline]
            fn allocate_sync(
                &self,
                layout: std::alloc::Layout,
            ) -> Result<std::ptr::NonNull<u8>, crate::error::Error> {
                self.allocate(crate::stream::StreamRef::HOST, layout)
            }

            #[inline]
            unsafe fn deallocate_sync(
                &self,
                ptr: std::ptr::NonNull<u8>,
                layout: std::alloc::Layout,
            ) {
                // SAFETY: the caller's promise (from this resource with `layout`, unused
                // now), which is what freeing on a host stream means.
                unsafe { self.deallocate(crate::stream::StreamRef::HOST, ptr, layout) }
            }
        }
    };
}

mod arena;
mod binning;
mod chunks;
mod coalescing;
mod core;
mod fixed;
mod granule;
pub(crate) use chunks::to_ptr;
mod pool;
mod pool_config;
mod regions;
mod segment_pool;
mod superblocks;
mod thread_cache;
mod virtual_pool;

pub use arena::Arena;
pub use binning::Binning;
pub use coalescing::PoolStats;
pub use fixed::FixedSize;
pub use pool::Pool;
pub use pool_config::{Growth, PoolConfig};
pub use segment_pool::{BlockEntry, Restored, SegmentPool, SegmentPoolConfig, Settle};
pub use superblocks::SUPERBLOCK_SIZE;
pub use virtual_pool::{SleepMode, VirtualPool, VirtualPoolConfig};

/// Gives the calling thread a lane of its own on every stream it shares with other
/// threads (see "Threads sharing a stream" above), for the rest of its life: its
/// allocations and frees on a stream use a list no thread in another lane locks. For a
/// thread that will run beside others on one stream (a server's worker); a thread that
/// runs into others takes one by itself after a few waits.
///
/// ```
/// use memres::{HostHeap, Pool, PoolConfig, Resource, StreamRef, layout};
///
/// let pool = Pool::new(HostHeap::new(), PoolConfig::new())?;
/// let l = layout(1 << 20)?;
/// std::thread::scope(|s| {
///     for _ in 0..2 {
///         s.spawn(|| {
///             memres::suballoc::own_lane();
///             let p = pool.allocate(StreamRef::host(7), l).unwrap();
///             // SAFETY: allocated just above with `l` on host stream 7; unused.
///             unsafe { pool.deallocate(StreamRef::host(7), p, l) };
///         });
///     }
/// });
/// // The host's list and one of stream 7 for each thread's lane.
/// assert!(pool.stats().stream_lists >= 3);
/// # Ok::<(), memres::Error>(())
/// ```
pub fn own_lane() {
    crate::sync::threads::own_lane();
}

/// loom models of the sub-allocators' protocols (run by `.ci/run` with
/// `--cfg memres_loom`; see `tests/loom.rs` for the public-API models).
#[cfg(all(test, memres_loom))]
mod loom_models;
