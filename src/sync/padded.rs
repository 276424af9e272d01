//! A value on cache lines of its own.

/// `T` alone on its cache lines: 128 bytes, the unit the adjacent-line prefetcher of
/// x86 cores fetches (two 64-byte lines), so that values that different threads write
/// (a ring's head and tail, a counter every thread reads beside one a few threads write)
/// do not share a line.
#[repr(align(128))]
#[derive(Debug, Default)]
pub(crate) struct CachePadded<T>(pub(crate) T);

impl<T> std::ops::Deref for CachePadded<T> {
    type Target = T;

    #[inline]
    fn deref(&self) -> &T {
        &self.0
    }
}
