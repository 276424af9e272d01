//! Arbitrary bytes as a log file through what `memres stats`, `memres plot` and `memres
//! replay` do with it (see `fuzz/common/cli_log.rs`): the reader, the command's plan, its
//! report, its plot and, for small logs, a replay over simulated memory; answers agree
//! with the events, and nothing panics.
//!
//! ```sh
//! cargo +nightly fuzz run cli_log fuzz/corpus/cli_log
//! ```
#![no_main]

// The command is a bin crate: its modules are compiled in here, at the crate root where
// their `crate::` paths expect each other (and `crate::bytes`, from `human.rs`).
#[path = "../../cli/src/human.rs"]
mod human;
use human::bytes;
#[allow(dead_code)]
#[path = "../../cli/src/plot.rs"]
mod plot;
#[allow(dead_code)]
#[path = "../../cli/src/replay.rs"]
mod replay;
#[allow(dead_code)]
#[path = "../../cli/src/simulated.rs"]
mod simulated;
#[allow(dead_code)]
#[path = "../../cli/src/stacks.rs"]
mod stacks;
#[allow(dead_code)]
#[path = "../../cli/src/stats.rs"]
mod stats;

use libfuzzer_sys::fuzz_target;

include!("../common/cli_log.rs");

fuzz_target!(|data: &[u8]| run(data));
