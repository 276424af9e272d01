//! Replays the committed fuzz corpora on stable Rust, with the fuzz targets' own checks:
//! the sub-allocators (`fuzz/corpus/suballoc`, found by `cargo +nightly fuzz run
//! suballoc`; the target's code is `fuzz/common/suballoc.rs`) and the log reader
//! (`fuzz/corpus/read_events`) and, with the `spec` feature (on whenever the workspace is
//! tested: the C ABI and the command enable it), the stack spec language
//! (`fuzz/corpus/spec`; the target's code is `fuzz/common/spec.rs`).

mod target {
    include!("../fuzz/common/suballoc.rs");
}

/// Runs `check` on every input of `fuzz/corpus/<target>` (at least 10 of them); skips,
/// saying so, where the corpus is absent (the GPU bundle carries binaries only).
fn replay(target: &str, check: impl Fn(&[u8])) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target);
    let Ok(entries) = std::fs::read_dir(&dir) else {
        println!(
            "memres-skip: no corpus at {} (run from a checkout)",
            dir.display()
        );
        return;
    };
    let mut inputs = 0;
    for entry in entries {
        check(&std::fs::read(entry.unwrap().path()).unwrap());
        inputs += 1;
    }
    assert!(
        inputs >= 10,
        "the corpus at {} has {inputs} inputs",
        dir.display()
    );
}

#[test]
fn the_suballoc_corpus_replays_clean() {
    replay("suballoc", target::run);
}

/// The log reader's corpus (`fuzz/corpus/read_events`, found by `cargo +nightly fuzz run
/// read_events`), with the target's own checks: events or an error, every event naming a
/// line of the input, never a panic.
#[test]
fn the_read_events_corpus_replays_clean() {
    replay("read_events", |data| {
        if let Ok(events) = memres::log::read_events(data) {
            assert!(events.iter().all(|e| e.line >= 2));
        }
        if let Ok(text) = std::str::from_utf8(data) {
            let _ = memres::log::parse_event(text, 2);
        }
    });
}

/// The spec language's corpus (`fuzz/corpus/spec`, found by `cargo +nightly fuzz run
/// spec`), with the target's own checks (`fuzz/common/spec.rs`): a spec or an error with a
/// message, never a panic, the same answer twice, small specs built over host memory.
#[cfg(feature = "spec")]
#[test]
fn the_spec_corpus_replays_clean() {
    replay("spec", spec_target::run);
}

#[cfg(feature = "spec")]
mod spec_target {
    include!("../fuzz/common/spec.rs");
}
