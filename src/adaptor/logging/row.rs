//! One CSV row of the log, formatted by hand (no `fmt` machinery: the writer thread
//! formats every event, and must keep up with the threads that log).

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

/// The longest row: a 20-digit thread id, the time (15), `allocate failure` (16), an
/// 18-character pointer, a 20-digit size, `host:` and 10 digits or an 18-character
/// stream, five commas and the newline.
const MAX_ROW: usize = 20 + 15 + 16 + 18 + 20 + 18 + 6;

/// Formats rows, keeping what repeats from row to row (the thread id's digits, the
/// `HH:MM:SS` of the current second) so that most rows cost a few dozen stores.
#[derive(Default)]
pub(super) struct RowFormat {
    thread: Option<u64>,
    thread_text: Text<20>,
    second: Option<u64>,
    hms: Text<9>,
}

/// A short text kept from row to row.
#[derive(Clone, Copy)]
struct Text<const N: usize> {
    bytes: [u8; N],
    len: usize,
}

impl<const N: usize> Default for Text<N> {
    fn default() -> Self {
        Text {
            bytes: [0; N],
            len: 0,
        }
    }
}

impl<const N: usize> Text<N> {
    fn as_slice(&self) -> &[u8] {
        &self.bytes[..self.len]
    }

    /// Replaces the text with what `f` writes.
    fn set(&mut self, f: impl FnOnce(&mut Cursor<'_>)) {
        let mut c = Cursor {
            bytes: &mut self.bytes,
            len: 0,
        };
        f(&mut c);
        self.len = c.len;
    }
}

/// Writes text into a byte slice, in place.
struct Cursor<'a> {
    bytes: &'a mut [u8],
    len: usize,
}

impl Cursor<'_> {
    #[inline]
    fn push(&mut self, b: u8) {
        self.bytes[self.len] = b;
        self.len += 1;
    }

    #[inline]
    fn extend(&mut self, s: &[u8]) {
        self.bytes[self.len..self.len + s.len()].copy_from_slice(s);
        self.len += s.len();
    }

    /// `n` in decimal, written in place (digits built elsewhere and copied in would be
    /// read back before their stores land, a stall on every row).
    #[inline]
    fn decimal(&mut self, mut n: u64) {
        let digits = n.checked_ilog10().unwrap_or(0) as usize + 1;
        let mut i = self.len + digits;
        self.len = i;
        while n >= 100 {
            let pair = (n % 100) as usize * 2;
            n /= 100;
            i -= 2;
            self.bytes[i] = PAIRS[pair];
            self.bytes[i + 1] = PAIRS[pair + 1];
        }
        if n >= 10 {
            let pair = n as usize * 2;
            self.bytes[i - 2] = PAIRS[pair];
            self.bytes[i - 1] = PAIRS[pair + 1];
        } else {
            self.bytes[i - 1] = b'0' + n as u8;
        }
    }

    /// `n` (below 10^width) in exactly `width` digits, zero-padded.
    #[inline]
    fn fixed(&mut self, mut n: u64, width: usize) {
        let end = self.len + width;
        for i in (self.len..end).rev() {
            self.bytes[i] = b'0' + (n % 10) as u8;
            n /= 10;
        }
        self.len = end;
    }

    /// `0x` and lowercase hex digits, as `{:#x}` writes them.
    #[inline]
    fn hex(&mut self, n: u64) {
        let digits = (64 - (n | 1).leading_zeros()).div_ceil(4) as usize;
        self.extend(b"0x");
        for i in (0..digits).rev() {
            self.push(b"0123456789abcdef"[(n >> (4 * i)) as usize & 0xf]);
        }
    }
}

/// "00" to "99".
const PAIRS: [u8; 200] = {
    let mut t = [0u8; 200];
    let mut i = 0;
    while i < 100 {
        t[2 * i] = b'0' + (i / 10) as u8;
        t[2 * i + 1] = b'0' + (i % 10) as u8;
        i += 1;
    }
    t
};

impl RowFormat {
    /// Appends `record`, which happened at `time_ns` (wall clock, nanoseconds since the
    /// epoch), as a row: `Thread,Time,Action,Pointer,Size,Stream` as RMM writes them
    /// (time UTC `HH:MM:SS.ffffff`, pointer `0x…` or `(nil)`, stream hex or `0`; host
    /// streams as `host:N`).
    pub(super) fn row(&mut self, out: &mut Vec<u8>, r: &Record, time_ns: u64) {
        if self.thread != Some(r.thread) {
            self.thread = Some(r.thread);
            self.thread_text.set(|t| t.decimal(r.thread));
        }
        let second = time_ns / 1_000_000_000;
        if self.second != Some(second) {
            self.second = Some(second);
            let secs = second % 86_400;
            self.hms.set(|t| {
                t.fixed(secs / 3600, 2);
                t.push(b':');
                t.fixed(secs / 60 % 60, 2);
                t.push(b':');
                t.fixed(secs % 60, 2);
            });
        }
        // Written straight into `out` (room made first), not built elsewhere and copied.
        let start = out.len();
        out.resize(start + MAX_ROW, 0);
        let mut row = Cursor {
            bytes: &mut out[start..],
            len: 0,
        };
        row.extend(self.thread_text.as_slice());
        row.push(b',');
        row.extend(self.hms.as_slice());
        row.push(b'.');
        row.fixed(time_ns / 1_000 % 1_000_000, 6);
        row.push(b',');
        row.extend(action_word(r.action));
        row.push(b',');
        match r.pointer {
            0 => row.extend(b"(nil)"),
            p => row.hex(p as u64),
        }
        row.push(b',');
        row.decimal(r.size as u64);
        row.push(b',');
        if r.host {
            row.extend(b"host:");
            row.decimal(r.stream);
        } else if r.stream == 0 {
            row.push(b'0');
        } else {
            row.hex(r.stream);
        }
        row.push(b'\n');
        let len = row.len;
        out.truncate(start + len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hand_formatting_matches_std() {
        for n in [0u64, 7, 9, 10, 99, 100, 12345, 1_000_000, u64::MAX] {
            let mut t = Text::<20>::default();
            t.set(|c| c.decimal(n));
            assert_eq!(t.as_slice(), n.to_string().as_bytes());
        }
        for n in [0u64, 1, 0xf, 0x10, 0x7ff490004d00, u64::MAX] {
            let mut t = Text::<18>::default();
            t.set(|c| c.hex(n));
            assert_eq!(t.as_slice(), format!("{n:#x}").as_bytes());
        }
        for (n, w) in [(0u64, 2), (5, 2), (59, 2), (760754, 6), (42, 6)] {
            let mut t = Text::<6>::default();
            t.set(|c| c.fixed(n, w));
            assert_eq!(t.as_slice(), format!("{n:0w$}").as_bytes());
        }
    }

    #[test]
    fn a_row_as_rmm_writes_it() {
        let mut row = Vec::new();
        let mut f = RowFormat::default();
        // 1970-01-02 03:04:05.678901 UTC
        let t = ((24 + 3) * 3600 + 4 * 60 + 5) * 1_000_000_000 + 678_901_234;
        let r = Record {
            time: 0,
            thread: 4242,
            action: action_code(Action::Free),
            pointer: 0x7f00_dead_be00,
            size: 1000,
            stream: 0x55aa,
            host: false,
        };
        f.row(&mut row, &r, t);
        f.row(
            &mut row,
            &Record {
                action: action_code(Action::AllocateFailure),
                pointer: 0,
                stream: 0,
                ..r
            },
            t,
        );
        f.row(
            &mut row,
            &Record {
                host: true,
                stream: 3,
                ..r
            },
            t,
        );
        assert_eq!(
            String::from_utf8(row.clone()).unwrap(),
            "4242,03:04:05.678901,free,0x7f00deadbe00,1000,0x55aa\n\
             4242,03:04:05.678901,allocate failure,(nil),1000,0\n\
             4242,03:04:05.678901,free,0x7f00deadbe00,1000,host:3\n"
        );
        // The cached thread and second are replaced when they change; the longest row
        // fits.
        row.clear();
        let long = Record {
            thread: u64::MAX,
            action: action_code(Action::AllocateFailure),
            pointer: usize::MAX,
            size: usize::MAX,
            stream: u64::MAX,
            ..r
        };
        f.row(&mut row, &long, t + 1_000_000_000);
        f.row(
            &mut row,
            &Record {
                host: true,
                stream: u64::from(u32::MAX),
                ..long
            },
            t,
        );
        let longest = "18446744073709551615,03:04:06.678901,allocate failure,0xffffffffffffffff,\
                       18446744073709551615,0xffffffffffffffff\n";
        assert_eq!(longest.len(), MAX_ROW);
        assert_eq!(
            String::from_utf8(row).unwrap(),
            format!(
                "{longest}18446744073709551615,03:04:05.678901,allocate failure,\
                 0xffffffffffffffff,18446744073709551615,host:4294967295\n"
            )
        );
    }
}
