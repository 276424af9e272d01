//! The Logging adaptor and the log reader: our logs read back exactly; RMM's parse too.

#[macro_use]
mod conformance;

use std::collections::HashMap;
use std::io::Write;
use std::sync::{Arc, Mutex};

use conformance::Caps;
use memres::adaptor::Logging;
use memres::log::{Action, LoggedStream, read_events, read_events_from_path};
use memres::{Error, HostHeap, Resource, StreamRef, SyncResource, layout};

/// A `Write` whose bytes the test can read afterwards.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn logged() -> Logging<HostHeap> {
    Logging::to_writer(HostHeap::new(), std::io::sink()).unwrap()
}

conformance_tests!(logging, logged(), Caps::host());

#[test]
fn every_event_from_many_threads_and_streams_is_logged_once() {
    let out = Captured::default();
    let log = Logging::to_writer(HostHeap::new(), out.clone()).unwrap();
    // (pointer, size, stream) of every allocation and free, as the threads saw them.
    let seen = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for t in 0..4u32 {
            let (log, seen) = (&log, &seen);
            s.spawn(move || {
                let stream = StreamRef::host(t + 1);
                let mut mine = Vec::new();
                for i in 0..250usize {
                    let size = 1 + (i * 37 + t as usize * 11) % 5000;
                    let l = layout(size).unwrap();
                    let p = log.allocate(stream, l).unwrap();
                    mine.push((Action::Allocate, p.as_ptr() as usize, size, t + 1));
                    if i % 2 == 1 {
                        // SAFETY: allocated just above with `l` on `stream`.
                        unsafe { log.deallocate(stream, p, l) };
                        mine.push((Action::Free, p.as_ptr() as usize, size, t + 1));
                    } else {
                        // Freed through the sync call, which logs the default stream.
                        // SAFETY: as above.
                        unsafe { log.deallocate_sync(p, l) };
                        mine.push((Action::Free, p.as_ptr() as usize, size, 0));
                    }
                }
                seen.lock().unwrap().extend(mine);
            });
        }
    });
    assert!(log.allocate_sync(layout(1 << 50).unwrap()).is_err());
    log.flush().unwrap();
    let bytes = out.0.lock().unwrap().clone();
    let events = read_events(&bytes[..]).unwrap();
    assert_eq!(events.len(), 4 * 500 + 1);
    let failure = events.last().unwrap();
    assert_eq!(failure.action, Action::AllocateFailure);
    assert_eq!((failure.pointer, failure.size), (None, 1 << 50));
    assert_eq!(failure.stream, LoggedStream::Cuda(0));
    // Every event the threads made appears exactly once.
    let mut expected: HashMap<(Action, usize, usize, u32), usize> = HashMap::new();
    for e in seen.into_inner().unwrap() {
        *expected.entry(e).or_default() += 1;
    }
    let mut logged: HashMap<(Action, usize, usize, u32), usize> = HashMap::new();
    for e in &events[..events.len() - 1] {
        let stream = match e.stream {
            LoggedStream::Host(id) => id,
            LoggedStream::Cuda(0) => 0,
            other => panic!("unexpected stream {other:?}"),
        };
        *logged
            .entry((e.action, e.pointer.unwrap(), e.size, stream))
            .or_default() += 1;
    }
    assert_eq!(logged, expected);
    // Four threads, four OS thread ids (plus the main thread's failure).
    let threads: std::collections::HashSet<u64> = events.iter().map(|e| e.thread).collect();
    assert_eq!(threads.len(), 5);
}

#[test]
fn a_log_written_by_rapids_rmm_parses() {
    // Embedded, so the test binary runs anywhere (the GPU bundle has no source tree).
    let sample = include_str!("data/rmm-log-sample.csv");
    let events = read_events(sample.as_bytes()).unwrap();
    assert_eq!(events.len(), 361);
    let first = &events[0];
    assert_eq!(first.thread, 576);
    assert_eq!(first.micros, ((4 * 60 + 2) * 60) * 1_000_000 + 760_754);
    assert_eq!(first.pointer, Some(0x7ff490004d00));
    assert_eq!(first.size, 8639);
    assert_eq!(first.stream, LoggedStream::Cuda(0x7ff484000ca0));
    let threads: std::collections::HashSet<u64> = events.iter().map(|e| e.thread).collect();
    assert_eq!(threads.len(), 4, "three workers and the main thread");
    let failures: Vec<_> = events
        .iter()
        .filter(|e| e.action == Action::AllocateFailure)
        .collect();
    assert_eq!(failures.len(), 1);
    assert_eq!(failures[0].size, 1 << 50);
    // Every free matches an earlier allocation of the same size.
    let mut live = HashMap::new();
    for e in &events {
        match e.action {
            Action::Allocate => assert!(live.insert(e.pointer, e.size).is_none()),
            Action::Free => assert_eq!(live.remove(&e.pointer), Some(e.size)),
            Action::AllocateFailure => {}
            other => panic!("this log has no {other:?}"),
        }
    }
    assert!(live.is_empty());
}

#[test]
fn bad_logs_are_errors_naming_the_line() {
    let no_header = "576,04:02:00.760754,allocate,0x10,1,0\n";
    assert!(matches!(
        read_events(no_header.as_bytes()),
        Err(Error::InvalidArgument(_))
    ));
    let bad = "Thread,Time,Action,Pointer,Size,Stream\n1,00:00:00.000001,allocate,0x10,1,0\n1,xx,free,0x10,1,0\n";
    for row in [
        "1,99999999999999:00:00.000001,free,0x10,1,0",
        "1,00:00:00:00.000001,free,0x10,1,0",
        "1,00:00:00.000001,free,(nil),1,0",
        "1,00:00:00.000001,allocate failure,0x10,1,0",
        "1,00:00:00.000001,allocate,0x10,1,0x2,extra",
    ] {
        let log = format!("Thread,Time,Action,Pointer,Size,Stream\n{row}\n");
        assert!(
            matches!(read_events(log.as_bytes()), Err(Error::InvalidArgument(_))),
            "{row}"
        );
    }
    match read_events(bad.as_bytes()) {
        Err(Error::InvalidArgument(m)) => {
            assert!(m.contains("line 3") && m.contains("time"), "{m}")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn sinks_a_file_or_the_environment() {
    let dir = std::env::temp_dir().join(format!("memres-logging-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("log.csv");
    std::fs::write(&path, "old contents to be truncated\n").unwrap();
    {
        let log = Logging::to_file(HostHeap::new(), &path)
            .unwrap()
            .auto_flush(true);
        let l = layout(64).unwrap();
        let p = log.allocate_sync(l).unwrap();
        // Auto-flush: the row is in the file already.
        assert_eq!(read_events_from_path(&path).unwrap().len(), 1);
        // SAFETY: allocated above with `l`.
        unsafe { log.deallocate_sync(p, l) };
    }
    assert_eq!(read_events_from_path(&path).unwrap().len(), 2);
    // The environment variable: its absence is an error naming it. (Only read here; no
    // test in this binary sets it.)
    match Logging::from_env(HostHeap::new()) {
        Err(Error::InvalidArgument(m)) => assert!(m.contains("MEMRES_LOG_FILE"), "{m}"),
        Ok(_) => assert!(std::env::var_os("MEMRES_LOG_FILE").is_some()),
        Err(e) => panic!("{e}"),
    }
    let missing = dir.join("no/such/dir/log.csv");
    assert!(matches!(
        Logging::to_file(HostHeap::new(), &missing),
        Err(Error::InvalidArgument(_))
    ));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn nothing_is_lost_at_drop() {
    let out = Captured::default();
    {
        let log = Logging::to_writer(HostHeap::new(), out.clone()).unwrap();
        let l = layout(8).unwrap();
        for _ in 0..1000 {
            let p = log.allocate_sync(l).unwrap();
            // SAFETY: allocated just above with `l`.
            unsafe { log.deallocate_sync(p, l) };
        }
    }
    let bytes = out.0.lock().unwrap().clone();
    assert_eq!(read_events(&bytes[..]).unwrap().len(), 2000);
}

#[test]
fn rows_match_rmm_format() {
    let out = Captured::default();
    let log = Logging::to_writer(HostHeap::new(), out.clone()).unwrap();
    let l = layout(4123).unwrap();
    let p = log.allocate_sync(l).unwrap();
    // SAFETY: allocated above.
    unsafe { log.deallocate_sync(p, l) };
    log.flush().unwrap();
    let text = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some("Thread,Time,Action,Pointer,Size,Stream"));
    let row: Vec<&str> = lines.next().unwrap().split(',').collect();
    assert!(row[0].parse::<u64>().is_ok(), "{row:?}");
    assert_eq!(row[1].len(), "04:02:00.760754".len(), "{row:?}");
    assert_eq!(row[2], "allocate");
    assert_eq!(row[3], format!("{:#x}", p.as_ptr() as usize));
    assert_eq!((row[4], row[5]), ("4123", "0"));
}

#[test]
fn every_field_is_written_as_rmm_writes_it() {
    let out = Captured::default();
    let log = Logging::to_writer(HostHeap::new(), out.clone()).unwrap();
    let l = layout(300).unwrap();
    // A CUDA stream handle (the per-thread stream, 0x2): HostHeap ignores it.
    let p = log.allocate(StreamRef::PER_THREAD, l).unwrap();
    // SAFETY: allocated above.
    unsafe { log.deallocate(StreamRef::PER_THREAD, p, l) };
    assert!(log.allocate_sync(layout(1 << 50).unwrap()).is_err());
    log.flush().unwrap();
    let text = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
    let rows: Vec<Vec<&str>> = text
        .lines()
        .skip(1)
        .map(|r| r.split(',').collect())
        .collect();
    let is_time = |t: &str| {
        let b = t.as_bytes();
        b.len() == 15
            && b[2] == b':'
            && b[5] == b':'
            && b[8] == b'.'
            && t.chars().filter(|c| c.is_ascii_digit()).count() == 12
    };
    let pointer = format!("{:#x}", p.as_ptr() as usize);
    assert_eq!(rows.len(), 3);
    for (row, (action, ptr, size, stream)) in rows.iter().zip([
        ("allocate", pointer.as_str(), "300", "0x2"),
        ("free", pointer.as_str(), "300", "0x2"),
        ("allocate failure", "(nil)", "1125899906842624", "0"),
    ]) {
        assert!(row[0].parse::<u64>().is_ok(), "{row:?}");
        assert!(is_time(row[1]), "{row:?}");
        assert_eq!(&row[2..], [action, ptr, size, stream], "{row:?}");
    }
}

mod reader_fuzz {
    //! The reader answers every input with events or an error, never a panic (the CI
    //! twin of `fuzz/fuzz_targets/read_events.rs`).

    use memres::log::{HEADER, read_events};
    use proptest::prelude::*;

    /// A row with fields drawn from plausible and broken values.
    fn row() -> impl Strategy<Value = String> {
        let field = prop_oneof![
            Just(String::new()),
            "[0-9]{1,25}",
            "0x[0-9a-fA-Fz]{0,18}",
            Just("(nil)".to_owned()),
            Just("allocate".to_owned()),
            Just("free".to_owned()),
            Just("allocate failure".to_owned()),
            "[0-9]{1,3}:[0-9]{1,3}:[0-9]{1,3}\\.[0-9]{0,12}",
            "host:[0-9a-z]{0,12}",
            "[^,\n]{0,12}",
        ];
        prop::collection::vec(field, 0..9).prop_map(|f| f.join(","))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn the_reader_never_panics_on_rows(rows in prop::collection::vec(row(), 0..6)) {
            let text = format!("{HEADER}\n{}\n", rows.join("\n"));
            if let Ok(events) = read_events(text.as_bytes()) {
                prop_assert!(events.iter().all(|e| e.line >= 2));
            }
        }

        #[test]
        fn the_reader_never_panics_on_bytes(bytes in prop::collection::vec(any::<u8>(), 0..300)) {
            let _ = read_events(&bytes[..]);
            let mut with_header = HEADER.as_bytes().to_vec();
            with_header.push(b'\n');
            with_header.extend_from_slice(&bytes);
            let _ = read_events(&with_header[..]);
        }
    }
}

/// Microseconds since midnight UTC, as the log's rows give times.
fn micros_of_day() -> u64 {
    let since_epoch = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    (since_epoch.as_micros() % (86_400 * 1_000_000)) as u64
}

/// A thread reuses its clock reading for a burst of events, but an event after a pause
/// longer than the writer lanes' nap carries its own time: the lanes woke meanwhile.
#[test]
fn an_event_after_a_pause_carries_its_own_time() {
    let out = Captured::default();
    let log = Logging::to_writer(HostHeap::new(), out.clone()).unwrap();
    let l = layout(256).unwrap();
    // Two events: the reading they carry could stamp six more.
    let p = log.allocate_sync(l).unwrap();
    // SAFETY: allocated above with `l`.
    unsafe { log.deallocate_sync(p, l) };
    // Idle lanes nap at most a millisecond.
    std::thread::sleep(std::time::Duration::from_millis(20));
    let before = micros_of_day();
    let p = log.allocate_sync(l).unwrap();
    let after = micros_of_day();
    // SAFETY: allocated above with `l`.
    unsafe { log.deallocate_sync(p, l) };
    log.flush().unwrap();
    let events = read_events(&out.0.lock().unwrap()[..]).unwrap();
    let last_allocation = &events[events.len() - 2];
    assert_eq!(last_allocation.action, Action::Allocate);
    // The counter's conversion to wall time is good to a few microseconds; a reading
    // from before the pause would be 20 ms early. (Midnight between the readings would
    // wrap them: skipped.)
    if after >= before {
        let t = last_allocation.micros;
        assert!(
            t + 200 >= before && t <= after + 200,
            "stamped {t}, called between {before} and {after}"
        );
    }
}
