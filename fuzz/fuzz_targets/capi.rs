//! The C ABI (`capi/src/lib.rs`, built as a Rust library by `fuzz/capi/`) driven as a C
//! program drives it, from the input (see `fuzz/common/capi.rs`): every call answers
//! with one of the header's codes and a bounded message, never a panic. Only where there
//! is no CUDA driver.
//!
//! ```sh
//! cargo +nightly fuzz run capi fuzz/corpus/capi
//! ```
#![no_main]

use libfuzzer_sys::fuzz_target;
use memres as mr;
use memres_capi as capi;

include!("../common/capi.rs");

fuzz_target!(|data: &[u8]| run(data));
