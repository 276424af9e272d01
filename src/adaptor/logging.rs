//! [`Logging`]: a CSV log of every allocation and free, readable by RMM's tools and ours.

use std::alloc::Layout;
use std::cell::RefCell;
use std::fmt;
use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::Path;
use std::ptr::NonNull;
use std::time::{SystemTime, UNIX_EPOCH};

use super::{eq_by_upstream, upstream_access};
use crate::error::Error;
use crate::log::{Action, HEADER};
use crate::resource::{Resource, SyncResource};
use crate::stream::StreamRef;
use crate::sync::Mutex;

/// The environment variable [`Logging::from_env`] reads the log's path from.
pub const LOG_FILE_VARIABLE: &str = "MEMRES_LOG_FILE";

/// Writes one CSV row per allocation, free and failed allocation (RMM's
/// `logging_resource_adaptor`, same format: see [`crate::log`]).
///
/// - Frees are logged before the upstream free (so the row exists even if the free
///   crashes); failures are logged and returned.
/// - Each row is formatted on the calling thread into a reusable per-thread buffer, and
///   only the finished bytes are copied into the shared writer under a short lock. Rows
///   are not batched per thread on purpose: the file order is then a real order of
///   events (an allocation's row precedes any reuse of its address by another thread,
///   since a free is logged before the upstream free), which a replay relies on.
/// - Nothing is lost: every row is in the writer's buffer when the call returns;
///   [`flush`](Self::flush), auto-flush, and drop (the buffer flushes itself; an error
///   there cannot be reported — call `flush` to see it) write it out.
/// - Times are UTC wall clock (`HH:MM:SS.ffffff`); threads are OS thread ids.
///
/// ```
/// use memres::adaptor::Logging;
/// use memres::{HostHeap, SyncResource, layout};
///
/// let path = std::env::temp_dir().join("memres-doc-example.csv");
/// let logged = Logging::to_file(HostHeap::new(), &path)?;
/// let l = layout(100)?;
/// let p = logged.allocate_sync(l)?;
/// // SAFETY: allocated above with `l`.
/// unsafe { logged.deallocate_sync(p, l) };
/// logged.flush()?;
/// let events = memres::log::read_events_from_path(&path)?;
/// assert_eq!(events.len(), 2);
/// # std::fs::remove_file(&path).ok();
/// # Ok::<(), memres::Error>(())
/// ```
pub struct Logging<U> {
    upstream: U,
    sink: Mutex<BufWriter<Box<dyn Write + Send>>>,
    auto_flush: bool,
}

upstream_access!(Logging<U>);

impl<U> Logging<U> {
    /// Logs to `writer`, writing the header first.
    pub fn to_writer(upstream: U, writer: impl Write + Send + 'static) -> Result<Self, Error> {
        // A large buffer: one write call per ~16,000 rows keeps system calls out of the
        // per-event cost.
        let mut sink: BufWriter<Box<dyn Write + Send>> =
            BufWriter::with_capacity(1 << 20, Box::new(writer));
        writeln!(sink, "{HEADER}").map_err(io_error)?;
        Ok(Logging {
            upstream,
            sink: Mutex::new(sink),
            auto_flush: false,
        })
    }

    /// Logs to the file at `path`, created or truncated.
    pub fn to_file(upstream: U, path: impl AsRef<Path>) -> Result<Self, Error> {
        let path = path.as_ref();
        let file = File::create(path).map_err(|e| {
            Error::invalid_argument(format!("cannot create the log {}: {e}", path.display()))
        })?;
        Logging::to_writer(upstream, file)
    }

    /// Logs to the file named by the environment variable `MEMRES_LOG_FILE`; its absence is
    /// [`Error::InvalidArgument`] naming the variable.
    pub fn from_env(upstream: U) -> Result<Self, Error> {
        match std::env::var_os(LOG_FILE_VARIABLE) {
            Some(path) => Logging::to_file(upstream, path),
            None => Err(Error::invalid_argument(format!(
                "no log file given and {LOG_FILE_VARIABLE} is not set"
            ))),
        }
    }

    /// Flushes after every row when `on` (slow; for logs that must survive a crash).
    pub fn auto_flush(mut self, on: bool) -> Self {
        self.auto_flush = on;
        self
    }

    /// Writes everything logged so far out to the sink.
    pub fn flush(&self) -> Result<(), Error> {
        self.sink().flush().map_err(io_error)
    }

    fn sink(&self) -> crate::sync::MutexGuard<'_, BufWriter<Box<dyn Write + Send>>> {
        // A panic while writing leaves at worst a partial row; keep logging.
        self.sink
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn log(
        &self,
        action: Action,
        pointer: Option<NonNull<u8>>,
        size: usize,
        stream: StreamRef<'_>,
    ) {
        let write = |row: &mut Vec<u8>| {
            row.clear();
            format_row(row, action, pointer, size, stream);
            let mut sink = self.sink();
            let written = sink.write_all(row);
            let flushed = if self.auto_flush {
                sink.flush()
            } else {
                Ok(())
            };
            if let Err(e) = written.and(flushed) {
                tracing::error!(%e, "memres::Logging: cannot write the log");
            }
        };
        // During thread exit the thread-local buffer may be gone (a thread-local cache
        // freeing into this log): use a fresh buffer then, never panic inside a free.
        if ROW.try_with(|row| write(&mut row.borrow_mut())).is_err() {
            write(&mut Vec::new());
        }
    }
}

thread_local! {
    /// Each thread formats its rows here, outside the lock.
    static ROW: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
    /// The OS thread id, looked up once per thread.
    static THREAD: u64 = os_thread_id();
}

#[cfg(target_os = "linux")]
fn os_thread_id() -> u64 {
    unsafe extern "C" {
        fn gettid() -> i32;
    }
    // SAFETY: `gettid` (glibc 2.30 and later) has no preconditions and cannot fail.
    (unsafe { gettid() }) as u64
}

#[cfg(not(target_os = "linux"))]
fn os_thread_id() -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    std::thread::current().id().hash(&mut h);
    h.finish()
}

/// Formats one row by hand (no `fmt` machinery: this runs for every event).
fn format_row(
    row: &mut Vec<u8>,
    action: Action,
    pointer: Option<NonNull<u8>>,
    size: usize,
    stream: StreamRef<'_>,
) {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let secs = now.as_secs() % 86_400;
    push_decimal(row, THREAD.with(|t| *t));
    row.push(b',');
    push_fixed(row, secs / 3600, 2);
    row.push(b':');
    push_fixed(row, secs / 60 % 60, 2);
    row.push(b':');
    push_fixed(row, secs % 60, 2);
    row.push(b'.');
    push_fixed(row, u64::from(now.subsec_micros()), 6);
    row.push(b',');
    row.extend_from_slice(action.as_str().as_bytes());
    row.push(b',');
    match pointer {
        Some(p) => push_hex(row, p.as_ptr() as usize),
        None => row.extend_from_slice(b"(nil)"),
    }
    row.push(b',');
    push_decimal(row, size as u64);
    row.push(b',');
    match stream.as_raw() {
        Some(raw) if raw.is_null() => row.push(b'0'),
        Some(raw) => push_hex(row, raw as usize),
        None => {
            row.extend_from_slice(b"host:");
            push_decimal(row, u64::from(stream.host_id().unwrap_or(0)));
        }
    }
    row.push(b'\n');
}

fn push_decimal(row: &mut Vec<u8>, mut n: u64) {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    row.extend_from_slice(&digits[i..]);
}

/// `n` in exactly `width` decimal digits, zero-padded (`n` has at most `width` digits).
fn push_fixed(row: &mut Vec<u8>, mut n: u64, width: usize) {
    let start = row.len();
    row.resize(start + width, b'0');
    for slot in row[start..].iter_mut().rev() {
        *slot = b'0' + (n % 10) as u8;
        n /= 10;
    }
}

/// `0x` and lowercase hex digits, as `{:#x}` writes them.
fn push_hex(row: &mut Vec<u8>, mut n: usize) {
    let mut digits = [0u8; 16];
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = b"0123456789abcdef"[n % 16];
        n /= 16;
        if n == 0 {
            break;
        }
    }
    row.extend_from_slice(b"0x");
    row.extend_from_slice(&digits[i..]);
}

fn io_error(e: io::Error) -> Error {
    Error::invalid_argument(format!("cannot write the log: {e}"))
}

eq_by_upstream!(Logging<U>);

impl<U: fmt::Debug> fmt::Debug for Logging<U> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Logging")
            .field("upstream", &self.upstream)
            .finish_non_exhaustive()
    }
}

// SAFETY: every block comes from the upstream unchanged; logging never touches memory.
unsafe impl<U: SyncResource> SyncResource for Logging<U> {
    type Properties = U::Properties;

    fn allocate_sync(&self, layout: Layout) -> Result<NonNull<u8>, Error> {
        let result = self.upstream.allocate_sync(layout);
        self.log_allocation(&result, layout, StreamRef::DEFAULT);
        result
    }

    unsafe fn deallocate_sync(&self, ptr: NonNull<u8>, layout: Layout) {
        self.log(Action::Free, Some(ptr), layout.size(), StreamRef::DEFAULT);
        // SAFETY: the caller's promise, for the upstream that allocated the block.
        unsafe { self.upstream.deallocate_sync(ptr, layout) }
    }
}

impl<U> Logging<U> {
    fn log_allocation(
        &self,
        result: &Result<NonNull<u8>, Error>,
        layout: Layout,
        stream: StreamRef<'_>,
    ) {
        match result {
            Ok(p) => self.log(Action::Allocate, Some(*p), layout.size(), stream),
            Err(_) => self.log(Action::AllocateFailure, None, layout.size(), stream),
        }
    }
}

// SAFETY: as for `SyncResource`.
unsafe impl<U: Resource> Resource for Logging<U> {
    fn allocate(&self, stream: StreamRef<'_>, layout: Layout) -> Result<NonNull<u8>, Error> {
        let result = self.upstream.allocate(stream, layout);
        self.log_allocation(&result, layout, stream);
        result
    }

    unsafe fn deallocate(&self, stream: StreamRef<'_>, ptr: NonNull<u8>, layout: Layout) {
        self.log(Action::Free, Some(ptr), layout.size(), stream);
        // SAFETY: the caller's promise, for the upstream that allocated the block.
        unsafe { self.upstream.deallocate(stream, ptr, layout) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hand_formatting_matches_std() {
        for n in [0u64, 7, 10, 99, 12345, u64::MAX] {
            let mut v = Vec::new();
            push_decimal(&mut v, n);
            assert_eq!(String::from_utf8(v).unwrap(), n.to_string());
        }
        for n in [0usize, 1, 0xf, 0x10, 0x7ff490004d00, usize::MAX] {
            let mut v = Vec::new();
            push_hex(&mut v, n);
            assert_eq!(String::from_utf8(v).unwrap(), format!("{n:#x}"));
        }
        for (n, w) in [(0u64, 2), (5, 2), (59, 2), (760754, 6), (42, 6)] {
            let mut v = Vec::new();
            push_fixed(&mut v, n, w);
            assert_eq!(String::from_utf8(v).unwrap(), format!("{n:0w$}"));
        }
    }
}
