//! Sub-allocators: resources that take large blocks from an upstream resource and hand
//! out pieces of them, much faster than the upstream could.
//!
//! - [`Pool`]: coalescing, any size, per-stream free lists (RMM's `pool_memory_resource`).
//! - [`FixedSize`]: blocks of one size in O(1) (RMM's `fixed_size_memory_resource`).
//! - [`Binning`]: requests sorted by size into bins of other resources, larger ones to the
//!   upstream (RMM's `binning_memory_resource`).
//! - [`Arena`]: one upstream allocation handed to per-stream arenas a superblock at a
//!   time (RMM's `arena_memory_resource`).
//!
//! All of them keep their upstream's properties (`Pool<Cuda>` is device memory,
//! `Pool<PinnedHost>` host-and-device), run on host memory as well as on a GPU, and are
//! safe to call from many threads at once: each stream has its own free list behind its
//! own lock, found without taking a shared lock.

mod arena;
mod binning;
mod chunks;
mod fixed;
mod free_blocks;
mod pool;
mod shards;
mod spin;
mod thread_cache;

pub use arena::{Arena, SUPERBLOCK_SIZE};
pub use binning::Binning;
pub use fixed::FixedSize;
pub use pool::{Pool, PoolConfig, PoolStats};

/// loom models of the sub-allocators' protocols (run by `.ci/run` with
/// `--cfg memres_loom`; see `tests/loom.rs` for the public-API models).
#[cfg(all(test, memres_loom))]
mod loom_models;
