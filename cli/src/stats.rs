//! `memres stats`: what a log holds.

use std::collections::{BTreeMap, HashSet};
use std::fmt::Write as _;

use memres::log::{Action, Event};

use crate::bytes;
use crate::replay::Plan;

/// The report `memres stats` prints.
pub(crate) fn report(name: &str, events: &[Event], plan: &Plan) -> String {
    let mut out = String::new();
    let threads: HashSet<u64> = events.iter().map(|e| e.thread).collect();
    let span = plan.micros.last().copied().unwrap_or(0);
    let count = |a: Action| events.iter().filter(|e| e.action == a).count();
    let _ = writeln!(
        out,
        "{name}: {} events on {} threads and {} streams, over {:.6} s",
        events.len(),
        threads.len(),
        plan.streams.len(),
        span as f64 / 1e6
    );
    let _ = writeln!(
        out,
        "  allocations {}, frees {}, allocation failures {}",
        count(Action::Allocate),
        count(Action::Free),
        count(Action::AllocateFailure)
    );
    let mut histogram: BTreeMap<u32, (usize, u64)> = BTreeMap::new();
    for e in events.iter().filter(|e| e.action == Action::Allocate) {
        let bucket = if e.size == 0 {
            0
        } else {
            usize::BITS - e.size.leading_zeros()
        };
        let entry = histogram.entry(bucket).or_default();
        entry.0 += 1;
        entry.1 = entry.1.saturating_add(e.size as u64);
    }
    let most = histogram.values().map(|v| v.0).max().unwrap_or(1);
    let _ = writeln!(out, "  allocation sizes (count, bytes):");
    for (bucket, (n, total)) in &histogram {
        let range = match bucket {
            0 => "0 B".to_owned(),
            b => {
                let edge = |e: u32| {
                    1u64.checked_shl(e)
                        .map_or_else(|| "2^64 B".to_owned(), bytes)
                };
                format!("[{}, {})", edge(b - 1), edge(*b))
            }
        };
        let bar = "#".repeat((n * 40).div_ceil(most));
        let _ = writeln!(out, "    {range:>24} {n:>9} {:>12}  {bar}", bytes(*total));
    }
    let (peak, line) = plan.peak_live;
    let when = events
        .iter()
        .find(|e| e.line == line)
        .map(|e| clock(e.micros))
        .unwrap_or_default();
    let _ = writeln!(out, "  peak live: {} at line {line} ({when})", bytes(peak));
    let _ = writeln!(
        out,
        "  never freed: {} allocations, {}",
        plan.never_freed.0,
        bytes(plan.never_freed.1)
    );
    for w in &plan.warnings {
        let _ = writeln!(out, "  warning: {w}");
    }
    out
}

/// Microseconds since midnight as `HH:MM:SS.ffffff`.
fn clock(micros: u64) -> String {
    let s = micros / 1_000_000;
    format!(
        "{:02}:{:02}:{:02}.{:06}",
        s / 3600,
        s / 60 % 60,
        s % 60,
        micros % 1_000_000
    )
}
