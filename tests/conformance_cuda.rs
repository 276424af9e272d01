//! The conformance suite over every CUDA resource. These need a GPU: CI skips them (they
//! are `#[ignore]`d), and `shared/gpu/bundle.sh`'s `run.sh` runs them on the GPU machine.

#[macro_use]
mod conformance;

use conformance::{Api, Caps, Driver};
use memres::upstream::CudaAsyncConfig;
use memres::{
    AnyResource, Cuda, Device, Error, ResourceExt, StreamRef, layout,
    upstream::{CudaAsync, CudaAsyncManaged, CudaAsyncView, PinnedHost},
};

fn device() -> memres::device::DeviceId {
    memres::device::DeviceId::current().expect("a CUDA device")
}

conformance_tests!(
    #[ignore = "needs a CUDA GPU"]
    cuda,
    Cuda::new().unwrap(),
    Caps::gpu(256)
);
conformance_tests!(
    #[ignore = "needs a CUDA GPU"]
    managed,
    memres::upstream::Managed::new().unwrap(),
    Caps::gpu(256)
);
conformance_tests!(
    #[ignore = "needs a CUDA GPU"]
    pinned_host,
    PinnedHost::new().unwrap(),
    Caps::gpu(4096)
);
conformance_tests!(
    #[ignore = "needs a CUDA GPU"]
    cuda_async,
    CudaAsync::new().unwrap(),
    Caps::gpu(256)
);
conformance_tests!(
    #[ignore = "needs a CUDA GPU"]
    cuda_async_primed,
    CudaAsync::with_config(CudaAsyncConfig::new().initial_size(256 << 20)).unwrap(),
    Caps::gpu(256)
);
conformance_tests!(
    #[ignore = "needs a CUDA GPU"]
    cuda_async_view_default_pool,
    CudaAsyncView::default_pool(device()).unwrap(),
    Caps::gpu(256)
);
conformance_tests!(
    #[ignore = "needs a CUDA GPU"]
    statistics_over_managed,
    memres::adaptor::Statistics::new(memres::upstream::Managed::new().unwrap()),
    Caps::gpu(256)
);
conformance_tests!(
    #[ignore = "needs a CUDA GPU"]
    prefetch_over_managed,
    memres::adaptor::Prefetch::new(memres::upstream::Managed::new().unwrap()).unwrap(),
    Caps::gpu(256)
);
conformance_tests!(
    #[ignore = "needs a CUDA GPU"]
    limiting_tracking_over_cuda,
    memres::adaptor::Limiting::new(
        memres::adaptor::Tracking::new(Cuda::new().unwrap()),
        1 << 36
    ),
    Caps::gpu(256)
);
conformance_tests!(
    #[ignore = "needs a CUDA GPU"]
    aligned_over_cuda,
    memres::adaptor::Aligned::new(Cuda::new().unwrap(), 4096, 0).unwrap(),
    Caps::gpu(4096)
);
conformance_tests!(
    #[ignore = "needs a CUDA GPU"]
    logging_over_cuda_async,
    memres::adaptor::Logging::to_writer(CudaAsync::new().unwrap(), std::io::sink()).unwrap(),
    Caps::gpu(256)
);
conformance_tests!(
    #[ignore = "needs a CUDA GPU"]
    any_resource_over_cuda_async,
    CudaAsync::new().unwrap().shared().into_any::<Device>(),
    Caps::gpu(256)
);

/// `CudaAsyncManaged` where the driver offers it; where it does not, the constructor must
/// say `Unsupported` (and the test says which it saw).
fn managed_pool() -> Option<CudaAsyncManaged> {
    match CudaAsyncManaged::new() {
        Ok(r) => Some(r),
        Err(Error::Unsupported(why)) => {
            println!("memres-skip: CudaAsyncManaged unsupported here: {why}");
            None
        }
        Err(e) => panic!("CudaAsyncManaged::new: {e}"),
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_async_managed_conformance() {
    let caps = Caps::gpu(256);
    let _serial = caps.serialise();
    let Some(r) = managed_pool() else { return };
    conformance::every_case(&r, &managed_pool().unwrap(), caps);
}

/// The per-thread default stream names a different stream on every thread; allocations
/// on it must work from several threads at once.
#[test]
#[ignore = "needs a CUDA GPU"]
fn per_thread_default_stream() {
    let _serial = Caps::gpu(256).serialise();
    let pool = CudaAsync::new().unwrap();
    let cuda = Cuda::new().unwrap();
    let any = AnyResource::<Device>::new(CudaAsync::new().unwrap());
    std::thread::scope(|s| {
        for t in 0..4 {
            let (pool, cuda, any) = (&pool, &cuda, &any);
            s.spawn(move || {
                let caps = Caps {
                    streams: [StreamRef::PER_THREAD, StreamRef::PER_THREAD],
                    ..Caps::gpu(256)
                };
                conformance::random_sizes(pool, caps, 100 + t);
                conformance::mixed_steps(cuda, caps, 200 + t);
                conformance::mixed_steps(any, caps, 300 + t);
                let mut d = Driver::new(pool, Api::Stream(StreamRef::PER_THREAD));
                let b = d.allocate(layout(1 << 20).unwrap());
                d.free(b);
            });
        }
    });
}

/// `System` and `SamHeadroom` where the device reaches pageable memory (HMM/ATS); where it
/// does not, both constructors must say `Unsupported`. The test says which side it saw.
#[test]
#[ignore = "needs a CUDA GPU"]
#[cfg(not(feature = "hip"))] // reads the attribute through cudarc's CUDA call
fn system_memory_on_either_side_of_the_hmm_check() {
    let caps = Caps::gpu(4096);
    let _serial = caps.serialise();
    let dev = cudarc::driver::result::device::get(0).unwrap();
    let attr = cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS;
    // SAFETY: `dev` was returned by `device::get`.
    let pageable = unsafe { cudarc::driver::result::device::get_attribute(dev, attr) }.unwrap();
    match (
        memres::upstream::System::new(),
        memres::upstream::SamHeadroom::new(1 << 30),
    ) {
        (Ok(system), Ok(sam)) => {
            assert_eq!(
                pageable, 1,
                "System was made though the device lacks pageable access"
            );
            eprintln!("pageable memory access: yes; running System and SamHeadroom");
            conformance::every_case(&system, &system, caps);
            conformance::every_case(&sam, &sam, caps);
            // All the device's memory as headroom: everything is advised to the host;
            // none: a small block prefers the device. Read the advice back.
            let all = memres::upstream::SamHeadroom::new(usize::MAX).unwrap();
            conformance::every_case(&all, &all, caps);
            assert_eq!(preferred_location(&all), -1, "CU_DEVICE_CPU");
            let none = memres::upstream::SamHeadroom::new(0).unwrap();
            assert_eq!(preferred_location(&none), 0, "device 0");
        }
        (Err(Error::Unsupported(a)), Err(Error::Unsupported(b))) => {
            assert_eq!(
                pageable, 0,
                "System refused though the device has pageable access"
            );
            assert!(a.contains("PAGEABLE_MEMORY_ACCESS"), "{a}");
            assert!(b.contains("PAGEABLE_MEMORY_ACCESS"), "{b}");
            eprintln!("pageable memory access: no; System and SamHeadroom say: {a}");
        }
        (a, b) => panic!("System: {a:?}, SamHeadroom: {b:?}"),
    }
}

/// Where the pages of a fresh 1 MiB block of `r` prefer to live (a device ordinal, or -1
/// for the host), read back with `cuMemRangeGetAttribute`.
#[cfg(not(feature = "hip"))]
fn preferred_location(r: &memres::upstream::SamHeadroom) -> i32 {
    use memres::SyncResource;
    let l = layout(1 << 20).unwrap();
    let p = r.allocate_sync(l).unwrap();
    let _on = memres::device::DeviceGuard::new(device()).unwrap();
    let mut location: i32 = -2;
    let attr =
        cudarc::driver::sys::CUmem_range_attribute::CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION;
    // SAFETY: the range is a live 1 MiB block; the attribute is a 4-byte int.
    let result = unsafe {
        cudarc::driver::sys::cuMemRangeGetAttribute(
            (&mut location as *mut i32).cast(),
            4,
            attr,
            p.as_ptr() as u64,
            1 << 20,
        )
    };
    assert_eq!(result, cudarc::driver::sys::CUresult::CUDA_SUCCESS);
    // SAFETY: allocated above with `l`; only its attributes were read.
    unsafe { r.deallocate_sync(p, l) };
    location
}

conformance_tests!(
    #[ignore = "needs a CUDA GPU"]
    cuda_virtual_leaf,
    memres::CudaVirtual::new().unwrap(),
    Caps::gpu(2 << 20)
);
conformance_tests!(
    #[ignore = "needs a CUDA GPU"]
    virtual_pool_over_cuda_virtual,
    memres::CudaVirtual::new()
        .unwrap()
        .virtual_pool(memres::VirtualPoolConfig::new())
        .unwrap(),
    Caps::gpu(usize::MAX)
);
conformance_tests!(
    #[ignore = "needs a CUDA GPU"]
    virtual_pool_over_cuda_virtual_with_threshold,
    memres::CudaVirtual::new()
        .unwrap()
        .virtual_pool(memres::VirtualPoolConfig::new().release_threshold(64 << 20))
        .unwrap(),
    Caps::gpu(usize::MAX)
);
conformance_tests!(
    #[ignore = "needs a CUDA GPU"]
    pool_over_cuda,
    memres::Pool::new(Cuda::new().unwrap(), memres::PoolConfig::new()).unwrap(),
    Caps::gpu(usize::MAX)
);
conformance_tests!(
    #[ignore = "needs a CUDA GPU"]
    pool_over_cuda_async,
    memres::Pool::new(
        CudaAsync::new().unwrap(),
        memres::PoolConfig::new().initial_size(256 << 20)
    )
    .unwrap(),
    Caps::gpu(usize::MAX)
);
conformance_tests!(
    #[ignore = "needs a CUDA GPU"]
    fixed_size_over_cuda,
    memres::suballoc::FixedSize::with_block_size(Cuda::new().unwrap(), 8 << 20, 16).unwrap(),
    Caps::gpu(256).fixed_blocks(8 << 20)
);
conformance_tests!(
    #[ignore = "needs a CUDA GPU"]
    binning_over_pool_over_cuda,
    memres::suballoc::Binning::new(
        memres::Pool::new(Cuda::new().unwrap(), memres::PoolConfig::new()).unwrap(),
        8,
        20
    )
    .unwrap(),
    Caps::gpu(usize::MAX)
);
conformance_tests!(
    #[ignore = "needs a CUDA GPU"]
    arena_over_cuda,
    memres::suballoc::Arena::with_size(Cuda::new().unwrap(), 12 << 30).unwrap(),
    Caps::gpu(usize::MAX)
);
