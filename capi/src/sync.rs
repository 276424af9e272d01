//! The std/loom switch for the C ABI's own tables (the streams recorded for live blocks,
//! the exports of live blocks): built with `RUSTFLAGS="--cfg memres_loom"`, they are
//! loom's, and the `loom_` models below explore every interleaving of their protocol (a
//! counter read without the lock on every free, the map under it). Statics stay std's
//! (loom's types cannot be made in a constant).

#[cfg(not(memres_loom))]
pub(crate) use std::sync::Mutex;
#[cfg(not(memres_loom))]
pub(crate) use std::sync::atomic::AtomicUsize;

#[cfg(memres_loom)]
pub(crate) use loom::sync::Mutex;
#[cfg(memres_loom)]
pub(crate) use loom::sync::atomic::AtomicUsize;

#[cfg(all(test, memres_loom))]
mod loom_models {
    use std::sync::atomic::Ordering;

    use loom::sync::Arc;
    use loom::sync::atomic::AtomicBool;
    use loom::thread;

    use crate::ipc::Exported;
    use crate::recorded::Recorded;

    /// A stream recorded on one thread for a block that another frees after it (the
    /// program orders the two, here with a flag): the free sees the stream, once.
    #[test]
    fn loom_a_record_before_the_free_is_taken_by_it() {
        loom::model(|| {
            let recorded = Arc::new(Recorded::default());
            let done = Arc::new(AtomicBool::new(false));
            let (r, d) = (Arc::clone(&recorded), Arc::clone(&done));
            let recorder = thread::spawn(move || {
                r.record(0x1000, 7);
                d.store(true, Ordering::Release);
            });
            if done.load(Ordering::Acquire) {
                assert_eq!(recorded.take(0x1000), Some(vec![7]));
                assert_eq!(recorded.take(0x1000), None, "taken once");
            }
            recorder.join().unwrap();
        });
    }

    /// Two threads record streams for one block while a third frees another block: the
    /// free takes nothing of the first block's, and a free of the first after both sees
    /// both streams.
    #[test]
    fn loom_records_of_two_threads_are_both_kept() {
        loom::model(|| {
            let recorded = Arc::new(Recorded::default());
            let spawn = |stream| {
                let r = Arc::clone(&recorded);
                thread::spawn(move || r.record(0x1000, stream))
            };
            let (a, b) = (spawn(7), spawn(9));
            assert_eq!(recorded.take(0x2000), None);
            a.join().unwrap();
            b.join().unwrap();
            let mut streams = recorded.take(0x1000).expect("both recorded");
            streams.sort_unstable();
            assert_eq!(streams, vec![7, 9]);
            assert_eq!(recorded.take(0x1000), None);
        });
    }

    /// An export kept on one thread and released by the block's free on another (ordered
    /// by the program): the free closes it, and the fast path's counter ends at zero.
    #[test]
    fn loom_an_export_is_released_by_the_free_after_it() {
        loom::model(|| {
            let exported = Arc::new(Exported::default());
            let done = Arc::new(AtomicBool::new(false));
            let (e, d) = (Arc::clone(&exported), Arc::clone(&done));
            let exporter = thread::spawn(move || {
                e.keep(0x1000, vec![1], 0, Vec::new());
                d.store(true, Ordering::Release);
            });
            let other = {
                let e = Arc::clone(&exported);
                thread::spawn(move || {
                    e.keep(0x2000, vec![2], 0, Vec::new());
                    e.release(0x2000);
                })
            };
            if done.load(Ordering::Acquire) {
                assert_eq!(exported.handle_of(0x1000, 1), Some((vec![1], 0)));
                exported.release(0x1000);
                assert_eq!(exported.handle_of(0x1000, 1), None);
            }
            exporter.join().unwrap();
            other.join().unwrap();
            exported.release(0x1000);
            assert!(!exported.any_in(0, usize::MAX), "every export released");
        });
    }
}
