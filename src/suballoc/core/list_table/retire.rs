//! Retirement: `trim` frees the lists that hold nothing, two grace periods after they left
//! the table, moving what was freed into them meanwhile to their streams' new lists.

use super::*;

impl<S> ListTable<S> {
    /// Frees the lists `idle` picks (it sees each with nothing locked), once no reader
    /// can hold them, and returns how many went. Items freed into one of them while it
    /// was going (`empty` says whether a state holds any) are moved by `drain` and
    /// `absorb` to the list `home` gives for it: the same stream's current one (no
    /// wait), made with the retired one's context and owner
    /// ([`get_or_insert_like`](Self::get_or_insert_like)) if there is none. Items move
    /// while `serialise` (the caller's lock, which its searches for free memory hold)
    /// is held, so that no search sees them in neither place. The contexts of retired
    /// lists stay in what [`synchronize_streams`](Self::synchronize_streams) waits for.
    /// Where grace periods are not offered ([`grace::can_wait`]) nothing is retired.
    ///
    /// Steps: the idle lists leave the table (a new table without them is published,
    /// the old tables are kept) for limbo, where iterations still find them; after a
    /// grace period no reader holds one from a lookup: `unlinked` gets their addresses
    /// (for the caller's own places that keep lists across calls), what was freed into
    /// them moves to their streams' current lists (issue 49: memory freed, merged or
    /// grown into one of them by a call that found it before it went, out of every
    /// search's reach from the moment it left limbo, made other threads run out of
    /// memory), then they leave limbo and `recent`; after a second no reader holds one
    /// from an iteration or from such a place, and they and the old tables are freed,
    /// what was put back into them meanwhile moved first (an iteration that took items
    /// out of one in limbo and returned them without holding `serialise`; one holding it
    /// returns them before the first move or finds nothing to take). They are marked
    /// retired as they leave
    /// the table ([`List::is_retired`]): `set_recent` and `note_free` pass them over,
    /// and so must every place of the caller's that keeps lists across calls; a thread
    /// that read the mark clear was pinned, so the first grace period outlasts what it
    /// did with it (the mark is stored before that grace period's heavy fence, and read
    /// after a pin's light one).
    ///
    /// # Safety
    /// Every reference to a list of this map is used only while its thread is pinned
    /// ([`grace::pin`]), but the lists `home` returns (only a retirement frees a list,
    /// one at a time, and this one does not free those) and those the caller keeps
    /// across calls, which it takes in only unless retired and gives up in `unlinked`;
    /// the caller is not pinned and holds no lock a pinned thread may wait for.
    // long: one protocol around two grace periods; split, SAFETY would span fns.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn retire<'a, T, G>(
        &'a self,
        idle: impl Fn(&List<S>) -> bool,
        empty: impl Fn(&S) -> bool,
        home: impl Fn(&List<S>) -> &'a List<S>,
        drain: impl Fn(&mut S) -> Vec<T>,
        absorb: impl Fn(&mut S, Vec<T>),
        unlinked: impl FnOnce(&[usize]),
        serialise: impl Fn() -> G,
    ) -> usize {
        let Some(waiter) = grace::can_wait() else {
            return 0;
        };
        let _one_at_a_time = lock(&self.rare.one_at_a_time);
        let (removed, old_tables) = {
            let mut tables = lock(&self.rare.tables);
            let table = self.table();
            let (mut kept, mut removed) = (Vec::new(), Vec::new());
            for slot in table.slots.iter() {
                let p = slot.list.load(Ordering::Relaxed);
                if !p.is_null() {
                    // SAFETY: read from a slot.
                    if idle(unsafe { self.at(p) }) {
                        removed.push(p);
                    } else {
                        kept.push((slot.key(), p));
                    }
                }
            }
            if removed.is_empty() {
                return 0;
            }
            for &p in &removed {
                // SAFETY: read from a slot; lists are freed only below.
                unsafe { self.at(p) }.retired.store(true, Ordering::Relaxed);
            }
            // At most half full after the next insertion, as `get_or_insert_with` keeps it.
            let len = (kept.len() * 2 + 2).next_power_of_two().max(FIRST_SLOTS);
            let smaller = Table::new(len);
            for &(key, p) in &kept {
                smaller.put(smaller.find(key).unwrap_err(), key, p);
            }
            let smaller = Box::into_raw(Box::new(smaller));
            lock(&self.rare.limbo).extend(removed.iter().copied());
            self.rare.limbo_any.store(true, Ordering::Release);
            self.table.store(smaller, Ordering::Release);
            let old = std::mem::replace(&mut tables.all, vec![smaller]);
            tables.lists = kept.len();
            (removed, old)
        };
        // A grace period: no lookup that found a removed list is still going on.
        grace::wait_for_readers(&waiter, &self.domain);
        // Every thread that may have put one anywhere that outlives a call (it read the
        // `retired` flag clear) has moved on, and no thread puts one anywhere now: the
        // caller takes them out of its own such places (while they are still in limbo,
        // so that what the caller puts back into them stays in reach of iterations).
        unlinked(
            &removed
                .iter()
                .map(|&p| p.expose_provenance())
                .collect::<Vec<_>>(),
        );
        // No call that found one by a lookup (a free into it, a merge or a growth into
        // it as the calling stream's list) is still going on: what they left there
        // moves to the streams' current lists while the removed ones are still in
        // limbo, so every search finds it in one place or the other.
        // SAFETY: the removed lists are freed only below, by this call.
        unsafe { self.move_late(&removed, &empty, &home, &drain, &absorb, &serialise) };
        // They leave limbo, which holds only them (retirements run one at a time, and each
        // empties it).
        lock(&self.rare.limbo).clear();
        self.rare.limbo_any.store(false, Ordering::Release);
        // No thread makes one the first a search looks at now (`set_recent` passes over
        // retired lists, and a thread that read the mark clear has moved on); a reader
        // of `recent` that found one is waited for below.
        for &p in &removed {
            let _ = self.recent.compare_exchange(
                p,
                ptr::null_mut(),
                Ordering::AcqRel,
                Ordering::Relaxed,
            );
        }

        // A second: no iteration that found one in limbo, no search that found one as
        // `recent`, and no reader of the caller's places that found one there is still
        // going on.
        grace::wait_for_readers(&waiter, &self.domain);
        // What such an iteration put back without holding `serialise` (items it took
        // out and returned, as a merge whose wait failed does).
        // SAFETY: as above.
        unsafe { self.move_late(&removed, &empty, &home, &drain, &absorb, &serialise) };
        for &p in &removed {
            // SAFETY: made by `Box::into_raw` in `get_or_insert_with`; out of every table
            // and of limbo, and two grace periods have passed, so no reference to it is
            // left: it is freed once.
            drop(unsafe { Box::from_raw(p) });
        }
        for table in old_tables {
            // SAFETY: made by `Box::into_raw`, no longer current or listed, and no reader
            // probing it is left (the grace periods above).
            drop(unsafe { Box::from_raw(table) });
        }
        removed.len()
    }

    /// Moves the items of the retired lists `removed` to the lists `home` gives for
    /// them, under `serialise` (see [`retire`](Self::retire)). The homes are found (or
    /// made) first, without `serialise` (making one may take the lock it stands for),
    /// for the lists holding items then; an item put into a list after that look
    /// stays for the next move.
    ///
    /// # Safety
    /// Every pointer of `removed` is a list of this map that is not freed during the
    /// call.
    unsafe fn move_late<'a, T, G>(
        &'a self,
        removed: &[*mut List<S>],
        empty: &impl Fn(&S) -> bool,
        home: &impl Fn(&List<S>) -> &'a List<S>,
        drain: &impl Fn(&mut S) -> Vec<T>,
        absorb: &impl Fn(&mut S, Vec<T>),
        serialise: &impl Fn() -> G,
    ) {
        let moves: Vec<(&List<S>, &List<S>)> = removed
            .iter()
            // SAFETY: the caller's promise.
            .map(|&p| unsafe { &*p })
            .filter(|old| !empty(&old.state.lock()))
            .map(|old| (old, home(old)))
            .collect();
        if moves.is_empty() {
            return;
        }
        let _searches = serialise();
        for (old, to) in moves {
            let late = drain(&mut old.state.lock());
            if !late.is_empty() {
                // A per-thread list's items were freed on its owner's per-thread stream:
                // they go to a list that another thread owns now (one that took the
                // exited owner's number and made a list of its own while the old one was
                // going) only after that stream's work is waited for, as a take-over
                // waits (issue 49: they went there without a wait). The owners are read
                // after the first grace period: a thread that takes the list `to` over
                // later waits itself, after every free of the exited thread.
                if old.key.is_per_thread() {
                    let owner = old.owner.load(Ordering::Relaxed);
                    if to.owner.load(Ordering::Relaxed) != owner {
                        old.wait_for_owner(owner);
                    }
                }
                absorb(&mut to.state.lock(), late);
                self.note_free(to);
            }
        }
    }
}

#[cfg(all(test, not(memres_loom)))]
mod tests {
    use std::sync::mpsc;
    use std::time::Duration;

    use super::*;

    /// A map whose host stream 7 has a list holding `items` (the one `recent` points
    /// at if `recent`), retired on another thread; `during` runs on this thread, pinned,
    /// once the retirement's first grace period has passed, with the map and a function
    /// that lets the retirement go on and says whether it returned within 300 ms (it
    /// must not while this thread is pinned). Returns what `during` returns and where
    /// `recent` points once the retirement is over.
    #[allow(clippy::type_complexity)]
    fn while_retiring<R>(
        items: Vec<u32>,
        recent: bool,
        during: impl FnOnce(&ListTable<Vec<u32>>, &mut dyn FnMut() -> bool) -> R,
    ) -> Option<(R, *mut List<Vec<u32>>)> {
        if grace::can_wait().is_none() {
            println!("memres-skip: no membarrier here: lists are not retired");
            return None;
        }
        let map = ListTable::<Vec<u32>>::default();
        let key = StreamKey::host(7);
        let list = map.get_or_insert_with(key, Vec::new);
        list.state.lock().extend(items);
        if recent {
            map.set_recent(list);
        }
        let (in_limbo, first_grace_period_over) = mpsc::channel::<()>();
        let (go, gate) = mpsc::channel::<()>();
        let (returned, retirement) = mpsc::channel::<usize>();
        let r = std::thread::scope(|s| {
            let map = &map;
            s.spawn(move || {
                // SAFETY: every use of the map's lists is inside a pin; this thread is
                // not pinned and holds no lock.
                let retired = unsafe {
                    map.retire(
                        |list| list.key == key,
                        Vec::is_empty,
                        |old| match map.find(old.key) {
                            Some(list) => list,
                            None => map.get_or_insert_like(old, Vec::new),
                        },
                        std::mem::take,
                        |list: &mut Vec<u32>, items| list.extend(items),
                        |_| {
                            in_limbo.send(()).unwrap();
                            // (Until `during` lets it go on, or returns.)
                            let _ = gate.recv();
                        },
                        || (),
                    )
                };
                returned.send(retired).unwrap();
            });
            first_grace_period_over
                .recv_timeout(Duration::from_secs(30))
                .expect("the retirement's first grace period ended");
            let r = {
                let _pin = map.pin();
                let mut go = Some(go);
                during(map, &mut || {
                    if let Some(go) = go.take() {
                        go.send(()).unwrap();
                    }
                    retirement.recv_timeout(Duration::from_millis(300)).is_ok()
                })
            };
            // (The retirement, if it has not returned, returns now: this thread unpinned.)
            r
        });
        Some((r, map.recent.load(Ordering::Acquire)))
    }

    /// A per-thread list retired after its thread exited, with a block freed into it
    /// while it went (by a call of that thread that had found it), and a new thread that
    /// took the exited one's number and made a list of its own meanwhile: the block
    /// reaches the new thread's list only after the exited thread's device work is
    /// waited for (issue 49: it went there without the wait a take-over makes, so the
    /// new thread could reuse it while the old thread's per-thread stream still used
    /// it). Fails without the wait in `move_late`.
    #[test]
    fn a_retired_per_thread_lists_late_block_reaches_a_new_owner_only_after_a_wait() {
        use crate::sync::threads::new_generation;

        if grace::can_wait().is_none() {
            println!("memres-skip: no membarrier here: lists are not retired");
            return;
        }
        // A number no real thread has, so that no other test's thread takes the list.
        let key = StreamKey::per_thread(1 << 40);
        let (exited, new) = (new_generation(), new_generation());
        let map = ListTable::<Vec<u32>>::default();
        map.get_or_insert_as(key, exited, Vec::new);
        let (in_limbo, first_grace_period_over) = mpsc::channel::<()>();
        let (go, gate) = mpsc::channel::<()>();
        std::thread::scope(|s| {
            let map = &map;
            let retirement = s.spawn(move || {
                // SAFETY: every use of the map's lists is inside a pin; this thread is not
                // pinned and holds no lock.
                unsafe {
                    map.retire(
                        |list| list.key == key,
                        Vec::is_empty,
                        |old| match map.find(old.key) {
                            Some(list) => list,
                            None => map.get_or_insert_like(old, Vec::new),
                        },
                        std::mem::take,
                        |list: &mut Vec<u32>, items| list.extend(items),
                        |_| {
                            in_limbo.send(()).unwrap();
                            let _ = gate.recv();
                        },
                        || (),
                    )
                }
            });
            first_grace_period_over
                .recv_timeout(Duration::from_secs(30))
                .expect("the retirement's first grace period ended");
            {
                let _pin = map.pin();
                // The exited thread's late free, into the list it had found.
                let old = map
                    .iter()
                    .find(|s| s.key == key)
                    .expect("the list is in limbo");
                old.state.lock().push(5);
                // The new thread with the exited one's number: the old list has left the
                // table, so it makes a list of its own.
                let mine = map.get_or_insert_as(key, new, Vec::new);
                assert!(!ptr::eq(mine, old), "a new list");
            }
            go.send(()).unwrap();
            assert_eq!(retirement.join().unwrap(), 1, "the old list retired");
        });
        let _pin = map.pin();
        let mine = map.find(key).expect("the new thread's list");
        assert_eq!(mine.owner.load(Ordering::Relaxed), new);
        assert_eq!(*mine.state.lock(), vec![5], "the late block moved to it");
        assert!(
            waits::waited(exited),
            "the exited thread's work was waited for before its block reached the new thread"
        );
    }

    /// An iteration during the retirement visits the retired list (in limbo), and the
    /// list's items are in the stream's list once it is over. Fails if iterations skip
    /// limbo.
    #[test]
    fn an_iteration_visits_a_list_being_retired() {
        let Some((seen, _)) = while_retiring(vec![5], false, |map, _| {
            map.iter()
                .flat_map(|s| s.state.lock().clone())
                .collect::<Vec<u32>>()
        }) else {
            return;
        };
        assert_eq!(seen, vec![5], "the retired list's items are in reach");
    }

    /// A retirement does not free a list (return) while a pinned thread that found it in
    /// limbo may still use it. Fails without the second grace period.
    #[test]
    fn a_retired_list_outlives_the_iterations_that_found_it() {
        let Some((returned, _)) = while_retiring(vec![], false, |map, go_on| {
            let found = map
                .iter()
                .any(|s| s.key == StreamKey::host(7) && s.is_retired());
            assert!(found, "the list is in limbo, marked retired");
            go_on()
        }) else {
            return;
        };
        assert!(
            !returned,
            "the retirement returned (freed the list) while a thread that found it was pinned"
        );
    }

    /// A thread that found the list in limbo and makes it the first a search looks at
    /// after the retirement took it out of `recent` (as `FixedSize`'s search through
    /// every list does) leaves `recent` alone: the list is marked retired. Fails if the
    /// mark is never set (`recent` would then point at a freed list).
    #[test]
    fn a_retired_list_never_becomes_recent_again() {
        let Some((at, recent)) = while_retiring(vec![], true, |map, go_on| {
            let list = map
                .iter()
                .find(|s| s.key == StreamKey::host(7))
                .expect("the list is in limbo");
            let at = ptr::from_ref(list).cast_mut();
            assert_eq!(map.recent.load(Ordering::Acquire), at);
            // Let the retirement go on until it has taken the list out of `recent`.
            go_on();
            let started = std::time::Instant::now();
            while map.recent.load(Ordering::Acquire) == at {
                assert!(
                    started.elapsed() < Duration::from_secs(30),
                    "`recent` kept the list"
                );
                std::thread::yield_now();
            }
            map.set_recent(list);
            at
        }) else {
            return;
        };
        // (Addresses only: the list is freed by now.)
        assert_ne!(recent, at, "`recent` points at the freed list");
    }
}
