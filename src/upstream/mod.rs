//! Leaf resources: where memory comes from.
//!
//! | resource | memory | properties |
//! | --- | --- | --- |
//! | [`HostHeap`] | the Rust global allocator | host |
//! | [`Callback`] | your closures | what you declare |
//! | [`Cuda`] | `cuMemAlloc` | device |
//! | [`Managed`] | `cuMemAllocManaged` | host + device |
//! | [`PinnedHost`] | `cuMemHostAlloc` | host + device |
//! | [`CudaAsync`] | a driver pool it owns (`cuMemAllocFromPoolAsync`) | device |
//! | [`CudaAsyncView`] | a driver pool it does not own | device |
//! | [`CudaAsyncManaged`] | the device's managed pool (CUDA 13) | host + device |
//! | [`System`] | host memory the GPU reaches through HMM/ATS | host + device |
//! | [`SamHeadroom`] | as `System`, keeping some GPU memory free | host + device |
//! | [`CudaVirtual`] | one reserved range, mapped a granule at a time (`cuMemCreate` + `cuMemMap`) | device |
//! | [`HostVirtual`] | the same over host pages (`mmap`), for tests and replays | host |
//! | [`Imported`] | another process's device memory ([`ipc_handle`], [`Virtual::export_fds`]) | device |
//!
//! Every CUDA leaf returns [`Error::NoDriver`](crate::Error::NoDriver) from its constructor
//! where libcuda is absent, maps the driver's out-of-memory to
//! [`Error::OutOfMemory`](crate::Error::OutOfMemory), and skips driver calls in `Drop` and
//! `deallocate` once [`process_is_exiting`](crate::device::process_is_exiting).

mod callback;
mod cuda;
mod cuda_async;
pub(crate) mod driver_leaf;
mod host_heap;
mod ipc;
mod managed;
mod pinned_host;
mod system;
pub(crate) mod virtual_memory;

pub use callback::Callback;
pub use cuda::Cuda;
pub use cuda_async::{
    CudaAsync, CudaAsyncConfig, CudaAsyncManaged, CudaAsyncView, ExportHandle, RawMemoryPool,
};
pub use host_heap::HostHeap;
pub use ipc::{IPC_HANDLE_SIZE, Imported, ipc_handle};
pub use managed::Managed;
pub use pinned_host::PinnedHost;
pub use system::{SamHeadroom, System};
pub use virtual_memory::{
    Backend, CudaPhysical, CudaVirtual, CudaVirtualConfig, GrowInPlace, HostCopy, HostPages,
    HostVirtual, Registering, Virtual,
};
