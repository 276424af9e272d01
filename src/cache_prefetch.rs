//! CPU cache prefetches (named apart from [`adaptor::Prefetch`](crate::adaptor::Prefetch),
//! which moves managed memory to a GPU): ask for a cache line ahead of a store or a load.

/// Defines a prefetch function: `$insn` on x86_64, a no-op elsewhere.
macro_rules! prefetch {
    ($(#[$doc:meta])* $name:ident, $insn:literal) => {
        $(#[$doc])*
        #[inline]
        pub(crate) fn $name<T>(value: &T) {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: a prefetch is a hint: it never faults and changes no memory,
            // registers or flags; the address is a live reference anyway.
            unsafe {
                std::arch::asm!(
                    concat!($insn, " [{at}]"),
                    at = in(reg) value as *const T,
                    options(nostack, preserves_flags, readonly)
                )
            };
            #[cfg(not(target_arch = "x86_64"))]
            let _ = value;
        }
    };
}

prefetch!(
    /// Starts fetching the cache line of `value` in writable state, so that a store to it
    /// a little later does not wait for it (for a line another core had, or one evicted
    /// from this core's first-level cache). `PREFETCHW` itself:
    /// `_mm_prefetch::<_MM_HINT_ET0>` compiles to a plain read prefetch unless the whole
    /// crate is built with `+prfchw` (checked in the binary), and a line fetched for
    /// reading must still be taken from another core when written. Processors without
    /// the instruction execute it as a no-op.
    for_write,
    "prefetchw"
);

prefetch!(
    /// Starts fetching the cache line of `value` for reading, so that a load from it a
    /// little later does not wait for it.
    for_read,
    "prefetcht0"
);
