//! [`VirtualPool`]: the coalescing pool that grows in place over a reserved address
//! range. How it holds memory (growth by mapping granules, release by unmapping them) is
//! [`grow`]; sleep and wake are [`sleep`]; the rest is its body, [`Coalescing`], shared
//! with the chunked [`Pool`](super::Pool).

use super::coalescing::{Coalescing, coalescing_pool};
use super::core::free_blocks::GRANULE;
use crate::error::Error;
use crate::resource::Resource;
use crate::upstream::GrowInPlace;
use crate::upstream::virtual_memory::{Backend, Granules, Virtual};

mod config;
mod grow;
mod sleep;
mod slept;
pub use config::VirtualPoolConfig;
use grow::{Mapped, Space};
pub use slept::SleepMode;

/// The pool that grows in place with its maps failing at chosen calls.
#[cfg(all(test, not(memres_loom)))]
mod fault_tests;

/// Sleep and wake of the virtual pool, its misuse included.
#[cfg(all(test, not(memres_loom)))]
mod sleep_tests;

/// The host copies' registration in the background, and the direct copies it allows.
#[cfg(all(test, not(memres_loom)))]
mod register_tests;

/// A coalescing sub-allocator that grows in place over a reserved address range (a
/// [`GrowInPlace`] upstream: [`CudaVirtual`](crate::CudaVirtual) on a GPU,
/// [`HostVirtual`](crate::upstream::HostVirtual) over host pages): the pool that holds least, and
/// the one that can [`sleep`](VirtualPool::sleep).
///
/// It maps exactly the granules a request lacks, right after its free memory, so its memory
/// is one range where every free block can merge with its neighbours, across growth steps;
/// [`trim`](VirtualPool::trim) gives back every fully free granule, also between live
/// blocks. A growth that takes the pool near the most it has held (its top eighth; a trim
/// starts its count again) first gives back the whole free granules elsewhere, so that it
/// holds, at its peaks, what is live; one well below keeps them for later requests, since
/// moving a granule costs the driver an unmap, a map and its access (about 50 us on an
/// H100). Requests below 512 KiB go to the lowest 16 MiB address region that has a fit, so
/// small blocks pack together and free memory gathers into whole granules (it costs some
/// speed: see `BENCHMARKS.md`). This is the default of the C ABI and the Python shims (the
/// spec word `virtual_pool`). Streams, lanes, merges, the release threshold and the drop
/// work as in the chunked [`Pool`](super::Pool), whose body it shares (its docs say how),
/// but for one rule: a host stream that finds no fit merges whole the list of a host stream
/// that has never missed in its own (one that has only freed, such as the freeing side of a
/// hand-off between streams) rather than take one block of it, so that their blocks
/// coalesce, as a CUDA stream's do after its merge. A stream that allocates keeps its list.
///
/// [`sleep`](VirtualPool::sleep) gives the physical memory back while the addresses stay
/// reserved, and [`wake`](VirtualPool::wake) maps it again where it was; only this pool
/// has them (a chunked pool has no addresses to keep):
///
/// ```compile_fail
/// use memres::{HostHeap, Pool, PoolConfig, suballoc::SleepMode};
///
/// let pool = Pool::new(HostHeap::new(), PoolConfig::new())?;
/// // SAFETY: nothing handed out.
/// unsafe { pool.sleep(SleepMode::Discard) }?; // no such method
/// # Ok::<(), memres::Error>(())
/// ```
///
/// Equality is identity: a pool equals only itself.
pub struct VirtualPool<U: Resource> {
    core: Coalescing<U, Space<U>>,
}

// The virtual pool's builder on its leaf, written here beside the pool (not in
// `upstream`, which imports nothing from `suballoc`).
impl<B: Backend> Virtual<B> {
    /// A [`VirtualPool`] over this leaf ([`VirtualPool::new`]).
    ///
    /// ```
    /// use memres::{Resource, StreamRef, VirtualPoolConfig, layout, upstream::HostVirtual};
    ///
    /// let pool = HostVirtual::new(1 << 30, 64 << 10)?.virtual_pool(VirtualPoolConfig::new())?;
    /// let l = layout(100 << 10)?;
    /// let p = pool.allocate(StreamRef::HOST, l)?;
    /// assert_eq!(pool.stats().pool_size, 128 << 10, "two 64 KiB granules");
    /// // SAFETY: allocated just above with `l` on the same stream; not used afterwards.
    /// unsafe { pool.deallocate(StreamRef::HOST, p, l) };
    /// pool.trim()?;
    /// assert_eq!(pool.stats().pool_size, 0);
    /// # Ok::<(), memres::Error>(())
    /// ```
    pub fn virtual_pool(self, config: VirtualPoolConfig) -> Result<VirtualPool<Virtual<B>>, Error> {
        VirtualPool::new(self, config)
    }
}

impl<U: Resource> VirtualPool<U> {
    /// A pool that grows in place over `upstream`'s reserved range: it maps only what a
    /// request lacks (whole granules, at least [`VirtualPoolConfig::growth_step`]) right after
    /// the free memory at the top of what it holds, so blocks merge across growth steps
    /// and no upstream allocation boundary fragments it; [`trim`](Self::trim) unmaps
    /// every fully free granule, also between live blocks. `config.initial()` is mapped
    /// at once (rounded up to the granularity); `config.maximum()` bounds what is mapped
    /// (a maximum below one granule, or one that the rounded initial size passes, is
    /// [`Error::InvalidArgument`]).
    ///
    /// ```
    /// use memres::{
    ///     Resource, StreamRef, VirtualPool, VirtualPoolConfig, layout,
    ///     upstream::HostVirtual,
    /// };
    ///
    /// let pool = VirtualPool::new(HostVirtual::new(1 << 30, 64 << 10)?, VirtualPoolConfig::new())?;
    /// let (a, b) = (layout(96 << 10)?, layout(96 << 10)?);
    /// let pa = pool.allocate(StreamRef::HOST, a)?; // maps two 64 KiB granules
    /// let pb = pool.allocate(StreamRef::HOST, b)?;
    /// // The second growth mapped only the one granule b lacked, right after the first two.
    /// assert_eq!(pool.stats().pool_size, 192 << 10);
    /// // SAFETY: each freed once with its layout; unused afterwards.
    /// unsafe {
    ///     pool.deallocate(StreamRef::HOST, pa, a);
    ///     pool.deallocate(StreamRef::HOST, pb, b);
    /// }
    /// assert_eq!(pool.stats().largest_free_block, 192 << 10, "merged across growths");
    /// # Ok::<(), memres::Error>(())
    /// ```
    // long: config checks, each error written out, then the pool and its initial memory.
    pub fn new(upstream: U, config: VirtualPoolConfig) -> Result<VirtualPool<U>, Error>
    where
        U: GrowInPlace,
    {
        config.validate()?;
        let granularity = upstream.granularity();
        let (base, len) = upstream.reservation();
        if !granularity.is_power_of_two() || granularity < GRANULE {
            return Err(Error::invalid_argument(format!(
                "a virtual pool needs a granularity that is a power of two of at least \
                 {GRANULE} bytes; the upstream's is {granularity}"
            )));
        }
        // The pool maps whole granules and never holds more than its maximum.
        if let Some(max) = config.maximum() {
            if max < granularity {
                return Err(Error::invalid_argument(format!(
                    "a virtual pool's maximum of {max} bytes is below one granule of its \
                     upstream ({granularity} bytes): it could never map anything"
                )));
            }
            if config.initial().next_multiple_of(granularity) > max {
                return Err(Error::invalid_argument(format!(
                    "a virtual pool's initial size of {} bytes rounds up to {} bytes \
                     (whole granules of {granularity}), above its maximum of {max}",
                    config.initial(),
                    config.initial().next_multiple_of(granularity)
                )));
            }
        }
        let space = Space::new(&upstream, config);
        let pool = VirtualPool {
            core: Coalescing::new(
                upstream,
                space,
                Mapped {
                    mapped: Granules::new(len / granularity),
                    ..Mapped::default()
                },
                config.maximum(),
                config.threshold(),
            ),
        };
        if config.initial() > 0 {
            let core = &pool.core;
            let host = core.host_list();
            let mut growth = core.lock_growth();
            let len = config.initial().next_multiple_of(granularity);
            let mut s = host.state.lock();
            core.map_into(&mut growth, &mut s, base, len)?;
            core.lists.note_free(host);
        }
        Ok(pool)
    }

    /// The configuration the pool was made with.
    pub fn config(&self) -> VirtualPoolConfig {
        self.core.holding.config
    }
}

coalescing_pool!(
    VirtualPool,
    "VirtualPool, VirtualPoolConfig, upstream::HostVirtual",
    "VirtualPool::new(HostVirtual::new(1 << 30, 64 << 10)?, VirtualPoolConfig::new()"
);
