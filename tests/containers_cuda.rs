//! The containers on a real GPU: RMM's `device_buffer`, `device_uvector` and
//! `device_scalar` cases, the cudarc views and the allocator-api2 bridge over pinned and
//! managed memory. All `#[ignore]`d: CI has no GPU; `shared/gpu/bundle.sh`'s `run.sh` runs
//! them on the GPU machine.

#[cfg(all(feature = "cudarc-interop", not(feature = "hip")))]
use std::sync::Arc;

#[cfg(all(feature = "cudarc-interop", not(feature = "hip")))]
use cudarc::driver::CudaContext;
use memres::adaptor::Statistics;
use memres::container::{DeviceBuffer, DeviceScalar, DeviceVec, HostAllocator};
use memres::device::{DeviceGuard, DeviceId};
use memres::stream::{Stream, StreamFlags};
use memres::{
    Cuda, Error, Pool, PoolConfig, StreamRef,
    upstream::{Managed, PinnedHost},
};

const D: StreamRef<'static> = StreamRef::DEFAULT;

fn pool() -> Pool<Statistics<Cuda>> {
    Pool::new(Statistics::new(Cuda::new().unwrap()), PoolConfig::default()).unwrap()
}

fn pattern(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i * 7 % 251) as u8).collect()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn empty_buffer() {
    let buf = DeviceBuffer::new(0, D, Cuda::new().unwrap()).unwrap();
    assert!(buf.is_empty());
    assert_eq!((buf.size(), buf.capacity()), (0, 0));
    assert_eq!(buf.device(), Some(DeviceId::current().unwrap()));
    assert_eq!(buf.to_host_vec().unwrap(), Vec::<u8>::new());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn explicit_stream_and_resource() {
    let pool = pool();
    let stream = Stream::with_flags(StreamFlags::NonBlocking).unwrap();
    {
        let buf = DeviceBuffer::new(1 << 20, stream.as_ref(), &pool).unwrap();
        assert_eq!(buf.stream(), stream.as_ref());
        assert!(*buf.resource() == &pool);
        assert_eq!(buf.as_ptr() as usize % 256, 0);
        assert_eq!(pool.upstream().allocations().current, 1);
    }
    stream.synchronize().unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn copy_from_host_and_device() {
    let pool = pool();
    let (a, b) = (Stream::new().unwrap(), Stream::new().unwrap());
    let data = pattern(3 << 20);
    let src = DeviceBuffer::from_host(&data, a.as_ref(), &pool).unwrap();
    assert_eq!(src.to_host_vec().unwrap(), data);
    // Device to device, onto another stream and another resource.
    let copy = DeviceBuffer::copy_from(&src, b.as_ref(), Cuda::new().unwrap()).unwrap();
    drop(src); // freed on `a`, which waits for the copy on `b`
    assert_eq!(copy.to_host_vec().unwrap(), data);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn copy_with_capacity_larger_than_size() {
    let pool = pool();
    let mut buf = DeviceBuffer::from_host(&pattern(1000), D, &pool).unwrap();
    buf.reserve(1 << 20).unwrap();
    assert_eq!((buf.size(), buf.capacity()), (1000, 1 << 20));
    let copy = DeviceBuffer::copy_from(&buf, D, &pool).unwrap();
    assert_eq!((copy.size(), copy.capacity()), (1000, 1000));
    assert_eq!(copy.to_host_vec().unwrap(), pattern(1000));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn move_keeps_the_memory() {
    let buf = DeviceBuffer::from_host(&pattern(4096), D, Cuda::new().unwrap()).unwrap();
    let ptr = buf.as_ptr();
    let moved = buf;
    assert_eq!(moved.as_ptr(), ptr);
    let handle = std::thread::spawn(move || moved.to_host_vec().unwrap());
    assert_eq!(handle.join().unwrap(), pattern(4096));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn resize_smaller_and_bigger() {
    let pool = pool();
    let mut buf = DeviceBuffer::from_host(&pattern(10_000), D, &pool).unwrap();
    let ptr = buf.as_ptr();
    buf.resize(5_000).unwrap();
    assert_eq!(
        (buf.size(), buf.capacity(), buf.as_ptr()),
        (5_000, 10_000, ptr)
    );
    buf.resize(8_000).unwrap();
    assert_eq!(
        (buf.size(), buf.capacity(), buf.as_ptr()),
        (8_000, 10_000, ptr)
    );
    buf.resize(20_000).unwrap();
    assert_eq!((buf.size(), buf.capacity()), (20_000, 20_000));
    // Only the bytes written are read back: the rest is uninitialized (compute-sanitizer's
    // initcheck reports reads of it).
    let mut kept = vec![0u8; 5_000];
    buf.copy_to_host(&mut kept).unwrap();
    assert_eq!(kept, pattern(5_000));
    buf.resize(100).unwrap();
    buf.shrink_to_fit().unwrap();
    assert_eq!((buf.size(), buf.capacity()), (100, 100));
    assert_eq!(buf.to_host_vec().unwrap(), pattern(100));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn reserve_and_set_stream() {
    let (a, b) = (Stream::new().unwrap(), Stream::new().unwrap());
    let mut buf =
        DeviceBuffer::from_host(&pattern(1 << 16), a.as_ref(), Cuda::new().unwrap()).unwrap();
    buf.reserve(1 << 20).unwrap();
    assert_eq!((buf.size(), buf.capacity()), (1 << 16, 1 << 20));
    buf.set_stream(b.as_ref()).unwrap();
    assert_eq!(buf.stream(), b.as_ref());
    buf.resize(1 << 21).unwrap(); // reallocated on `b`, after `a`'s work
    let mut kept = vec![0u8; 1 << 16];
    buf.copy_to_host(&mut kept).unwrap();
    assert_eq!(kept, pattern(1 << 16));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn alignment_and_too_large_alignment() {
    let pinned = PinnedHost::new().unwrap();
    let buf = DeviceBuffer::with_alignment(100, 4096, D, pinned).unwrap();
    assert_eq!(buf.as_ptr() as usize % 4096, 0);
    assert_eq!(buf.alignment(), 4096);
    let err = DeviceBuffer::with_alignment(100, 1 << 16, D, Cuda::new().unwrap()).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    assert!(err.to_string().contains("alignment"), "{err}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn out_of_memory_is_an_error() {
    let err = DeviceBuffer::new(1 << 50, D, Cuda::new().unwrap()).unwrap_err();
    assert!(err.is_out_of_memory(), "{err}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn vec_elements() {
    let pool = pool();
    let stream = Stream::new().unwrap();
    let s = stream.as_ref();
    let mut v = DeviceVec::from_slice(&[1.0f64, 2.0, 3.0, 4.0], s, &pool).unwrap();
    v.set(0, -0.0, s).unwrap();
    assert_eq!(v.get(0, s).unwrap().to_bits(), (-0.0f64).to_bits());
    assert_eq!(v.front(D).unwrap().to_bits(), (-0.0f64).to_bits()); // another stream
    assert_eq!(v.back(s).unwrap(), 4.0);
    static FIVE: f64 = 5.0;
    v.set_async(1, &FIVE, D).unwrap();
    assert_eq!(v.to_vec(s).unwrap(), [-0.0, 5.0, 3.0, 4.0]);
    let err = v.get(4, s).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    assert!(v.set(4, 0.0, s).is_err());

    let z = DeviceVec::<u32, _>::zeroed(1 << 20, s, &pool).unwrap();
    assert!(z.to_vec(s).unwrap().iter().all(|&x| x == 0));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn vec_resize_reserve_shrink_into_buffer() {
    let pool = pool();
    let mut v = DeviceVec::from_slice(&[1u16, 2, 3], D, &pool).unwrap();
    v.reserve(1000).unwrap();
    assert_eq!((v.len(), v.capacity()), (3, 1000));
    v.resize(500).unwrap();
    assert_eq!(v.capacity(), 1000);
    v.resize(2000).unwrap();
    assert_eq!((v.len(), v.capacity()), (2000, 2000));
    let kept: Vec<u16> = (0..3).map(|i| v.get(i, D).unwrap()).collect();
    assert_eq!(kept, [1, 2, 3]);
    v.resize(2).unwrap();
    v.shrink_to_fit().unwrap();
    assert_eq!((v.len(), v.capacity()), (2, 2));
    let buf = v.into_buffer();
    assert_eq!(buf.to_host_vec().unwrap(), [1, 0, 2, 0]);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn scalar_round_trips() {
    let mut x = DeviceScalar::with_value(&-0.0f32, D, Cuda::new().unwrap()).unwrap();
    assert_eq!(x.value(D).unwrap().to_bits(), (-0.0f32).to_bits());
    x.set_value(3.25, D).unwrap();
    assert_eq!(x.value(D).unwrap(), 3.25);
    x.set_value_to_zero(D).unwrap();
    assert_eq!(x.value(D).unwrap().to_bits(), 0);
    x.set_value_async(&9.5, D).unwrap();
    assert_eq!(x.value(D).unwrap(), 9.5);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn default_resource_containers_hold_their_resource() {
    let mut v = DeviceVec::<f32, _>::new_default(1000, D).unwrap();
    v.set_to_zero(D).unwrap(); // `new` leaves the elements uninitialized
    assert_eq!(v.len(), 1000);
    let before = memres::per_device::current_resource().unwrap();
    assert!(*v.resource() == before);
    // Replacing the default does not touch the vector's resource.
    let old =
        memres::per_device::set_current_resource(memres::AnyResource::new(Cuda::new().unwrap()))
            .unwrap();
    assert!(v.to_vec(D).is_ok());
    drop(v);
    if let Some(old) = old {
        memres::per_device::set_current_resource(old).unwrap();
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn dropped_with_another_device_current() {
    let devices = DeviceId::count().unwrap();
    if devices < 2 {
        println!(
            "memres-skip: one GPU only ({devices}); needs two to drop on device 0 with 1 current"
        );
        return;
    }
    let on_0 = {
        let _d0 = DeviceGuard::new(DeviceId::new(0)).unwrap();
        DeviceBuffer::from_host(&pattern(1 << 20), D, Cuda::new().unwrap()).unwrap()
    };
    let _d1 = DeviceGuard::new(DeviceId::new(1)).unwrap();
    assert_eq!(on_0.device(), Some(DeviceId::new(0)));
    assert_eq!(on_0.to_host_vec().unwrap(), pattern(1 << 20));
    drop(on_0);
    assert_eq!(DeviceId::current().unwrap(), DeviceId::new(1));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn host_accessible_device_memory_has_host_slices() {
    let stream = Stream::new().unwrap();
    let s = stream.as_ref();
    let mut pinned = DeviceVec::from_slice(&[1i32, 2, 3], s, PinnedHost::new().unwrap()).unwrap();
    pinned.as_mut_slice().unwrap()[1] = 20;
    assert_eq!(pinned.to_vec(s).unwrap(), [1, 20, 3]);
    let fresh = DeviceVec::<i32, _>::new(1 << 16, s, Managed::new().unwrap()).unwrap();
    assert!(
        fresh.as_slice().unwrap().iter().all(|&x| x == 0),
        "zeroed on host memory"
    );
    let managed = DeviceVec::from_slice(&[5u8; 1000], s, Managed::new().unwrap()).unwrap();
    assert_eq!(managed.as_slice().unwrap(), [5u8; 1000]);
}

#[test]
#[ignore = "needs a CUDA GPU"]
#[cfg(all(feature = "cudarc-interop", not(feature = "hip")))]
fn cudarc_copies_and_memsets_take_views() {
    let ctx = CudaContext::new(0).unwrap();
    let cs: Arc<_> = ctx.new_stream().unwrap();
    let pool = pool();
    let mut v = DeviceVec::<f32, _>::new(1024, StreamRef::from(&*cs), &pool).unwrap();
    let host: Vec<f32> = (0..1024).map(|i| i as f32).collect();
    cs.memcpy_htod(&host, &mut v.cudarc_mut(&cs).unwrap())
        .unwrap();
    assert_eq!(v.to_vec(StreamRef::from(&*cs)).unwrap(), host);
    let mut back = vec![0f32; 1024];
    cs.memcpy_dtoh(&v.cudarc(&cs).unwrap(), &mut back).unwrap();
    cs.synchronize().unwrap();
    assert_eq!(back, host);
    cs.memset_zeros(&mut v.cudarc_mut(&cs).unwrap()).unwrap();
    assert!(
        v.to_vec(StreamRef::from(&*cs))
            .unwrap()
            .iter()
            .all(|&x| x == 0.0)
    );

    // Another stream is refused, with a message saying what to do.
    let other = ctx.new_stream().unwrap();
    let err = v.cudarc(&other).unwrap_err();
    assert!(err.to_string().contains("set_stream"), "{err}");

    // A copy issued from another stream through a view is ordered and completes.
    let mut w = DeviceVec::<f32, _>::new(1024, StreamRef::from(&*other), &pool).unwrap();
    other
        .memcpy_dtod(&v.cudarc(&cs).unwrap(), &mut w.cudarc_mut(&other).unwrap())
        .unwrap();
    assert!(
        w.to_vec(StreamRef::from(&*other))
            .unwrap()
            .iter()
            .all(|&x| x == 0.0)
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn allocator_api2_over_pinned_and_managed_memory() {
    let pinned_pool = Pool::new(PinnedHost::new().unwrap(), PoolConfig::default()).unwrap();
    let mut v = allocator_api2::vec::Vec::new_in(HostAllocator::new(&pinned_pool));
    v.extend(0..100_000u32);
    assert_eq!(
        v.iter().map(|&x| x as u64).sum::<u64>(),
        99_999 * 100_000 / 2
    );

    let mut m = hashbrown::HashMap::new_in(HostAllocator::new(Managed::new().unwrap()));
    for i in 0..1000u64 {
        m.insert(i, i * i);
    }
    assert_eq!(m[&999], 998_001);

    let mut p = allocator_api2::vec::Vec::new_in(HostAllocator::new(PinnedHost::new().unwrap()));
    p.resize(1 << 20, 1u8);
    assert_eq!(p.iter().map(|&x| x as usize).sum::<usize>(), 1 << 20);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn element_access_on_a_stream_of_another_device() {
    let devices = DeviceId::count().unwrap();
    if devices < 2 {
        println!("memres-skip: one GPU only ({devices}); needs two");
        return;
    }
    let on_1 = {
        let _d1 = DeviceGuard::new(DeviceId::new(1)).unwrap();
        Stream::new().unwrap()
    };
    let _d0 = DeviceGuard::new(DeviceId::new(0)).unwrap();
    let stream = Stream::new().unwrap();
    let mut v =
        DeviceVec::from_slice(&[1u32; 1024], stream.as_ref(), Cuda::new().unwrap()).unwrap();
    v.set(3, 5, on_1.as_ref()).unwrap();
    assert_eq!(v.get(3, on_1.as_ref()).unwrap(), 5);
    assert_eq!(v.get(3, stream.as_ref()).unwrap(), 5);
    static SEVEN: u32 = 7;
    v.set_async(4, &SEVEN, on_1.as_ref()).unwrap();
    // A memset of device 0's memory issued on device 1's stream needs peer access, which
    // memres does not turn on: the driver may refuse it. Either way the vector stays
    // consistent: zeroed, or untouched with the error returned.
    match v.set_to_zero(on_1.as_ref()) {
        Ok(()) => assert_eq!(v.get(4, stream.as_ref()).unwrap(), 0),
        Err(e) => {
            assert!(matches!(e, Error::Driver(_)), "{e}");
            assert_eq!(v.get(4, stream.as_ref()).unwrap(), 7);
        }
    }
    drop(v); // ordered after the work on device 1's stream
    stream.synchronize().unwrap();
}
