//! Replays the `cli_log` fuzz target's committed corpus (`fuzz/corpus/cli_log`, found by
//! `cargo +nightly fuzz run cli_log`) on stable Rust, with the target's own checks
//! (`fuzz/common/cli_log.rs`): each input as a log through the reader, the command's
//! plan, `stats`' report, `plot`'s SVG and, for small logs, a replay over simulated
//! memory. Here rather than in the workspace's `tests/fuzz_corpus.rs` (which replays the
//! other targets' corpora) because the command's modules need its dependencies (the plot
//! draws with `plotters`).

// The command's modules, compiled into this test as into the fuzz target (the command is
// a bin crate); their unit tests (`stacks`, `simulated`) run here a second time.
#[path = "../src/human.rs"]
mod human;
use human::bytes;
#[allow(dead_code)]
#[path = "../src/plot.rs"]
mod plot;
#[allow(dead_code)]
#[path = "../src/replay.rs"]
mod replay;
#[allow(dead_code)]
#[path = "../src/simulated.rs"]
mod simulated;
#[allow(dead_code)]
#[path = "../src/stacks.rs"]
mod stacks;
#[allow(dead_code)]
#[path = "../src/stats.rs"]
mod stats;

include!("../../fuzz/common/cli_log.rs");

/// Every input of `fuzz/corpus/cli_log` (at least 10) through the target's checks; skips,
/// saying so, where the corpus is absent (the GPU bundle carries binaries only).
#[test]
fn the_cli_log_corpus_replays_clean() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/cli_log");
    let Ok(entries) = std::fs::read_dir(&dir) else {
        println!(
            "memres-skip: no corpus at {} (run from a checkout)",
            dir.display()
        );
        return;
    };
    let mut inputs = 0;
    for entry in entries {
        run(&std::fs::read(entry.unwrap().path()).unwrap());
        inputs += 1;
    }
    assert!(
        inputs >= 10,
        "the corpus at {} has {inputs} inputs",
        dir.display()
    );
}
