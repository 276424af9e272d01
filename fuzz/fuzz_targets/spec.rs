//! The stack spec language (`memres::spec`, the library's `spec` feature) on arbitrary
//! text (see `fuzz/common/spec.rs`): a spec or an error with a message, never a panic, the
//! same answer twice, and small specs built over host memory by the library's builder.
//!
//! ```sh
//! cargo +nightly fuzz run spec fuzz/corpus/spec
//! ```
#![no_main]

use libfuzzer_sys::fuzz_target;

include!("../common/spec.rs");

fuzz_target!(|data: &[u8]| run(data));
