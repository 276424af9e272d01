//! The stack spec parser (`memres::spec`, the library's `spec` feature) on arbitrary
//! text: a spec or an error with a message, never a panic, and the same answer twice.
//!
//! ```sh
//! cargo +nightly fuzz run spec fuzz/corpus/spec
//! ```
#![no_main]

use libfuzzer_sys::fuzz_target;
use memres::spec;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match spec::Spec::parse(text) {
        Ok(parsed) => assert_eq!(spec::Spec::parse(text).ok(), Some(parsed)),
        Err(e) => assert!(!e.message().is_empty()),
    }
});
