//! Containers that own memory from a resource: [`DeviceBuffer`] (bytes), [`DeviceVec`]
//! (a typed array), [`DeviceScalar`] (one value); [`HostAllocator`] (host-accessible
//! resources under `allocator_api2` collections); [`StreamAllocator`] (a resource and a
//! stream as one value).
//!
//! # Lifetimes checked by the compiler
//! RMM's containers hold a non-owning pointer to their resource and a non-owning stream
//! view, and ask their users to keep both alive. Here a container is generic over its
//! resource *handle* `R` and carries its stream's lifetime `'s`:
//! - `&'a Pool<Cuda>`: borrowed and zero-cost; the container cannot outlive the pool.
//! - `Arc<..>`, [`Shared`](crate::erased::Shared), [`AnyResource<Device>`](crate::AnyResource):
//!   owned; the resource lives as long as the container.
//! - `new_default` constructors use the current device's resource
//!   ([`per_device::current_resource`](crate::per_device::current_resource)) and keep the handle,
//!   so replacing the default later cannot leave a container dangling.
//! - A container on a [`Stream`](crate::stream::Stream) borrows it: it cannot outlive the
//!   stream it will be freed on.
//!
//! # Memory on the host
//! Containers over host memory (`HostHeap`, pools over it) use host streams
//! ([`StreamRef::HOST`](crate::StreamRef::HOST)) and never touch the driver, so their
//! behaviour is tested on machines with no GPU; on CUDA streams the driver copies.
//! Host slices of a [`DeviceVec`] exist only where its resource's memory is
//! host-accessible.
//!
//! # cudarc
//! With the `cudarc-interop` feature (on by default), `DeviceVec::cudarc` /
//! `DeviceVec::cudarc_mut` lend a vector to cudarc's copies, memsets and kernel launches
//! (`CudarcView`, `CudarcViewMut`); streams convert both ways
//! (`StreamRef::from(&cuda_stream)`, `Stream::from_cudarc`).

mod buffer;
#[cfg(feature = "cudarc-interop")]
mod cudarc_view;
mod host_alloc;
mod scalar;
mod stream_alloc;
mod vec;

pub use buffer::{DeviceBuffer, RawParts};
#[cfg(feature = "cudarc-interop")]
pub use cudarc_view::{CudarcView, CudarcViewMut};
pub use host_alloc::{HostAllocator, ShareOnClone};
pub use scalar::DeviceScalar;
pub use stream_alloc::StreamAllocator;
pub use vec::DeviceVec;
