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

/// The action word of `code`, padded to 16 bytes (so that it is copied in one constant-size
/// move), and its length.
fn action_word(code: u8) -> (&'static [u8; 16], usize) {
    const fn padded(word: &str) -> [u8; 16] {
        let mut out = [b' '; 16];
        let mut i = 0;
        while i < word.len() {
            out[i] = word.as_bytes()[i];
            i += 1;
        }
        out
    }
    const WORDS: [[u8; 16]; 3] = [
        padded(Action::Allocate.as_str()),
        padded(Action::Free.as_str()),
        padded(Action::AllocateFailure.as_str()),
    ];
    let (i, word) = match code {
        0 => (0, Action::Allocate),
        1 => (1, Action::Free),
        _ => (2, Action::AllocateFailure),
    };
    (&WORDS[i], word.as_str().len())
}

/// The longest row: a 20-digit thread id, the time (15), `allocate failure` (16), an
/// 18-character pointer, a 20-digit size, `host:` and 10 digits or an 18-character
/// stream, five commas and the newline.
const MAX_ROW: usize = 20 + 15 + 16 + 18 + 20 + 18 + 6;

/// Room for a row: the longest, and the bytes that the fixed-size moves of its last field
/// may write past the field's end (they are overwritten or cut off).
const ROW_ROOM: usize = MAX_ROW + 16;

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
    #[cfg(test)]
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

    /// The `N` bytes of `text`'s buffer, in one constant-size move; the cursor advances by
    /// the text's length.
    #[inline]
    fn text<const N: usize>(&mut self, text: &Text<N>) {
        self.padded(&text.bytes, text.len);
    }

    /// `bytes` in one constant-size move; the cursor advances by `len` (at most `N`).
    #[inline]
    fn padded<const N: usize>(&mut self, bytes: &[u8; N], len: usize) {
        self.bytes[self.len..self.len + N].copy_from_slice(bytes);
        self.len += len.min(N);
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
        let start = self.len;
        let mut i = start + width;
        self.len = i;
        while i >= start + 2 {
            let pair = (n % 100) as usize * 2;
            n /= 100;
            i -= 2;
            self.bytes[i] = PAIRS[pair];
            self.bytes[i + 1] = PAIRS[pair + 1];
        }
        if i > start {
            self.bytes[i - 1] = b'0' + (n % 10) as u8;
        }
    }

    /// `0x` and lowercase hex digits, as `{:#x}` writes them: all sixteen digits are
    /// made at once in a register and stored in one move, the cursor advancing past the
    /// significant ones.
    #[inline]
    fn hex(&mut self, n: u64) {
        let digits = (64 - (n | 1).leading_zeros()).div_ceil(4) as usize;
        self.extend(b"0x");
        let text = hex_digits(n) >> (8 * (16 - digits));
        self.padded(&text.to_le_bytes(), digits);
    }
}

/// The sixteen hex digits of `n` (lowercase, the most significant first), as the bytes of
/// a little-endian `u128`.
#[inline]
fn hex_digits(n: u64) -> u128 {
    /// Nibble `i` of `x` into byte `i`.
    fn spread(x: u32) -> u64 {
        let x = u64::from(x);
        let x = (x | (x << 16)) & 0x0000_ffff_0000_ffff;
        let x = (x | (x << 8)) & 0x00ff_00ff_00ff_00ff;
        (x | (x << 4)) & 0x0f0f_0f0f_0f0f_0f0f
    }
    /// Each byte's nibble as its digit (`+ 6` carries into bit 4 for 10 to 15).
    fn digits(nibbles: u64) -> u64 {
        let letters = ((nibbles + 0x0606_0606_0606_0606) >> 4) & 0x0101_0101_0101_0101;
        nibbles + 0x3030_3030_3030_3030 + letters * u64::from(b'a' - b'0' - 10)
    }
    let high = digits(spread((n >> 32) as u32)).swap_bytes();
    let low = digits(spread(n as u32)).swap_bytes();
    u128::from(high) | (u128::from(low) << 64)
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
        out.resize(start + ROW_ROOM, 0);
        let mut row = Cursor {
            bytes: &mut out[start..],
            len: 0,
        };
        row.text(&self.thread_text);
        row.push(b',');
        row.text(&self.hms);
        row.push(b'.');
        row.fixed(time_ns / 1_000 % 1_000_000, 6);
        row.push(b',');
        let (word, len) = action_word(r.action);
        row.padded(word, len);
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
        let mut rng = 1u64;
        let random = (0..1000).map(|_| {
            rng = rng
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            rng >> (rng % 64)
        });
        for n in [
            0u64,
            1,
            9,
            0xa,
            0xf,
            0x10,
            0xabcdef,
            0x7ff490004d00,
            u64::MAX,
        ]
        .into_iter()
        .chain(random)
        {
            let mut t = Text::<18>::default();
            t.set(|c| c.hex(n));
            assert_eq!(t.as_slice(), format!("{n:#x}").as_bytes());
        }
        for (n, w) in [
            (0u64, 2),
            (5, 2),
            (59, 2),
            (760754, 6),
            (42, 6),
            (7, 1),
            (123, 3),
            (0, 6),
        ] {
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
