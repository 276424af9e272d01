//! Compile-fail tests: each file in `ui-tests/` breaks one rule of the type system (named
//! in its first comment) and must fail to compile with the message in its `.stderr`.
//!
//! The expected messages are pinned to the toolchain in use, rustc 1.95 (the crate's
//! `rust-version`); rustc words its diagnostics differently from release to release. After
//! a toolchain change, regenerate them with `TRYBUILD=overwrite cargo test --test ui` and
//! review the diff: the messages are part of the documentation.
//!
//! The GPU bundle skips this target (its name starts with `ui`): it needs cargo.

#[test]
fn type_rules_are_enforced_at_compile_time() {
    let cases = trybuild::TestCases::new();
    cases.compile_fail("ui-tests/*.rs");
}
