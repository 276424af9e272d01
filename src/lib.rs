//! memres: fast, typed memory resources for GPU and host memory.
//!
//! memres brings the capabilities of RAPIDS RMM and CCCL's `cuda::mr` to Rust. A *memory
//! resource* hands out memory; resources compose into stacks of zero-cost generic layers
//! (a pool over the CUDA driver, statistics over the pool, ...), every call through a
//! stack is static, and type erasure ([`ResourceRef`], [`AnyResource`]) is used only at
//! API boundaries.
//!
//! Where memory may be accessed from is part of a resource's type: a resource declares its
//! [property set](property), and code that needs device-accessible memory writes
//! `R: Has<DeviceAccessible>`; passing host-only memory does not compile.
//!
//! ```
//! use memres::{AnyResource, Host, HostHeap, Resource, ResourceExt, StreamRef, layout};
//!
//! // A stack, built top-down and erased at the boundary.
//! let mr: AnyResource<Host> = HostHeap::new().shared().into_any();
//!
//! let l = layout(1 << 20)?; // 1 MiB, 256-byte aligned
//! let p = mr.allocate(StreamRef::HOST, l)?;
//! // SAFETY: `p` came from `mr` with `l` and is not used after this.
//! unsafe { mr.deallocate(StreamRef::HOST, p, l) };
//! # Ok::<(), memres::Error>(())
//! ```
//!
//! # Choosing a resource
//!
//! | you want | use |
//! | --- | --- |
//! | least memory held (the C ABI's and Python's default) | a [`VirtualPool`], growing in place: `CudaVirtual::new()?.virtual_pool(VirtualPoolConfig::new())` |
//! | the fastest general pool over `cuMemAlloc` | `Pool::new(Cuda::new()?, PoolConfig::new())` |
//! | a fixed amount up front, many threads | [`suballoc::Arena`] |
//! | many small blocks | [`suballoc::Binning`] over a pool |
//! | blocks of one size | [`suballoc::FixedSize`] |
//! | the driver's own pool | [`upstream::CudaAsync`] |
//! | counts, limits, leak hunting, logs, bounds checks | the [`adaptor`]s over any of them |
//!
//! README.md gives the measured footprint and speed of each (against RMM and PyTorch)
//! and the limitations.
//!
//! # What the root holds
//!
//! Every public item lives in its module (the list below), and that path always works.
//! The root re-exports only what a first program names, 21 items: the contract (the
//! traits [`SyncResource`] and [`Resource`], the builders [`ResourceExt`], [`Error`],
//! [`StreamRef`], [`layout`]); where memory may be accessed from (the sets [`Host`],
//! [`Device`], [`HostDevice`], and [`Has`], [`HostAccessible`], [`DeviceAccessible`] for
//! bounds); the two erased handles most APIs take ([`AnyResource`], [`ResourceRef`]);
//! and the first rows of the table above: the leaves [`Cuda`], [`CudaVirtual`],
//! [`HostHeap`] and the pools [`Pool`], [`VirtualPool`] with their configurations
//! [`PoolConfig`], [`VirtualPoolConfig`]. The rest (other leaves, sub-allocators and
//! adaptors, configurations, the sync-only erased handles, `Layer`, `layout_with_alignment`)
//! is written with its module: `memres::suballoc::Arena`, `memres::adaptor::Statistics`,
//! `memres::upstream::CudaAsync`. A new item joins the root only if a first program needs
//! it; otherwise it stays in its module.
//!
//! # Layers
//! - [`resource`] holds the [`SyncResource`] and [`Resource`] traits and their contract.
//! - [`property`] holds compile-time properties ([`DeviceAccessible`], [`HostAccessible`],
//!   yours).
//! - [`erased`] holds [`ResourceRef`], [`SyncResourceRef`](erased::SyncResourceRef),
//!   [`AnyResource`], [`AnySyncResource`](erased::AnySyncResource) and
//!   [`Shared`](erased::Shared).
//! - [`stream`] holds [`StreamRef`], owned streams, events and the stream pool.
//! - [`upstream`] holds the leaf resources: [`HostHeap`], [`Callback`](upstream::Callback),
//!   the CUDA ones ([`Cuda`], [`Managed`](upstream::Managed),
//!   [`PinnedHost`](upstream::PinnedHost), [`CudaAsync`](upstream::CudaAsync),
//!   [`CudaAsyncView`](upstream::CudaAsyncView),
//!   [`CudaAsyncManaged`](upstream::CudaAsyncManaged), [`System`](upstream::System),
//!   [`SamHeadroom`](upstream::SamHeadroom)), the virtual-memory leaves ([`CudaVirtual`],
//!   [`HostVirtual`](upstream::HostVirtual)) and memory of other processes
//!   ([`Imported`](upstream::Imported)).
//! - [`suballoc`] holds the sub-allocators: [`Pool`] (chunked), [`VirtualPool`] (growing
//!   in place over a virtual-memory leaf; it can sleep), [`Arena`](suballoc::Arena),
//!   [`Binning`](suballoc::Binning), [`FixedSize`](suballoc::FixedSize),
//!   [`SegmentPool`](suballoc::SegmentPool).
//! - [`device`] holds devices and [`process_is_exiting`](device::process_is_exiting);
//!   [`per_device`] the per-device default resources.
//! - [`adaptor`] holds the adaptors: [`Statistics`](adaptor::Statistics),
//!   [`Tracking`](adaptor::Tracking), [`Limiting`](adaptor::Limiting),
//!   [`Aligned`](adaptor::Aligned), [`FailureRetry`](adaptor::FailureRetry),
//!   [`ThreadSafe`](adaptor::ThreadSafe), [`Logging`](adaptor::Logging),
//!   [`Prefetch`](adaptor::Prefetch), [`Profiling`](adaptor::Profiling),
//!   [`Guard`](adaptor::Guard).
//! - [`container`] holds [`DeviceBuffer`](container::DeviceBuffer),
//!   [`DeviceVec`](container::DeviceVec), [`DeviceScalar`](container::DeviceScalar), the
//!   `allocator_api2` bridge [`HostAllocator`](container::HostAllocator) and
//!   [`StreamAllocator`](container::StreamAllocator).
//! - [`log`] holds the CSV event-log format shared with RMM and its reader.
//! - [`profile`] attributes allocations to named scopes of a program (with the
//!   [`Profiling`](adaptor::Profiling) adaptor).
//! - [`layer`] holds top-down composition ([`ResourceExt`], [`Layer`](layer::Layer)).
//! - [`units`] parses byte counts written by people (`512MiB`).
//! - `spec` (with the `spec` feature) parses stack specs, the text language of the C ABI
//!   and the `memres` command (`statistics(pool:max=4GiB)`).
//! - [`error`] holds the one [`Error`] type; [`driver`] says whether a CUDA driver is
//!   present.

pub mod adaptor;
pub mod container;
pub mod device;
pub mod driver;
pub mod erased;
pub mod error;
pub mod layer;
pub mod log;
pub mod per_device;
pub(crate) mod platform;
pub mod profile;
pub mod property;
pub mod resource;
#[cfg(feature = "spec")]
pub mod spec;
pub mod stream;
pub mod suballoc;
pub mod units;
pub mod upstream;

mod addr_map;
mod cache_prefetch;
mod copy;
mod sync;

pub use erased::{AnyResource, ResourceRef};
pub use error::Error;
pub use layer::ResourceExt;
pub use property::{Device, DeviceAccessible, Host, HostAccessible, HostDevice};
pub use resource::{Has, Resource, SyncResource, layout};
pub use stream::StreamRef;
pub use suballoc::{Pool, PoolConfig, VirtualPool, VirtualPoolConfig};
pub use upstream::{Cuda, CudaVirtual, HostHeap};

/// The README's example is compiled and run as a doc test.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
