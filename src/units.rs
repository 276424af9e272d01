//! Byte counts written the way people write them: `512MiB`, `80GiB`, `1.5 GB`.
//!
//! Used by the stack specs (the library's `spec` feature: the C ABI's configuration
//! strings and the `memres` command), and handy for any program that takes a pool size
//! from its user.

use crate::error::Error;

/// Parses a byte count: a number (digits, optionally with a fraction) and an optional
/// unit. Binary units (`KiB`, `MiB`, `GiB`, `TiB`, and the short `K`, `M`, `G`, `T`) are
/// powers of 1024; decimal ones (`kB`, `MB`, `GB`, `TB`) powers of 1000; `B` or no unit is
/// bytes. Units are case-insensitive and may follow a space. Fractions are rounded down
/// to a whole byte.
///
/// ```
/// use memres::units::parse_size;
///
/// assert_eq!(parse_size("512MiB")?, 512 << 20);
/// assert_eq!(parse_size("80GiB")?, 80 << 30);
/// assert_eq!(parse_size("1.5 GB")?, 1_500_000_000);
/// assert_eq!(parse_size("4096")?, 4096);
/// assert!(parse_size("12 parsecs").is_err());
/// # Ok::<(), memres::Error>(())
/// ```
///
/// # Errors
/// [`Error::InvalidArgument`] naming the text, for a missing or malformed number, an
/// unknown unit, or a count that does not fit in `usize`.
pub fn parse_size(text: &str) -> Result<usize, Error> {
    let bad = |why: &str| Error::invalid_argument(format!("{why} in the size {text:?}"));
    let trimmed = text.trim();
    let split = trimmed
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(trimmed.len());
    let (number, unit) = trimmed.split_at(split);
    if number.is_empty() {
        return Err(bad("no number"));
    }
    let multiplier: u128 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => {
            return Err(bad(
                "an unknown unit (use B, KiB, MiB, GiB, TiB, kB, MB, GB or TB)",
            ));
        }
    };
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty() && fraction.is_empty() || fraction.contains('.') {
        return Err(bad("a malformed number"));
    }
    let digits = |s: &str| -> Result<u128, Error> {
        if s.is_empty() {
            Ok(0)
        } else {
            s.parse::<u128>().map_err(|_| bad("a number too large"))
        }
    };
    // Fractions: at most 18 digits count (finer than a byte for any unit up to TiB).
    let fraction = &fraction[..fraction.len().min(18)];
    let scale = 10u128.pow(fraction.len() as u32);
    let bytes = digits(whole)?
        .checked_mul(multiplier)
        .and_then(|b| b.checked_add(digits(fraction).ok()? * multiplier / scale))
        .ok_or_else(|| bad("a number too large"))?;
    usize::try_from(bytes).map_err(|_| bad("a number too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("0").unwrap(), 0);
        assert_eq!(parse_size("1k").unwrap(), 1024);
        assert_eq!(parse_size("1 KiB").unwrap(), 1024);
        assert_eq!(parse_size("2kb").unwrap(), 2000);
        assert_eq!(parse_size("0.5MiB").unwrap(), 512 << 10);
        assert_eq!(parse_size(".25GiB").unwrap(), 256 << 20);
        assert_eq!(parse_size("8GiB").unwrap(), 8 << 30);
        assert_eq!(parse_size(" 3 tb ").unwrap(), 3_000_000_000_000);
        assert_eq!(parse_size("1.999B").unwrap(), 1);
    }

    #[test]
    fn errors_name_the_text() {
        for bad in [
            "",
            "GiB",
            ".",
            "1..2MiB",
            "1.2.3",
            "5 XB",
            "-1",
            "99999999999999999999999999999999999999999GiB",
        ] {
            let e = parse_size(bad).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{bad:?}: {e}");
            assert!(e.to_string().contains(&format!("{bad:?}")), "{e}");
        }
    }
}
