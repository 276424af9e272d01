//! Stack specs: the one text language for a resource stack, read by the C ABI
//! (`memres_configure`, `MEMRES_RESOURCE`), the Python package and the `memres` command
//! (`--stack`, `compare`). Behind the `spec` feature (off by default: a Rust program
//! builds its stack as types).
//!
//! ```text
//! spec    := base [":" options] | wrapper "(" spec ["," options] ")"
//!          | "fallback(" spec "," spec ")"
//! base    := cuda | cuda_async | managed | pinned | pinned_pool | virtual_pool | pool
//!          | arena | binning | fixed_size
//! wrapper := statistics | logging | limiting
//! options := key "=" value ["," options]
//! ```
//!
//! Sizes take units (`8GiB`, `512MiB`). Inside a wrapper, options that are not the
//! wrapper's own belong to the spec it wraps, so `limiting(pool:initial=1GiB,max=4GiB,
//! limit=2GiB)` reads as a pool of 1 to 4 GiB under a 2 GiB limit.
//!
//! ```
//! use memres::spec::Spec;
//!
//! let spec = Spec::parse("statistics(pool:initial=1GiB,max=4GiB)")?;
//! assert!(matches!(spec, Spec::Statistics(_)));
//! assert!(Spec::parse("pool:initial=lots").is_err());
//! # Ok::<(), memres::spec::SpecError>(())
//! ```
//!
//! [`Spec::build`] builds the stack a spec names over the leaves a [`Target`] gives (the C
//! ABI's are the CUDA driver's, the command's simulated or host memory), so every program
//! reading specs builds them by the same rules and with the same defaults.

use std::fmt;
use std::path::PathBuf;

use crate::suballoc::Growth;
use crate::units::parse_size;

mod build;

pub use build::{Built, LeafOptions, Target, Tiers};

/// A parsed stack, outermost layer first. Sizes are bytes; `None` is the default the
/// program building the stack uses (the C ABI's are in `capi/include/memres.h`). Each
/// variant is its spec word in camel case (`virtual_pool`: `VirtualPool`, `statistics(..)`:
/// `Statistics`, `limiting(..)`: `Limiting`). Where a variant shares its name with a type
/// (`Pool`, `Statistics`), rustc prints that type with its whole path in its messages
/// when the `spec` feature is on (`memres::adaptor::Statistics<..>`). New layers become
/// new variants, so a match on it outside this crate has a `_` arm (`#[non_exhaustive]`).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Spec {
    /// `cuda`: `cuMemAlloc` per request.
    Cuda,
    /// `cuda_async`: a driver pool (`cuMemAllocFromPoolAsync`).
    CudaAsync {
        /// `initial=`: bytes the driver pool keeps from the start.
        initial: Option<usize>,
        /// `release=`: the driver pool's release threshold.
        release_threshold: Option<u64>,
    },
    /// `pool`: memres's coalescing pool over `Cuda`, growing by what a request needs, at
    /// least an eighth of the pool (`growth=rmm`: RMM's doubling, up to 2x of what is
    /// live held without a maximum); `VirtualPool` holds least.
    Pool {
        /// `initial=`: bytes taken at once.
        initial: Option<usize>,
        /// `max=`: the most the pool holds.
        max: Option<usize>,
        /// `growth=eighth|rmm`: how a chunk is sized.
        growth: Growth,
    },
    /// `virtual_pool`: a [`VirtualPool`](crate::VirtualPool), growing in place over
    /// `CudaVirtual` (the default): least memory held.
    VirtualPool {
        /// `initial=`: bytes mapped at once.
        initial: Option<usize>,
        /// `max=`: the most the pool maps.
        max: Option<usize>,
        /// `step=`: the least a growth maps.
        step: Option<usize>,
        /// `release=`: free bytes kept before frees give memory back.
        release: Option<usize>,
        /// `reserve=`: the virtual address range reserved.
        reserve: Option<usize>,
        /// `granule=`: the bytes mapped and given back at a time (a power of two): larger
        /// ones make a sleep and wake faster, see [`LeafOptions::granule`]. `None`: the
        /// leaf's minimum, 2 MiB on current GPUs (the library's `CudaVirtual` and the C
        /// ABI's pools alike). Through the C ABI the tags' pools take the first
        /// `virtual_pool`'s.
        granule: Option<usize>,
    },
    /// `arena`: RMM's arena over `Cuda`.
    Arena {
        /// `size=`: the arena's size (default: half the free memory).
        size: Option<usize>,
    },
    /// `managed`: `cuMemAllocManaged` per request.
    Managed,
    /// `pinned`: pinned host memory (`cuMemHostAlloc`) per request.
    Pinned,
    /// `pinned_pool`: memres's coalescing pool over pinned host memory.
    PinnedPool,
    /// `fixed_size`: blocks of one size, taken `blocks` at a time; larger requests fail.
    FixedSize {
        /// `block=`: the size of every block (default 1 MiB).
        block: usize,
        /// `blocks=`: blocks per chunk taken from the memory (default 128).
        blocks: usize,
    },
    /// `binning`: fixed-size bins of 2^min .. 2^max bytes over a default virtual pool
    /// (the [`VirtualPool`](crate::VirtualPool), which holds least); larger requests go
    /// to that pool.
    Binning {
        /// `min=`: the smallest bin's exponent.
        min: u32,
        /// `max=`: the largest bin's exponent.
        max: u32,
    },
    /// `statistics(..)`: counts of bytes and allocations over the spec inside.
    Statistics(Box<Spec>),
    /// `logging(..)`: an RMM-format CSV log of every event.
    Logging {
        /// The spec logged.
        inner: Box<Spec>,
        /// `file=`: where the log goes (default: the program's choice).
        file: Option<PathBuf>,
        /// `exact_times=true`: every event reads the clock (`Logging::exact_times`).
        exact_times: bool,
    },
    /// `fallback(first, then)`: `then` serves what `first` has no memory for
    /// ([`Fallback`](crate::adaptor::Fallback)).
    Fallback {
        /// The first tier.
        first: Box<Spec>,
        /// The tier for what the first cannot hold.
        then: Box<Spec>,
    },
    /// `limiting(..)`: a cap on the bytes live through it.
    Limiting {
        /// The spec limited.
        inner: Box<Spec>,
        /// `limit=`: the cap.
        limit: usize,
    },
}

/// What was wrong with a spec, in words that name the offending part.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecError(String);

impl SpecError {
    /// The message: the spec, and what was wrong with which part of it.
    pub fn message(&self) -> &str {
        &self.0
    }
}

impl std::error::Error for SpecError {}

impl fmt::Display for SpecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

const RESOURCES: &str = "cuda, cuda_async, managed, pinned, pinned_pool, virtual_pool, pool, \
                         arena, binning, fixed_size, statistics(..), logging(..), limiting(..), \
                         fallback(..)";

/// The most wrappers a spec may nest (real stacks have two or three).
const MAX_DEPTH: usize = 16;
/// The longest spec accepted.
const MAX_LEN: usize = 4096;
/// The most characters of a spec (or a part of one) that an error quotes.
const QUOTE_CHARS: usize = 200;

/// `text` quoted for an error message as `{:?}` writes it, cut after [`QUOTE_CHARS`]
/// characters with its whole length stated: a 100 kB spec must not make a 100 kB message.
fn quoted(text: &str) -> String {
    match text.char_indices().nth(QUOTE_CHARS) {
        None => format!("{text:?}"),
        Some((end, _)) => format!("{:?}... ({} bytes in all)", &text[..end], text.len()),
    }
}

impl Spec {
    /// Parses a whole spec.
    pub fn parse(text: &str) -> Result<Spec, SpecError> {
        let fail = |e: String| SpecError(format!("invalid resource spec {}: {e}", quoted(text)));
        if text.len() > MAX_LEN {
            return Err(fail(format!("longer than {MAX_LEN} bytes")));
        }
        parse(text.trim(), 0).map_err(fail)
    }

    /// The spec used when none is configured: the pool that holds least, growing in
    /// place over CUDA virtual memory from nothing.
    pub fn default_spec() -> Spec {
        Spec::VirtualPool {
            initial: None,
            max: None,
            step: None,
            release: None,
            reserve: None,
            granule: None,
        }
    }

    /// The name a spec is written with.
    fn name(&self) -> &'static str {
        match self {
            Spec::Cuda => "cuda",
            Spec::CudaAsync { .. } => "cuda_async",
            Spec::Managed => "managed",
            Spec::Pinned => "pinned",
            Spec::PinnedPool => "pinned_pool",
            Spec::Fallback { .. } => "fallback",
            Spec::FixedSize { .. } => "fixed_size",
            Spec::Pool { .. } => "pool",
            Spec::VirtualPool { .. } => "virtual_pool",
            Spec::Arena { .. } => "arena",
            Spec::Binning { .. } => "binning",
            Spec::Statistics(_) => "statistics",
            Spec::Logging { .. } => "logging",
            Spec::Limiting { .. } => "limiting",
        }
    }

    /// The base (non-wrapper) spec at the bottom of the stack.
    ///
    /// ```
    /// use memres::spec::Spec;
    ///
    /// let spec = Spec::parse("statistics(limiting(arena, limit=1GiB))")?;
    /// assert_eq!(spec.base(), &Spec::Arena { size: None });
    /// # Ok::<(), memres::spec::SpecError>(())
    /// ```
    pub fn base(&self) -> &Spec {
        match self {
            Spec::Statistics(inner)
            | Spec::Logging { inner, .. }
            | Spec::Limiting { inner, .. } => inner.base(),
            base => base,
        }
    }

    /// The base spec, to change.
    pub fn base_mut(&mut self) -> &mut Spec {
        match self {
            Spec::Statistics(inner)
            | Spec::Logging { inner, .. }
            | Spec::Limiting { inner, .. } => inner.base_mut(),
            base => base,
        }
    }

    /// Sets option `key` of a base spec.
    fn set(&mut self, key: &str, value: &str) -> Result<(), String> {
        let name = self.name();
        match (self, key) {
            (Spec::CudaAsync { initial, .. }, "initial") => *initial = Some(size(key, value)?),
            (
                Spec::CudaAsync {
                    release_threshold, ..
                },
                "release",
            ) => {
                *release_threshold = Some(size(key, value)? as u64);
            }
            (Spec::Pool { initial, .. }, "initial") => *initial = Some(size(key, value)?),
            (Spec::Pool { max, .. }, "max") => *max = Some(size(key, value)?),
            (Spec::Pool { growth, .. }, "growth") => *growth = growth_rule(key, value)?,
            (Spec::VirtualPool { initial, .. }, "initial") => *initial = Some(size(key, value)?),
            (Spec::VirtualPool { max, .. }, "max") => *max = Some(size(key, value)?),
            (Spec::VirtualPool { step, .. }, "step") => *step = Some(size(key, value)?),
            (Spec::VirtualPool { release, .. }, "release") => *release = Some(size(key, value)?),
            (Spec::VirtualPool { reserve, .. }, "reserve") => *reserve = Some(size(key, value)?),
            (Spec::VirtualPool { granule, .. }, "granule") => *granule = Some(size(key, value)?),
            (Spec::Arena { size: s }, "size") => *s = Some(size(key, value)?),
            (Spec::FixedSize { block, .. }, "block") => *block = nonzero(size(key, value)?, key)?,
            (Spec::FixedSize { blocks, .. }, "blocks") => {
                *blocks = nonzero(count(key, value)?, key)?;
            }
            (Spec::Binning { min, .. }, "min") => *min = exponent(key, value)?,
            (Spec::Binning { max, .. }, "max") => *max = exponent(key, value)?,
            _ => {
                let known = match name {
                    "cuda_async" => "initial, release",
                    "pool" => "initial, max, growth",
                    "virtual_pool" => "initial, max, step, release, reserve, granule",
                    "arena" => "size",
                    "binning" => "min, max",
                    "fixed_size" => "block, blocks",
                    _ => "none",
                };
                return Err(format!(
                    "unknown option {} for {name} (options: {known})",
                    quoted(key)
                ));
            }
        }
        Ok(())
    }
}

fn parse(text: &str, depth: usize) -> Result<Spec, String> {
    if depth > MAX_DEPTH {
        return Err(format!("wrappers nested deeper than {MAX_DEPTH}"));
    }
    let name_end = text
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(text.len());
    let (name, rest) = text.split_at(name_end);
    if name.is_empty() {
        return Err(format!(
            "{} does not start with a resource name ({RESOURCES})",
            quoted(text)
        ));
    }
    let rest = rest.trim_start();
    if let Some(after_open) = rest.strip_prefix('(') {
        let mut level = 1usize;
        let close = after_open.char_indices().find_map(|(i, c)| {
            match c {
                '(' => level += 1,
                ')' => level -= 1,
                _ => {}
            }
            (level == 0).then_some(i)
        });
        let close = close.ok_or_else(|| format!("{}: unbalanced parentheses", quoted(text)))?;
        let after = after_open[close + 1..].trim();
        if !after.is_empty() {
            return Err(format!(
                "{}: text after the closing parenthesis: {}",
                quoted(text),
                quoted(after)
            ));
        }
        return parse_wrapper(name, &after_open[..close], depth);
    }
    let options = match rest.strip_prefix(':') {
        Some(options) => split_top_level(options)?,
        None if rest.is_empty() => Vec::new(),
        None => {
            return Err(format!(
                "{}: expected ':' or '(' after {}",
                quoted(text),
                quoted(name)
            ));
        }
    };
    let mut spec = base(name)?;
    for option in options {
        let (key, value) = key_value(option)?;
        spec.set(key, value)?;
    }
    if let Spec::Binning { min, max } = spec
        && min > max
    {
        return Err(format!("binning: min={min} is above max={max}"));
    }
    Ok(spec)
}

/// Splits at commas outside parentheses.
fn split_top_level(text: &str) -> Result<Vec<&str>, String> {
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0i32, 0);
    for (i, c) in text.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(text[start..i].trim());
                start = i + 1;
            }
            _ => {}
        }
        if depth < 0 {
            return Err(format!("{}: unbalanced parentheses", quoted(text)));
        }
    }
    if depth != 0 {
        return Err(format!("{}: unbalanced parentheses", quoted(text)));
    }
    parts.push(text[start..].trim());
    Ok(parts)
}

fn key_value(option: &str) -> Result<(&str, &str), String> {
    option
        .split_once('=')
        .map(|(k, v)| (k.trim(), v.trim()))
        .filter(|(k, v)| !k.is_empty() && !v.is_empty())
        .ok_or_else(|| format!("option {} is not key=value", quoted(option)))
}

fn size(key: &str, value: &str) -> Result<usize, String> {
    parse_size(value).map_err(|e| match e {
        crate::Error::InvalidArgument(message) => format!("{key}: {message}"),
        other => format!("{key}: {other}"),
    })
}

/// A base spec by name, with its defaults.
fn base(name: &str) -> Result<Spec, String> {
    Ok(match name {
        "cuda" => Spec::Cuda,
        "cuda_async" => Spec::CudaAsync {
            initial: None,
            release_threshold: None,
        },
        "pool" => Spec::Pool {
            initial: None,
            max: None,
            growth: Growth::default(),
        },
        "managed" => Spec::Managed,
        "pinned" => Spec::Pinned,
        "pinned_pool" => Spec::PinnedPool,
        "fixed_size" => Spec::FixedSize {
            block: 1 << 20,
            blocks: 128,
        },
        "virtual_pool" => Spec::default_spec(),
        "arena" => Spec::Arena { size: None },
        "binning" => Spec::Binning { min: 10, max: 22 },
        "statistics" | "logging" | "limiting" => {
            return Err(format!("{name} wraps another resource: write {name}(pool)"));
        }
        "fallback" => {
            return Err(
                "fallback takes two resources: write fallback(virtual_pool, pinned_pool)".into(),
            );
        }
        other => {
            return Err(format!(
                "unknown resource {} (expected one of {RESOURCES})",
                quoted(other)
            ));
        }
    })
}

fn count(key: &str, value: &str) -> Result<usize, String> {
    value
        .parse::<usize>()
        .map_err(|_| format!("{key}={}: expected a count of blocks", quoted(value)))
}

fn nonzero(n: usize, key: &str) -> Result<usize, String> {
    if n == 0 {
        return Err(format!("{key}=0: must be at least 1"));
    }
    Ok(n)
}

fn growth_rule(key: &str, value: &str) -> Result<Growth, String> {
    match value {
        "eighth" => Ok(Growth::Eighth),
        "rmm" => Ok(Growth::Rmm),
        _ => Err(format!(
            "{key}={}: the growth rule is eighth (what a request needs, at least an \
             eighth of the pool) or rmm (RMM's doubling)",
            quoted(value)
        )),
    }
}

fn exponent(key: &str, value: &str) -> Result<u32, String> {
    match value.parse::<u32>() {
        Ok(e) if e < 48 => Ok(e),
        _ => Err(format!(
            "{key}={}: a bin size is a power-of-two exponent below 48 (10 = 1 KiB)",
            quoted(value)
        )),
    }
}

// long: fallback's tiers, then the wrappers' own keys, each check with its message in place.
fn parse_wrapper(name: &str, inside: &str, depth: usize) -> Result<Spec, String> {
    if name == "fallback" {
        let parts = split_top_level(inside)?;
        let [first, then] = parts[..] else {
            return Err(format!(
                "fallback(..) takes two resources, the first tier and the next (got {}): \
                 write fallback(virtual_pool, pinned_pool)",
                parts.len()
            ));
        };
        if first.is_empty() || then.is_empty() {
            return Err("fallback(..) takes two resources, neither empty".into());
        }
        return Ok(Spec::Fallback {
            first: Box::new(parse(first, depth + 1)?),
            then: Box::new(parse(then, depth + 1)?),
        });
    }
    let own_keys: &[&str] = match name {
        "statistics" => &[],
        "logging" => &["file", "exact_times"],
        "limiting" => &["limit"],
        "cuda" | "cuda_async" | "managed" | "pinned" | "pinned_pool" | "virtual_pool" | "pool"
        | "arena" | "binning" | "fixed_size" => {
            return Err(format!(
                "{name} does not wrap a resource: write {name}:key=value for its options"
            ));
        }
        other => {
            return Err(format!(
                "unknown resource {} (expected one of {RESOURCES})",
                quoted(other)
            ));
        }
    };
    let mut parts = split_top_level(inside)?.into_iter();
    let first = parts.next().unwrap_or_default();
    if first.is_empty() {
        return Err(format!(
            "{name}(..) needs the resource it wraps, e.g. {name}(pool)"
        ));
    }
    let mut inner = Box::new(parse(first, depth + 1)?);
    let mut own = Vec::new();
    for part in parts {
        let (key, value) = key_value(part)?;
        if own_keys.contains(&key) {
            own.push((key, value));
        } else {
            // An option of the stack's base, written after the spec it belongs to:
            // `limiting(pool:initial=1GiB, max=4GiB, limit=2GiB)`.
            inner.base_mut().set(key, value)?;
        }
    }
    if let Spec::Binning { min, max } = *inner.base_mut()
        && min > max
    {
        return Err(format!("binning: min={min} is above max={max}"));
    }
    let value_of = |key: &str| own.iter().rev().find(|(k, _)| *k == key).map(|(_, v)| *v);
    Ok(match name {
        "statistics" => Spec::Statistics(inner),
        "logging" => Spec::Logging {
            inner,
            file: value_of("file").map(PathBuf::from),
            exact_times: match value_of("exact_times") {
                None | Some("false") => false,
                Some("true") => true,
                Some(other) => {
                    return Err(format!(
                        "exact_times={}: write true or false",
                        quoted(other)
                    ));
                }
            },
        },
        _ => Spec::Limiting {
            inner,
            limit: size(
                "limit",
                value_of("limit").ok_or("limiting(..) needs limit=SIZE, e.g. limit=10GiB")?,
            )?,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(text: &str) -> Spec {
        Spec::parse(text).unwrap_or_else(|e| panic!("{text}: {e}"))
    }

    fn err(text: &str) -> String {
        Spec::parse(text).unwrap_err().0
    }

    /// A `pool` spec with the default growth rule.
    fn pool(initial: Option<usize>, max: Option<usize>) -> Spec {
        Spec::Pool {
            initial,
            max,
            growth: Growth::default(),
        }
    }

    fn plain_pool() -> Spec {
        pool(None, None)
    }

    #[test]
    fn the_default_is_the_virtual_pool() {
        assert_eq!(ok("virtual_pool"), Spec::default_spec());
        assert_eq!(
            ok(
                "virtual_pool:initial=1GiB,max=60GiB,step=32MiB,release=2GiB,reserve=256GiB,granule=32MiB"
            ),
            Spec::VirtualPool {
                initial: Some(1 << 30),
                max: Some(60 << 30),
                step: Some(32 << 20),
                release: Some(2 << 30),
                reserve: Some(256 << 30),
                granule: Some(32 << 20),
            }
        );
        assert_eq!(
            ok("statistics(virtual_pool:release=1GiB)"),
            Spec::Statistics(Box::new(Spec::VirtualPool {
                initial: None,
                max: None,
                step: None,
                release: Some(1 << 30),
                reserve: None,
                granule: None,
            }))
        );
    }

    #[test]
    fn bases() {
        assert_eq!(ok("cuda"), Spec::Cuda);
        assert_eq!(
            ok("cuda_async"),
            Spec::CudaAsync {
                initial: None,
                release_threshold: None
            }
        );
        assert_eq!(ok(" pool "), plain_pool());
        assert_eq!(
            ok("pool:initial=8GiB,max=60GiB"),
            pool(Some(8 << 30), Some(60 << 30))
        );
        assert_eq!(
            ok("pool:growth=rmm"),
            Spec::Pool {
                initial: None,
                max: None,
                growth: Growth::Rmm
            }
        );
        assert_eq!(ok("pool:growth=eighth"), plain_pool());
        assert_eq!(
            ok("arena:size=40GiB"),
            Spec::Arena {
                size: Some(40 << 30)
            }
        );
        assert_eq!(
            ok("binning:min=10,max=22"),
            Spec::Binning { min: 10, max: 22 }
        );
        assert_eq!(ok("managed"), Spec::Managed);
        assert_eq!(ok("pinned"), Spec::Pinned);
        assert_eq!(
            ok("fallback(virtual_pool:max=1GiB, pinned_pool)"),
            Spec::Fallback {
                first: Box::new(Spec::VirtualPool {
                    initial: None,
                    max: Some(1 << 30),
                    step: None,
                    release: None,
                    reserve: None,
                    granule: None,
                }),
                then: Box::new(Spec::PinnedPool),
            }
        );
        assert!(matches!(
            ok("statistics(fallback(pool, fallback(managed, pinned)))"),
            Spec::Statistics(_)
        ));
        assert!(err("fallback(pool)").contains("two resources"));
        assert!(err("fallback(pool, pinned, cuda)").contains("two resources"));
        assert!(err("fallback").contains("two resources"));
        assert!(err("fallback(pool, )").contains("neither empty"));
        assert_eq!(
            ok("fixed_size:block=64KiB,blocks=16"),
            Spec::FixedSize {
                block: 64 << 10,
                blocks: 16
            }
        );
        assert!(err("fixed_size:block=0").contains("at least 1"));
        assert!(err("fixed_size:blocks=many").contains("count of blocks"));
        assert!(err("managed(pool)").contains("does not wrap"));
        assert_eq!(
            ok("cuda_async:initial=1GiB,release=2GiB"),
            Spec::CudaAsync {
                initial: Some(1 << 30),
                release_threshold: Some(2 << 30)
            }
        );
    }

    #[test]
    fn wrappers() {
        assert_eq!(
            ok("statistics(pool:initial=4GiB)"),
            Spec::Statistics(Box::new(pool(Some(4 << 30), None)))
        );
        assert_eq!(
            ok("logging(pool,file=/tmp/log.csv)"),
            Spec::Logging {
                inner: Box::new(plain_pool()),
                file: Some("/tmp/log.csv".into()),
                exact_times: false
            }
        );
        assert_eq!(
            ok("limiting(pool,limit=10GiB)"),
            Spec::Limiting {
                inner: Box::new(plain_pool()),
                limit: 10 << 30
            }
        );
        assert_eq!(
            ok("limiting(pool:initial=1GiB,max=4GiB,limit=2GiB)"),
            Spec::Limiting {
                inner: Box::new(pool(Some(1 << 30), Some(4 << 30))),
                limit: 2 << 30
            }
        );
        assert_eq!(
            ok("statistics(limiting(arena:size=2GiB, limit=1GiB))"),
            Spec::Statistics(Box::new(Spec::Limiting {
                inner: Box::new(Spec::Arena {
                    size: Some(2 << 30)
                }),
                limit: 1 << 30
            }))
        );
        assert_eq!(
            ok("logging(statistics(pool),file=x.csv)"),
            Spec::Logging {
                inner: Box::new(Spec::Statistics(Box::new(plain_pool()))),
                file: Some("x.csv".into()),
                exact_times: false
            }
        );
        assert_eq!(
            ok("logging(pool,exact_times=true)"),
            Spec::Logging {
                inner: Box::new(plain_pool()),
                file: None,
                exact_times: true
            }
        );
        assert!(err("logging(pool,exact_times=yes)").contains("true or false"));
    }

    #[test]
    fn options_after_nested_wrappers_reach_the_base() {
        assert_eq!(
            ok("statistics(limiting(pool,limit=1GiB),initial=4GiB)"),
            Spec::Statistics(Box::new(Spec::Limiting {
                inner: Box::new(pool(Some(4 << 30), None)),
                limit: 1 << 30
            }))
        );
        assert_eq!(
            ok("limiting(statistics(pool),initial=1GiB,limit=2GiB)"),
            Spec::Limiting {
                inner: Box::new(Spec::Statistics(Box::new(pool(Some(1 << 30), None)))),
                limit: 2 << 30
            }
        );
        assert_eq!(
            ok("statistics (pool : initial=1GiB)"),
            ok("statistics(pool:initial=1GiB)")
        );
    }

    #[test]
    fn deep_or_long_specs_are_refused_not_a_crash() {
        let deep = format!("{}pool{}", "statistics(".repeat(10_000), ")".repeat(10_000));
        assert!(err(&deep).contains("longer than 4096 bytes"));
        let nested = format!("{}pool{}", "statistics(".repeat(20), ")".repeat(20));
        assert!(
            err(&nested).contains("nested deeper than 16"),
            "{}",
            err(&nested)
        );
        let fine = format!("{}pool{}", "statistics(".repeat(5), ")".repeat(5));
        assert!(Spec::parse(&fine).is_ok());
    }

    /// Quoted input is cut with its size stated: a 100 kB spec, or a 4 kB name inside
    /// one, does not make a message of that size (issue 49).
    #[test]
    fn long_specs_are_quoted_cut_with_their_size() {
        let long = "x".repeat(100_000);
        let message = err(&long);
        assert!(message.len() < 1000, "{} bytes", message.len());
        assert!(message.contains("100000 bytes in all"), "{message}");
        assert!(message.contains("longer than 4096 bytes"), "{message}");
        let name = format!("statistics({})", "y".repeat(4000));
        let message = err(&name);
        assert!(message.len() < 1000, "{} bytes", message.len());
        assert!(message.contains("unknown resource"), "{message}");
        assert!(message.contains("4000 bytes in all"), "{message}");
        // Short specs are quoted whole, as before.
        assert!(err("poool").contains("\"poool\""));
    }

    #[test]
    fn errors_name_what_was_wrong() {
        let cases = [
            ("", "does not start with a resource name"),
            ("poool", "unknown resource \"poool\""),
            (
                "pool:initial=8GB,maxx=1GiB",
                "unknown option \"maxx\" for pool (options: initial, max, growth)",
            ),
            ("pool:growth=double", "the growth rule is eighth"),
            ("pool:initial=eight", "initial: no number"),
            ("pool:initial", "option \"initial\" is not key=value"),
            ("pool(cuda)", "pool does not wrap a resource"),
            ("statistics", "statistics wraps another resource"),
            ("statistics()", "statistics(..) needs the resource it wraps"),
            ("statistics(pool", "unbalanced parentheses"),
            ("limiting(pool)", "limiting(..) needs limit=SIZE"),
            ("limiting(pool,limit=lots)", "limit: no number"),
            ("binning:min=30,max=20", "min=30 is above max=20"),
            ("binning:min=64", "power-of-two exponent"),
            ("pool;initial=1", "expected ':' or '('"),
            ("cuda:initial=1GiB", "unknown option \"initial\" for cuda"),
            (
                "limiting(cuda,limit=1GiB)x",
                "text after the closing parenthesis",
            ),
            (
                "statistics(pool)(cuda)",
                "text after the closing parenthesis",
            ),
            (
                "statistics(limiting(cuda,limit=1GiB),initial=4GiB)",
                "unknown option \"initial\" for cuda",
            ),
        ];
        for (text, want) in cases {
            let got = err(text);
            assert!(got.contains(want), "{text:?}: {got:?} lacks {want:?}");
            assert!(
                got.contains(&format!("{text:?}")),
                "{got:?} does not quote the spec"
            );
        }
    }
}
