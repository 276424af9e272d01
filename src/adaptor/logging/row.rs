//! One CSV row of the log, formatted by hand (no `fmt` machinery: the writer thread
//! formats every event).

use super::ring::Record;
use crate::log::Action;

/// The action byte of a [`Record`].
pub(super) fn action_code(action: Action) -> u8 {
    match action {
        Action::Allocate => 0,
        Action::Free => 1,
        Action::AllocateFailure => 2,
    }
}

fn action_word(code: u8) -> &'static [u8] {
    match code {
        0 => Action::Allocate.as_str().as_bytes(),
        1 => Action::Free.as_str().as_bytes(),
        _ => Action::AllocateFailure.as_str().as_bytes(),
    }
}

/// Appends `record` as a row: `Thread,Time,Action,Pointer,Size,Stream` as RMM writes
/// them (time UTC `HH:MM:SS.ffffff`, pointer `0x…` or `(nil)`, stream hex or `0`; host
/// streams as `host:N`).
pub(super) fn format_row(row: &mut Vec<u8>, r: &Record) {
    let secs = r.time_ns / 1_000_000_000 % 86_400;
    let micros = r.time_ns / 1_000 % 1_000_000;
    push_decimal(row, r.thread);
    row.push(b',');
    push_fixed(row, secs / 3600, 2);
    row.push(b':');
    push_fixed(row, secs / 60 % 60, 2);
    row.push(b':');
    push_fixed(row, secs % 60, 2);
    row.push(b'.');
    push_fixed(row, micros, 6);
    row.push(b',');
    row.extend_from_slice(action_word(r.action));
    row.push(b',');
    match r.pointer {
        0 => row.extend_from_slice(b"(nil)"),
        p => push_hex(row, p as u64),
    }
    row.push(b',');
    push_decimal(row, r.size as u64);
    row.push(b',');
    if r.host {
        row.extend_from_slice(b"host:");
        push_decimal(row, r.stream);
    } else if r.stream == 0 {
        row.push(b'0');
    } else {
        push_hex(row, r.stream);
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
fn push_hex(row: &mut Vec<u8>, mut n: u64) {
    let mut digits = [0u8; 16];
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = b"0123456789abcdef"[(n % 16) as usize];
        n /= 16;
        if n == 0 {
            break;
        }
    }
    row.extend_from_slice(b"0x");
    row.extend_from_slice(&digits[i..]);
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
        for n in [0u64, 1, 0xf, 0x10, 0x7ff490004d00, u64::MAX] {
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

    #[test]
    fn a_row_as_rmm_writes_it() {
        let mut row = Vec::new();
        let r = Record {
            // 1970-01-02 03:04:05.678901 UTC
            time_ns: ((24 + 3) * 3600 + 4 * 60 + 5) * 1_000_000_000 + 678_901_234,
            thread: 4242,
            action: action_code(Action::Free),
            pointer: 0x7f00_dead_be00,
            size: 1000,
            stream: 0x55aa,
            host: false,
        };
        format_row(&mut row, &r);
        format_row(
            &mut row,
            &Record {
                action: action_code(Action::AllocateFailure),
                pointer: 0,
                stream: 0,
                ..r
            },
        );
        format_row(
            &mut row,
            &Record {
                host: true,
                stream: 3,
                ..r
            },
        );
        assert_eq!(
            String::from_utf8(row).unwrap(),
            "4242,03:04:05.678901,free,0x7f00deadbe00,1000,0x55aa\n\
             4242,03:04:05.678901,allocate failure,(nil),1000,0\n\
             4242,03:04:05.678901,free,0x7f00deadbe00,1000,host:3\n"
        );
    }
}
