//! What a sleeping virtual pool keeps ([`Slept`], under its growth lock, with the
//! [`SleepMode`] it slept in), apart from the sleep and wake themselves (`sleep.rs`), so
//! that what the pool holds (`grow.rs`) can name it without importing them.

use crate::upstream::HostCopy;

/// What becomes of the contents of a pool's memory while it sleeps
/// ([`VirtualPool::sleep`](super::VirtualPool::sleep)). More modes may come (a match on it
/// outside memres has a `_` arm).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum SleepMode {
    /// The contents are lost: after [`VirtualPool::wake`](super::VirtualPool::wake) the blocks hold whatever the new
    /// memory holds (for a KV cache, activations, scratch memory).
    Discard,
    /// The contents are copied to host memory (pinned, for device memory) before the
    /// memory goes back, and copied back when the pool wakes (for model weights). It
    /// costs as much host memory as the pool holds while it sleeps.
    Offload,
}

/// What a sleeping pool maps and restores when it wakes.
pub(super) struct Slept {
    pub(super) mode: SleepMode,
    /// What was mapped, as `(address, bytes)` in address order: the mapped runs, cut
    /// into pieces of at most `PIECE` bytes (whole granules).
    pub(super) pieces: Vec<(usize, usize)>,
    /// One per piece, when the contents were offloaded.
    pub(super) copies: Vec<HostCopy>,
}

impl Slept {
    /// Bytes the pool held when it went to sleep.
    pub(super) fn size(&self) -> usize {
        self.pieces.iter().map(|&(_, len)| len).sum()
    }

    /// Bytes of host memory its copies hold.
    pub(super) fn copy_bytes(&self) -> usize {
        bytes(&self.copies)
    }
}

/// Bytes of host memory `copies` hold.
pub(super) fn bytes(copies: &[HostCopy]) -> usize {
    copies.iter().map(HostCopy::len).sum()
}
