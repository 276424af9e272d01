//! Behaviour of the host leaf resources beyond the conformance suite.

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};

use memres::{
    Error, Host, HostHeap, Resource, StreamRef, SyncResource, layout, upstream::Callback,
};

static HEAP: HostHeap = HostHeap::new();

#[test]
fn host_heap_honours_large_alignments() {
    for shift in [12, 16, 21] {
        let l = Layout::from_size_align(100, 1 << shift).unwrap();
        let p = HEAP.allocate_sync(l).unwrap();
        assert!((p.as_ptr() as usize).is_multiple_of(1 << shift));
        // SAFETY: allocated above with `l`.
        unsafe { HEAP.deallocate_sync(p, l) };
    }
}

#[test]
fn host_heaps_are_all_equal() {
    assert_eq!(HostHeap::new(), HostHeap);
    // Memory from one may be freed by another.
    let l = layout(10).unwrap();
    let p = HostHeap::new().allocate(StreamRef::host(1), l).unwrap();
    // SAFETY: `p` came from a `HostHeap`, and all are equal.
    unsafe { HostHeap::new().deallocate(StreamRef::host(2), p, l) };
}

#[test]
fn host_heap_out_of_memory_names_the_size() {
    let err = HEAP.allocate_sync(layout(1 << 50).unwrap()).unwrap_err();
    assert_eq!(err, Error::out_of_memory(1 << 50));
    assert!(err.to_string().contains("1.0 PiB"), "{err}");
}

/// A `Callback` over the heap that counts calls and can be told to misbehave.
struct Probe {
    allocations: AtomicUsize,
    frees: AtomicUsize,
    /// Added to every pointer handed out (0: behave).
    skew: usize,
    /// Fail every call after this many (usize::MAX: never).
    fail_after: usize,
}

impl Probe {
    fn new(skew: usize, fail_after: usize) -> Self {
        Probe {
            allocations: AtomicUsize::new(0),
            frees: AtomicUsize::new(0),
            skew,
            fail_after,
        }
    }

    fn resource(&self) -> impl Resource<Properties = Host> + Sync + '_ {
        let allocate = |l: Layout, _: StreamRef<'_>| {
            if self.allocations.load(Ordering::Relaxed) >= self.fail_after {
                return Err(Error::out_of_memory(l.size()));
            }
            self.allocations.fetch_add(1, Ordering::Relaxed);
            let wide = Layout::from_size_align(l.size() + self.skew, l.align()).unwrap();
            let p = HEAP.allocate_sync(wide)?;
            // SAFETY: `wide` has `skew` more bytes than `l`, so the result is in bounds.
            Ok(unsafe { p.add(self.skew) })
        };
        let deallocate = |p: NonNull<u8>, l: Layout, _: StreamRef<'_>| {
            self.frees.fetch_add(1, Ordering::Relaxed);
            let wide = Layout::from_size_align(l.size() + self.skew, l.align()).unwrap();
            // SAFETY: undoes the skew of `allocate`: `p - skew` came from `HEAP` with `wide`.
            unsafe { HEAP.deallocate_sync(p.sub(self.skew), wide) }
        };
        // SAFETY: heap memory, host-accessible and usable at once. With a skew the blocks
        // are misaligned, which `Callback` must catch before anyone sees them.
        unsafe { Callback::<Host>::new(allocate, deallocate) }
    }
}

#[test]
fn callback_reports_misaligned_memory_and_gives_it_back() {
    let probe = Probe::new(1, usize::MAX);
    let r = probe.resource();
    let l = layout(64).unwrap();
    match r.allocate_sync(l) {
        Err(Error::Misaligned { align, address }) => {
            assert_eq!(align, 256);
            assert_eq!(address % 256, 1);
        }
        other => panic!("expected Misaligned, got {other:?}"),
    }
    // The misaligned block went straight back to the deallocate closure: nothing leaks.
    assert_eq!(probe.allocations.load(Ordering::Relaxed), 1);
    assert_eq!(probe.frees.load(Ordering::Relaxed), 1);
    // The stream-ordered path checks too.
    assert!(matches!(
        r.allocate(StreamRef::HOST, l),
        Err(Error::Misaligned { .. })
    ));
    // An alignment the skew happens to satisfy is fine.
    let l1 = Layout::from_size_align(8, 1).unwrap();
    let p = r.allocate_sync(l1).unwrap();
    // SAFETY: allocated above with `l1`.
    unsafe { r.deallocate_sync(p, l1) };
}

#[test]
fn callback_passes_errors_through_and_stays_usable() {
    let probe = Probe::new(0, 2);
    let r = probe.resource();
    let l = layout(100).unwrap();
    let a = r.allocate_sync(l).unwrap();
    let b = r.allocate(StreamRef::HOST, l).unwrap();
    assert_eq!(r.allocate_sync(l), Err(Error::out_of_memory(100)));
    // SAFETY: `a` and `b` came from `r` with `l`.
    unsafe {
        r.deallocate_sync(a, l);
        r.deallocate(StreamRef::HOST, b, l);
    }
    assert_eq!(probe.frees.load(Ordering::Relaxed), 2);
}

#[test]
fn callback_never_sees_zero_bytes() {
    let probe = Probe::new(0, usize::MAX);
    let r = probe.resource();
    let l = Layout::from_size_align(0, 512).unwrap();
    let p = r.allocate_sync(l).unwrap();
    assert!((p.as_ptr() as usize).is_multiple_of(512));
    // SAFETY: a zero-byte allocation from `r`.
    unsafe { r.deallocate_sync(p, l) };
    assert_eq!(probe.allocations.load(Ordering::Relaxed), 0);
    assert_eq!(probe.frees.load(Ordering::Relaxed), 0);
}

#[test]
fn callback_closures_get_the_stream() {
    let seen = std::sync::Mutex::new(Vec::new());
    let allocate = |l: Layout, s: StreamRef<'_>| {
        seen.lock().unwrap().push(format!("allocate {s:?}"));
        HEAP.allocate_sync(l)
    };
    let deallocate = |p: NonNull<u8>, l: Layout, s: StreamRef<'_>| {
        seen.lock().unwrap().push(format!("free {s:?}"));
        // SAFETY: `Callback` passes back only blocks from `allocate`, from `HEAP` with `l`.
        unsafe { HEAP.deallocate_sync(p, l) }
    };
    // SAFETY: heap memory, host-accessible and usable at once on any stream.
    let r = unsafe { Callback::<Host>::new(allocate, deallocate) };
    let l = layout(8).unwrap();
    let a = r.allocate(StreamRef::host(7), l).unwrap();
    let b = r.allocate_sync(l).unwrap();
    // SAFETY: both came from `r` with `l`.
    unsafe {
        r.deallocate(StreamRef::host(8), a, l);
        r.deallocate_sync(b, l);
    }
    assert_eq!(
        *seen.lock().unwrap(),
        [
            "allocate StreamRef(host 7)",
            "allocate StreamRef(host 0)",
            "free StreamRef(host 8)",
            "free StreamRef(host 0)"
        ]
    );
}

#[test]
fn callback_equality_is_identity() {
    let probe = Probe::new(0, usize::MAX);
    let a = probe.resource();
    let b = probe.resource();
    assert!(a == a);
    assert!(
        a != b,
        "closures cannot be compared, so two Callbacks are never equal"
    );
}
