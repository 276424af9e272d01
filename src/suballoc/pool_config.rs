//! [`PoolConfig`]: how a [`Pool`](super::Pool) starts, grows and gives memory back (and
//! the checks of its sizes, which [`VirtualPoolConfig`](super::VirtualPoolConfig) shares).

use super::core::free_blocks::GRANULE;
use crate::error::Error;

/// How a pool over chunks ([`Pool::new`]) sizes the upstream allocation it takes when
/// no free block fits a request. (A [`VirtualPool`] maps only the granules a request
/// lacks: it has no growth rule.)
///
/// A chunk's blocks never merge with another chunk's, and a chunk goes back to the
/// upstream only once all of it is free, so the rule trades memory held against the
/// number of upstream calls and the memory stranded between chunks:
///
/// | rule | a new chunk | GPT-2 training, held / live | `random` seeds 1-6, mean (max) | upstream calls, `random` |
/// | --- | --- | --- | --- | --- |
/// | [`Eighth`](Growth::Eighth) | the request, at least 1/8 of the pool, rounded up to 2 MiB | 1.134 | 1.303 (1.488) | 24 |
/// | [`Rmm`](Growth::Rmm) | at least the pool's size again (doubling) | 1.669 | 1.837 (2.178) | 8 |
///
/// (H100, 2026-11-25, `BENCHMARKS.md`; PyTorch's caching allocator held 1.123 of the same
/// GPT-2 run, and a pool growing in place 1.089.) Chunks fitted exactly to each request
/// held more under GPT-2 (1.240: free memory scattered over many small chunks) and
/// chunks of 1/16 or 1/32 of the pool too (1.189, 1.324), so the default keeps a floor
/// of an eighth, which also bounds how many chunks a pool has (each growth adds at least
/// 1/8 of its size). A pool that has reached its working size calls the upstream no more
/// under either rule.
///
/// ```
/// use memres::suballoc::{Growth, Pool, PoolConfig};
/// use memres::{HostHeap, SyncResource, layout};
///
/// let pool = Pool::new(HostHeap::new(), PoolConfig::new())?;
/// let p = pool.allocate_sync(layout(3 << 20)?)?;
/// assert_eq!(pool.pool_size(), 4 << 20); // 3 MiB rounded up to 2 MiB pages
///
/// // RMM's rule: each growth at least doubles the pool.
/// let rmm = Pool::new(HostHeap::new(), PoolConfig::new().growth(Growth::Rmm))?;
/// let q = rmm.allocate_sync(layout(1 << 20)?)?;
/// let r = rmm.allocate_sync(layout(1 << 20)?)?;
/// assert_eq!(rmm.pool_size(), 2 << 20);
/// # // SAFETY: allocated above with these layouts; not used.
/// # unsafe {
/// #     pool.deallocate_sync(p, layout(3 << 20)?);
/// #     rmm.deallocate_sync(q, layout(1 << 20)?);
/// #     rmm.deallocate_sync(r, layout(1 << 20)?);
/// # }
/// # Ok::<(), memres::Error>(())
/// ```
///
/// [`Pool::new`]: super::Pool::new
/// [`VirtualPool`]: super::VirtualPool
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Growth {
    /// The default: a chunk of what the request needs (with room for its alignment), at
    /// least an eighth of what the pool holds and at least the
    /// [growth step](PoolConfig::growth_step), rounded up to a multiple of 2 MiB, the page
    /// in which the driver maps large allocations (PyTorch's caching allocator rounds its
    /// large segments the same way). With a maximum, no more than what remains below it.
    /// When the upstream refuses such a chunk, the pool asks for the request rounded up to
    /// 2 MiB, then for the request alone.
    #[default]
    Eighth,
    /// RMM's `pool_memory_resource` rule: without a maximum, the larger of the request and
    /// the pool's size (the pool doubles); with one, the larger of the request and half
    /// of what remains; halving the attempt, down to the request, when the upstream
    /// refuses. Without a maximum it holds up to 2x of what the pool needs; fewest
    /// upstream calls.
    Rmm,
}

/// What [`Growth::Eighth`] rounds a chunk up to.
pub(super) const CHUNK_ROUNDING: usize = 2 << 20;

/// The least share of the pool's size that a [`Growth::Eighth`] chunk adds.
pub(super) const EIGHTH: usize = 8;

/// How a [`Pool`] starts, how it grows and when it gives memory back.
///
/// The initial and maximum sizes must be multiples of 256 bytes and the initial size may
/// not exceed the maximum; [`Pool::new`] returns [`Error::InvalidArgument`] otherwise.
///
/// ```
/// use memres::suballoc::PoolConfig;
///
/// let config = PoolConfig::new().initial_size(64 << 20).maximum_size(1 << 30);
/// assert_eq!(config.maximum(), Some(1 << 30));
/// ```
///
/// [`Pool`]: super::Pool
/// [`Pool::new`]: super::Pool::new
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolConfig {
    pub(super) initial: usize,
    pub(super) maximum: Option<usize>,
    pub(super) step: usize,
    pub(super) growth: Growth,
    pub(super) release_threshold: Option<usize>,
}

impl PoolConfig {
    /// No memory at first, no maximum.
    pub const fn new() -> PoolConfig {
        PoolConfig {
            initial: 0,
            maximum: None,
            step: 0,
            growth: Growth::Eighth,
            release_threshold: None,
        }
    }

    /// How the pool sizes the chunks it takes (default: [`Growth::Eighth`]).
    #[must_use]
    pub const fn growth(mut self, rule: Growth) -> PoolConfig {
        self.growth = rule;
        self
    }

    /// The growth rule.
    pub const fn growth_rule(&self) -> Growth {
        self.growth
    }
}

/// The methods on sizes that both pools' configurations have ([`PoolConfig`] and
/// [`VirtualPoolConfig`](super::VirtualPoolConfig), each with the fields `initial`,
/// `maximum`, `step` and `release_threshold`), written once: the builders (with their
/// docs, which differ, passed in as lines), the getters and the checks.
macro_rules! size_methods {
    (
        $ty:ident,
        initial: [$($initial:literal),* $(,)?],
        maximum: [$($maximum:literal),* $(,)?],
        step: [$($step:literal),* $(,)?],
        release_threshold: [$($release:literal),* $(,)?] $(,)?
    ) => {
        impl $ty {
            $(#[doc = $initial])*
            #[must_use]
            pub const fn initial_size(mut self, bytes: usize) -> $ty {
                self.initial = bytes;
                self
            }

            $(#[doc = $maximum])*
            #[must_use]
            pub const fn maximum_size(mut self, bytes: usize) -> $ty {
                self.maximum = Some(bytes);
                self
            }

            $(#[doc = $step])*
            #[must_use]
            pub const fn growth_step(mut self, bytes: usize) -> $ty {
                self.step = bytes;
                self
            }

            $(#[doc = $release])*
            #[must_use]
            pub const fn release_threshold(mut self, bytes: usize) -> $ty {
                self.release_threshold = Some(bytes);
                self
            }

            /// The release threshold, if any.
            pub const fn threshold(&self) -> Option<usize> {
                self.release_threshold
            }

            /// The initial size.
            pub const fn initial(&self) -> usize {
                self.initial
            }

            /// The maximum size, if any.
            pub const fn maximum(&self) -> Option<usize> {
                self.maximum
            }

            /// Checks the sizes (see `pool_config::validate`).
            pub(in crate::suballoc) fn validate(&self) -> Result<(), crate::error::Error> {
                crate::suballoc::pool_config::validate(
                    self.initial,
                    self.maximum,
                    self.step,
                    self.release_threshold,
                )
            }
        }
    };
}

pub(super) use size_methods;

size_methods!(
    PoolConfig,
    initial: ["Bytes taken from the upstream when the pool is made."],
    maximum: ["The most bytes the pool may hold from its upstream."],
    step: [
        "The least a growth takes: growing by [`Growth::Eighth`], the smallest chunk the",
        "pool asks for first (rounded up to 2 MiB and capped at the maximum; default:",
        "2 MiB). A larger step means fewer, larger growths and more memory held ahead of",
        "need. [`Growth::Rmm`] ignores it.",
    ],
    release_threshold: [
        "Gives memory back to the upstream whenever a free leaves more than `bytes` free in",
        "one stream's list: the pool then waits for the streams it has seen, merges its",
        "lists and gives back its entirely free chunks, as a `cudaMemPool`'s release",
        "threshold does at synchronisation points.",
        "Default: none, keep everything until [`Pool::trim`](super::Pool::trim) (as RMM's",
        "pool does).",
    ],
);

/// Checks a pool's sizes (both pools' configurations have them): multiples of 256 bytes,
/// no larger than an allocation can be, the initial size within the maximum.
pub(super) fn validate(
    initial: usize,
    maximum: Option<usize>,
    step: usize,
    release_threshold: Option<usize>,
) -> Result<(), Error> {
    let multiple = |what: &str, n: usize| {
        if n.is_multiple_of(GRANULE) {
            Ok(())
        } else {
            Err(Error::invalid_argument(format!(
                "the pool's {what} size ({n} bytes) is not a multiple of {GRANULE} bytes"
            )))
        }
    };
    let sizes = [
        ("initial", Some(initial)),
        ("maximum", maximum),
        ("growth step", Some(step)),
        ("release threshold", release_threshold),
    ];
    for (what, n) in sizes {
        if let Some(n) = n.filter(|&n| n > isize::MAX as usize) {
            return Err(Error::invalid_argument(format!(
                "the pool's {what} ({n} bytes) is larger than any allocation can be"
            )));
        }
    }
    multiple("initial", initial)?;
    if let Some(max) = maximum {
        multiple("maximum", max)?;
        if initial > max {
            return Err(Error::invalid_argument(format!(
                "the pool's initial size ({initial} bytes) exceeds its maximum ({max} bytes)"
            )));
        }
    }
    Ok(())
}

/// The chunk sizes a pool over chunks asks its upstream for, for one request: a pure
/// function of the request, what the pool holds and its configuration (the growth rule
/// of [`Growth`], written once).
#[derive(Debug, Clone, Copy)]
pub(super) struct ChunkSizes {
    growth: Growth,
    /// The request with room for its alignment: no chunk is smaller.
    min: usize,
    /// What remains below the maximum (`usize::MAX` without one).
    remaining: usize,
    capped: bool,
    step: usize,
}

impl ChunkSizes {
    /// The sizes for a request needing `min` bytes while the pool holds `held`; `None`
    /// when the maximum leaves no room for it.
    pub(super) fn new(config: &PoolConfig, min: usize, held: usize) -> Option<ChunkSizes> {
        let remaining = match config.maximum {
            Some(max) if min > max.saturating_sub(held) => return None,
            Some(max) => max - held,
            None => usize::MAX,
        };
        Some(ChunkSizes {
            growth: config.growth,
            min,
            remaining,
            capped: config.maximum.is_some(),
            step: config.step,
        })
    }

    /// `n` rounded up to 2 MiB pages, within what remains and what a `Layout` holds;
    /// else the request itself.
    fn rounded(&self, n: usize) -> usize {
        let n = n
            .checked_next_multiple_of(CHUNK_ROUNDING)
            .unwrap_or(usize::MAX)
            .min(self.remaining);
        if n <= isize::MAX as usize {
            n
        } else {
            self.min
        }
    }

    /// The first chunk to ask for, the pool holding `held` bytes.
    pub(super) fn first(&self, held: usize) -> usize {
        let min = self.min;
        match self.growth {
            // Under a maximum, a chunk holds a whole number of such requests (within what
            // remains): blocks never span chunks, so a 2 MiB chunk for 768 KiB requests
            // would strand 512 KiB of the maximum in each chunk (a maximum of 8 such
            // requests fitted 6; RMM's halving fits 8, and so does this).
            Growth::Eighth if self.capped => {
                let n = self.rounded(min.max(self.step).max(held / EIGHTH));
                match n.checked_next_multiple_of(min) {
                    Some(whole) if whole <= self.remaining => whole,
                    _ => n,
                }
            }
            Growth::Eighth => self.rounded(min.max(self.step).max(held / EIGHTH)),
            Growth::Rmm if self.capped => min.max((self.remaining / 2).next_multiple_of(GRANULE)),
            Growth::Rmm => min.max(held),
        }
    }

    /// The next chunk to ask for after the upstream refused `attempt` (larger than the
    /// request): RMM halves its attempt; the default asks for the request rounded up to
    /// 2 MiB pages (the driver maps no less), then for the request itself.
    pub(super) fn after_refusal(&self, attempt: usize) -> usize {
        let min = self.min;
        match self.growth {
            Growth::Eighth if self.rounded(min) < attempt => self.rounded(min),
            Growth::Eighth => min,
            Growth::Rmm => min.max((attempt / 2).next_multiple_of(GRANULE)),
        }
    }

    /// The request with room for its alignment.
    pub(super) fn min(&self) -> usize {
        self.min
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    #[test]
    fn eighth_grows_by_an_eighth_in_2_mib_pages_and_falls_back_to_the_request() {
        let sizes = ChunkSizes::new(&PoolConfig::new(), 3 * MIB + 256, 0).unwrap();
        assert_eq!(sizes.first(0), 4 * MIB, "the request in 2 MiB pages");
        assert_eq!(
            sizes.first(256 * MIB),
            32 * MIB,
            "an eighth of what is held"
        );
        assert_eq!(sizes.after_refusal(32 * MIB), 4 * MIB);
        assert_eq!(
            sizes.after_refusal(4 * MIB),
            3 * MIB + 256,
            "then the request"
        );
    }

    #[test]
    fn under_a_maximum_a_chunk_holds_whole_requests_within_what_remains() {
        let config = PoolConfig::new().maximum_size(8 * (768 << 10));
        let sizes = ChunkSizes::new(&config, 768 << 10, 0).unwrap();
        assert_eq!(
            sizes.first(0),
            3 * (768 << 10),
            "2 MiB up to whole requests"
        );
        let sizes = ChunkSizes::new(&config, 768 << 10, 7 * (768 << 10)).unwrap();
        assert_eq!(sizes.first(7 * (768 << 10)), 768 << 10, "what remains");
        assert!(
            ChunkSizes::new(&config, 768 << 10, 8 * (768 << 10)).is_none(),
            "full"
        );
    }

    #[test]
    fn rmm_doubles_and_halves() {
        let config = PoolConfig::new().growth(Growth::Rmm);
        let sizes = ChunkSizes::new(&config, MIB, 64 * MIB).unwrap();
        assert_eq!(sizes.first(64 * MIB), 64 * MIB, "the pool doubles");
        assert_eq!(sizes.after_refusal(64 * MIB), 32 * MIB);
        let capped = PoolConfig::new()
            .growth(Growth::Rmm)
            .maximum_size(100 * MIB);
        let sizes = ChunkSizes::new(&capped, MIB, 0).unwrap();
        assert_eq!(sizes.first(0), 50 * MIB, "half of what remains");
    }

    #[test]
    fn new_is_the_default() {
        assert_eq!(PoolConfig::new(), PoolConfig::default());
        assert_eq!(PoolConfig::new().growth_rule(), Growth::Eighth);
    }
}
