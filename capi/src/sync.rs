//! The std/loom switch for the C ABI's own tables (the exports of live blocks, the tags'
//! bound): built with `RUSTFLAGS="--cfg memres_loom"`, they are loom's, and the `loom_`
//! models below explore every interleaving of their protocols (a counter read without
//! the lock on every free and the map under it, a tag's pool made beside a new bound).
//! The live blocks and their recorded streams are the library's `StreamUse` layer, and
//! the tags' pools its `Router` (a pool made once per tag, frees finding it by address),
//! each modelled there. Statics stay std's (loom's types cannot be made in a constant).

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

    use crate::exports::Exported;
    use crate::routed::{self, Reserved, Tags};
    use mr::adaptor::Router;

    /// A stand-in for a tag's pool (which needs a GPU): its range and its bound.
    struct StandIn {
        base: usize,
        limit: std::sync::Mutex<Option<usize>>,
    }

    impl StandIn {
        fn at(base: usize) -> StandIn {
            StandIn {
                base,
                limit: std::sync::Mutex::new(None),
            }
        }

        fn limit(&self) -> Option<usize> {
            *self.limit.lock().unwrap()
        }
    }

    impl Reserved for StandIn {
        fn reservation(&self) -> (usize, usize) {
            (self.base, 0x1000)
        }

        fn set_limit(&self, bytes: Option<usize>) {
            *self.limit.lock().unwrap() = bytes;
        }
    }

    /// `memres_set_limit` beside the first allocation under a tag: the pool made is
    /// bounded, whichever comes first, and so is one made after both. Fails if
    /// `set_limit` stores the bound and bounds the pools without the router's lock for
    /// making members (`Router::update`), or bounds a copy of the pools taken before
    /// that lock. (The router's own protocol, one member per key and frees finding
    /// members made on other threads, is modelled in the library's `adaptor/router.rs`.)
    #[test]
    fn loom_a_pool_made_beside_a_new_bound_is_bounded() {
        loom::model(|| {
            let next = std::sync::atomic::AtomicUsize::new(1);
            let tags =
                Tags::new(move || Ok(StandIn::at(0x1000 * next.fetch_add(1, Ordering::Relaxed))));
            let router = Arc::new(Router::<(), _, _>::new((), tags));
            let maker = {
                let r = Arc::clone(&router);
                thread::spawn(move || {
                    r.member(1).unwrap();
                })
            };
            let bounder = {
                let r = Arc::clone(&router);
                thread::spawn(move || routed::set_limit(&r, Some(64 << 20)))
            };
            maker.join().unwrap();
            bounder.join().unwrap();
            assert_eq!(
                router.find(1).unwrap().limit(),
                Some(64 << 20),
                "the pool made beside the bound"
            );
            let later = router.member(2).unwrap();
            assert_eq!(later.limit(), Some(64 << 20), "a pool made after it");
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
