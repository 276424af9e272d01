//! Prefetches: ask for a cache line ahead of a store or a load.

/// Starts fetching the cache line of `value` in writable state, so that a store to it a
/// little later does not wait for it (for a line another core had, or one evicted from
/// this core's first-level cache).
#[cfg(target_arch = "x86_64")]
#[inline]
pub(crate) fn for_write<T>(value: &T) {
    // `PREFETCHW` itself: `_mm_prefetch::<_MM_HINT_ET0>` compiles to a plain read
    // prefetch unless the whole crate is built with `+prfchw` (checked in the binary), and
    // a line fetched for reading must still be taken from another core when written.
    // Processors without the instruction execute it as a no-op.
    // SAFETY: a prefetch is a hint: it never faults and changes no memory, registers or
    // flags; the address is a live reference anyway.
    unsafe {
        std::arch::asm!(
            "prefetchw [{at}]",
            at = in(reg) value as *const T,
            options(nostack, preserves_flags, readonly)
        )
    };
}

/// Starts fetching the cache line of `value` in writable state (a no-op on this target).
#[cfg(not(target_arch = "x86_64"))]
#[inline]
pub(crate) fn for_write<T>(_: &T) {}

/// Starts fetching the cache line of `value` for reading, so that a load from it a little
/// later does not wait for it.
#[cfg(target_arch = "x86_64")]
#[inline]
pub(crate) fn for_read<T>(value: &T) {
    // SAFETY: as in `for_write`: a hint that never faults and changes nothing.
    unsafe {
        std::arch::asm!(
            "prefetcht0 [{at}]",
            at = in(reg) value as *const T,
            options(nostack, preserves_flags, readonly)
        )
    };
}

/// Starts fetching the cache line of `value` for reading (a no-op on this target).
#[cfg(not(target_arch = "x86_64"))]
#[inline]
pub(crate) fn for_read<T>(_: &T) {}
