//! The stream-ordered core of the sub-allocators: stream keys and the per-stream list
//! table (`list_table`), a stream's free list (`free_list`, over the segregated-fit
//! index `free_blocks`), and the blocks held for other streams' work (`held`).

pub(crate) mod free_blocks;
pub(crate) mod free_list;
pub(crate) mod held;
pub(crate) mod lanes;
pub(crate) mod list_table;
pub(crate) mod ordered;
pub(crate) mod stream_key;
