//! The CUDA resources, streams, events and devices on a real GPU. All `#[ignore]`d: CI
//! has no GPU; `shared/gpu/bundle.sh`'s `run.sh` runs them on the GPU machine.

// A HIP build (feature `hip`) leaves these out: they check results through cudarc's
// CUDA calls. docs/platforms.md says what runs on an AMD GPU instead.
#![cfg(not(feature = "hip"))]

use std::ffi::c_void;
use std::process::Command;
use std::ptr::NonNull;

use cudarc::driver::sys;
use memres::device::{DeviceGuard, DeviceId, percent_of_free_device_memory};
use memres::stream::{Event, Stream, StreamFlags, StreamPool};
use memres::upstream::CudaVirtualConfig;
use memres::upstream::{CudaAsyncConfig, ExportHandle};
use memres::{
    Cuda, Error, Resource, StreamRef, SyncResource, layout,
    upstream::{CudaAsync, CudaAsyncManaged, CudaAsyncView, Managed, PinnedHost},
};
use memres::{CudaVirtual, upstream::GrowInPlace};

fn d0() -> DeviceId {
    DeviceId::new(0)
}

/// `cuPointerGetAttribute` for a 32-bit attribute.
fn pointer_attribute(p: NonNull<u8>, attribute: sys::CUpointer_attribute) -> u32 {
    let _on = DeviceGuard::new(d0()).unwrap();
    let mut value = 0u32;
    // SAFETY: `p` is a live allocation; the attributes read here fit in 32 bits (the
    // driver writes an `unsigned int` or a `bool` into the low bytes of a zeroed u32).
    let r = unsafe {
        sys::cuPointerGetAttribute(
            (&mut value as *mut u32).cast(),
            attribute,
            p.as_ptr() as u64,
        )
    };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "{attribute:?}");
    value
}

fn memory_type(p: NonNull<u8>) -> u32 {
    pointer_attribute(
        p,
        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
    )
}

fn is_managed(p: NonNull<u8>) -> bool {
    pointer_attribute(p, sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_MANAGED) != 0
}

const HOST: u32 = sys::CUmemorytype::CU_MEMORYTYPE_HOST as u32;
const DEVICE: u32 = sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32;

/// Allocates 1 MiB from `r`, checks the pointer with `check`, frees it.
fn with_block<R: SyncResource>(r: &R, check: impl FnOnce(NonNull<u8>)) {
    let l = layout(1 << 20).unwrap();
    let p = r.allocate_sync(l).unwrap();
    check(p);
    // SAFETY: allocated above with `l`; only its attributes were read.
    unsafe { r.deallocate_sync(p, l) };
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn pointer_kinds_are_what_the_types_say() {
    with_block(&Cuda::new().unwrap(), |p| {
        assert_eq!(memory_type(p), DEVICE);
        assert!(!is_managed(p));
    });
    with_block(&CudaAsync::new().unwrap(), |p| {
        assert_eq!(memory_type(p), DEVICE);
        assert!(!is_managed(p));
    });
    with_block(&Managed::new().unwrap(), |p| assert!(is_managed(p)));
    with_block(&PinnedHost::new().unwrap(), |p| {
        assert_eq!(memory_type(p), HOST);
        assert!(!is_managed(p));
    });
    match CudaAsyncManaged::new() {
        Ok(r) => with_block(&r, |p| assert!(is_managed(p))),
        Err(Error::Unsupported(why)) => eprintln!("no managed pool here: {why}"),
        Err(e) => panic!("{e}"),
    }
}

/// Writes a pattern from the host, copies it through device memory with the driver, and
/// reads it back: the device sees what the host wrote, and the other way round.
fn host_round_trip<R: SyncResource>(r: &R) {
    const N: usize = 1 << 20;
    let l = layout(N).unwrap();
    let shared = r.allocate_sync(l).unwrap();
    let cuda = Cuda::new().unwrap();
    let device = cuda.allocate_sync(l).unwrap();
    let _on = DeviceGuard::new(d0()).unwrap();
    // SAFETY: `shared` is host-accessible (the resources given here are), N bytes, ours.
    let host = unsafe { std::slice::from_raw_parts_mut(shared.as_ptr(), N) };
    for (i, b) in host.iter_mut().enumerate() {
        *b = (i * 7 % 251) as u8;
    }
    // SAFETY: both blocks hold N bytes; unified addressing lets `cuMemcpy` take either.
    unsafe {
        assert_eq!(
            sys::cuMemcpy(device.as_ptr() as u64, shared.as_ptr() as u64, N),
            sys::CUresult::CUDA_SUCCESS
        );
        std::ptr::write_bytes(shared.as_ptr(), 0, N);
        assert_eq!(
            sys::cuMemcpy(shared.as_ptr() as u64, device.as_ptr() as u64, N),
            sys::CUresult::CUDA_SUCCESS
        );
    }
    // SAFETY: as above; the synchronous copy is complete.
    let host = unsafe { std::slice::from_raw_parts(shared.as_ptr(), N) };
    assert!(
        host.iter()
            .enumerate()
            .all(|(i, &b)| b == (i * 7 % 251) as u8)
    );
    // SAFETY: both allocated above with `l`; the copies are complete.
    unsafe {
        r.deallocate_sync(shared, l);
        cuda.deallocate_sync(device, l);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn host_writes_reach_the_device_through_pinned_and_managed_memory() {
    host_round_trip(&PinnedHost::new().unwrap());
    host_round_trip(&Managed::new().unwrap());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_async_applies_its_configuration() {
    let default = CudaAsync::new().unwrap();
    assert_eq!(default.release_threshold().unwrap(), u64::MAX);
    let primed = CudaAsync::with_config(CudaAsyncConfig::new().initial_size(256 << 20)).unwrap();
    assert!(
        primed.reserved_bytes().unwrap() >= 256 << 20,
        "reserved {} after priming 256 MiB",
        primed.reserved_bytes().unwrap()
    );
    assert_eq!(primed.used_bytes().unwrap(), 0);
    let thrifty =
        CudaAsync::with_config(CudaAsyncConfig::new().release_threshold(1 << 20)).unwrap();
    assert_eq!(thrifty.release_threshold().unwrap(), 1 << 20);
    assert_eq!(thrifty.export_handle(), ExportHandle::None);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_async_equality() {
    let (a, b) = (CudaAsync::new().unwrap(), CudaAsync::new().unwrap());
    assert!(a != b, "two pools are two resources");
    // SAFETY: `a` owns the pool and outlives the view.
    let view = unsafe { CudaAsyncView::from_raw(a.pool_handle(), a.device()) }.unwrap();
    assert!(a == view, "the owner equals a view of its pool");
    assert!(view == a, "and the view equals the owner");
    assert!(b != view);
    // Memory from the pool may be freed through the view.
    let l = layout(4096).unwrap();
    let p = a.allocate(StreamRef::DEFAULT, l).unwrap();
    // SAFETY: `view` uses `a`'s pool; no work uses the block.
    unsafe { view.deallocate(StreamRef::DEFAULT, p, l) };
    let (v1, v2) = (
        CudaAsyncView::default_pool(d0()).unwrap(),
        CudaAsyncView::default_pool(d0()).unwrap(),
    );
    assert_eq!(v1, v2);
    assert!(v1 != view);
    // Stateless leaves: equal per device.
    assert_eq!(Cuda::new().unwrap(), Cuda::on(d0()).unwrap());
    assert_eq!(PinnedHost::new().unwrap(), PinnedHost::new().unwrap());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn alignment_beyond_the_guarantee_is_an_invalid_argument() {
    let l = memres::resource::layout_with_alignment(100, 512).unwrap();
    assert!(matches!(
        Cuda::new().unwrap().allocate_sync(l),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        CudaAsync::new().unwrap().allocate(StreamRef::DEFAULT, l),
        Err(Error::InvalidArgument(_))
    ));
    let page = memres::resource::layout_with_alignment(100, 8192).unwrap();
    assert!(matches!(
        PinnedHost::new().unwrap().allocate_sync(page),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_pool_made_without_an_export_handle_cannot_be_exported() {
    let pool = CudaAsync::new().unwrap();
    assert!(matches!(pool.export_fd(), Err(Error::Unsupported(_))));
    // Not only memres's own check: the driver refuses too.
    let _on = DeviceGuard::new(d0()).unwrap();
    let mut fd: std::ffi::c_int = -1;
    let posix = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    // SAFETY: the pool is live; `fd` is a valid place for an `int` handle.
    let r = unsafe {
        sys::cuMemPoolExportToShareableHandle(
            (&mut fd as *mut std::ffi::c_int).cast(),
            pool.pool_handle().cast(),
            posix,
            0,
        )
    };
    assert_ne!(
        r,
        sys::CUresult::CUDA_SUCCESS,
        "a pool made without a handle type exported one"
    );
}

unsafe extern "C" {
    fn fcntl(fd: std::ffi::c_int, cmd: std::ffi::c_int, ...) -> std::ffi::c_int;
}
const F_SETFD: std::ffi::c_int = 2;

/// Runs the test `child` of this binary as another process that inherits `fd` (as
/// `MEMRES_IPC_FD`) and gets `env`, and asserts that it printed `"{tag}: "` and the hex
/// of `expected`.
fn child_reads(
    child: &str,
    fd: &std::os::fd::OwnedFd,
    env: &[(&str, String)],
    tag: &str,
    expected: &[u8],
) {
    use std::os::fd::AsRawFd;
    // SAFETY: `fd` is a descriptor we own; clearing FD_CLOEXEC lets the child inherit it.
    assert_eq!(unsafe { fcntl(fd.as_raw_fd(), F_SETFD, 0) }, 0);
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            child,
            "--exact",
            "--include-ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("MEMRES_IPC_FD", fd.as_raw_fd().to_string())
        .envs(env.iter().map(|(k, v)| (k, v)))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "child failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let expected: String = expected.iter().map(|b| format!("{b:02x}")).collect();
    assert!(
        stdout.contains(&format!("{tag}: {expected}")),
        "the child read something else: {stdout}"
    );
}

/// The exporting side: a pool exported as a POSIX file descriptor, a block in it filled
/// with a pattern, and a child process (this binary again) that imports the pool and the
/// block and prints what it reads.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_pool_exported_as_a_file_descriptor_is_read_by_another_process() {
    let config = CudaAsyncConfig::new().export(ExportHandle::PosixFd);
    let pool = match CudaAsync::with_config(config) {
        Ok(pool) => pool,
        Err(Error::Unsupported(why)) => {
            // Only acceptable where the device really lacks it.
            let dev = cudarc::driver::result::device::get(0).unwrap();
            let attr = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES;
            // SAFETY: `dev` was returned by `device::get`.
            let types =
                unsafe { cudarc::driver::result::device::get_attribute(dev, attr) }.unwrap();
            assert_eq!(types & 1, 0, "the device supports POSIX fds, yet: {why}");
            eprintln!("POSIX fd export is not supported here: {why}");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    assert_eq!(pool.export_handle(), ExportHandle::PosixFd);
    let l = layout(4096).unwrap();
    let block = pool.allocate_sync(l).unwrap();
    let pattern: Vec<u8> = (0..4096u32).map(|i| (i * 13 % 256) as u8).collect();
    let _on = DeviceGuard::new(pool.device()).unwrap();
    // SAFETY: `block` holds 4096 device bytes; `pattern` 4096 host bytes.
    let r = unsafe { sys::cuMemcpyHtoD_v2(block.as_ptr() as u64, pattern.as_ptr().cast(), 4096) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    let fd = pool.export_fd().unwrap();
    let mut data = sys::CUmemPoolPtrExportData { reserved: [0; 64] };
    // SAFETY: `block` came from this exportable pool; `data` is a valid place.
    let r = unsafe { sys::cuMemPoolExportPointer(&mut data, block.as_ptr() as u64) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    let hex: String = data.reserved.iter().map(|b| format!("{b:02x}")).collect();
    child_reads(
        "import_child",
        &fd,
        &[("MEMRES_IPC_DATA", hex)],
        "memres-ipc-read",
        &pattern[..32],
    );
    // SAFETY: the child has exited and released its import; nothing uses the block.
    unsafe { pool.deallocate_sync(block, l) };
}

/// The importing side, run only as the child of the test above.
#[test]
#[ignore = "needs a CUDA GPU"]
fn import_child() {
    let (Ok(fd), Ok(hex)) = (
        std::env::var("MEMRES_IPC_FD"),
        std::env::var("MEMRES_IPC_DATA"),
    ) else {
        return; // not the child
    };
    let fd: usize = fd.parse().unwrap();
    let mut data = sys::CUmemPoolPtrExportData { reserved: [0; 64] };
    for (i, b) in data.reserved.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap();
    }
    let _on = DeviceGuard::new(d0()).unwrap();
    let mut pool = std::ptr::null_mut();
    let posix = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    // SAFETY: a POSIX fd handle is passed as the descriptor's value cast to a pointer.
    let r =
        unsafe { sys::cuMemPoolImportFromShareableHandle(&mut pool, fd as *mut c_void, posix, 0) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "importing the pool");
    let mut ptr = 0;
    // SAFETY: `pool` was just imported; `data` is the exporter's description of a block.
    let r = unsafe { sys::cuMemPoolImportPointer(&mut ptr, pool, &mut data) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "importing the block");
    let mut host = [0u8; 32];
    // SAFETY: the imported block holds 4096 bytes; `host` 32.
    let r = unsafe { sys::cuMemcpyDtoH_v2(host.as_mut_ptr().cast(), ptr, 32) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "reading the block");
    let read: String = host.iter().map(|b| format!("{b:02x}")).collect();
    println!("memres-ipc-read: {read}");
    // SAFETY: the imported block is ours to release, once.
    let r = unsafe { sys::cuMemFree_v2(ptr) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "releasing the import");
}

/// `CudaVirtual`'s IPC: a granule exported as a POSIX file descriptor, filled with a
/// pattern, imported and mapped by a child process (this binary again) into its own
/// address space, which prints what it reads.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_virtual_granule_exported_as_a_file_descriptor_is_read_by_another_process() {
    let config = CudaVirtualConfig::new().export(ExportHandle::PosixFd);
    let leaf = CudaVirtual::with_config(d0(), config).unwrap();
    let g = leaf.granularity();
    let l = layout(g).unwrap();
    let block = leaf.allocate_sync(l).unwrap();
    let pattern: Vec<u8> = (0..4096u32).map(|i| (i * 7 % 251) as u8).collect();
    let _on = DeviceGuard::new(d0()).unwrap();
    // SAFETY: `block` holds `g` >= 4096 device bytes; `pattern` 4096 host bytes.
    let r = unsafe { sys::cuMemcpyHtoD_v2(block.as_ptr() as u64, pattern.as_ptr().cast(), 4096) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    let fd = leaf.export_fd(block.as_ptr() as usize).unwrap();
    child_reads(
        "virtual_import_child",
        &fd,
        &[("MEMRES_VIRTUAL_GRANULE", g.to_string())],
        "memres-virtual-read",
        &pattern[..32],
    );
    // SAFETY: the child has exited and unmapped its import; nothing uses the block.
    unsafe { leaf.deallocate_sync(block, l) };
}

/// The importing side, run only as the child of the test above.
#[test]
#[ignore = "needs a CUDA GPU"]
fn virtual_import_child() {
    let (Ok(fd), Ok(g)) = (
        std::env::var("MEMRES_IPC_FD"),
        std::env::var("MEMRES_VIRTUAL_GRANULE"),
    ) else {
        return; // not the child
    };
    let (fd, g): (usize, usize) = (fd.parse().unwrap(), g.parse().unwrap());
    let _on = DeviceGuard::new(d0()).unwrap();
    let posix = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    let mut handle = 0;
    // SAFETY: a POSIX fd handle is passed as the descriptor's value cast to a pointer.
    let r = unsafe { sys::cuMemImportFromShareableHandle(&mut handle, fd as *mut c_void, posix) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "importing the granule");
    let mut ptr = 0;
    // SAFETY: a fresh reservation of one granule, aligned to it.
    let r = unsafe { sys::cuMemAddressReserve(&mut ptr, g, g, 0, 0) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "reserving an address range");
    // SAFETY: `ptr..ptr + g` is reserved and unmapped; `handle` holds `g` bytes.
    let r = unsafe { sys::cuMemMap(ptr, g, 0, handle, 0) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "mapping the import");
    let access = sys::CUmemAccessDesc {
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: 0,
        },
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    // SAFETY: `ptr..ptr + g` was just mapped; one access descriptor.
    let r = unsafe { sys::cuMemSetAccess(ptr, g, &access, 1) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "granting access");
    let mut host = [0u8; 32];
    // SAFETY: the mapping holds `g` >= 32 bytes; `host` 32.
    let r = unsafe { sys::cuMemcpyDtoH_v2(host.as_mut_ptr().cast(), ptr, 32) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "reading the granule");
    let read: String = host.iter().map(|b| format!("{b:02x}")).collect();
    println!("memres-virtual-read: {read}");
    // SAFETY: ours to undo, once each: the mapping, the imported handle, the range.
    unsafe {
        assert_eq!(sys::cuMemUnmap(ptr, g), sys::CUresult::CUDA_SUCCESS);
        assert_eq!(sys::cuMemRelease(handle), sys::CUresult::CUDA_SUCCESS);
        assert_eq!(sys::cuMemAddressFree(ptr, g), sys::CUresult::CUDA_SUCCESS);
    }
}

/// The access device 1 has to the mapping at `ptr` (`cuMemGetAccess`).
fn access_of_device_1(ptr: u64) -> u64 {
    let location = sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: 1,
    };
    let mut flags = 0u64;
    // SAFETY: `ptr` lies in a mapped virtual range; `flags` is a valid place.
    let r = unsafe { sys::cuMemGetAccess(&mut flags, &location, ptr) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "cuMemGetAccess");
    flags
}

/// Device 1, where there are two GPUs and it can reach device 0's memory (else `None`,
/// the reason printed as a skip).
fn device_1_reaching_device_0() -> Option<DeviceId> {
    if DeviceId::count().unwrap() < 2 {
        println!("memres-skip: fewer than two GPUs");
        return None;
    }
    let mut can = 0;
    // SAFETY: two valid ordinals; `can` is a valid place.
    let r = unsafe { sys::cuDeviceCanAccessPeer(&mut can, 1, 0) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    if can == 0 {
        println!("memres-skip: device 1 cannot access device 0's memory");
        return None;
    }
    Some(DeviceId::new(1))
}

/// Device 1 fills each block (`n` bytes of device 0's memory, every granule checked
/// read-write for device 1 first) with its own byte, and device 0 reads them back.
fn device_1_fills(blocks: &[(std::ptr::NonNull<u8>, usize)], g: usize) {
    let rw = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE as u64;
    for &(b, n) in blocks {
        for offset in (0..n).step_by(g) {
            assert_eq!(access_of_device_1(b.as_ptr() as u64 + offset as u64), rw);
        }
    }
    device_1_writes(blocks);
}

/// Device 1 fills each block (`n` bytes of device 0's memory that device 1 may reach)
/// with its own byte, and device 0 reads them back.
fn device_1_writes(blocks: &[(std::ptr::NonNull<u8>, usize)]) {
    for (i, &(b, n)) in blocks.iter().enumerate() {
        let _on = DeviceGuard::new(DeviceId::new(1)).unwrap();
        // SAFETY: `b` holds `n` bytes of device 0's memory that device 1 may read and
        // write (the caller's promise: a mapping's access, or its driver pool's).
        let r = unsafe { sys::cuMemsetD8_v2(b.as_ptr() as u64, 0x50 + i as u8, n) };
        assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "device 1 writing block {i}");
        // SAFETY: waits for device 1's work; no arguments.
        let r = unsafe { sys::cuCtxSynchronize() };
        assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    }
    let _on = DeviceGuard::new(d0()).unwrap();
    for (i, &(b, n)) in blocks.iter().enumerate() {
        let mut host = vec![0u8; n];
        // SAFETY: `b` holds `n` bytes on device 0; `host` holds `n`.
        let r = unsafe { sys::cuMemcpyDtoH_v2(host.as_mut_ptr().cast(), b.as_ptr() as u64, n) };
        assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
        assert!(host.iter().all(|&x| x == 0x50 + i as u8), "block {i}");
    }
}

/// A pool growing in place on device 0 whose `CudaVirtual` names device 1 as a peer:
/// every granule it maps, in each growth step, is readable and writable by device 1
/// (device 1 fills the blocks, device 0 reads them back); without the peer, device 1 has
/// no access. Needs two GPUs that can reach each other (skipped otherwise).
#[test]
#[ignore = "needs two CUDA GPUs"]
fn a_peer_device_writes_every_granule_of_a_virtual_pool() {
    let Some(d1) = device_1_reaching_device_0() else {
        return;
    };
    let leaf = CudaVirtual::with_config(d0(), CudaVirtualConfig::new().peers([d1])).unwrap();
    let g = leaf.granularity();
    let pool = leaf.virtual_pool(memres::VirtualPoolConfig::new()).unwrap();
    // Two growth steps: 3 granules, then 5 more.
    let blocks: Vec<_> = [3 * g, 5 * g]
        .into_iter()
        .map(|n| (pool.allocate_sync(layout(n).unwrap()).unwrap(), n))
        .collect();
    device_1_fills(&blocks, g);
    for (b, n) in blocks {
        // SAFETY: from `pool` with this layout; the work on it was waited for.
        unsafe { pool.deallocate_sync(b, layout(n).unwrap()) };
    }
    // Without the peer, device 1 has no access to the same kind of mapping.
    let alone = CudaVirtual::with_config(d0(), CudaVirtualConfig::new()).unwrap();
    let l = layout(g).unwrap();
    let b = alone.allocate_sync(l).unwrap();
    assert_eq!(access_of_device_1(b.as_ptr() as u64), 0);
    // SAFETY: from `alone` with `l`; never used.
    unsafe { alone.deallocate_sync(b, l) };
}

/// A peer granted after the pool grew (`grant_access`, what the C ABI's
/// `memres_enable_peer_access` does when PyTorch first needs it) reaches what was mapped
/// before (two growth steps with a hole unmapped between them) and what is mapped after;
/// a second grant, and one for the leaf's own device, change nothing.
#[test]
#[ignore = "needs two CUDA GPUs"]
fn a_peer_granted_later_reaches_what_was_mapped_before_and_after() {
    let Some(d1) = device_1_reaching_device_0() else {
        return;
    };
    let leaf = CudaVirtual::with_config(d0(), CudaVirtualConfig::new()).unwrap();
    let g = leaf.granularity();
    let pool = leaf.virtual_pool(memres::VirtualPoolConfig::new()).unwrap();
    let (a, hole, b) = (2 * g, 3 * g, 2 * g);
    let blocks: Vec<_> = [a, hole, b]
        .into_iter()
        .map(|n| (pool.allocate_sync(layout(n).unwrap()).unwrap(), n))
        .collect();
    // SAFETY: from `pool` with this layout; never used.
    unsafe { pool.deallocate_sync(blocks[1].0, layout(hole).unwrap()) };
    pool.trim().unwrap();
    assert_eq!(
        pool.upstream().mapped_bytes(),
        a + b,
        "two runs, a hole between"
    );
    assert_eq!(
        access_of_device_1(blocks[0].0.as_ptr() as u64),
        0,
        "not yet"
    );
    pool.upstream().grant_access(d1).unwrap();
    pool.upstream().grant_access(d1).unwrap();
    pool.upstream().grant_access(d0()).unwrap();
    assert_eq!(pool.upstream().accessible_from(), [d0(), d1]);
    let later = 4 * g;
    let mut reached = vec![blocks[0], blocks[2]];
    reached.push((pool.allocate_sync(layout(later).unwrap()).unwrap(), later));
    device_1_fills(&reached, g);
    for (p, n) in reached {
        // SAFETY: from `pool` with this layout; the work on it was waited for.
        unsafe { pool.deallocate_sync(p, layout(n).unwrap()) };
    }
}

/// A driver pool's memory is not reached through the contexts' peer access: granting a
/// peer (`cuMemPoolSetAccess`, what `memres_enable_peer_access` does for `cuda_async`
/// stacks) lets device 1 write a block the pool held before the grant and one it
/// allocates after; a second grant, and one for the pool's own device, change nothing.
/// The evidence that the grant took is the driver's own answer (`accessible_from`, from
/// `cuMemPoolGetAccess`: device 0 alone before); the writes show the access works (a
/// write without it would end the context, so the test does not try one).
#[test]
#[ignore = "needs two CUDA GPUs"]
fn a_peer_granted_to_a_driver_pool_writes_its_blocks() {
    let Some(d1) = device_1_reaching_device_0() else {
        return;
    };
    let pool = memres::upstream::CudaAsync::on(d0(), CudaAsyncConfig::new()).unwrap();
    assert_eq!(
        pool.accessible_from().unwrap(),
        [d0()],
        "its own device only"
    );
    let n = 3 << 20;
    let before = pool.allocate_sync(layout(n).unwrap()).unwrap();
    pool.grant_access(d1).unwrap();
    pool.grant_access(d1).unwrap();
    pool.grant_access(d0()).unwrap();
    assert_eq!(pool.accessible_from().unwrap(), [d0(), d1]);
    let after = pool.allocate_sync(layout(n).unwrap()).unwrap();
    device_1_writes(&[(before, n), (after, n)]);
    for p in [before, after] {
        // SAFETY: from `pool` with this layout; the work on it was waited for.
        unsafe { pool.deallocate_sync(p, layout(n).unwrap()) };
    }
}

/// A block freed in stream order behind long work is pending in the driver pool: a
/// trim then keeps it; once the device's work is waited for (`DeviceId::synchronize`,
/// what `memres_trim` does for `cuda_async` stacks), a trim gives everything back.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_driver_pool_trimmed_after_the_device_is_waited_for_holds_nothing() {
    let pool = CudaAsync::on(d0(), CudaAsyncConfig::new()).unwrap();
    let stream = Stream::with_flags(StreamFlags::NonBlocking).unwrap();
    let n = 512 << 20;
    let p = pool.allocate(stream.as_ref(), layout(n).unwrap()).unwrap();
    // Work on the stream that takes a while (256 fills of 512 MiB: tens of ms on an
    // H100, where the trim below comes microseconds after), then the free.
    let raw = stream.raw() as sys::CUstream;
    for i in 0..=255u8 {
        // SAFETY: `p` holds `n` bytes allocated on this stream; the fill is ordered on it.
        let r = unsafe { sys::cuMemsetD8Async(p.as_ptr() as u64, i, n, raw) };
        assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    }
    // SAFETY: from `pool` on this stream with this layout; its work is ordered before.
    unsafe { pool.deallocate(stream.as_ref(), p, layout(n).unwrap()) };
    pool.trim_to(0).unwrap();
    assert!(
        pool.reserved_bytes().unwrap() >= n as u64,
        "the free is still pending: the pool keeps its memory"
    );
    d0().synchronize().unwrap();
    pool.trim_to(0).unwrap();
    assert_eq!(pool.reserved_bytes().unwrap(), 0);
    assert_eq!(pool.used_bytes().unwrap(), 0);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn streams_events_and_the_stream_pool() {
    let (a, b) = (
        Stream::with_flags(StreamFlags::NonBlocking).unwrap(),
        Stream::new().unwrap(),
    );
    assert_ne!(a.as_ref(), b.as_ref());
    assert_eq!(a.device(), d0());
    let e = Event::new().unwrap();
    assert!(e.is_complete().unwrap(), "an unrecorded event is complete");
    e.record(a.as_ref()).unwrap();
    b.as_ref().wait_for(&e).unwrap();
    e.synchronize().unwrap();
    assert!(e.is_complete().unwrap());
    a.synchronize().unwrap();
    b.synchronize().unwrap();
    StreamRef::DEFAULT.synchronize().unwrap();
    StreamRef::PER_THREAD.synchronize().unwrap();
    // Host streams with events: recording on one waits for the event.
    e.record(StreamRef::HOST).unwrap();
    StreamRef::HOST.wait_for(&e).unwrap();

    let pool = StreamPool::new().unwrap();
    assert_eq!(pool.len(), StreamPool::DEFAULT_SIZE);
    let firsts: Vec<_> = (0..pool.len()).map(|_| pool.get()).collect();
    for (i, s) in firsts.iter().enumerate() {
        assert!(
            !firsts[..i].contains(s),
            "round-robin hands out every stream once"
        );
    }
    assert_eq!(pool.get_by_id(3), pool.get_by_id(3 + pool.len()));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn allocate_on_one_stream_free_on_another_after_an_event() {
    let pool = CudaAsync::new().unwrap();
    let (a, b) = (
        Stream::with_flags(StreamFlags::NonBlocking).unwrap(),
        Stream::with_flags(StreamFlags::NonBlocking).unwrap(),
    );
    let l = layout(64 << 20).unwrap();
    for _ in 0..100 {
        let p = pool.allocate(a.as_ref(), l).unwrap();
        let _on = DeviceGuard::new(d0()).unwrap();
        // SAFETY: `p` holds 64 MiB; the memset is enqueued on `a`, where `p` is valid.
        let r = unsafe { sys::cuMemsetD8Async(p.as_ptr() as u64, 0x5a, 64 << 20, a.raw().cast()) };
        assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
        let done = Event::new().unwrap();
        done.record(a.as_ref()).unwrap();
        b.as_ref().wait_for(&done).unwrap();
        // SAFETY: `b` waits for the memset on `a`, so the free is ordered after it.
        unsafe { pool.deallocate(b.as_ref(), p, l) };
    }
    b.synchronize().unwrap();
    a.synchronize().unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
#[cfg(feature = "cudarc-interop")]
fn cudarc_streams_work_both_ways() {
    let ctx = cudarc::driver::CudaContext::new(0).unwrap();
    let theirs = ctx.new_stream().unwrap();
    let pool = CudaAsync::new().unwrap();
    let l = layout(1 << 20).unwrap();
    // cudarc -> memres, borrowed:
    let p = pool.allocate(StreamRef::from(&*theirs), l).unwrap();
    // SAFETY: nothing uses `p`; freed on the stream it was allocated on.
    unsafe { pool.deallocate(StreamRef::from(&*theirs), p, l) };
    // cudarc -> memres, owned:
    let ours = Stream::from_cudarc(theirs.clone()).unwrap();
    ours.synchronize().unwrap();
    // memres -> cudarc:
    let mine = Stream::new().unwrap();
    // SAFETY: `ctx` is device 0's primary context; `wrapped` is dropped before `mine`.
    let wrapped = unsafe { mine.as_cudarc(&ctx) };
    assert_eq!(wrapped.cu_stream().cast(), mine.raw());
    wrapped.synchronize().unwrap();
    drop(wrapped);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn devices_and_their_memory() {
    let n = DeviceId::count().unwrap();
    assert!(n >= 1);
    eprintln!("{n} device(s); device 0: {}", d0().name().unwrap());
    // A fresh thread has no context current: device 0 counts as current.
    std::thread::spawn(|| assert_eq!(DeviceId::current().unwrap(), d0()))
        .join()
        .unwrap();
    {
        let _guard = DeviceGuard::new(DeviceId::new((n - 1) as i32)).unwrap();
        assert_eq!(DeviceId::current().unwrap(), DeviceId::new((n - 1) as i32));
    }
    let before = d0().memory_info().unwrap();
    assert!(0 < before.free && before.free <= before.total);
    let half = percent_of_free_device_memory(50).unwrap();
    let after = d0().memory_info().unwrap();
    assert_eq!(half % 256, 0);
    // Other tests allocate meanwhile: bound by the free memory seen on either side, with
    // 2% of the device as slack.
    let slack = before.total / 50;
    let (lo, hi) = (before.free.min(after.free), before.free.max(after.free));
    assert!(
        lo / 2 <= half + slack && half <= hi / 2 + slack,
        "{half} vs {before:?} / {after:?}"
    );
    assert_eq!(percent_of_free_device_memory(0).unwrap(), 0);
    assert!(matches!(
        DeviceId::new(n as i32 + 10).memory_info(),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        Cuda::on(DeviceId::new(n as i32)),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn prefetch_moves_managed_memory_to_the_device_and_leaves_other_memory_alone() {
    use memres::adaptor::Prefetch;
    let managed = Prefetch::new(Managed::new().unwrap()).unwrap();
    let stream = Stream::with_flags(StreamFlags::NonBlocking).unwrap();
    let l = layout(8 << 20).unwrap();
    let p = managed.allocate(stream.as_ref(), l).unwrap();
    stream.synchronize().unwrap();
    if managed.is_enabled() {
        let _on = DeviceGuard::new(d0()).unwrap();
        let mut location: i32 = -2;
        let attr = sys::CUmem_range_attribute::CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION;
        // SAFETY: the range is a live 8 MiB block; the attribute is a 4-byte int.
        let r = unsafe {
            sys::cuMemRangeGetAttribute(
                (&mut location as *mut i32).cast(),
                4,
                attr,
                p.as_ptr() as u64,
                8 << 20,
            )
        };
        assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
        assert_eq!(location, 0, "prefetched to device 0");
    } else {
        println!(
            "memres-skip: (in part) no concurrent managed access here: only the forwarding path of Prefetch ran"
        );
    }
    // SAFETY: allocated above on `stream`; nothing uses it.
    unsafe { managed.deallocate(stream.as_ref(), p, l) };
    // Device memory is not managed: forwarded, no error.
    let plain = Prefetch::new(Cuda::new().unwrap()).unwrap();
    let q = plain.allocate(stream.as_ref(), l).unwrap();
    // SAFETY: as above.
    unsafe { plain.deallocate(stream.as_ref(), q, l) };
    stream.synchronize().unwrap();
}

/// A growth near the pool's peak gives back the whole free granules it does not join, and
/// waits for its stream's work first (the stream's, not the whole device's: it must still
/// be the stream's): a copy enqueued on the stream behind long work reads a block freed on
/// that stream, then a larger request on the stream grows the pool, giving that block's
/// granules back. The copy must read the block's bytes, with no fault.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_growth_gives_back_a_freed_block_only_after_its_streams_work_with_it() {
    use memres::suballoc::{VirtualPool, VirtualPoolConfig};
    let pool = VirtualPool::new(CudaVirtual::new().unwrap(), VirtualPoolConfig::new()).unwrap();
    let main = Stream::with_flags(StreamFlags::NonBlocking).unwrap();
    let cuda = Cuda::new().unwrap();
    let (n, busy) = (64 << 20, 256 << 20);
    let (l, lbusy) = (layout(n).unwrap(), layout(busy).unwrap());
    let x = pool.allocate(main.as_ref(), l).unwrap();
    // Above `x`, kept: `x`'s free block joins no growth site.
    let pin = pool
        .allocate(main.as_ref(), layout(1 << 20).unwrap())
        .unwrap();
    let scratch = cuda.allocate(main.as_ref(), lbusy).unwrap();
    let seen = cuda.allocate(main.as_ref(), l).unwrap();
    let raw = main.raw().cast();
    // SAFETY: each pointer holds the bytes named, used on `main` in its order.
    unsafe {
        assert_eq!(
            sys::cuMemsetD8Async(x.as_ptr() as u64, 0x5a, n, raw),
            sys::CUresult::CUDA_SUCCESS
        );
        for _ in 0..100 {
            assert_eq!(
                sys::cuMemsetD8Async(scratch.as_ptr() as u64, 0, busy, raw),
                sys::CUresult::CUDA_SUCCESS
            );
        }
        let copied = sys::cuMemcpyDtoDAsync_v2(seen.as_ptr() as u64, x.as_ptr() as u64, n, raw);
        assert_eq!(copied, sys::CUresult::CUDA_SUCCESS);
    }
    let mapped = pool.stats().pool_size;
    // SAFETY: allocated above with `l` on `main`; its last use is enqueued there.
    unsafe { pool.deallocate(main.as_ref(), x, l) };
    let big = layout(2 * n).unwrap();
    let y = pool.allocate(main.as_ref(), big).unwrap();
    assert!(
        pool.stats().pool_size < mapped + 2 * n,
        "the growth gave back the freed block's granules"
    );
    main.synchronize()
        .expect("the copy ran with its source mapped");
    let mut host = vec![0u8; n];
    // SAFETY: `seen` holds `n` device bytes; `main` is done.
    let back = unsafe { sys::cuMemcpyDtoH_v2(host.as_mut_ptr().cast(), seen.as_ptr() as u64, n) };
    assert_eq!(back, sys::CUresult::CUDA_SUCCESS);
    assert!(
        host.iter().all(|&b| b == 0x5a),
        "the copy read the block's bytes"
    );
    // SAFETY: each allocated above with its layout on `main`, which is done.
    unsafe {
        pool.deallocate(main.as_ref(), y, big);
        pool.deallocate(main.as_ref(), pin, layout(1 << 20).unwrap());
        cuda.deallocate(main.as_ref(), scratch, lbusy);
        cuda.deallocate(main.as_ref(), seen, l);
    }
}
