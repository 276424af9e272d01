//! StreamKey: which list a stream's blocks go to (its kind, handle and lane in one word).

use std::fmt;

use crate::stream::StreamRef;
use crate::sync::threads::{this_lane, this_thread};

/// What identifies a stream's free list: the stream's kind in the top two bits, its
/// handle, host id or thread number below (one word, so that comparing and hashing keys
/// costs next to nothing on the allocation path).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct StreamKey(u64);

const KIND_SHIFT: u32 = 62;
const CUDA: u64 = 0;
const HOST: u64 = 1;
const PER_THREAD: u64 = 2;

/// Lanes of one stream (see [`StreamKey::of_lane`]) sit in the bits below the kind: CUDA
/// stream handles are pointers, far below 2^56, and host ids are 32 bits.
pub(crate) use crate::sync::threads::LANES;
const LANE_SHIFT: u32 = 56;
const LANE_MASK: u64 = (LANES - 1) << LANE_SHIFT;

impl StreamKey {
    #[inline]
    pub(crate) fn of(stream: StreamRef<'_>) -> StreamKey {
        if let Some(id) = stream.host_id() {
            StreamKey::host(id)
        } else if stream.is_per_thread() {
            StreamKey((PER_THREAD << KIND_SHIFT) | this_thread().number as u64)
        } else if stream.is_default() {
            StreamKey(CUDA << KIND_SHIFT)
        } else {
            // CUDA stream handles are pointers, far below 2^62.
            StreamKey(stream.as_raw().map_or(0, |raw| raw as u64))
        }
    }

    /// The key of `stream`'s list in the calling thread's lane: threads sharing one stream
    /// use its lane 0 until they run into each other, then up to `OWN_LANES` (16) lists of
    /// their own (`sync::threads`), so that they do not all wait for one lock. Lanes of one
    /// stream are one stream to the device: memory moves between them without a wait. The
    /// per-thread default stream has one list per thread already, and no lanes.
    #[inline]
    pub(crate) fn of_lane(stream: StreamRef<'_>) -> StreamKey {
        let key = StreamKey::of(stream);
        if key.is_per_thread() {
            return key;
        }
        StreamKey(key.0 | this_lane() << LANE_SHIFT)
    }

    /// The key of the same stream in `lane` (not for the per-thread default stream).
    #[inline]
    pub(super) fn in_lane(self, lane: u64) -> StreamKey {
        debug_assert!(!self.is_per_thread() && lane < LANES);
        StreamKey(self.stream().0 | lane << LANE_SHIFT)
    }

    /// The stream the key names, whatever its lane.
    #[inline]
    pub(crate) fn stream(self) -> StreamKey {
        if self.is_per_thread() {
            self
        } else {
            StreamKey(self.0 & !LANE_MASK)
        }
    }

    /// Blocks a list of this stream keeps for its own stream rather than give to others
    /// (`FixedSize`'s rule: a list's last block stays, but the shared host stream's, whose
    /// blocks every stream takes): lists holding more than this have blocks to spare.
    #[inline]
    pub(crate) fn kept_for_itself(self) -> usize {
        usize::from(self.stream() != StreamKey::host(0))
    }

    /// The key of the per-thread default stream's list of thread number `number`.
    #[cfg(test)]
    pub(crate) const fn per_thread(number: usize) -> StreamKey {
        StreamKey((PER_THREAD << KIND_SHIFT) | number as u64)
    }

    /// The key of host stream `id`.
    pub(crate) const fn host(id: u32) -> StreamKey {
        StreamKey((HOST << KIND_SHIFT) | id as u64)
    }

    /// The handle of an explicit CUDA stream (not a default or per-thread one).
    pub(super) fn explicit_stream(self) -> Option<usize> {
        let handle = self.stream().0;
        (handle >> KIND_SHIFT == CUDA && handle != 0).then_some(handle as usize)
    }

    /// Blocks freed on a host stream may be taken by any stream without waiting.
    #[inline]
    pub(crate) fn is_host(self) -> bool {
        self.0 >> KIND_SHIFT == HOST
    }

    /// The per-thread list that threads use while their thread-local destructors run
    /// (see `this_thread`): shared by every exiting thread, each on its own stream.
    pub(crate) fn is_exiting_threads(self) -> bool {
        self.0 == PER_THREAD << KIND_SHIFT
    }

    #[inline]
    pub(super) fn is_per_thread(self) -> bool {
        self.0 >> KIND_SHIFT == PER_THREAD
    }

    /// The key's lane (0 for the per-thread default stream's lists).
    #[inline]
    pub(super) fn lane(self) -> u64 {
        (self.0 & LANE_MASK) >> LANE_SHIFT
    }

    /// The key as one word (what a list table's slot holds beside the list).
    #[inline]
    pub(super) fn bits(self) -> u64 {
        self.0
    }

    /// The key whose [`bits`](Self::bits) these are.
    pub(super) fn from_bits(bits: u64) -> StreamKey {
        StreamKey(bits)
    }

    /// The key's bits (for tables that keep keys as plain words).
    #[inline(always)]
    pub(crate) fn raw(self) -> u64 {
        self.0
    }

    /// A hash of the key, its best bits at the top.
    #[inline]
    pub(crate) fn hash(self) -> u64 {
        self.0.wrapping_mul(0x9E37_79B9_7F4A_7C15)
    }

    /// Where the key's probe starts in a table of `mask + 1` slots.
    #[inline]
    pub(crate) fn slot(self, mask: usize) -> usize {
        (self.hash() >> 32) as usize & mask
    }
}

impl fmt::Debug for StreamKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_per_thread() {
            let n = self.0 & ((1 << KIND_SHIFT) - 1);
            return write!(f, "per-thread stream of thread {n}");
        }
        let n = self.0 & ((1 << LANE_SHIFT) - 1);
        let lane = (self.0 & LANE_MASK) >> LANE_SHIFT;
        match self.0 >> KIND_SHIFT {
            HOST => write!(f, "host stream {n}, lane {lane}"),
            _ => write!(f, "CUDA stream {n:#x}, lane {lane}"),
        }
    }
}
