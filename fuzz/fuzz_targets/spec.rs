//! The C ABI's spec parser (`capi/src/spec.rs`, compiled in as a module) on arbitrary
//! text: a spec or an error with a message, never a panic, and the same answer twice.
//!
//! ```sh
//! cargo +nightly fuzz run spec fuzz/corpus/spec
//! ```
#![no_main]

extern crate memres as mr;

use libfuzzer_sys::fuzz_target;

#[allow(dead_code, unreachable_pub)]
#[path = "../../capi/src/spec.rs"]
mod spec;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match spec::Spec::parse(text) {
        Ok(parsed) => assert_eq!(spec::Spec::parse(text).ok(), Some(parsed)),
        Err(e) => assert!(!e.0.is_empty()),
    }
});
