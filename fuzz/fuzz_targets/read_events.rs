//! The log reader on arbitrary bytes: it returns events or an error, never panics.
//!
//! ```sh
//! cargo +nightly fuzz run read_events   # from the repository root, with cargo-fuzz
//! ```
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(events) = memres::log::read_events(data) {
        for e in &events {
            // Every event names a line of the input.
            assert!(e.line >= 2);
        }
    }
    // Single rows too, without the header.
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = memres::log::parse_event(text, 2);
    }
});
