//! The synchronisation primitives every shared-state type in memres goes through.
//!
//! Built normally, these are `std::sync`'s. Built with `RUSTFLAGS="--cfg memres_loom"`
//! (see `tests/loom.rs`), they are loom's, so the loom model tests explore every
//! interleaving of the protocols built on them. The cfg is the crate's own: a plain
//! `--cfg loom` would switch dependencies that know that name too.

#[cfg(not(memres_loom))]
pub(crate) use std::sync::{
    Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard, atomic,
};

#[cfg(memres_loom)]
pub(crate) use loom::sync::{
    Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard, atomic,
};

/// Turns a `std` `Arc` (which can be unsized into `Arc<dyn Trait>`) into the shim's `Arc`.
#[cfg(not(memres_loom))]
#[inline]
pub(crate) fn arc_from_std<T: ?Sized>(arc: std::sync::Arc<T>) -> Arc<T> {
    arc
}

/// Turns a `std` `Arc` (which can be unsized into `Arc<dyn Trait>`) into the shim's `Arc`.
#[cfg(memres_loom)]
pub(crate) fn arc_from_std<T: ?Sized>(arc: std::sync::Arc<T>) -> Arc<T> {
    Arc::from_std(arc)
}
