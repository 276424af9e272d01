//! Fallback to a peer GPU (issue 37, rmm #2075): a pool on GPU 0 capped below what the
//! program needs, then a pool on GPU 1 whose memory GPU 0 may reach (peer access over
//! NVLink or PCIe). Requests past the cap come from GPU 1; GPU 0 writes them and the bytes
//! read back; frees reach the pool that served each block; the tiers' figures say what
//! each served. Needs two GPUs that reach each other (`memres-skip` otherwise).

// A HIP build (feature `hip`) leaves these out: they check results through cudarc's
// CUDA calls. docs/platforms.md says what runs on an AMD GPU instead.
#![cfg(not(feature = "hip"))]

use cudarc::driver::sys;
use memres::device::{DeviceGuard, DeviceId};
use memres::{
    CudaVirtual, Error, Resource, ResourceExt, StreamRef, VirtualPool, VirtualPoolConfig, layout,
    upstream::CudaVirtualConfig,
};

const MIB: usize = 1 << 20;

/// The ordinal of the device whose memory holds `addr`.
fn device_of(addr: usize) -> i32 {
    let mut ordinal = -1i32;
    // SAFETY: `ordinal` is a valid place for the attribute (an int); `addr` is a device
    // pointer of this process.
    let r = unsafe {
        sys::cuPointerGetAttribute(
            (&raw mut ordinal).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            addr as sys::CUdeviceptr,
        )
    };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    ordinal
}

#[test]
#[ignore = "needs two CUDA GPUs"]
fn a_full_device_falls_back_to_a_peer_gpu() -> Result<(), Error> {
    let n = DeviceId::count()?;
    if n < 2 {
        println!("memres-skip: only {n} GPU here: falling back to a peer needs two");
        return Ok(());
    }
    let (d0, d1) = (DeviceId::new(0), DeviceId::new(1));
    if !d0.can_access_peer(d1)? {
        println!("memres-skip: GPU 0 cannot reach GPU 1's memory (no peer access)");
        return Ok(());
    }
    let local = VirtualPool::new(
        CudaVirtual::with_config(d0, CudaVirtualConfig::new())?,
        VirtualPoolConfig::new().maximum_size(64 * MIB),
    )?;
    // GPU 1's memory, mapped so that GPU 0 may read and write it.
    let peer = VirtualPool::new(
        CudaVirtual::with_config(d1, CudaVirtualConfig::new().peers([d0]))?,
        VirtualPoolConfig::new(),
    )?;
    let chain = local.with_fallback(peer);
    let _on = DeviceGuard::new(d0)?;
    let l = layout(40 * MIB)?;
    let blocks: Vec<_> = (0..4)
        .map(|_| chain.allocate(StreamRef::HOST, l))
        .collect::<Result<_, _>>()?;
    let homes: Vec<i32> = blocks
        .iter()
        .map(|p| device_of(p.as_ptr() as usize))
        .collect();
    assert_eq!(
        homes,
        [0, 1, 1, 1],
        "one block fits under GPU 0's cap; the rest are GPU 1's"
    );
    for (i, p) in blocks.iter().enumerate() {
        // GPU 0 (its context is current) writes every block, its peer's included.
        // SAFETY: a live block of `l.size()` bytes that GPU 0 may reach.
        let r =
            unsafe { sys::cuMemsetD8_v2(p.as_ptr() as sys::CUdeviceptr, i as u8 + 1, l.size()) };
        assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    }
    // SAFETY: only waits for the memsets above.
    let r = unsafe { sys::cuCtxSynchronize() };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    for (i, p) in blocks.iter().enumerate() {
        let mut back = vec![0u8; l.size()];
        // SAFETY: the block is `l.size()` bytes; `back` is as long.
        let r = unsafe {
            sys::cuMemcpyDtoH_v2(
                back.as_mut_ptr().cast(),
                p.as_ptr() as sys::CUdeviceptr,
                l.size(),
            )
        };
        assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
        assert!(
            back.iter().all(|&b| b == i as u8 + 1),
            "block {i} holds what GPU 0 wrote"
        );
    }
    let [first, then] = chain.tiers();
    assert_eq!(first.bytes.current, 40 * MIB as i64);
    assert_eq!(then.bytes.current, 3 * 40 * MIB as i64);
    println!(
        "GPU 0 served {} MiB, its peer GPU 1 {} MiB",
        first.bytes.current >> 20,
        then.bytes.current >> 20
    );
    for p in blocks {
        // SAFETY: allocated above with `l` on the host stream; the work using it is done.
        unsafe { chain.deallocate(StreamRef::HOST, p, l) };
    }
    let [first, then] = chain.tiers();
    assert_eq!(
        (first.bytes.current, then.bytes.current),
        (0, 0),
        "each free reached its tier"
    );
    assert_eq!(chain.first().stats().live_bytes(), 0);
    assert_eq!(chain.then().stats().live_bytes(), 0);
    Ok(())
}
