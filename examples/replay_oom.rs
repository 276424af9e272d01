//! Replaying the allocation log of a run that went out of memory: read the log (RMM's CSV
//! format, which memres's `Logging` adaptor also writes), replay it through a stack with
//! the memory the run had, and see which request failed and what was live then; then
//! try the same log with another stack or limit. `memres replay` does this at scale
//! (gzip logs, simulated device memory, several stacks side by side, plots).
//!
//! ```sh
//! cargo run --release --example replay_oom
//! ```
//!
//! Runs on host memory anywhere: the log's pattern, not its bytes, is what matters. On a
//! GPU the stack would end in `Cuda` or `CudaVirtual` instead of `HostHeap`.

use std::collections::HashMap;
use std::io::BufReader;
use std::ptr::NonNull;

use memres::log::{Action, read_events};
use memres::suballoc::PoolConfig;
use memres::{Error, HostHeap, Resource, ResourceExt, StreamRef, layout};

/// A log RMM wrote (`examples/data/`), embedded so the example runs from anywhere.
const LOG: &str = include_str!("data/rmm-log-sample.csv");

/// Replays the log through `mr`; returns the first failure: (log line, bytes asked, bytes
/// live then).
fn replay<R: Resource>(mr: &R, events: &[memres::log::Event]) -> Option<(usize, usize, usize)> {
    let mut live: HashMap<usize, (NonNull<u8>, std::alloc::Layout)> = HashMap::new();
    let mut live_bytes = 0;
    let mut failure = None;
    for e in events {
        match (e.action, e.pointer) {
            (Action::Allocate, Some(logged)) => {
                let l = layout(e.size).expect("a log's sizes are layouts");
                match mr.allocate(StreamRef::HOST, l) {
                    Ok(p) => {
                        live.insert(logged, (p, l));
                        live_bytes += e.size;
                    }
                    Err(Error::OutOfMemory { .. }) => {
                        failure = Some((e.line, e.size, live_bytes));
                        break;
                    }
                    Err(other) => panic!("line {}: {other}", e.line),
                }
            }
            (Action::Free, Some(logged)) => {
                if let Some((p, l)) = live.remove(&logged) {
                    live_bytes -= l.size();
                    // SAFETY: allocated above through `mr` with `l`; not used afterwards.
                    unsafe { mr.deallocate(StreamRef::HOST, p, l) };
                }
            }
            _ => {} // failures in the log itself, frees of unknown pointers
        }
    }
    for (p, l) in live.into_values() {
        // SAFETY: as above.
        unsafe { mr.deallocate(StreamRef::HOST, p, l) };
    }
    failure
}

fn main() -> Result<(), Error> {
    let events = read_events(BufReader::new(LOG.as_bytes()))?;
    // The log's own peak of live bytes.
    let (mut live, mut peak) = (0i64, 0i64);
    for e in &events {
        match e.action {
            Action::Allocate => live += e.size as i64,
            Action::Free => live -= e.size as i64,
            // A failed allocation, or an action of a later log format.
            _ => {}
        }
        peak = peak.max(live);
    }
    println!("{} events, {} bytes live at the peak", events.len(), peak);

    // The run had 90% of its peak: which request failed?
    let limit = (peak as usize) * 9 / 10;
    let tight = HostHeap::new()
        .pool(PoolConfig::new())?
        .with_limiting(limit);
    match replay(&tight, &events) {
        Some((line, size, live)) => println!(
            "with {limit} bytes: log line {line} asked for {size} bytes with {live} live: out of memory"
        ),
        None => println!("with {limit} bytes: no failure"),
    }
    // With 2x the peak, the same stack serves every request.
    let roomy = HostHeap::new()
        .pool(PoolConfig::new())?
        .with_limiting(2 * peak as usize);
    let failure = replay(&roomy, &events);
    println!(
        "with {} bytes: {}",
        2 * peak,
        failure.map_or("every request served".into(), |f| format!(
            "failed at line {}",
            f.0
        ))
    );
    Ok(())
}
