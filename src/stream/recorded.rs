//! [`Recorded`]: the streams recorded for one live block (PyTorch's
//! `Tensor.record_stream`), which its free hands to the held blocks (`held.rs`). One type
//! for both tables that keep such records: the [`StreamUse`](crate::adaptor::StreamUse)
//! layer's (every live block of the layer, sharded) and a
//! [`SegmentPool`](crate::suballoc::SegmentPool)'s (its blocks, under its table's lock).
//! Each table says which blocks are live; this type says which streams use one.

use super::StreamRef;

/// The streams recorded for one live block, each once, in the order first recorded.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Recorded(Vec<StreamRef<'static>>);

impl Recorded {
    /// Records `stream`; a stream recorded already adds nothing.
    pub(crate) fn add(&mut self, stream: StreamRef<'static>) {
        if !self.0.contains(&stream) {
            self.0.push(stream);
        }
    }

    /// Adds the streams of a free's `used_on` (each once), for that free.
    ///
    /// # Safety
    /// The record is used only while the streams of `used_on` are live (during the free
    /// that passed them).
    pub(crate) unsafe fn add_used_on(&mut self, used_on: &[StreamRef<'_>]) {
        for &other in used_on {
            // SAFETY: the caller's promise: the record ends with the free.
            self.add(unsafe { other.detach() });
        }
    }

    /// The streams, in the order first recorded.
    pub(crate) fn streams(&self) -> &[StreamRef<'static>] {
        &self.0
    }

    /// The streams, taken.
    pub(crate) fn into_streams(self) -> Vec<StreamRef<'static>> {
        self.0
    }
}

#[cfg(all(test, not(memres_loom)))]
mod tests {
    use super::*;

    #[test]
    fn each_stream_is_recorded_once_in_order() {
        let (s7, s9) = (StreamRef::host(7), StreamRef::host(9));
        let mut r = Recorded::default();
        r.add(s9);
        r.add(s7);
        r.add(s9);
        // SAFETY: host streams live for the whole program.
        unsafe { r.add_used_on(&[s7, StreamRef::host(3)]) };
        assert_eq!(r.streams(), [s9, s7, StreamRef::host(3)]);
        assert_eq!(r.into_streams(), vec![s9, s7, StreamRef::host(3)]);
    }
}
