//! The `memres` command, run as a user runs it: replays of crafted logs with known
//! answers, the sample logs, malformed input, `stats` and `plot`.

use std::path::PathBuf;
use std::process::{Command, Output};

/// The `cli/` folder: where cargo built the test, or under `MEMRES_REPO` (the GPU
/// bundle's `run.sh` sets it: the test runs on another machine there).
fn cli_dir() -> PathBuf {
    match std::env::var_os("MEMRES_REPO") {
        Some(repo) => PathBuf::from(repo).join("cli"),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")),
    }
}

fn data(name: &str) -> PathBuf {
    cli_dir().join("tests/data").join(name)
}

fn sample(name: &str) -> PathBuf {
    cli_dir().join("../examples/data").join(name)
}

fn memres(args: &[&str]) -> Output {
    // The bundle's copy of the binary where `run.sh` says so.
    let bin = std::env::var_os("MEMRES_BIN").map_or_else(
        || PathBuf::from(env!("CARGO_BIN_EXE_memres")),
        PathBuf::from,
    );
    Command::new(bin)
        .args(args)
        .output()
        .expect("the memres binary runs")
}

fn ok(args: &[&str]) -> String {
    let out = memres(args);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "memres {args:?} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Runs, expects failure, returns stderr.
fn fails(args: &[&str]) -> String {
    let out = memres(args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !out.status.success(),
        "memres {args:?} succeeded: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(
        !stderr.contains("panicked"),
        "memres {args:?} panicked: {stderr}"
    );
    stderr
}

/// The table row of `resource` in replay output, split into columns.
fn row<'a>(out: &'a str, resource: &str) -> Vec<&'a str> {
    out.lines()
        .find(|l| l.split_whitespace().next() == Some(resource))
        .unwrap_or_else(|| panic!("no row for {resource} in\n{out}"))
        .split_whitespace()
        .collect()
}

#[test]
fn known_answers_through_pool_arena_and_binning() {
    let log = data("known.csv");
    let out = ok(&[
        "replay",
        log.to_str().unwrap(),
        "--compare",
        "pool,arena,binning",
        "--simulate",
        "1GiB",
    ]);
    // 1000 + 2000 live at once is the peak; 0x2000 and 0x3000 are never freed.
    assert!(out.contains("peak live 2.93 KiB"), "{out}");
    assert!(
        out.contains("1 allocate-failure rows are left out"),
        "{out}"
    );
    assert!(
        out.contains("memory: simulated device memory of 1.00 GiB"),
        "{out}"
    );
    for resource in ["pool", "arena", "binning"] {
        let cols = row(&out, resource);
        // resource, time, unit, per op, unit, failures, first failure, ...
        assert_eq!(cols[5], "0", "{resource}: failures in {out}");
        assert_eq!(cols[6], "-", "{resource}");
        let leaks = cols[cols.len() - 3..].join(" ");
        assert_eq!(
            leaks, "2 (2.44 KiB)",
            "{resource}: 2000 + 500 bytes never freed"
        );
    }
}

#[test]
fn a_failure_is_reported_at_its_line() {
    let log = data("too_big.csv");
    let out = ok(&[
        "replay",
        log.to_str().unwrap(),
        "--compare",
        "pool,arena,binning",
        "--simulate",
        "2GiB",
    ]);
    for resource in ["pool", "arena", "binning"] {
        let cols = row(&out, resource);
        assert_eq!(cols[5], "1", "{resource}: one failure in {out}");
        assert_eq!(
            &cols[6..8],
            ["line", "6"],
            "{resource}: the 4 GiB allocation is on line 6"
        );
        assert!(
            out.contains(&format!("{resource}: first failure at line 6 (4.00 GiB)")),
            "{out}"
        );
    }
}

#[test]
fn the_rmm_log_replays_without_error() {
    let log = sample("rmm-log-sample.csv");
    let out = ok(&["replay", log.to_str().unwrap(), "--simulate", "80GiB"]);
    assert!(
        out.contains("361 events (360 replayed) on 4 threads and 3 streams"),
        "{out}"
    );
    let cols = row(&out, "pool");
    assert_eq!(cols[5], "0", "{out}");
    assert!(!out.contains("warning"), "{out}");
}

#[test]
fn the_sample_training_log_replays_and_compares() {
    let log = sample("training.csv.gz");
    let out = ok(&[
        "replay",
        log.to_str().unwrap(),
        "--compare",
        "pool,binning,cuda,host-pool,virtual-pool,host-binning",
        "pool:growth=rmm",
        // Simulated device memory on a GPU machine too: there, real memory makes the
        // `cuda` stack 120,000 cuMemAlloc/cuMemFree pairs (minutes), and the figures
        // checked here do not depend on it.
        "--simulate",
        "80GiB",
    ]);
    assert!(out.contains("238777 events"), "{out}");
    assert!(out.contains("on 3 threads and 4 streams"), "{out}");
    for resource in ["pool", "binning", "cuda", "host-pool", "host-binning"] {
        let cols = row(&out, resource);
        assert_eq!(cols[5], "0", "{resource}: {out}");
        // One metrics buffer is never freed.
        assert_eq!(cols[cols.len() - 3], "1", "{resource}: {out}");
    }
    // `cuda` hands every request to the memory: its footprint is the live peak.
    assert!(out.contains("peak live 328.42 MiB"), "{out}");
    assert_eq!(row(&out, "cuda")[7..9], ["328.42", "MiB"], "{out}");
    // The pool growing in place (2 MiB granules) holds what the live peak needs, give or
    // take a few granules: 340 MiB with the 8 MiB quick cache per stream (336 with a 1 MiB
    // cache, 342 before small requests were placed low). At most 5% above the live peak.
    let virtual_pool = row(&out, "virtual-pool");
    assert_eq!(virtual_pool[5], "0", "{out}");
    assert_eq!(virtual_pool[8], "MiB", "{out}");
    let held: f64 = virtual_pool[7].parse().unwrap();
    assert!((328.42..=328.42 * 1.05).contains(&held), "{out}");
    // The chunked pool: 350 MiB growing by at least an eighth, 512 MiB by RMM's doubling.
    assert_eq!(row(&out, "pool")[7..9], ["350.00", "MiB"], "{out}");
    assert_eq!(
        row(&out, "pool:growth=rmm")[7..9],
        ["512.00", "MiB"],
        "{out}"
    );
    // Bins over the pool growing in place: each bin's chunk of 128 blocks, and the pool's
    // granules for the rest (2.00 GiB over the chunked pool); the same on host memory.
    for resource in ["binning", "host-binning"] {
        assert_eq!(row(&out, resource)[7..9], ["1.11", "GiB"], "{out}");
    }
}

#[test]
fn stats_describe_the_log() {
    let out = ok(&["stats", sample("training.csv.gz").to_str().unwrap()]);
    assert!(
        out.contains("238777 events on 3 threads and 4 streams"),
        "{out}"
    );
    assert!(out.contains("peak live: 328.42 MiB at line"), "{out}");
    assert!(out.contains("never freed: 1 allocations"), "{out}");
    assert!(out.contains("[8.00 MiB, 16.00 MiB)"), "{out}");
    let out = ok(&["stats", data("known.csv").to_str().unwrap()]);
    assert!(
        out.contains("allocations 4, frees 2, allocation failures 1"),
        "{out}"
    );
    assert!(
        out.contains("peak live: 2.93 KiB at line 3 (10:00:00.000010)"),
        "{out}"
    );
    assert!(
        out.contains("never freed: 2 allocations, 2.44 KiB"),
        "{out}"
    );
}

#[test]
fn plots_are_svg_naming_what_they_show() {
    let dir = std::env::temp_dir().join(format!("memres-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let svg = dir.join("rmm.svg");
    let log = sample("rmm-log-sample.csv");
    ok(&["plot", log.to_str().unwrap(), "-o", svg.to_str().unwrap()]);
    let text = std::fs::read_to_string(&svg).unwrap();
    roxmltree::Document::parse(&text).expect("the plot is well-formed XML");
    assert!(text.contains("memory over time: rmm-log-sample.csv"));
    assert!(text.contains("live bytes (log)"));

    let replayed = dir.join("replay.svg");
    let out = ok(&[
        "replay",
        log.to_str().unwrap(),
        "--compare",
        "pool,arena",
        "--plot",
        replayed.to_str().unwrap(),
    ]);
    assert!(out.contains("wrote"), "{out}");
    let text = std::fs::read_to_string(&replayed).unwrap();
    roxmltree::Document::parse(&text).expect("the plot is well-formed XML");
    for label in [
        "pool: footprint",
        "pool: largest free block",
        "arena: footprint",
    ] {
        assert!(text.contains(label), "the legend lacks {label:?}");
    }
    assert!(text.contains("memory (MiB)") || text.contains("memory (GiB)"));
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn malformed_logs_are_errors_naming_file_and_line() {
    let cases = [
        (
            "missing_column.csv",
            "log line 3: expected 6 comma-separated fields",
        ),
        ("bad_pointer.csv", "log line 3: bad pointer: \"0xZZ\""),
        ("bad_size.csv", "log line 3: bad size: \"-12\""),
        ("empty.csv", "the log is empty"),
        ("header_only.csv", "the log has a header but no events"),
        ("not_csv.csv", "log line 1: not UTF-8 text"),
    ];
    for (file, want) in cases {
        let path = data(file);
        for command in ["replay", "stats"] {
            let err = fails(&[command, path.to_str().unwrap()]);
            assert!(
                err.contains(file),
                "{command} {file}: {err:?} does not name the file"
            );
            assert!(
                err.contains(want),
                "{command} {file}: {err:?} lacks {want:?}"
            );
        }
    }
    let err = fails(&["replay", "/no/such/log.csv"]);
    assert!(err.contains("/no/such/log.csv"), "{err}");
}

#[test]
fn a_free_of_an_unknown_pointer_is_reported_and_the_replay_goes_on() {
    let out = ok(&[
        "replay",
        data("unknown_free.csv").to_str().unwrap(),
        "--simulate",
        "1GiB",
    ]);
    assert!(
        out.contains("warning: line 3: free of 0xdead00, which the log never allocated or already freed (skipped)"),
        "{out}"
    );
    assert_eq!(row(&out, "pool")[5], "0", "{out}");
}

#[test]
fn a_free_with_another_size_is_reported_and_frees_what_was_allocated() {
    let out = ok(&[
        "replay",
        data("wrong_size_free.csv").to_str().unwrap(),
        "--simulate",
        "1GiB",
    ]);
    assert!(
        out.contains("line 3: free of 0x1000 with 64 bytes; line 2 allocated 1000"),
        "{out}"
    );
    // Nothing is left live: the free used the allocated size.
    assert_eq!(row(&out, "pool")[5], "0", "{out}");
}

/// Stacks as the C ABI composes them, adaptors included, beside plain names in one table.
#[test]
fn spec_strings_compose_stacks_as_the_c_abi_does() {
    let log = data("known.csv");
    let out = ok(&[
        "replay",
        log.to_str().unwrap(),
        "--simulate",
        "1GiB",
        "--compare",
        "pool,arena",
        "statistics(pool:initial=64MiB)",
        "limiting(virtual_pool,limit=1KiB)",
    ]);
    // resource, time, unit, per op, unit, failures, first failure, footprint, unit, ...
    let stats = row(&out, "statistics(pool:initial=64MiB)");
    assert_eq!(
        (stats[5], stats[7], stats[8]),
        ("0", "64.00", "MiB"),
        "{out}"
    );
    // 2000 bytes never fit under 1 KiB (line 3); whether the 500 of another thread does
    // depends on how the replay interleaves the threads.
    let limited = row(&out, "limiting(virtual_pool,limit=1KiB)");
    assert_ne!(limited[5], "0", "{out}");
    assert_eq!((limited[6], limited[7]), ("line", "3"), "{out}");
    assert!(out.contains("would pass the limit of 1.0 KiB"), "{out}");
    row(&out, "pool");
    row(&out, "arena");
    let err = fails(&["replay", log.to_str().unwrap(), "-r", "statistics(pooll)"]);
    assert!(
        err.contains("not a spec string") && err.contains("unknown resource \"pooll\""),
        "{err}"
    );
}

#[test]
fn bad_options_are_errors() {
    let log = data("known.csv");
    let err = fails(&["replay", log.to_str().unwrap(), "--resource", "poool"]);
    assert!(err.contains("unknown resource \"poool\""), "{err}");
    let err = fails(&["replay", log.to_str().unwrap(), "--simulate", "lots"]);
    assert!(err.contains("no number in the size \"lots\""), "{err}");
    let err = fails(&[
        "replay",
        log.to_str().unwrap(),
        "--resource",
        "cuda-async",
        "--simulate",
        "1GiB",
    ]);
    assert!(err.contains("needs a GPU"), "{err}");
    // A block size that overflows when rounded up: an error, not a panic.
    let err = fails(&[
        "replay",
        log.to_str().unwrap(),
        "--resource",
        "fixed",
        "--fixed-block",
        "18446744073709551615",
    ]);
    assert!(err.contains("overflows the address space"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn bench_prints_the_anchors_csv_and_a_table() {
    // A thousandth of the ops: the point is the shape, not the figures.
    let out = ok(&[
        "bench",
        "--scale",
        "1000",
        "--stacks",
        "pool,arena",
        "--pool-size",
        "256MiB",
    ]);
    assert!(
        out.contains("impl,resource,workload,threads,ops,ns_per_op_min,ns_per_op_median"),
        "{out}"
    );
    for line in [
        "memres,pool,pair-256B,1,1000,",
        "memres,arena,random,1,200,",
        "memres,pool,random-mt,8,800,",
    ] {
        assert!(out.contains(line), "{out} lacks {line}");
    }
    assert!(out.contains("median ns per op"), "{out}");
    assert!(
        !out.contains("memres,binning"),
        "only the stacks asked for run: {out}"
    );
}

#[test]
fn absurd_sizes_are_failures_not_crashes() {
    let log = data("huge_sizes.csv");
    let out = ok(&[
        "replay",
        log.to_str().unwrap(),
        "--compare",
        "cuda,pool,host",
        "--simulate",
        "16000000TiB",
    ]);
    assert_eq!(row(&out, "cuda")[5], "3", "{out}");
    let out = ok(&["stats", log.to_str().unwrap()]);
    assert!(out.contains("never freed: 3 allocations"), "{out}");
}

#[test]
fn a_pointer_allocated_twice_counts_as_never_freed_and_midnight_is_crossed() {
    let log = data("reallocated.csv");
    let out = ok(&["stats", log.to_str().unwrap()]);
    assert!(out.contains("never freed: 1 allocations, 100 B"), "{out}");
    assert!(
        out.contains("over 0.001500 s"),
        "the log runs past midnight: {out}"
    );
    let out = ok(&["replay", log.to_str().unwrap(), "--simulate", "1GiB"]);
    let cols = row(&out, "pool");
    assert_eq!(cols[cols.len() - 3..].join(" "), "1 (100 B)", "{out}");
}

#[test]
fn bench_refuses_what_it_does_not_know() {
    let err = fails(&["bench", "--stacks", "nosuch"]);
    assert!(
        err.contains("unknown stack \"nosuch\"") && err.contains("pool"),
        "{err}"
    );
    let err = fails(&["bench", "--workloads", "pool,nosuch"]);
    assert!(err.contains("unknown workload \"pool\""), "{err}");
    let err = fails(&["bench", "--scale", "0"]);
    assert!(err.contains("'0'") && err.contains("--scale"), "{err}");
    let help = ok(&["bench", "--help"]);
    assert!(
        help.contains("workloads/src/lib.rs") && !help.contains("shared/"),
        "{help}"
    );
}

#[test]
fn an_output_path_that_cannot_be_written_fails_before_the_work() {
    let log = sample("training.csv.gz");
    let log = log.to_str().unwrap();
    for args in [
        vec!["replay", log, "--plot", "/nonexistent/x.svg"],
        vec!["plot", log, "-o", "/nonexistent/x.svg"],
    ] {
        let out = memres(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains("/nonexistent/x.svg"),
            "{err}"
        );
        // Refused before the log was read: nothing was replayed or printed.
        assert!(
            out.stdout.is_empty(),
            "{}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
}

#[test]
fn replay_options_out_of_range_and_long_specs_get_short_clear_errors() {
    let log = sample("rmm-log-sample.csv");
    let log = log.to_str().unwrap();
    let err = fails(&["replay", log, "--simulate", "0"]);
    assert!(err.contains("at least 1MiB"), "{err}");
    let err = fails(&["replay", log, "--fixed-block", "0"]);
    assert!(err.contains("at least 256"), "{err}");
    let long = "statistics(".repeat(10_000);
    let err = fails(&["replay", log, "-r", &long]);
    assert!(err.len() < 1_000, "the error echoes {} bytes", err.len());
    assert!(err.contains("110000 bytes in all"), "{err}");
    // The spec names work as stack names; the older spelling too, with a note.
    for name in [
        "virtual_pool",
        "virtual-pool",
        "fixed",
        "fixed_size",
        "host-fixed_size",
    ] {
        ok(&["replay", log, "-r", name]);
    }
    let out = memres(&["replay", log, "-r", "virtual-pool"]);
    let note = String::from_utf8_lossy(&out.stderr);
    assert!(
        note.contains("\"virtual-pool\" is spelled \"virtual_pool\" now"),
        "{note}"
    );
    let out = memres(&["replay", log, "-r", "virtual_pool"]);
    assert!(out.stderr.is_empty(), "no note for the spec's name");
}

#[test]
fn help_takes_help_and_names_the_commands() {
    let out = ok(&["help", "--help"]);
    assert!(out.contains("Usage: memres help [COMMAND]"), "{out}");
    let out = ok(&["help", "replay"]);
    assert!(
        out.contains("Usage: memres replay [OPTIONS] <LOG>"),
        "{out}"
    );
    let err = fails(&["help", "nosuch"]);
    assert!(
        err.contains("no command named \"nosuch\"; the commands: replay, stats, plot, bench"),
        "{err}"
    );
}

/// A replay larger than its simulated device memory completes through `fallback(..)`
/// (issue 37: the host simulation of a device pool falling back to pinned host memory),
/// with what each tier served; the pool alone fails.
#[test]
fn a_replay_larger_than_the_device_completes_through_a_fallback() {
    let log = sample("training.csv.gz");
    let log = log.to_str().unwrap();
    let out = ok(&[
        "replay",
        log,
        "--simulate",
        "200MiB",
        "--compare",
        "pool",
        "fallback(pool, pinned_pool)",
    ]);
    let row = |name: &str| {
        out.lines()
            .find(|l| l.starts_with(&format!("{name} ")))
            .unwrap_or_else(|| panic!("no row for {name}: {out}"))
            .split_whitespace()
            .nth(if name == "pool" { 5 } else { 6 })
            .unwrap()
            .to_owned()
    };
    assert_ne!(row("pool"), "0", "the pool alone runs out: {out}");
    assert_eq!(row("fallback(pool, pinned_pool)"), "0", "no failure: {out}");
    let tiers = out
        .lines()
        .find(|l| l.starts_with("fallback(pool, pinned_pool): the first tier served"))
        .unwrap_or_else(|| panic!("no tier line: {out}"));
    assert!(
        !tiers.contains("the next 0 "),
        "the next tier served some: {tiers}"
    );
}

/// A scratch folder of this test's own under the target folder.
fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn a_plot_over_its_own_log_is_refused_and_the_log_kept() {
    let dir = scratch("plot-over-log");
    let original = std::fs::read(sample("training.csv.gz")).unwrap();
    let log = dir.join("run.csv.gz");
    std::fs::write(&log, &original).unwrap();
    let link = dir.join("link.csv.gz");
    std::os::unix::fs::symlink(&log, &link).unwrap();
    let (log, link) = (log.to_str().unwrap(), link.to_str().unwrap());
    for args in [
        vec!["plot", log, "-o", log],
        vec!["plot", log, "-o", link],
        vec!["replay", log, "--plot", log],
        vec!["replay", log, "-r", "host-pool", "--plot", link],
    ] {
        let err = fails(&args);
        assert!(err.contains("is the log being read"), "{args:?}: {err}");
        assert_eq!(
            std::fs::read(log).unwrap(),
            original,
            "{args:?} changed the log"
        );
    }
    // An existing plot is replaced only when the new one is whole.
    let svg = dir.join("memory.svg");
    std::fs::write(&svg, "old").unwrap();
    ok(&["plot", log, "-o", svg.to_str().unwrap()]);
    assert!(std::fs::read_to_string(&svg).unwrap().starts_with("<svg"));
    let names: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names.len(), 3, "no part file is left: {names:?}");
}

/// `memres ... | head -1`: the reader goes away after one line.
#[test]
fn a_closed_stdout_ends_the_command_quietly() {
    use std::io::{BufRead, BufReader};
    use std::os::unix::process::ExitStatusExt;
    use std::process::Stdio;
    let bin = std::env::var_os("MEMRES_BIN").map_or_else(
        || PathBuf::from(env!("CARGO_BIN_EXE_memres")),
        PathBuf::from,
    );
    let log = sample("training.csv.gz");
    let log = log.to_str().unwrap();
    for args in [
        vec![
            "replay",
            log,
            "--compare",
            "host-pool,host-arena,host-binning",
        ],
        vec!["bench", "--scale", "1000", "--stacks", "pool"],
    ] {
        let mut child = Command::new(&bin)
            .args(&args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut first = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut first)
            .unwrap();
        assert!(!first.is_empty(), "{args:?} printed nothing");
        // The reading end is closed here: later lines meet a broken pipe.
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        assert!(
            out.status.success() || out.status.signal() == Some(libc_sigpipe()),
            "{args:?} ended with {:?}: {stderr}",
            out.status
        );
    }
}

/// SIGPIPE's number on Linux (and every other unix memres builds on).
fn libc_sigpipe() -> i32 {
    13
}

#[test]
fn endless_lines_are_errors_naming_the_line_with_a_short_quote() {
    let dir = scratch("endless-lines");
    // A 4 MiB line of NUL bytes after the header: refused at 1 MiB.
    let nul = dir.join("nul.csv");
    let mut text = b"Thread,Time,Action,Pointer,Size,Stream\n".to_vec();
    text.resize(text.len() + (4 << 20), 0);
    std::fs::write(&nul, &text).unwrap();
    let err = fails(&["stats", nul.to_str().unwrap()]);
    assert!(err.contains("log line 2: longer than 1 MiB"), "{err}");
    assert!(err.len() < 1_000, "the error echoes {} bytes", err.len());
    // A long malformed line under the limit: quoted in part, with its size.
    let long = dir.join("long.csv");
    let row = format!(
        "Thread,Time,Action,Pointer,Size,Stream\n1,00:00:00.000001,allocate,0x10,{},0\n",
        "9".repeat(100_000)
    );
    std::fs::write(&long, row).unwrap();
    let err = fails(&["stats", long.to_str().unwrap()]);
    assert!(err.contains("log line 2: bad size"), "{err}");
    assert!(err.contains("(100000 bytes in all)"), "{err}");
    assert!(err.len() < 1_000, "the error echoes {} bytes", err.len());
}

#[test]
fn bin_options_follow_the_spec_forms_rules() {
    let log = data("known.csv");
    let log = log.to_str().unwrap();
    for (min, max, says) in [
        ("40", "2", "min=40 is above max=2"),
        ("10", "64", "a bin size is a power-of-two exponent below 48"),
    ] {
        let err = fails(&[
            "replay",
            log,
            "-r",
            "binning",
            "--bin-min",
            min,
            "--bin-max",
            max,
        ]);
        assert!(
            err.contains(&format!("--bin-min {min} --bin-max {max}")),
            "{err}"
        );
        assert!(err.contains(says), "{err}");
        assert!(!err.contains("out of memory"), "{err}");
    }
}

#[test]
fn spec_errors_are_shown_whole() {
    let log = data("known.csv");
    let log = log.to_str().unwrap();
    // Only an option is wrong: the error says which, not "unknown resource".
    let err = fails(&["replay", log, "-r", "statistics(pool:initial=lots)"]);
    assert!(err.contains("initial"), "{err}");
    assert!(err.contains("lots"), "{err}");
    // A spec longer than the old 80-character cut still says why at the end.
    let long = format!(
        "{}pool:initial=lots{}",
        "statistics(".repeat(10),
        ")".repeat(10)
    );
    let err = fails(&["replay", log, "-r", &long]);
    assert!(err.contains("lots"), "{err}");
    // A 40-deep one says it is too deep.
    let deep = format!("{}pool{}", "statistics(".repeat(40), ")".repeat(40));
    let err = fails(&["replay", log, "-r", &deep]);
    assert!(err.contains("nested deeper than 16"), "{err}");
}
