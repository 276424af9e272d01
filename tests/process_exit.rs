//! Resources left in the per-device map are dropped when the process exits, with
//! `process_is_exiting()` true, so their drops skip the driver and nothing crashes.
//!
//! Each test runs a child: this same test binary, asked to run one `child_*` test with
//! `MEMRES_EXIT_CHILD` set. The child leaves a resource in the map and returns; the parent
//! checks that the child exited cleanly and that the resource's drop ran at exit.

use std::alloc::Layout;
use std::process::Command;
use std::ptr::NonNull;

use memres::device::{DeviceId, process_is_exiting};
use memres::per_device::set_per_device_resource;
use memres::{AnyResource, Device, Resource, StreamRef, SyncResource};

/// Wraps a resource (and keeps other CUDA objects alive with it) and says, when dropped,
/// whether the process was exiting.
struct Announces<R>(
    R,
    #[allow(dead_code)] Vec<Box<dyn std::any::Any + Send + Sync>>,
);

impl<R: PartialEq> PartialEq for Announces<R> {
    fn eq(&self, other: &Self) -> bool {
        self.0 == other.0
    }
}

impl<R> Drop for Announces<R> {
    fn drop(&mut self) {
        eprintln!(
            "memres-exit-test: dropped, exiting = {}",
            process_is_exiting()
        );
    }
}

// SAFETY: every call goes to the wrapped resource, whose properties it keeps.
unsafe impl<R: SyncResource> SyncResource for Announces<R> {
    type Properties = R::Properties;
    fn allocate_sync(&self, l: Layout) -> Result<NonNull<u8>, memres::Error> {
        self.0.allocate_sync(l)
    }
    unsafe fn deallocate_sync(&self, p: NonNull<u8>, l: Layout) {
        // SAFETY: forwards the caller's promise.
        unsafe { self.0.deallocate_sync(p, l) }
    }
}

// SAFETY: as for `SyncResource`.
unsafe impl<R: Resource> Resource for Announces<R> {
    fn allocate(&self, s: StreamRef<'_>, l: Layout) -> Result<NonNull<u8>, memres::Error> {
        self.0.allocate(s, l)
    }
    unsafe fn deallocate(&self, s: StreamRef<'_>, p: NonNull<u8>, l: Layout) {
        // SAFETY: forwards the caller's promise.
        unsafe { self.0.deallocate(s, p, l) }
    }
}

mod common;

/// Heap memory claiming device access, for the host-only run (never given to a kernel).
type StandIn = common::HeapAs<Device>;

fn in_child() -> bool {
    std::env::var_os("MEMRES_EXIT_CHILD").is_some()
}

/// Runs `test` of this binary in a child and returns its stderr, asserting a clean exit.
fn run_child(test: &str) -> String {
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            test,
            "--exact",
            "--include-ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("MEMRES_EXIT_CHILD", "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "child {test} failed: {:?}\nstdout: {}\nstderr: {stderr}",
        out.status,
        String::from_utf8_lossy(&out.stdout)
    );
    stderr
}

#[test]
fn child_leaves_a_host_resource_in_the_map() {
    if !in_child() {
        return;
    }
    set_per_device_resource(
        DeviceId::new(2000),
        AnyResource::new(Announces(StandIn::new(0), Vec::new())),
    );
}

#[test]
fn a_resource_left_in_the_map_is_dropped_at_exit() {
    let stderr = run_child("child_leaves_a_host_resource_in_the_map");
    assert!(
        stderr.contains("memres-exit-test: dropped, exiting = true"),
        "the drop did not run at exit: {stderr}"
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn child_leaves_a_cuda_pool_with_live_memory_in_the_map() {
    if !in_child() {
        return;
    }
    let pool = memres::upstream::CudaAsync::new().unwrap();
    let l = memres::layout(64 << 20).unwrap();
    // Left allocated on purpose: the pool is dropped at exit with a block still out.
    let _block = pool.allocate(StreamRef::DEFAULT, l).unwrap();
    let dev = DeviceId::current().unwrap();
    // A stream, an event and (with `cudarc-interop`) a stream taken from cudarc, dropped at
    // exit with the pool.
    let stream = memres::stream::Stream::new().unwrap();
    let event = memres::stream::Event::new().unwrap();
    event.record(stream.as_ref()).unwrap();
    #[allow(unused_mut)] // without `cudarc-interop` (or in a HIP build), nothing is pushed
    let mut extras: Vec<Box<dyn std::any::Any + Send + Sync>> =
        vec![Box::new(stream), Box::new(event)];
    #[cfg(all(feature = "cudarc-interop", not(feature = "hip")))]
    {
        let ctx = cudarc::driver::CudaContext::new(0).unwrap();
        let theirs = memres::stream::Stream::from_cudarc(ctx.new_stream().unwrap()).unwrap();
        extras.push(Box::new(theirs));
    }
    set_per_device_resource(dev, AnyResource::new(Announces(pool, extras)));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_cuda_pool_left_in_the_map_is_dropped_at_exit_without_a_crash() {
    let stderr = run_child("child_leaves_a_cuda_pool_with_live_memory_in_the_map");
    assert!(
        stderr.contains("memres-exit-test: dropped, exiting = true"),
        "the drop did not run at exit: {stderr}"
    );
}
