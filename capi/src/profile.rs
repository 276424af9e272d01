//! The scope profiler behind the C ABI: scopes opened and closed by id (C cannot hold a
//! Rust guard), and the report as text.

use std::cell::RefCell;
use std::ffi::{CStr, c_char, c_int};
use std::sync::atomic::{AtomicI64, Ordering};

use mr::profile::{self, Scope};

use crate::{Failure, MEMRES_OK, guarded};

thread_local! {
    /// The scopes this thread opened through the C ABI, by id.
    static SCOPES: RefCell<Vec<(i64, Scope)>> = const { RefCell::new(Vec::new()) };
}

/// The next scope id (ids are positive; negative returns are failure codes).
static NEXT_ID: AtomicI64 = AtomicI64::new(1);

/// Opens a profiler scope named `name`: counting the calling thread's allocations, or
/// every thread's when `all_threads` is non-zero. Returns its id (positive), to close it
/// with `memres_profile_pop` on the same thread, or a negative failure code.
///
/// # Safety
/// `name` is null or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memres_profile_push(name: *const c_char, all_threads: c_int) -> i64 {
    guarded(
        |code| code.into(),
        || {
            if name.is_null() {
                return Err(Failure::invalid("memres_profile_push: the name is null"));
            }
            // SAFETY: non-null and NUL-terminated (the caller's promise).
            let name = unsafe { CStr::from_ptr(name) }
                .to_string_lossy()
                .into_owned();
            let scope = if all_threads != 0 {
                profile::scope_all_threads(name)
            } else {
                profile::scope(name)
            };
            let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
            SCOPES
                .try_with(|scopes| scopes.borrow_mut().push((id, scope)))
                .map_err(|_| Failure::invalid("memres_profile_push: the thread is exiting"))?;
            Ok(id)
        },
    )
}

/// Closes the scope `id` (opened on this thread), adding its figures to its name's
/// record.
#[unsafe(no_mangle)]
pub extern "C" fn memres_profile_pop(id: i64) -> c_int {
    guarded(
        |code| code,
        || {
            let scope = SCOPES
                .try_with(|scopes| {
                    let mut scopes = scopes.borrow_mut();
                    let i = scopes.iter().rposition(|(open, _)| *open == id)?;
                    Some(scopes.remove(i).1)
                })
                .ok()
                .flatten()
                .ok_or_else(|| {
                    Failure::invalid(format!(
                        "memres_profile_pop: no scope {id} is open on this thread"
                    ))
                })?;
            // Dropped outside the borrow: closing records it.
            drop(scope);
            Ok(MEMRES_OK)
        },
    )
}

/// Writes the profiler's report into `buf` (at most `len` bytes, NUL included) and returns
/// the length of the whole report, without its NUL: call again with a larger buffer when
/// that is `len` or more. One line per name, highest peak first: the name (with `\`, tab
/// and newline written `\\`, `\t`, `\n`), then calls, allocations, bytes, peak bytes and
/// retained bytes, separated by tabs.
///
/// # Safety
/// `buf` is null (with `len` 0) or valid for writing `len` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memres_profile_report(buf: *mut c_char, len: usize) -> isize {
    guarded(
        |code| code as isize,
        || {
            if buf.is_null() && len != 0 {
                return Err(Failure::invalid("memres_profile_report: `buf` is null"));
            }
            let text = report_text(&profile::report());
            if len > 0 {
                let n = text.len().min(len - 1);
                // SAFETY: `buf` is valid for `len` bytes (the caller's promise) and
                // `n + 1 <= len`; `text` is a separate allocation.
                unsafe {
                    std::ptr::copy_nonoverlapping(text.as_ptr(), buf.cast::<u8>(), n);
                    buf.add(n).write(0);
                }
            }
            // A `String`'s length is at most `isize::MAX`.
            Ok(text.len() as isize)
        },
    )
}

/// Forgets every profiler record (open scopes are recorded when they close).
#[unsafe(no_mangle)]
pub extern "C" fn memres_profile_reset() {
    guarded(
        |_| (),
        || {
            profile::reset();
            Ok(())
        },
    )
}

/// The report as `memres_profile_report` writes it.
pub(crate) fn report_text(report: &profile::Report) -> String {
    let mut out = String::new();
    for r in report.records() {
        for c in r.name.chars() {
            match c {
                '\\' => out.push_str("\\\\"),
                '\t' => out.push_str("\\t"),
                '\n' => out.push_str("\\n"),
                c => out.push(c),
            }
        }
        out.push_str(&format!(
            "\t{}\t{}\t{}\t{}\t{}\n",
            r.calls, r.allocations, r.bytes, r.peak_bytes, r.retained_bytes
        ));
    }
    out
}
