//! Host-side cost of the resource layers: one allocate + free of 256 bytes (the
#![allow(missing_docs)] // criterion_group! makes undocumented public items
//! `pair-256B` workload of `docs/workloads.md`) through the heap directly and
//! through each kind of handle, so the price of a handle or of erasure shows.
//!
//! `cargo bench --bench resources`

use std::hint::black_box;
use std::sync::Arc;

use criterion::{Criterion, criterion_group, criterion_main};
use memres::adaptor::Guard;
use memres::suballoc::{Arena, Binning, FixedSize, Pool, PoolConfig};
use memres::{
    AnyResource, Host, HostHeap, Resource, ResourceExt, ResourceRef, StreamRef, erased::Shared,
    layout,
};

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

/// The sub-allocators' fast paths over host memory: a same-stream 256-byte pair (the
/// per-stream cache), and a 300 KiB pair (the coalescing free list).
fn suballocators(c: &mut Criterion) {
    let pool = Pool::new(HostHeap::new(), PoolConfig::new().initial_size(64 << 20)).unwrap();
    let fixed = FixedSize::with_block_size(HostHeap::new(), 4096, 128).unwrap();
    let binning = Binning::new(
        Pool::new(HostHeap::new(), PoolConfig::new()).unwrap(),
        8,
        16,
    )
    .unwrap();
    let arena = Arena::with_size(HostHeap::new(), 64 << 20).unwrap();
    let l = layout(256).unwrap();
    let mut g = c.benchmark_group("suballoc-pair-256B");
    g.bench_function("Pool", |b| b.iter(|| pair(&pool, l)));
    g.bench_function("FixedSize", |b| b.iter(|| pair(&fixed, l)));
    g.bench_function("Binning(Pool)", |b| b.iter(|| pair(&binning, l)));
    g.bench_function("Arena", |b| b.iter(|| pair(&arena, l)));
    g.finish();
    let l = layout(300 << 10).unwrap();
    let mut g = c.benchmark_group("suballoc-pair-300KiB");
    g.bench_function("Pool", |b| b.iter(|| pair(&pool, l)));
    g.bench_function("Arena", |b| b.iter(|| pair(&arena, l)));
    g.finish();
    let l = layout(4 << 20).unwrap();
    let mut g = c.benchmark_group("suballoc-pair-4MiB");
    g.bench_function("Pool", |b| b.iter(|| pair(&pool, l)));
    g.finish();
}

/// What the guard adds to a pool's 256-byte pair on host memory: writing and checking
/// two canaries of 256 bytes (the default) or 16.
fn guard(c: &mut Criterion) {
    let pool = || Pool::new(HostHeap::new(), PoolConfig::new().initial_size(64 << 20)).unwrap();
    let plain = pool();
    let guarded = pool().with_guard();
    let small = Guard::with_pad(pool(), 16).unwrap();
    let l = layout(256).unwrap();
    let mut g = c.benchmark_group("guard-pair-256B");
    g.bench_function("Pool", |b| b.iter(|| pair(&plain, l)));
    g.bench_function("Guard(Pool)", |b| b.iter(|| pair(&guarded, l)));
    g.bench_function("Guard(Pool) pad 16", |b| b.iter(|| pair(&small, l)));
    g.finish();
}

criterion_group!(benches, pair_256b, suballocators, guard);
criterion_main!(benches);
