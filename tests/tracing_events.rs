//! The `tracing` events an operator can turn on: debug-level events when a pool grows,
//! merges other streams' lists, gives memory back, and when an arena defragments;
//! trace-level events per allocation and free with the `trace-allocations` feature only.
//! A small subscriber of its own records them (no `tracing-subscriber` needed).

use std::sync::{Arc, Mutex};

use memres::suballoc::{Arena, Pool, PoolConfig};
use memres::{HostHeap, Resource, StreamRef, layout};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Level, Metadata, Subscriber};

/// One recorded event: level, target and message with its fields as text.
#[derive(Debug, Clone)]
struct Seen {
    level: Level,
    target: String,
    text: String,
}

#[derive(Default, Clone)]
struct Recorder(Arc<Mutex<Vec<Seen>>>);

struct Text<'a>(&'a mut String);

impl Visit for Text<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        use std::fmt::Write;
        let _ = write!(self.0, "{}={:?} ", field.name(), value);
    }
}

impl Subscriber for Recorder {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, event: &Event<'_>) {
        let mut text = String::new();
        event.record(&mut Text(&mut text));
        self.0.lock().unwrap().push(Seen {
            level: *event.metadata().level(),
            target: event.metadata().target().to_owned(),
            text,
        });
    }
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

/// Runs `f` with a recorder installed on this thread; returns what it saw.
fn record(f: impl FnOnce()) -> Vec<Seen> {
    let recorder = Recorder::default();
    tracing::subscriber::with_default(recorder.clone(), f);
    recorder.0.lock().unwrap().clone()
}

fn debug_with(seen: &[Seen], words: &str) -> bool {
    seen.iter()
        .any(|s| s.level == Level::DEBUG && s.text.contains(words))
}

#[test]
fn a_pool_says_when_it_grows_merges_and_gives_memory_back() {
    let seen = record(|| {
        let pool = Pool::new(HostHeap::new(), PoolConfig::new()).unwrap();
        let l = layout(1 << 20).unwrap();
        let p = pool.allocate(StreamRef::host(1), l).unwrap();
        // SAFETY: allocated above with `l`; freed on another host stream.
        unsafe { pool.deallocate(StreamRef::host(2), p, l) };
        pool.coalesce().unwrap();
        pool.trim().unwrap();
    });
    assert!(debug_with(&seen, "pool grew"), "{seen:#?}");
    assert!(
        debug_with(&seen, "merged other streams' lists"),
        "{seen:#?}"
    );
    assert!(debug_with(&seen, "gave memory back"), "{seen:#?}");
    assert!(
        seen.iter().all(|s| s.target.starts_with("memres")),
        "{seen:#?}"
    );
}

#[test]
fn an_arena_says_when_it_defragments() {
    let seen = record(|| {
        let arena = Arena::with_size(HostHeap::new(), 4 << 20).unwrap();
        let l = layout(3 << 20).unwrap();
        // Taken and freed on one stream, the superblock stays there; another stream's
        // request then needs a defragmentation to get it back.
        let p = arena.allocate(StreamRef::host(1), l).unwrap();
        // SAFETY: allocated above with `l` on host stream 1.
        unsafe { arena.deallocate(StreamRef::host(1), p, l) };
        let q = arena.allocate(StreamRef::host(2), l).unwrap();
        // SAFETY: allocated above with `l` on host stream 2.
        unsafe { arena.deallocate(StreamRef::host(2), q, l) };
    });
    assert!(debug_with(&seen, "arena defragmented"), "{seen:#?}");
}

#[test]
fn allocations_are_traced_only_with_the_feature() {
    let seen = record(|| {
        let pool = Pool::new(HostHeap::new(), PoolConfig::new().initial_size(1 << 20)).unwrap();
        let l = layout(4096).unwrap();
        let p = pool.allocate(StreamRef::HOST, l).unwrap();
        // SAFETY: allocated above with `l`.
        unsafe { pool.deallocate(StreamRef::HOST, p, l) };
    });
    let traced = seen.iter().filter(|s| s.level == Level::TRACE).count();
    if cfg!(feature = "trace-allocations") {
        assert_eq!(traced, 2, "{seen:#?}");
    } else {
        assert_eq!(traced, 0, "{seen:#?}");
    }
}
