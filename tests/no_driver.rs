//! On a machine without a CUDA driver (CI), every CUDA entry point returns
//! `Error::NoDriver` and nothing panics. On a GPU machine this file checks nothing: the
//! GPU tests cover those paths there.

mod common;

use memres::device::{self, DeviceId};
use memres::per_device;
use memres::stream::{Event, Stream, StreamFlags, StreamPool};
use memres::upstream::{CudaAsyncConfig, ExportHandle};
use memres::{
    Cuda, Error, StreamRef,
    upstream::{CudaAsync, CudaAsyncManaged, CudaAsyncView, Managed, PinnedHost},
};

fn no_driver() -> bool {
    if memres::driver::is_present() {
        eprintln!("a CUDA driver is present: the no-driver paths are not reachable here");
        return false;
    }
    true
}

fn assert_no_driver<T: std::fmt::Debug>(what: &str, result: Result<T, Error>) {
    match result {
        Err(Error::NoDriver) => {}
        other => panic!("{what}: expected Err(NoDriver), got {other:?}"),
    }
}

#[test]
fn every_cuda_constructor_reports_no_driver() {
    if !no_driver() {
        println!("memres-skip: a CUDA driver is present (this test is for machines without one)");
        return;
    }
    let d0 = DeviceId::new(0);
    assert_no_driver("Cuda::new", Cuda::new());
    assert_no_driver("Cuda::on", Cuda::on(d0));
    assert_no_driver("Managed::new", Managed::new());
    assert_no_driver("Managed::on", Managed::on(d0));
    assert_no_driver("PinnedHost::new", PinnedHost::new());
    assert_no_driver("PinnedHost::on", PinnedHost::on(d0));
    assert_no_driver("CudaAsync::new", CudaAsync::new());
    assert_no_driver(
        "CudaAsync::with_config",
        CudaAsync::with_config(
            CudaAsyncConfig::new()
                .initial_size(1 << 20)
                .release_threshold(0)
                .export(ExportHandle::PosixFd),
        ),
    );
    assert_no_driver(
        "CudaAsyncView::default_pool",
        CudaAsyncView::default_pool(d0),
    );
    // SAFETY: never used: the constructor fails before it could be.
    assert_no_driver("CudaAsyncView::from_raw", unsafe {
        CudaAsyncView::from_raw(std::ptr::null_mut(), d0)
    });
    assert_no_driver("CudaAsyncManaged::new", CudaAsyncManaged::new());
    assert_no_driver("CudaVirtual::new", memres::CudaVirtual::new());
    assert_no_driver(
        "CudaVirtual::with_config",
        memres::CudaVirtual::with_config(
            d0,
            memres::upstream::CudaVirtualConfig::new()
                .reserve(1 << 30)
                .peers([DeviceId::new(1)])
                .export(ExportHandle::PosixFd),
        ),
    );
    assert_no_driver("System::new", memres::upstream::System::new());
    assert_no_driver("System::on", memres::upstream::System::on(d0));
    assert_no_driver(
        "SamHeadroom::new",
        memres::upstream::SamHeadroom::new(1 << 30),
    );
    assert_no_driver(
        "Prefetch::new",
        memres::adaptor::Prefetch::new(memres::HostHeap::new()),
    );
}

#[test]
fn devices_streams_and_defaults_report_no_driver() {
    if !no_driver() {
        println!("memres-skip: a CUDA driver is present (this test is for machines without one)");
        return;
    }
    assert_no_driver("DeviceId::current", DeviceId::current());
    assert_no_driver("DeviceId::count", DeviceId::count());
    assert_no_driver("memory_info", DeviceId::new(0).memory_info());
    assert_no_driver("name", DeviceId::new(0).name());
    assert_no_driver("synchronize", DeviceId::new(0).synchronize());
    assert_no_driver(
        "require_peer_access",
        DeviceId::new(1).require_peer_access(DeviceId::new(0)),
    );
    assert_no_driver("DeviceGuard", device::DeviceGuard::new(DeviceId::new(0)));
    assert_no_driver("percent", device::percent_of_free_device_memory(50));
    assert_no_driver("Stream::new", Stream::new());
    assert_no_driver(
        "Stream::with_flags",
        Stream::with_flags(StreamFlags::NonBlocking),
    );
    assert_no_driver("StreamPool::new", StreamPool::new());
    assert_no_driver("Event::new", Event::new());
    assert_no_driver("synchronize", StreamRef::DEFAULT.synchronize());
    assert_no_driver(
        "per-thread synchronize",
        StreamRef::PER_THREAD.synchronize(),
    );
    assert_no_driver(
        "reset_current_resource",
        per_device::reset_current_resource(),
    );
    let stand_in = memres::AnyResource::new(common::HeapAs::<memres::Device>::new(1));
    assert_no_driver(
        "set_current_resource",
        per_device::set_current_resource(stand_in),
    );
    assert_no_driver("current_resource", per_device::current_resource());
    assert_no_driver(
        "per_device_resource",
        per_device::per_device_resource(DeviceId::new(0)),
    );
    // Host streams need no driver.
    assert_eq!(StreamRef::host(3).synchronize(), Ok(()));
}

#[test]
fn invalid_arguments_are_errors_before_the_driver_is_asked() {
    assert!(matches!(
        device::percent_of_free_device_memory(101),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        StreamPool::with_size(0, StreamFlags::Default),
        Err(Error::InvalidArgument(_))
    ));
}
