//! The memory-event log format shared with RAPIDS RMM, and its reader.
//!
//! A log is CSV with the header `Thread,Time,Action,Pointer,Size,Stream` and one row per
//! event, as RMM's `logging_resource_adaptor` writes it and memres's
//! [`Logging`](crate::adaptor::Logging) adaptor too:
//!
//! | column | meaning | example |
//! | --- | --- | --- |
//! | Thread | the OS thread id, decimal | `576` |
//! | Time | wall clock, `HH:MM:SS.ffffff` (memres writes UTC) | `04:02:00.760754` |
//! | Action | `allocate`, `free` or `allocate failure` | `allocate` |
//! | Pointer | hex address, `(nil)` for a failure | `0x7ff490004d00` |
//! | Size | bytes | `8639` |
//! | Stream | hex CUDA stream handle, `0` for the default stream; memres writes host streams as `host:N` | `0x7ff484000ca0` |
//!
//! ```
//! let log = "Thread,Time,Action,Pointer,Size,Stream\n\
//!            576,04:02:00.760754,allocate,0x7ff490004d00,8639,0x7ff484000ca0\n\
//!            569,04:02:00.763390,allocate failure,(nil),1125899906842624,0\n";
//! let events = memres::log::read_events(log.as_bytes())?;
//! assert_eq!(events.len(), 2);
//! assert_eq!(events[0].pointer, Some(0x7ff490004d00));
//! assert_eq!(events[1].action, memres::log::Action::AllocateFailure);
//! # Ok::<(), memres::Error>(())
//! ```

use std::io::{BufRead, Read};

use crate::error::Error;

/// The header line of a log.
pub const HEADER: &str = "Thread,Time,Action,Pointer,Size,Stream";

/// What happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Action {
    /// A successful allocation.
    Allocate,
    /// A free.
    Free,
    /// An allocation that failed.
    AllocateFailure,
}

impl Action {
    /// The word the log uses.
    pub const fn as_str(self) -> &'static str {
        match self {
            Action::Allocate => "allocate",
            Action::Free => "free",
            Action::AllocateFailure => "allocate failure",
        }
    }
}

/// The stream of an event, as the log names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LoggedStream {
    /// A CUDA stream handle (0 is the legacy default stream).
    Cuda(usize),
    /// A memres host stream.
    Host(u32),
}

/// One row of a log.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Event {
    /// The OS thread id.
    pub thread: u64,
    /// Microseconds since midnight (wall clock).
    pub micros: u64,
    /// What happened.
    pub action: Action,
    /// The address; `None` for a failure.
    pub pointer: Option<usize>,
    /// Bytes.
    pub size: usize,
    /// The stream.
    pub stream: LoggedStream,
    /// The 1-based line of the log it was read from.
    pub line: usize,
}

/// The longest line a log may have: 1 MiB (an event's row is under 100 bytes; a longer
/// one is not a log, and is not read into memory whole).
pub const MAX_LINE: usize = 1 << 20;

fn bad(line: usize, what: &str, text: &str) -> Error {
    Error::invalid_argument(format!("log line {line}: {what}: {}", quoted(text)))
}

/// `text` quoted, cut to its first 100 characters with its size where longer: an error
/// names what it read without echoing a whole line of junk.
fn quoted(text: &str) -> String {
    const MOST: usize = 100;
    match text.char_indices().nth(MOST) {
        Some((cut, _)) => format!("{:?}... ({} bytes in all)", &text[..cut], text.len()),
        None => format!("{text:?}"),
    }
}

fn hex(field: &str) -> Option<usize> {
    let digits = field.strip_prefix("0x").unwrap_or(field);
    usize::from_str_radix(digits, 16).ok()
}

/// Parses `HH:MM:SS.ffffff` into microseconds since midnight.
fn time(field: &str) -> Option<u64> {
    let (hms, frac) = field.split_once('.')?;
    let mut parts = hms.split(':').map(|p| p.parse::<u64>().ok());
    let (h, m, s) = (parts.next()??, parts.next()??, parts.next()??);
    if parts.next().is_some() || h >= 24 || m >= 60 || s >= 61 || frac.len() > 9 {
        return None;
    }
    let frac: u64 = format!("{frac:0<6}").get(..6)?.parse().ok()?;
    Some(((h * 60 + m) * 60 + s) * 1_000_000 + frac)
}

/// Parses one data row (`line` is its 1-based line number, for messages).
pub fn parse_event(row: &str, line: usize) -> Result<Event, Error> {
    let fields: Vec<&str> = row.trim_end_matches(['\r', '\n']).split(',').collect();
    let [thread, t, action, pointer, size, stream] = fields[..] else {
        return Err(bad(line, "expected 6 comma-separated fields", row));
    };
    let action = match action {
        "allocate" => Action::Allocate,
        "free" => Action::Free,
        "allocate failure" => Action::AllocateFailure,
        other => return Err(bad(line, "unknown action", other)),
    };
    let pointer = match (pointer, action) {
        ("(nil)" | "0x0" | "0", Action::AllocateFailure) => None,
        (p, Action::AllocateFailure) => return Err(bad(line, "a failure with a pointer", p)),
        (p, _) => match hex(p) {
            Some(0) | None => return Err(bad(line, "bad pointer", p)),
            some => some,
        },
    };
    let stream = match stream.strip_prefix("host:") {
        Some(id) => LoggedStream::Host(id.parse().map_err(|_| bad(line, "bad stream", stream))?),
        None => LoggedStream::Cuda(hex(stream).ok_or_else(|| bad(line, "bad stream", stream))?),
    };
    Ok(Event {
        thread: thread
            .parse()
            .map_err(|_| bad(line, "bad thread id", thread))?,
        micros: time(t).ok_or_else(|| bad(line, "bad time", t))?,
        action,
        pointer,
        size: size.parse().map_err(|_| bad(line, "bad size", size))?,
        stream,
        line,
    })
}

/// Reads a whole log (RMM's or memres's): the header, then one event per line; blank
/// lines are skipped. A malformed line, or one longer than [`MAX_LINE`], is
/// [`Error::InvalidArgument`] naming the line.
pub fn read_events(mut reader: impl BufRead) -> Result<Vec<Event>, Error> {
    let mut events = Vec::new();
    let mut buf = Vec::new();
    let mut number = 0;
    loop {
        buf.clear();
        // At most one byte past the limit: a line without end is never read whole.
        let read = (&mut reader)
            .take(MAX_LINE as u64 + 1)
            .read_until(b'\n', &mut buf)
            .map_err(|e| Error::invalid_argument(format!("reading the log: {e}")))?;
        if read == 0 {
            break;
        }
        number += 1;
        if buf.last() == Some(&b'\n') {
            buf.pop();
            if buf.last() == Some(&b'\r') {
                buf.pop();
            }
        } else if read > MAX_LINE {
            return Err(Error::invalid_argument(format!(
                "log line {number}: longer than {} MiB: a log is CSV with the header \
                 {HEADER:?}, one short row per event",
                MAX_LINE >> 20
            )));
        }
        let line = std::str::from_utf8(&buf).map_err(|_| {
            Error::invalid_argument(format!(
                "log line {number}: not UTF-8 text: a log is CSV with the header {HEADER:?}"
            ))
        })?;
        if number == 1 {
            if line.trim_end() != HEADER {
                return Err(bad(1, "expected the header", line));
            }
            continue;
        }
        if line.trim().is_empty() {
            continue;
        }
        events.push(parse_event(line, number)?);
    }
    if number == 0 {
        return Err(Error::invalid_argument(format!(
            "the log is empty: expected the header {HEADER:?} on line 1"
        )));
    }
    Ok(events)
}

/// [`read_events`] from a file.
pub fn read_events_from_path(path: impl AsRef<std::path::Path>) -> Result<Vec<Event>, Error> {
    let path = path.as_ref();
    let file = std::fs::File::open(path).map_err(|e| {
        Error::invalid_argument(format!("cannot open the log {}: {e}", path.display()))
    })?;
    read_events(std::io::BufReader::new(file))
}
