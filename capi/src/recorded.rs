//! The streams recorded for live blocks with `memres_record_stream` (PyTorch's
//! `Tensor.record_stream`), consumed when the block is freed.

use std::collections::HashMap;
use std::sync::PoisonError;
use std::sync::atomic::Ordering;

use crate::sync::{AtomicUsize, Mutex};

/// Per device: block address -> the raw handles of the other streams that used it.
#[derive(Default)]
pub(crate) struct Recorded {
    /// Blocks in `map`: `memres_free` reads this one atomic and skips the lock while it is 0.
    blocks: AtomicUsize,
    map: Mutex<HashMap<usize, Vec<usize>>>,
}

impl Recorded {
    /// Records that work on `stream` (a raw handle) uses the block at `address`.
    pub(crate) fn record(&self, address: usize, stream: usize) {
        let mut map = self.map.lock().unwrap_or_else(PoisonError::into_inner);
        let streams = map.entry(address).or_insert_with(|| {
            self.blocks.fetch_add(1, Ordering::Relaxed);
            Vec::new()
        });
        if !streams.contains(&stream) {
            streams.push(stream);
        }
    }

    /// The streams recorded for the block at `address` (which is being freed), if any.
    #[inline]
    pub(crate) fn take(&self, address: usize) -> Option<Vec<usize>> {
        if self.blocks.load(Ordering::Relaxed) == 0 {
            return None;
        }
        self.take_slow(address)
    }

    #[cold]
    fn take_slow(&self, address: usize) -> Option<Vec<usize>> {
        let mut map = self.map.lock().unwrap_or_else(PoisonError::into_inner);
        let streams = map.remove(&address)?;
        self.blocks.fetch_sub(1, Ordering::Relaxed);
        Some(streams)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_are_recorded_once_and_taken_with_the_block() {
        let r = Recorded::default();
        assert_eq!(r.take(0x1000), None);
        r.record(0x1000, 7);
        r.record(0x1000, 7);
        r.record(0x1000, 9);
        r.record(0x2000, 7);
        assert_eq!(r.take(0x1000), Some(vec![7, 9]));
        assert_eq!(r.take(0x1000), None);
        assert_eq!(r.take(0x2000), Some(vec![7]));
        assert_eq!(r.blocks.load(Ordering::Relaxed), 0);
    }
}
