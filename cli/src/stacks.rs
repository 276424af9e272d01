//! The resource stacks a replay can run through, by name, over a memory source.

use std::fmt;
use std::sync::Arc;

use std::alloc::Layout;
use std::ptr::NonNull;

use memres::adaptor::ExactCounter;
use memres::property::Contains;
use memres::suballoc::{Arena, Binning, FixedSize, Growth, Pool, PoolConfig, PoolStats};
use memres::upstream::{Backend, Virtual};
use memres::{AnyResource, Callback, Error, Resource, StreamRef};

/// Where the memory comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Memory {
    /// Addresses from a range of this many bytes, never touched.
    Simulated(usize),
    /// The GPU (device 0).
    Gpu,
    /// Host memory (the Rust global allocator).
    Host,
}

impl fmt::Display for Memory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Memory::Simulated(size) => write!(
                f,
                "simulated device memory of {}",
                crate::bytes(*size as u64)
            ),
            Memory::Gpu => f.write_str("the GPU (device 0)"),
            Memory::Host => f.write_str("host memory"),
        }
    }
}

/// The sub-allocator (or none) a stack puts over its memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// memres's coalescing pool.
    Pool,
    /// RMM's arena.
    Arena,
    /// Fixed-size bins over a pool growing in place (as `VirtualPool`), as the C ABI's
    /// `binning`; larger requests go to the pool.
    Binning,
    /// One block size; larger requests fail.
    Fixed,
    /// No sub-allocator: every request goes to the memory (`cuda`, `host`).
    Direct,
    /// The driver's stream-ordered pool (GPU only).
    CudaAsync,
    /// Managed memory, directly (GPU only).
    Managed,
    /// A pool growing in place over a virtual-memory leaf (the C ABI's `virtual_pool`):
    /// `CudaVirtual` on the GPU, `HostVirtual` (2 MiB granules, as on an H100) on
    /// simulated or host memory.
    VirtualPool,
}

/// A stack by name: `pool`, `virtual_pool`, `arena`, `binning`, `fixed`, `cuda`,
/// `cuda_async`, `managed` (the spec strings' names; the older `virtual-pool` and
/// `cuda-async` work too, with a note saying so), and the host variants `host`, `host-pool`, `host-arena`,
/// `host-binning`, `host-fixed`; or a spec string of the C ABI
/// (`statistics(pool:initial=1GiB)`, see `capi/include/memres.h`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StackName {
    pub name: String,
    pub kind: Kind,
    /// Host memory whatever the memory source is.
    pub host: bool,
    /// Adaptors over the sub-allocator, innermost first (from a spec string).
    pub wrappers: Vec<Wrapper>,
}

/// An adaptor a spec string puts over the stack.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Wrapper {
    Statistics,
    Limiting(usize),
    /// The log's file (else `MEMRES_LOG_FILE`), and whether every event reads the clock.
    Logging(Option<std::path::PathBuf>, bool),
}

pub const NAMES: &str = "pool, virtual_pool, arena, binning, fixed, cuda, cuda_async, managed, host, host-pool, host-arena, host-binning, host-fixed";

/// At most the first 80 characters of `text`, marked where cut: errors quote what was
/// given without echoing a whole file's worth of it.
fn excerpt(text: &str) -> String {
    const MOST: usize = 80;
    match text.char_indices().nth(MOST) {
        Some((cut, _)) => format!("{}... ({} bytes in all)", &text[..cut], text.len()),
        None => text.to_owned(),
    }
}

impl StackName {
    pub fn parse(text: &str) -> Result<StackName, String> {
        let name = text.trim().to_ascii_lowercase();
        let (host, base) = match name.strip_prefix("host-") {
            Some(base) => (true, base.to_owned()),
            None if name == "host" => (true, "cuda".to_owned()),
            None => (false, name.clone()),
        };
        // The spellings of earlier versions: taken, with a note naming the spec's.
        let base = match base.as_str() {
            old @ ("virtual-pool" | "cuda-async") => {
                let spec = old.replace('-', "_");
                eprintln!("memres: note: {old:?} is spelled {spec:?} now, as in spec strings");
                spec
            }
            _ => base,
        };
        let kind = match base.as_str() {
            "pool" => Kind::Pool,
            "virtual_pool" => Kind::VirtualPool,
            "arena" => Kind::Arena,
            "binning" => Kind::Binning,
            "fixed" => Kind::Fixed,
            "cuda" => Kind::Direct,
            "cuda_async" if !host => Kind::CudaAsync,
            "managed" if !host => Kind::Managed,
            _ => {
                return Err(format!(
                    "unknown resource {:?} (expected one of {NAMES})",
                    excerpt(text)
                ));
            }
        };
        Ok(StackName {
            name,
            kind,
            host,
            wrappers: Vec::new(),
        })
    }

    /// A name of [`NAMES`], else a spec string of the C ABI, with the options it sets
    /// over `defaults` (the command line's).
    pub fn parse_with(text: &str, defaults: &Options) -> Result<(StackName, Options), String> {
        if let Ok(name) = StackName::parse(text) {
            return Ok((name, *defaults));
        }
        let spec = memres::spec::Spec::parse(text).map_err(|e| {
            format!(
                "unknown resource {:?}: neither one of {NAMES} nor a spec string ({})",
                excerpt(text),
                excerpt(&e.to_string())
            )
        })?;
        let mut options = *defaults;
        let mut wrappers = Vec::new();
        let kind = from_spec(&spec, &mut options, &mut wrappers);
        wrappers.reverse(); // innermost first
        Ok((
            StackName {
                name: text.trim().to_owned(),
                kind,
                host: false,
                wrappers,
            },
            options,
        ))
    }
}

/// The sub-allocator of `spec` (its options set in `options`), collecting its adaptors
/// outermost first. Two options of the C ABI do not apply to a replay: `virtual_pool`'s
/// `reserve=` (a replay reserves what its memory source has) and `cuda_async`'s sizes (the
/// replay's driver pool keeps its defaults).
fn from_spec(
    spec: &memres::spec::Spec,
    options: &mut Options,
    wrappers: &mut Vec<Wrapper>,
) -> Kind {
    use memres::spec::Spec;
    match spec {
        Spec::Cuda => Kind::Direct,
        Spec::CudaAsync { .. } => Kind::CudaAsync,
        Spec::Pool {
            initial,
            max,
            growth,
        } => {
            options.initial_size = initial.unwrap_or(options.initial_size);
            options.max_size = max.or(options.max_size);
            options.growth = *growth;
            Kind::Pool
        }
        Spec::VirtualPool {
            initial,
            max,
            step,
            release,
            reserve: _,
        } => {
            options.initial_size = initial.unwrap_or(options.initial_size);
            options.max_size = max.or(options.max_size);
            options.step = step.or(options.step);
            options.release = release.or(options.release);
            Kind::VirtualPool
        }
        Spec::Arena { size } => {
            options.arena_size = size.or(options.arena_size);
            Kind::Arena
        }
        Spec::Binning { min, max } => {
            (options.bin_min, options.bin_max) = (*min, *max);
            Kind::Binning
        }
        Spec::WithStatistics(inner) => {
            wrappers.push(Wrapper::Statistics);
            from_spec(inner, options, wrappers)
        }
        Spec::Limited { inner, limit } => {
            wrappers.push(Wrapper::Limiting(*limit));
            from_spec(inner, options, wrappers)
        }
        Spec::Logged {
            inner,
            file,
            exact_times,
        } => {
            wrappers.push(Wrapper::Logging(file.clone(), *exact_times));
            from_spec(inner, options, wrappers)
        }
    }
}

/// Puts `wrappers` (innermost first) over the stack's top.
pub fn wrap(mut stack: Stack, wrappers: &[Wrapper]) -> Result<Stack, Error> {
    for w in wrappers {
        let top = std::mem::replace(&mut stack.top, AnyResource::new(memres::HostHeap));
        stack.top = match w {
            Wrapper::Statistics => AnyResource::new(memres::adaptor::Statistics::new(top)),
            Wrapper::Limiting(limit) => {
                AnyResource::new(memres::adaptor::Limiting::new(top, *limit))
            }
            Wrapper::Logging(file, exact_times) => AnyResource::new(
                match file {
                    Some(path) => memres::adaptor::Logging::to_file(top, path)?,
                    None => memres::adaptor::Logging::from_env(top)?,
                }
                .exact_times(*exact_times),
            ),
        };
    }
    Ok(stack)
}

/// Sizes and shapes of the sub-allocators.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    pub initial_size: usize,
    pub max_size: Option<usize>,
    /// The arena's size; `None`: half the memory.
    pub arena_size: Option<usize>,
    pub bin_min: u32,
    pub bin_max: u32,
    pub fixed_block: usize,
    /// The smallest growth of a pool that grows in place (spec `step=`).
    pub step: Option<usize>,
    /// Free bytes above which a pool gives memory back (spec `release=`).
    pub release: Option<usize>,
    /// How a pool over chunks grows (spec `growth=`).
    pub growth: Growth,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            initial_size: 0,
            max_size: None,
            arena_size: None,
            bin_min: 10,
            bin_max: 22,
            fixed_block: 1 << 20,
            step: None,
            release: None,
            growth: Growth::default(),
        }
    }
}

/// A built stack: the top that replays go through (erased: stacks differ in type), the
/// footprint it takes from its memory, and the pool's figures where it has a pool.
pub struct Stack {
    pub top: AnyResource<()>,
    footprint: Box<dyn Fn() -> memres::adaptor::Counter + Send + Sync>,
    pool: Option<PoolFigures>,
}

/// Reads a pool's figures.
type PoolFigures = Box<dyn Fn() -> PoolStats + Send + Sync>;

impl Stack {
    /// Bytes the stack holds from its memory: now, and the most it held.
    pub fn footprint(&self) -> memres::adaptor::Counter {
        (self.footprint)()
    }

    /// The pool's figures (size, free bytes, largest free block), where there is a pool.
    pub fn pool_stats(&self) -> Option<PoolStats> {
        self.pool.as_ref().map(|f| f())
    }
}

/// `memory` with every block it hands out counted in the returned counter (exact: the
/// replay interleaves threads, where `Statistics`' per-thread counting may be off by a
/// few ops).
fn counted<U>(
    memory: U,
) -> (
    impl Resource<Properties = U::Properties> + Send + Sync + 'static,
    Arc<ExactCounter>,
)
where
    U: Resource + Send + Sync + 'static,
{
    let footprint = Arc::new(ExactCounter::default());
    let memory = Arc::new(memory);
    let (up, count) = (Arc::clone(&memory), Arc::clone(&footprint));
    let allocate = move |l: Layout, s: StreamRef<'_>| {
        let p = up.allocate(s, l)?;
        count.add(l.size() as i64); // a layout's size is at most isize::MAX
        Ok(p)
    };
    let count = Arc::clone(&footprint);
    let deallocate = move |p: NonNull<u8>, l: Layout, s: StreamRef<'_>| {
        count.sub(l.size() as i64);
        // SAFETY: `Callback` hands back only blocks `allocate` returned, from `memory`
        // with this layout, under `Resource::deallocate`'s contract.
        unsafe { memory.deallocate(s, p, l) }
    };
    // SAFETY: every call goes to `memory`, which keeps the contract; the closures only
    // count.
    (
        unsafe { Callback::<U::Properties>::new(allocate, deallocate) },
        footprint,
    )
}

/// The pools' configuration from the options.
fn pool_config(options: &Options) -> PoolConfig {
    let mut config = PoolConfig::new()
        .initial_size(options.initial_size)
        .growth(options.growth);
    if let Some(max) = options.max_size {
        config = config.maximum_size(max);
    }
    if let Some(step) = options.step {
        config = config.growth_step(step);
    }
    if let Some(release) = options.release {
        config = config.release_threshold(release);
    }
    config
}

/// Builds `kind` over `memory` (counted, to measure the footprint).
/// `total` is the memory's size, for the arena's default.
pub fn build<U>(kind: Kind, memory: U, total: usize, options: &Options) -> Result<Stack, Error>
where
    U: Resource + Send + Sync + 'static,
    U::Properties: Contains<()>,
{
    let (memory, count) = counted(memory);
    let counted = Arc::new(memory);
    let footprint = Box::new(move || count.read());
    let pool_config = || pool_config(options);
    let (top, pool): (AnyResource<()>, Option<PoolFigures>) = match kind {
        Kind::Pool => {
            let pool = Arc::new(Pool::new(Arc::clone(&counted), pool_config())?);
            let stats = Arc::clone(&pool);
            (
                AnyResource::new(pool),
                Some(Box::new(move || stats.stats())),
            )
        }
        Kind::Arena => {
            let size = options.arena_size.unwrap_or(total / 2);
            (
                AnyResource::new(Arena::with_size(Arc::clone(&counted), size)?),
                None,
            )
        }
        Kind::Fixed => (
            AnyResource::new(FixedSize::with_block_size(
                Arc::clone(&counted),
                options.fixed_block,
                128,
            )?),
            None,
        ),
        Kind::Direct | Kind::CudaAsync | Kind::Managed => {
            (AnyResource::new(Arc::clone(&counted)), None)
        }
        Kind::VirtualPool | Kind::Binning => {
            return Err(Error::invalid_argument(format!(
                "{kind:?} is built over a virtual-memory leaf (build_virtual)"
            )));
        }
    };
    Ok(Stack {
        top,
        footprint,
        pool,
    })
}

/// A pool that grows in place over `leaf` (its footprint: the bytes the leaf has mapped),
/// alone (`Kind::VirtualPool`) or with `binning`'s bins over it (`Kind::Binning`).
pub fn build_virtual<B>(leaf: Virtual<B>, options: &Options, bins: bool) -> Result<Stack, Error>
where
    B: Backend + Send + Sync + 'static,
    B::Properties: Contains<()>,
{
    let pool = Arc::new(leaf.pool_in_place(pool_config(options))?);
    let (held, stats) = (Arc::clone(&pool), Arc::clone(&pool));
    let top = if bins {
        AnyResource::new(Binning::new(pool, options.bin_min, options.bin_max)?)
    } else {
        AnyResource::new(pool)
    };
    Ok(Stack {
        top,
        footprint: Box::new(move || memres::adaptor::Counter {
            current: held.upstream().mapped_bytes() as i64,
            peak: held.upstream().peak_mapped_bytes() as i64,
            total: 0,
        }),
        pool: Some(Box::new(move || stats.stats())),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kinds that need a virtual-memory leaf are refused over any other memory (the
    /// replay builds them with `build_virtual`), as an error, not a stack of another kind.
    #[test]
    fn kinds_over_virtual_memory_are_refused_over_other_memory() {
        for kind in [Kind::VirtualPool, Kind::Binning] {
            let built = build(kind, memres::HostHeap, 1 << 30, &Options::default());
            assert!(matches!(built, Err(Error::InvalidArgument(_))), "{kind:?}");
        }
    }

    /// `build_virtual` puts `binning`'s bins over the pool when asked: a small request
    /// then takes a whole bin's chunk from the pool.
    #[test]
    fn build_virtual_puts_bins_over_the_pool() {
        let leaf = || memres::HostVirtual::new(1 << 30, 2 << 20).unwrap();
        let options = Options::default();
        for (bins, mapped) in [(false, false), (true, true)] {
            let stack = build_virtual(leaf(), &options, bins).unwrap();
            let (l, s) = (Layout::from_size_align(100, 8).unwrap(), StreamRef::HOST);
            let p = stack.top.allocate(s, l).unwrap();
            // The bins took their first chunks (128 blocks each) when they were made.
            assert_eq!(
                (stack.footprint)().current > (2 << 20),
                mapped,
                "bins: {bins}"
            );
            // SAFETY: allocated above with `l` on `s`.
            unsafe { stack.top.deallocate(s, p, l) };
        }
    }
}
