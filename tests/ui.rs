//! Compile-fail tests: each file in `ui-tests/` breaks one rule of the type system (named
//! in its first comment) and must fail to compile with the message in its `.stderr`.
//!
//! The expected messages are pinned to the toolchain in use, rustc 1.95 (the crate's
//! `rust-version`); rustc words its diagnostics differently from release to release. After
//! a toolchain change, regenerate them with `TRYBUILD=overwrite cargo test --test ui` and
//! review the diff: the messages are part of the documentation.
//!
//! The messages are those of the `spec` feature on, as `cargo test` at the workspace's root
//! builds the library (the C ABI and the command turn it on): rustc prints a type with its
//! whole path when a `Spec` variant shares its name (`memres::Pool`). Without
//! `cudarc-interop`, the case that needs cudarc's streams is left out.
//!
//! The GPU bundle skips this target (its name starts with `ui`): it needs cargo.

/// The cases that name cudarc's types, which exist only with `cudarc-interop`.
const CUDARC_CASES: &[&str] = &["stream_ref_outlives_stream.rs"];

#[test]
fn type_rules_are_enforced_at_compile_time() {
    let cases = trybuild::TestCases::new();
    if cfg!(feature = "cudarc-interop") {
        cases.compile_fail("ui-tests/*.rs");
        return;
    }
    let mut files: Vec<_> = std::fs::read_dir("ui-tests")
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "rs"))
        .filter(|path| !CUDARC_CASES.iter().any(|case| path.ends_with(case)))
        .collect();
    files.sort();
    for file in files {
        cases.compile_fail(file);
    }
}
