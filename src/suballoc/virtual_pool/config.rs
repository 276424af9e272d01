//! [`VirtualPoolConfig`]: how a [`VirtualPool`](super::VirtualPool) starts, how much it
//! maps at a time, and when it gives memory back.

use crate::suballoc::pool_config::size_methods;

/// How a [`VirtualPool`](super::VirtualPool) starts, how much it maps at a time, its
/// maximum and when it gives memory back. (No growth rule: it maps only the granules a
/// request lacks.)
///
/// The initial and maximum sizes must be multiples of 256 bytes and the initial size may
/// not exceed the maximum; [`VirtualPool::new`](super::VirtualPool::new) returns
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) otherwise.
///
/// ```
/// use memres::VirtualPoolConfig;
///
/// let config = VirtualPoolConfig::new().initial_size(64 << 20).maximum_size(1 << 30);
/// assert_eq!(config.maximum(), Some(1 << 30));
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VirtualPoolConfig {
    initial: usize,
    maximum: Option<usize>,
    pub(super) step: usize,
    release_threshold: Option<usize>,
}

impl VirtualPoolConfig {
    /// No memory at first, no maximum, one granule at a time, no release threshold.
    pub const fn new() -> VirtualPoolConfig {
        VirtualPoolConfig {
            initial: 0,
            maximum: None,
            step: 0,
            release_threshold: None,
        }
    }
}

size_methods!(
    VirtualPoolConfig,
    initial: ["Bytes mapped when the pool is made (rounded up to the upstream's granularity)."],
    maximum: ["The most bytes the pool may map."],
    step: [
        "The least a growth maps (rounded up to the upstream's granularity; default: one",
        "granule). A larger step means fewer, larger growths and more memory held ahead of",
        "need.",
    ],
    release_threshold: [
        "Gives memory back to the upstream whenever a free leaves more than `bytes` free in",
        "one stream's list: the pool then waits for the streams it has seen, merges its",
        "lists and unmaps fully free granules, highest first, until at most `bytes` are",
        "free, as a `cudaMemPool`'s release threshold does at synchronisation points. A",
        "growth near the pool's peak, which otherwise first gives back every whole free",
        "granule elsewhere (so that what the pool holds at its peaks follows what is live),",
        "keeps that many free bytes too: with sizes that vary widely a threshold spares the",
        "driver's remaps at growths. Default: none: frees give nothing back until",
        "[`VirtualPool::trim`](super::VirtualPool::trim); a growth that takes the pool into",
        "the top eighth of the most it has held gives back every whole free granule it does",
        "not join, and one below keeps them. Set it above how much the working set swings",
        "within a phase: below that, each phase unmaps the swing as it frees and maps it",
        "again as it allocates, with a wait for the device at each release (GPT-2 inference",
        "over varied shapes with 256 MiB: its step 2.2x as long, BENCHMARKS.md).",
    ],
);
