//! The `capi` fuzz target's committed corpus (`fuzz/corpus/capi`, found by `cargo
//! +nightly fuzz run capi`) replayed by `cargo test` on stable Rust, with the target's own
//! checks (`fuzz/common/capi.rs`). A test module of the C ABI (declared at the end of
//! `capi/src/lib.rs`: the C ABI's package builds no Rust library another test could call),
//! kept beside the target's code.

use crate as capi;

include!("capi.rs");

/// Set in the child process that replays the corpus.
const CHILD: &str = "MEMRES_CAPI_FUZZ_CORPUS_CHILD";

/// The corpus, replayed in a child process: its calls configure the process's stacks,
/// which other tests of this crate set and check. Skipped, saying so, where the corpus is
/// absent (the GPU bundle carries binaries only) or a CUDA driver is present (the target's
/// calls would allocate device memory and write the log files its specs name).
#[test]
fn the_capi_corpus_replays_clean() {
    let dir = corpus();
    if !dir.is_dir() {
        println!(
            "memres-skip: no corpus at {} (run from a checkout)",
            dir.display()
        );
        return;
    }
    if mr::driver::is_present() {
        println!("memres-skip: the capi corpus replays only where there is no CUDA driver");
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "fuzz_corpus::capi_corpus_child", "--nocapture"])
        .env(CHILD, "1")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let replayed = text
        .lines()
        .find_map(|l| l.strip_prefix("capi corpus: replayed "))
        .and_then(|n| n.parse::<usize>().ok());
    assert!(
        out.status.success() && replayed.is_some_and(|n| n >= 10),
        "the child failed or replayed fewer than 10 inputs:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The body of the test above, run only in its child process.
#[test]
fn capi_corpus_child() {
    if std::env::var_os(CHILD).is_none() {
        return; // not the child
    }
    let mut inputs = 0;
    for entry in std::fs::read_dir(corpus()).unwrap() {
        run(&std::fs::read(entry.unwrap().path()).unwrap());
        inputs += 1;
    }
    println!("capi corpus: replayed {inputs}");
}

fn corpus() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/capi")
}
