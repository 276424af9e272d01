//! Replays the committed fuzz corpus of the sub-allocators (`fuzz/corpus/suballoc`, found
//! by `cargo +nightly fuzz run suballoc`) on stable Rust, with the fuzz target's own
//! checks (`fuzz/common/suballoc.rs`).

mod target {
    include!("../fuzz/common/suballoc.rs");
}

#[test]
fn the_suballoc_corpus_replays_clean() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/suballoc");
    let Ok(entries) = std::fs::read_dir(&dir) else {
        // The GPU bundle carries binaries only.
        println!(
            "memres-skip: no corpus at {} (run from a checkout)",
            dir.display()
        );
        return;
    };
    let mut inputs = 0;
    for entry in entries {
        let path = entry.unwrap().path();
        target::run(&std::fs::read(&path).unwrap());
        inputs += 1;
    }
    assert!(
        inputs >= 10,
        "the corpus at {} has {inputs} inputs",
        dir.display()
    );
}
