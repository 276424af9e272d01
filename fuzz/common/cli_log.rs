// The `cli_log` target's code, shared by the fuzz target (`fuzz/fuzz_targets/cli_log.rs`)
// and the corpus replay of `cargo test` (`cli/tests/fuzz_corpus.rs`), which `include!` it
// at their crate root, beside the command's own modules (`cli/src/replay.rs`,
// `stacks.rs`, `simulated.rs`, `stats.rs`, `plot.rs`, declared there with `#[path]`: the
// command is a bin crate, so its modules are compiled into the includer).
//
// Arbitrary bytes as a log file, through what `memres stats`, `memres plot` and `memres
// replay` do with one (cli/src/main.rs, without the binary): the log reader, then the
// command's plan of the events, the stats report, the plot, and for a small log a replay
// through one of the command's stacks over simulated device memory. Each step answers
// (an error with a bounded message where the command would stop), never panics, and
// what it says agrees with the events.

use std::path::PathBuf;

use memres::log::{Action, Event, LoggedStream};

use crate::replay::Plan;
use crate::stacks::{Options, Replay, StackName};

/// The longest error message the reader may give: it quotes at most 100 characters of
/// the input (each escaped as `{:?}` writes it: at most 10 bytes), with its size.
const LONGEST_MESSAGE: usize = 2048;

/// Logs replayed through a stack: at most this many events...
const REPLAY_EVENTS: usize = 512;
/// ...on at most this many threads (the replay starts one per logged thread).
const REPLAY_THREADS: usize = 4;

/// The stacks a replay goes through (the command's names and spec strings), one per
/// input, picked by a hash of it.
const STACKS: [&str; 6] = [
    "pool",
    "virtual_pool",
    "arena",
    "binning",
    "fixed_size",
    "statistics(fallback(pool:max=64MiB,virtual_pool))",
];

/// Simulated device memory of the replays: the command's default where there is no GPU
/// (addresses only: nothing is touched).
const SIMULATED: usize = 80 << 30;

/// Where the plots are written: one file per process, replaced by each input.
fn plot_path() -> PathBuf {
    std::env::temp_dir().join(format!("memres-fuzz-cli-log-{}.svg", std::process::id()))
}

fn run(data: &[u8]) {
    // `read_log`: the reader's answer, or the command's message and exit status 1.
    let events = match memres::log::read_events(data) {
        Ok(events) => events,
        Err(e) => {
            let message = e.to_string();
            assert!(
                message.len() <= LONGEST_MESSAGE,
                "a {}-byte message: {:?}...",
                message.len(),
                &message[..message.floor_char_boundary(200)]
            );
            return;
        }
    };
    if events.is_empty() {
        return; // "the log has a header but no events"
    }
    let plan = Plan::new(&events);
    check_plan(&events, &plan);
    // `memres stats`.
    let report = crate::stats::report("fuzz.csv", &events, &plan);
    assert!(report.starts_with("fuzz.csv: "), "{report}");
    assert!(report.contains("\n  peak live: "), "{report}");
    // `memres plot`.
    let out = plot_path();
    let written = crate::plot::write(&out, "memory over time: fuzz.csv", &plan, &[]);
    assert!(written.is_ok(), "{written:?}");
    check_svg(&out);
    // `memres replay` of a small log, with its plot.
    if plan.len() <= REPLAY_EVENTS && plan.threads() <= REPLAY_THREADS {
        let stack = STACKS[data
            .iter()
            .fold(0usize, |h, &b| h.wrapping_mul(31).wrapping_add(b.into()))
            % STACKS.len()];
        replay(&plan, stack, &out);
    }
    let _ = std::fs::remove_file(&out);
}

/// What the plan says agrees with the events.
fn check_plan(events: &[Event], plan: &Plan) {
    let count = |a: Action| events.iter().filter(|e| e.action == a).count();
    assert_eq!(plan.len(), events.len());
    assert_eq!(plan.live.len(), events.len());
    assert_eq!(plan.micros.len(), events.len());
    assert_eq!(plan.failures_in_log, count(Action::AllocateFailure));
    assert!(plan.replayed_ops() <= count(Action::Allocate) + count(Action::Free));
    let mut threads: Vec<u64> = events.iter().map(|e| e.thread).collect();
    threads.sort_unstable();
    threads.dedup();
    assert_eq!(plan.threads(), threads.len());
    let mut streams: Vec<LoggedStream> = Vec::new();
    for e in events {
        if !streams.contains(&e.stream) {
            streams.push(e.stream);
        }
    }
    assert_eq!(plan.streams, streams, "the streams in order of first use");
    let most = plan.live.iter().copied().max().unwrap_or(0);
    assert_eq!(plan.peak_live.0, most);
    assert!(plan.never_freed.0 <= count(Action::Allocate));
    assert_eq!(
        plan.micros.first(),
        Some(&0),
        "times start at the first event"
    );
    for w in &plan.warnings {
        assert!(w.starts_with("line "), "a warning names its line: {w}");
    }
}

/// The plot at `out` is a whole SVG document.
fn check_svg(out: &std::path::Path) {
    let svg = std::fs::read_to_string(out).expect("the plot was written");
    assert!(
        svg.starts_with("<svg"),
        "{}",
        &svg[..svg.floor_char_boundary(200)]
    );
    assert!(
        svg.trim_end().ends_with("</svg>"),
        "the plot ends its document"
    );
}

/// Replays `plan` through `stack` over simulated memory as `memres replay --resource
/// STACK --plot OUT` does without a GPU, one host stream per logged stream.
fn replay(plan: &Plan, stack: &str, out: &std::path::Path) {
    const GRANULE: usize = 2 << 20;
    let name = StackName::parse_with(stack, &Options::default()).expect("a stack of the command");
    let leaf = |_| memres::upstream::HostVirtual::new(SIMULATED, GRANULE);
    let built = Replay::new(
        crate::simulated::simulated(SIMULATED),
        leaf,
        SIMULATED / 2,
        false,
    )
    .build(&name.spec)
    .unwrap_or_else(|e| panic!("{stack}: {e}"));
    let streams: Vec<memres::StreamRef<'_>> = (0..plan.streams.len())
        .map(|i| memres::StreamRef::host(i as u32))
        .collect();
    let outcome = crate::replay::replay(plan, &built, &streams, Some(1), &|_| {})
        .unwrap_or_else(|e| panic!("{stack}: {e}"));
    assert_eq!(outcome.ops, plan.replayed_ops(), "{stack}");
    assert!(outcome.failures <= plan.replayed_ops(), "{stack}");
    assert!(outcome.leaks.0 <= plan.never_freed.0, "{stack}");
    assert_eq!(
        outcome.samples.len(),
        plan.len(),
        "{stack}: one sample per op"
    );
    assert_eq!(
        outcome.first_failure.is_some(),
        outcome.failures > 0,
        "{stack}"
    );
    let replays = vec![(stack.to_owned(), outcome)];
    let written = crate::plot::write(out, "memory over time: fuzz.csv", plan, &replays);
    assert!(written.is_ok(), "{stack}: {written:?}");
    check_svg(out);
}
