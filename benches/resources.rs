//! Host-side cost of the resource layers: one allocate + free of 256 bytes (the
#![allow(missing_docs)] // criterion_group! makes undocumented public items
//! `pair-256B` workload of `shared/bench/WORKLOADS.md`) through the heap directly and
//! through each kind of handle, so the price of a handle or of erasure shows.
//!
//! `cargo bench --bench resources`

use std::hint::black_box;
use std::sync::Arc;

use criterion::{Criterion, criterion_group, criterion_main};
use memres::{AnyResource, Host, HostHeap, Resource, ResourceRef, Shared, StreamRef, layout};

fn pair<R: Resource>(r: &R, l: std::alloc::Layout) {
    let p = r.allocate(StreamRef::HOST, black_box(l)).unwrap();
    // SAFETY: allocated just above with `l`; never touched.
    unsafe { r.deallocate(StreamRef::HOST, black_box(p), l) };
}

fn pair_256b(c: &mut Criterion) {
    let l = layout(256).unwrap();
    let heap = HostHeap::new();
    let mut g = c.benchmark_group("pair-256B");
    g.bench_function("HostHeap", |b| b.iter(|| pair(&heap, l)));
    g.bench_function("&HostHeap", |b| b.iter(|| pair(&&heap, l)));
    let arc = Arc::new(heap);
    g.bench_function("Arc<HostHeap>", |b| b.iter(|| pair(&arc, l)));
    let shared = Shared::new(heap);
    g.bench_function("Shared<HostHeap>", |b| b.iter(|| pair(&shared, l)));
    let r = ResourceRef::<Host>::new(&heap);
    g.bench_function("ResourceRef<Host>", |b| b.iter(|| pair(&r, l)));
    let any = AnyResource::<Host>::new(heap);
    g.bench_function("AnyResource<Host>", |b| b.iter(|| pair(&any, l)));
    g.finish();
}

criterion_group!(benches, pair_256b);
criterion_main!(benches);
