//! The units the sub-allocators' free-block structures share.

/// The pool's unit of size and alignment: every block is a multiple of it.
pub(crate) const GRANULE: usize = 256;

/// No node: the end of a list (of the free blocks' address regions, `regions.rs`).
pub(crate) const NIL: u32 = u32::MAX;
