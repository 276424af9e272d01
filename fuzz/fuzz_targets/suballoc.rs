//! Sub-allocators over host memory on arbitrary operation sequences (see
//! `fuzz/common/suballoc.rs`): allocations aligned, apart and intact; nothing leaked.
//!
//! ```sh
//! cargo +nightly fuzz run suballoc fuzz/corpus/suballoc
//! ```
#![no_main]

use libfuzzer_sys::fuzz_target;

include!("../common/suballoc.rs");

fuzz_target!(|data: &[u8]| run(data));
