//! Writes a memres event log of a training-loop-like allocation pattern: the sample log of
//! `examples/data/` that `memres replay`, `stats` and `plot` are shown with.
//!
//! ```sh
//! cargo run --release --example training_log       # writes target/training.csv
//! gzip -9c target/training.csv > examples/data/training.csv.gz   # to refresh the sample
//! ```
//!
//! Three threads on four streams, as a data-parallel training step looks from its
//! allocator: the main thread allocates long-lived weights and optimizer state once, then
//! per step activations layer by layer (forward), short-lived workspaces, gradients
//! (backward, activations freed in reverse), and frees the gradients after the update; a
//! data-loader thread stages input batches on a copy stream; a metrics thread keeps a few
//! small buffers. Memory is host memory (the pattern, not the bytes, is what the log
//! records); the streams are named with CUDA-style handles but never given to a driver.

use std::sync::Barrier;
use std::sync::atomic::{AtomicBool, Ordering};

use memres::adaptor::Logging;
use memres::{HostHeap, Resource, StreamRef, layout};
use memres_workloads::splitmix64;

const LAYERS: usize = 24;
const STEPS: usize = 1200;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "target/training.csv".into());
    let log = Logging::to_file(HostHeap::new(), &path)?;
    // SAFETY: the handles are only written to the log: `HostHeap` never gives a stream to
    // the CUDA driver, and nothing else sees them.
    let (compute, copy, metrics) = unsafe {
        (
            StreamRef::from_raw(std::ptr::without_provenance_mut(0x7f3a_5c00_0b40)),
            StreamRef::from_raw(std::ptr::without_provenance_mut(0x7f3a_5c00_1d80)),
            StreamRef::from_raw(std::ptr::without_provenance_mut(0x7f3a_5c00_2fc0)),
        )
    };
    let done = AtomicBool::new(false);
    let step_barrier = Barrier::new(2);
    std::thread::scope(|scope| -> Result<(), memres::Error> {
        let loader = scope.spawn(|| data_loader(&log, copy, &step_barrier));
        let watcher = scope.spawn(|| metrics_thread(&log, metrics, &done));
        let trained = train(&log, compute, &step_barrier);
        done.store(true, Ordering::Relaxed);
        loader.join().expect("the loader thread")?;
        watcher.join().expect("the metrics thread")?;
        trained
    })?;
    log.flush()?;
    println!("wrote {path}");
    Ok(())
}

/// A block from `log`, freed with the same stream and size.
struct Block {
    ptr: std::ptr::NonNull<u8>,
    size: usize,
}

fn alloc(log: &Logging<HostHeap>, s: StreamRef<'_>, size: usize) -> Result<Block, memres::Error> {
    Ok(Block {
        ptr: log.allocate(s, layout(size)?)?,
        size,
    })
}

fn free(log: &Logging<HostHeap>, s: StreamRef<'_>, b: Block) {
    if let Ok(l) = layout(b.size) {
        // SAFETY: `b` came from `log` with this layout; the memory was never used.
        unsafe { log.deallocate(s, b.ptr, l) };
    }
}

fn train(
    log: &Logging<HostHeap>,
    s: StreamRef<'_>,
    step_barrier: &Barrier,
) -> Result<(), memres::Error> {
    let mut rng = 7u64;
    let width = |layer: usize| (1 + layer % 4) << 20; // 1 to 4 MiB per weight matrix
    // Weights and biases, for the whole run.
    let mut weights = Vec::new();
    for layer in 0..LAYERS {
        weights.push(alloc(log, StreamRef::DEFAULT, width(layer))?);
        weights.push(alloc(log, StreamRef::DEFAULT, 4096 + layer * 256)?);
    }
    let mut optimizer = Vec::new();
    for step in 0..STEPS {
        step_barrier.wait(); // the batch is staged
        let batch = 1 + (splitmix64(&mut rng) % 4) as usize; // varying sequence length
        let mut activations = Vec::new();
        for layer in 0..LAYERS {
            activations.push(alloc(log, s, batch * width(layer) / 2)?);
            let workspace = 256 + (splitmix64(&mut rng) % (1 << 20)) as usize;
            let w = alloc(log, s, workspace)?;
            free(log, s, w);
        }
        let loss = alloc(log, s, 4)?;
        let mut grads = Vec::new();
        for layer in (0..LAYERS).rev() {
            grads.push(alloc(log, s, width(layer))?);
            let w = alloc(log, s, 256 + (splitmix64(&mut rng) % (64 << 10)) as usize)?;
            free(log, s, w);
            if let Some(a) = activations.pop() {
                free(log, s, a);
            }
        }
        free(log, s, loss);
        if step == 0 {
            // Optimizer state (two moments per weight), made at the first update.
            for layer in 0..LAYERS {
                optimizer.push(alloc(log, s, width(layer))?);
                optimizer.push(alloc(log, s, width(layer))?);
            }
        }
        for g in grads.drain(..) {
            free(log, s, g);
        }
    }
    step_barrier.wait(); // let the loader finish
    for b in weights.into_iter().chain(optimizer) {
        free(log, s, b);
    }
    Ok(())
}

fn data_loader(
    log: &Logging<HostHeap>,
    s: StreamRef<'_>,
    step_barrier: &Barrier,
) -> Result<(), memres::Error> {
    let mut staged: Vec<Block> = Vec::new();
    for _ in 0..STEPS {
        staged.push(alloc(log, s, 8 << 20)?); // the next input batch
        staged.push(alloc(log, s, 64 << 10)?); // its labels
        step_barrier.wait();
        if staged.len() > 4 {
            // Two batches in flight: the oldest is consumed.
            let labels = staged.remove(1);
            let batch = staged.remove(0);
            free(log, s, labels);
            free(log, s, batch);
        }
    }
    step_barrier.wait();
    for b in staged {
        free(log, s, b);
    }
    Ok(())
}

fn metrics_thread(
    log: &Logging<HostHeap>,
    s: StreamRef<'_>,
    done: &AtomicBool,
) -> Result<(), memres::Error> {
    let mut kept: Vec<Block> = Vec::new();
    let mut n = 0usize;
    while !done.load(Ordering::Relaxed) {
        kept.push(alloc(log, s, 512 + (n % 7) * 128)?);
        if kept.len() > 16 {
            let oldest = kept.remove(0);
            free(log, s, oldest);
        }
        n += 1;
        std::thread::sleep(std::time::Duration::from_micros(200));
    }
    // One buffer is never freed (a leak for `memres stats` and `replay` to find): the
    // `Block` is dropped without going back to the log; its host memory leaks with it.
    kept.pop();
    for b in kept {
        free(log, s, b);
    }
    Ok(())
}
