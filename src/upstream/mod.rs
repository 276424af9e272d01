//! Leaf resources: where memory comes from.
//!
//! Host-side leaves live here now ([`HostHeap`], [`Callback`]); the CUDA leaves (`Cuda`,
//! `Managed`, `PinnedHost`, `CudaAsync`, ...) join them with the CUDA resources.

mod callback;
mod host_heap;

pub use callback::Callback;
pub use host_heap::HostHeap;
