//! The containers over host memory (CI): `DeviceBuffer`, `DeviceVec`, `DeviceScalar`, the
//! allocator-api2 bridge and `StreamAllocator`. The same cases on a GPU are in
//! `tests/containers_cuda.rs`.

use std::alloc::Layout;
use std::ptr::NonNull;

use memres::adaptor::Statistics;
use memres::container::{
    DeviceBuffer, DeviceScalar, DeviceVec, HostAllocator, RawParts, StreamAllocator,
};
use memres::{
    DeviceAccessible, Error, HostDevice, HostHeap, Pool, PoolConfig, StreamRef, SyncResource,
    upstream::Callback,
};

const S: StreamRef<'static> = StreamRef::HOST;

/// Counts what is outstanding, so each test can check everything was given back.
fn counted() -> Statistics<HostHeap> {
    Statistics::new(HostHeap)
}

fn assert_all_freed(stats: &Statistics<HostHeap>) {
    let bytes = stats.bytes();
    assert_eq!(bytes.current, 0, "bytes still allocated: {bytes:?}");
    assert_eq!(stats.allocations().current, 0);
}

/// Host memory that says it is pinned (host and device accessible), as `PinnedHost`
/// memory does, so the host-and-device paths run without a GPU.
fn pinned_like() -> impl memres::Resource<Properties = HostDevice> + PartialEq {
    let allocate = |l: Layout, _: StreamRef<'_>| HostHeap.allocate_sync(l);
    // SAFETY: `Callback` passes back only blocks `allocate` returned, from `HostHeap`.
    let deallocate =
        |p: NonNull<u8>, l: Layout, _: StreamRef<'_>| unsafe { HostHeap.deallocate_sync(p, l) };
    // SAFETY: heap memory, usable at once on any stream; it claims device access, which
    // is only ever used through host streams in these tests (host copies).
    unsafe { Callback::<HostDevice>::new(allocate, deallocate) }
}

#[test]
fn buffer_basics() {
    let stats = counted();
    {
        let buf = DeviceBuffer::new(1000, S, &stats).unwrap();
        assert_eq!(
            (buf.size(), buf.capacity(), buf.alignment()),
            (1000, 1000, 256)
        );
        assert!(!buf.is_empty());
        assert_eq!(buf.as_ptr() as usize % 256, 0);
        assert_eq!(buf.device(), None, "host streams record no device");
        assert_eq!(buf.stream(), S);
        assert!(*buf.resource() == &stats);
        assert_eq!(
            buf.to_host_vec().unwrap(),
            vec![0; 1000],
            "host memory starts zeroed"
        );
        assert_eq!(stats.bytes().current, 1000);

        let empty = DeviceBuffer::new(0, S, &stats).unwrap();
        assert!(empty.is_empty());
        assert_eq!(empty.capacity(), 0);
    }
    assert_all_freed(&stats);
}

#[test]
fn buffer_from_host_and_copies() {
    let stats = counted();
    {
        let data: Vec<u8> = (0..=255).cycle().take(5000).collect();
        let buf = DeviceBuffer::from_host(&data, S, &stats).unwrap();
        assert_eq!(buf.to_host_vec().unwrap(), data);

        let copy = DeviceBuffer::copy_from(&buf, StreamRef::host(1), HostHeap).unwrap();
        assert_eq!(copy.to_host_vec().unwrap(), data);
        assert_eq!(copy.stream(), StreamRef::host(1));

        let mut head = [0u8; 10];
        buf.copy_to_host(&mut head).unwrap();
        assert_eq!(head, data[..10]);

        let mut too_long = vec![0u8; 5001];
        let err = buf.copy_to_host(&mut too_long).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        assert!(err.to_string().contains("5001 bytes"), "{err}");
    }
    assert_all_freed(&stats);
}

#[test]
fn buffer_copy_with_capacity_larger_than_size_copies_the_size() {
    let stats = counted();
    {
        let mut buf = DeviceBuffer::from_host(&[7; 100], S, &stats).unwrap();
        buf.reserve(1000).unwrap();
        assert_eq!((buf.size(), buf.capacity()), (100, 1000));
        let copy = DeviceBuffer::copy_from(&buf, S, &stats).unwrap();
        assert_eq!((copy.size(), copy.capacity()), (100, 100));
        assert_eq!(copy.to_host_vec().unwrap(), vec![7; 100]);
    }
    assert_all_freed(&stats);
}

#[test]
fn buffer_resize_within_and_beyond_capacity() {
    let stats = counted();
    {
        let mut buf = DeviceBuffer::from_host(&[1, 2, 3, 4, 5, 6, 7, 8], S, &stats).unwrap();
        let first = buf.as_ptr();

        // Smaller: only the size changes.
        buf.resize(4).unwrap();
        assert_eq!((buf.size(), buf.capacity()), (4, 8));
        assert_eq!(buf.as_ptr(), first);

        // Bigger within the capacity: still no reallocation; new bytes are zero (host).
        buf.resize(6).unwrap();
        assert_eq!((buf.size(), buf.capacity()), (6, 8));
        assert_eq!(buf.as_ptr(), first);
        assert_eq!(buf.to_host_vec().unwrap(), [1, 2, 3, 4, 0, 0]);

        // Beyond: a block of exactly the new size, the old bytes copied.
        buf.resize(20).unwrap();
        assert_eq!((buf.size(), buf.capacity()), (20, 20));
        let mut want = vec![1, 2, 3, 4, 0, 0];
        want.resize(20, 0);
        assert_eq!(buf.to_host_vec().unwrap(), want);
        assert_eq!(stats.allocations().current, 1, "the old block is freed");

        buf.resize(3).unwrap();
        buf.shrink_to_fit().unwrap();
        assert_eq!((buf.size(), buf.capacity()), (3, 3));
        assert_eq!(buf.to_host_vec().unwrap(), [1, 2, 3]);
        assert_eq!(stats.bytes().current, 3);

        // Reserve below the capacity does nothing.
        buf.reserve(2).unwrap();
        assert_eq!(buf.capacity(), 3);
    }
    assert_all_freed(&stats);
}

#[test]
fn buffer_alignment() {
    let stats = counted();
    {
        let buf = DeviceBuffer::with_alignment(100, 4096, S, &stats).unwrap();
        assert_eq!(buf.alignment(), 4096);
        assert_eq!(buf.as_ptr() as usize % 4096, 0);
        let mut grown = buf;
        grown.resize(10_000).unwrap();
        assert_eq!(
            grown.as_ptr() as usize % 4096,
            0,
            "reallocation keeps the alignment"
        );

        let err = DeviceBuffer::with_alignment(100, 3, S, &stats).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    }
    assert_all_freed(&stats);
}

#[test]
fn buffer_set_stream_and_raw_parts() {
    let stats = counted();
    {
        let mut buf = DeviceBuffer::from_host(b"memres", S, &stats).unwrap();
        buf.set_stream(StreamRef::host(7)).unwrap();
        assert_eq!(buf.stream(), StreamRef::host(7));

        let parts = buf.into_raw_parts();
        assert_eq!((parts.size, parts.capacity, parts.alignment), (6, 6, 256));
        assert_eq!(stats.allocations().current, 1, "taking apart frees nothing");
        let RawParts { ptr, .. } = parts;
        assert_eq!(ptr.as_ptr() as usize % 256, 0);
        // SAFETY: the parts came from `into_raw_parts` unchanged.
        let back = unsafe { DeviceBuffer::from_raw_parts(parts) };
        assert_eq!(back.to_host_vec().unwrap(), b"memres");
    }
    assert_all_freed(&stats);
}

#[test]
fn buffer_moves_between_threads() {
    let stats = counted();
    {
        let buf = DeviceBuffer::from_host(&[9; 64], S, &stats).unwrap();
        let bytes =
            std::thread::scope(|s| s.spawn(move || buf.to_host_vec().unwrap()).join()).unwrap();
        assert_eq!(bytes, vec![9; 64]);
    }
    assert_all_freed(&stats);
}

#[test]
fn the_per_thread_stream_is_refused() {
    // It names another stream on every thread a container might move to.
    let err = DeviceBuffer::new(64, StreamRef::PER_THREAD, HostHeap).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    assert!(err.to_string().contains("per-thread"), "{err}");
    let mut buf = DeviceBuffer::new(64, S, HostHeap).unwrap();
    assert!(buf.set_stream(StreamRef::PER_THREAD).is_err());
    assert_eq!(buf.stream(), S);
}

#[test]
fn out_of_memory_is_an_error() {
    let err = DeviceBuffer::new(isize::MAX as usize - 4096, S, HostHeap).unwrap_err();
    assert!(err.is_out_of_memory(), "{err}");
    let err = DeviceVec::<u64, _>::new(usize::MAX / 4, S, HostHeap).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
}

#[test]
fn device_only_memory_on_a_host_stream_cannot_be_copied_by_the_host() {
    let allocate = |l: Layout, _: StreamRef<'_>| HostHeap.allocate_sync(l);
    // SAFETY: `Callback` passes back only blocks `allocate` returned, from `HostHeap`.
    let deallocate =
        |p: NonNull<u8>, l: Layout, _: StreamRef<'_>| unsafe { HostHeap.deallocate_sync(p, l) };
    // SAFETY: heap memory, usable at once; it claims less than it has (no host access),
    // which is always allowed.
    let device_only = unsafe { Callback::<DeviceAccessible>::new(allocate, deallocate) };
    let buf = DeviceBuffer::new(16, S, &device_only).unwrap();
    let err = buf.to_host_vec().unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    assert!(err.to_string().contains("host stream"), "{err}");
}

#[test]
fn vec_round_trips_on_pinned_like_memory() {
    let mr = pinned_like();
    let mut v = DeviceVec::from_slice(&[1.5f32, 2.5, 3.5, 4.5], S, &mr).unwrap();
    assert_eq!(v.len(), 4);
    assert_eq!(v.as_ptr() as usize % 256, 0);
    assert_eq!(v.to_vec(S).unwrap(), [1.5, 2.5, 3.5, 4.5]);
    assert_eq!(v.front(S).unwrap(), 1.5);
    assert_eq!(v.back(S).unwrap(), 4.5);

    // Negative zero survives: the bits go both ways unchanged.
    v.set(2, -0.0, S).unwrap();
    assert_eq!(v.get(2, S).unwrap().to_bits(), (-0.0f32).to_bits());

    static SEVEN: f32 = 7.0;
    v.set_async(0, &SEVEN, StreamRef::host(3)).unwrap();
    v.set_async(1, &8.0, S).unwrap(); // a promoted constant is `'static`
    assert_eq!(v.as_slice().unwrap(), [7.0, 8.0, -0.0, 4.5]);

    v.as_mut_slice().unwrap()[3] = 9.0;
    assert_eq!(v.get(3, S).unwrap(), 9.0);

    for bad in [4, 100] {
        let err = v.get(bad, S).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        assert!(err.to_string().contains(&format!("index {bad}")), "{err}");
        assert!(v.set(bad, 0.0, S).is_err());
    }
}

#[test]
fn vec_resize_reserve_shrink_and_into_buffer() {
    let stats = counted();
    {
        let mut v = DeviceVec::<u32, _>::zeroed(10, S, &stats).unwrap();
        assert_eq!(v.to_vec(S).unwrap(), [0; 10]);
        v.as_mut_slice()
            .unwrap()
            .copy_from_slice(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]);

        v.reserve(100).unwrap();
        assert_eq!((v.len(), v.capacity()), (10, 100));
        v.resize(12).unwrap();
        assert_eq!(v.capacity(), 100);
        assert_eq!(v.to_vec(S).unwrap(), [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 0, 0]);
        v.resize(5).unwrap();
        v.shrink_to_fit().unwrap();
        assert_eq!((v.len(), v.capacity()), (5, 5));
        assert_eq!(stats.bytes().current, 20);

        let buf = v.into_buffer();
        assert_eq!(buf.size(), 20);
        let words: Vec<u32> = buf
            .to_host_vec()
            .unwrap()
            .chunks(4)
            .map(|c| u32::from_ne_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(words, [1, 2, 3, 4, 5]);

        let empty = DeviceVec::<u8, _>::new(0, S, &stats).unwrap();
        assert!(empty.is_empty());
        assert!(empty.front(S).is_err());
        assert!(empty.back(S).is_err());
    }
    assert_all_freed(&stats);
}

#[test]
fn vec_new_on_host_memory_is_zeroed() {
    let v = DeviceVec::<f64, _>::new(1000, S, HostHeap).unwrap();
    assert!(v.as_slice().unwrap().iter().all(|&x| x == 0.0));
}

#[test]
fn scalar_round_trips() {
    let stats = counted();
    {
        let mut x = DeviceScalar::with_value(&-0.0f64, S, &stats).unwrap();
        assert_eq!(x.value(S).unwrap().to_bits(), (-0.0f64).to_bits());
        x.set_value(42.25, S).unwrap();
        assert_eq!(x.value(S).unwrap(), 42.25);
        x.set_value_async(&1.0, S).unwrap();
        assert_eq!(x.value(S).unwrap(), 1.0);
        x.set_value_to_zero(S).unwrap();
        assert_eq!(x.value(S).unwrap().to_bits(), 0);
        assert_eq!(x.as_ptr() as usize % 256, 0);

        let fresh = DeviceScalar::<u16, _>::new(S, &stats).unwrap();
        assert_eq!(fresh.value(S).unwrap(), 0);
        assert_eq!(fresh.into_vec().len(), 1);
    }
    assert_all_freed(&stats);
}

#[test]
fn allocator_api2_collections_over_a_pool_give_everything_back() {
    let stats = counted();
    {
        let pool = Pool::new(&stats, PoolConfig::default()).unwrap();
        let alloc = HostAllocator::new(&pool);
        {
            let mut v = allocator_api2::vec::Vec::new_in(alloc.clone());
            for i in 0..100_000u64 {
                v.push(i);
            }
            assert_eq!(v.iter().sum::<u64>(), 100_000 * 99_999 / 2);

            let mut map = hashbrown::HashMap::new_in(alloc.clone());
            for i in 0..10_000u32 {
                map.insert(i, i.to_string());
            }
            assert_eq!(map.len(), 10_000);
            assert_eq!(map[&1234], "1234");
            map.retain(|k, _| k % 2 == 0);
            assert_eq!(map.len(), 5_000);
            let cloned = map.clone();
            assert_eq!(cloned, map);
        }
        // The pool holds its memory until it is dropped; the allocator gave it all back.
        assert!(stats.bytes().current > 0);
    }
    assert_all_freed(&stats);
}

#[test]
fn stream_allocator_pairs_a_resource_with_a_stream() {
    let stats = counted();
    {
        let a = StreamAllocator::new(&stats, S);
        let b = a; // Copy
        assert!(a == b);
        let p = a.allocate::<u64>(1000).unwrap();
        assert_eq!(p.as_ptr() as usize % 256, 0);
        assert_eq!(stats.bytes().current, 8000);
        // SAFETY: allocated just above for 1000 `u64`s; never used.
        unsafe { b.deallocate(p, 1000) };

        let other = a.with_stream(StreamRef::host(2));
        assert_eq!(other.stream(), StreamRef::host(2));
        let v = other.vec::<u8>(10).unwrap();
        assert_eq!(v.stream(), StreamRef::host(2));
        assert!(a.allocate::<u64>(usize::MAX).is_err());
    }
    assert_all_freed(&stats);
}
