//! The std/loom switch for the C ABI's own tables (the exports of live blocks, the tags'
//! pools): built with `RUSTFLAGS="--cfg memres_loom"`, they are loom's, and the `loom_`
//! models below explore every interleaving of their protocols (a counter read without
//! the lock on every free and the map under it, a tag's pool made on first use from two
//! threads or beside a new bound). The live blocks and their recorded streams are the
//! library's `StreamUse` layer, modelled there. Statics stay std's (loom's types cannot
//! be made in a constant).

#[cfg(not(memres_loom))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicUsize};
#[cfg(not(memres_loom))]
pub(crate) use std::sync::{Mutex, RwLock};

#[cfg(memres_loom)]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicUsize};
#[cfg(memres_loom)]
pub(crate) use loom::sync::{Mutex, RwLock};

#[cfg(all(test, memres_loom))]
mod loom_models {
    use std::sync::atomic::Ordering;

    use loom::sync::Arc;
    use loom::sync::atomic::AtomicBool;
    use loom::thread;

    use crate::exports::Exported;
    use crate::routed::{Reserved, TagPools};

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

    /// Two threads allocate under one tag on a device that has no pool for it yet: one
    /// pool is made, and both get it. Fails without the second look under the write lock.
    #[test]
    fn loom_two_threads_asking_for_one_tag_get_one_pool() {
        loom::model(|| {
            let tags = Arc::new(TagPools::<StandIn>::default());
            let made = Arc::new(std::sync::atomic::AtomicUsize::new(0));
            let ask = || {
                let (t, m) = (Arc::clone(&tags), Arc::clone(&made));
                thread::spawn(move || {
                    t.pool(1, || {
                        m.fetch_add(1, Ordering::Relaxed);
                        Ok(StandIn::at(0x1000))
                    })
                    .unwrap()
                })
            };
            let (a, b) = (ask(), ask());
            let (a, b) = (a.join().unwrap(), b.join().unwrap());
            assert!(std::sync::Arc::ptr_eq(&a, &b), "one pool for the tag");
            assert_eq!(made.load(Ordering::Relaxed), 1, "made once");
            assert_eq!(tags.all().len(), 1);
        });
    }

    /// `memres_set_limit` beside the first allocation under a tag: the pool made is
    /// bounded, whichever comes first, and so is one made after both. Fails if the pool
    /// reads the bound before taking the write lock, or if `set_limit` bounds the pools
    /// of a copy of the table taken before it stores the bound.
    #[test]
    fn loom_a_pool_made_beside_a_new_bound_is_bounded() {
        loom::model(|| {
            let tags = Arc::new(TagPools::<StandIn>::default());
            let maker = {
                let t = Arc::clone(&tags);
                thread::spawn(move || t.pool(1, || Ok(StandIn::at(0x1000))).unwrap())
            };
            tags.set_limit(Some(64 << 20));
            let first = maker.join().unwrap();
            assert_eq!(
                first.limit(),
                Some(64 << 20),
                "the pool made beside the bound"
            );
            let later = tags.pool(2, || Ok(StandIn::at(0x4000))).unwrap();
            assert_eq!(later.limit(), Some(64 << 20), "a pool made after it");
        });
    }

    /// A block of a tag's pool made on one thread, freed on another (which learns of the
    /// block through the program, here a flag) while a third thread makes another tag's
    /// pool (the table grows): the free finds the block's pool by address; an address in
    /// no tag's range finds none.
    #[test]
    fn loom_a_free_finds_the_tag_pool_made_on_another_thread() {
        loom::model(|| {
            let tags = Arc::new(TagPools::<StandIn>::default());
            let allocated = Arc::new(AtomicBool::new(false));
            let allocator = {
                let (t, a) = (Arc::clone(&tags), Arc::clone(&allocated));
                thread::spawn(move || {
                    let pool = t.pool(1, || Ok(StandIn::at(0x1000))).unwrap();
                    a.store(true, Ordering::Release); // hands out 0x1800
                    pool
                })
            };
            let other = {
                let t = Arc::clone(&tags);
                thread::spawn(move || t.pool(2, || Ok(StandIn::at(0x4000))).unwrap())
            };
            if allocated.load(Ordering::Acquire) {
                let pool = tags.holding(0x1800).expect("the free finds the tag's pool");
                assert_eq!(pool.base, 0x1000);
            }
            assert!(tags.holding(0x9000).is_none(), "in no tag's range");
            let first = allocator.join().unwrap();
            let second = other.join().unwrap();
            assert!(std::sync::Arc::ptr_eq(
                &tags.holding(0x1800).unwrap(),
                &first
            ));
            assert!(std::sync::Arc::ptr_eq(
                &tags.holding(0x4800).unwrap(),
                &second
            ));
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
