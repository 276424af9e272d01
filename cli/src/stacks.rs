//! The resource stacks a replay can run through, by name or spec string, built by the
//! library's spec builder (`memres::spec`) over a memory source.

use std::fmt;
use std::sync::Arc;

use std::alloc::Layout;
use std::ptr::NonNull;

use memres::adaptor::{Counter, ExactCounter, StatisticsSnapshot};
use memres::device::DeviceId;
use memres::property::Contains;
use memres::spec::{Built, LeafOptions, Spec, Target};
use memres::suballoc::PoolStats;
use memres::upstream::{Backend, CudaAsync, CudaAsyncConfig, Managed, PinnedHost, Virtual};
use memres::{AnyResource, Error, HostHeap, Resource, StreamRef, SyncResource};

/// Where the memory comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Memory {
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

/// A stack by name: `pool`, `virtual_pool`, `arena`, `binning`, `fixed_size`, `cuda`,
/// `cuda_async`, `managed` (the spec strings' names; the older `virtual-pool`,
/// `cuda-async` and `fixed` work too, with a note saying so), the host variants `host`,
/// `host-pool`, `host-virtual_pool`, `host-arena`, `host-binning`, `host-fixed_size`
/// (that stack over host memory, whatever the replay's memory is); or a spec string
/// (`statistics(pool:initial=1GiB)`, the grammar of `memres::spec`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StackName {
    pub name: String,
    /// The stack.
    pub spec: Spec,
    /// Host memory whatever the memory source is.
    pub host: bool,
}

pub(crate) const NAMES: &str = "pool, virtual_pool, arena, binning, fixed_size, cuda, cuda_async, managed, host, host-pool, host-virtual_pool, host-arena, host-binning, host-fixed_size";

/// At most the first 80 characters of `text`, marked where cut: errors quote what was
/// given without echoing a whole file's worth of it.
fn excerpt(text: &str) -> String {
    const MOST: usize = 80;
    match text.char_indices().nth(MOST) {
        Some((cut, _)) => format!("{}... ({} bytes in all)", &text[..cut], text.len()),
        None => text.to_owned(),
    }
}

/// A message shown whole up to 600 characters; past that its first and last 300,
/// with what was left out counted between them (a spec parser's message quotes the
/// spec, and the reason is often at its end).
pub(crate) fn bounded(message: &str) -> String {
    const HALF: usize = 300;
    let chars = message.chars().count();
    if chars <= 2 * HALF {
        return message.to_owned();
    }
    let head: String = message.chars().take(HALF).collect();
    let tail: String = message.chars().skip(chars - HALF).collect();
    let left_out = message.len() - head.len() - tail.len();
    format!("{head} ... ({left_out} bytes left out) ... {tail}")
}

impl StackName {
    /// A name of [`NAMES`] (the stack with the command line's `options`). An option
    /// that breaks the spec form's rules is an error in that form's words.
    pub(crate) fn parse(text: &str, options: &Options) -> Result<StackName, String> {
        let Some((name, host, base)) = Self::known(text) else {
            return Err(format!(
                "unknown resource {:?} (expected one of {NAMES})",
                excerpt(text)
            ));
        };
        if let Some(old) = ["virtual-pool", "cuda-async", "fixed"]
            .into_iter()
            .find(|old| name.ends_with(old))
        {
            eprintln!("memres: note: {old:?} is spelled {base:?} now, as in spec strings");
        }
        let mut spec = Spec::parse(&base).map_err(|e| e.to_string())?;
        options.apply(&mut spec, true)?;
        Ok(StackName { name, spec, host })
    }

    /// The name (lower case), whether it is a host variant, and its spec word, where
    /// `text` is one of [`NAMES`] (or an earlier spelling of one).
    fn known(text: &str) -> Option<(String, bool, String)> {
        let name = text.trim().to_ascii_lowercase();
        let (host, base) = match name.strip_prefix("host-") {
            Some(base) => (true, base),
            None if name == "host" => (true, "cuda"),
            None => (false, name.as_str()),
        };
        // The spellings of earlier versions are taken (`parse` notes the new one).
        let base = match base {
            "fixed" => "fixed_size",
            "virtual-pool" => "virtual_pool",
            "cuda-async" => "cuda_async",
            other => other,
        };
        let known = match base {
            "pool" | "virtual_pool" | "arena" | "binning" | "fixed_size" | "cuda" => true,
            "cuda_async" | "managed" => !host,
            _ => false,
        };
        let base = base.to_owned();
        known.then_some((name, host, base))
    }

    /// A name of [`NAMES`], else a spec string: the command line's `options` fill what
    /// the spec leaves to its default. Errors are shown whole ([`bounded`]).
    pub(crate) fn parse_with(text: &str, options: &Options) -> Result<StackName, String> {
        if Self::known(text).is_some() {
            return StackName::parse(text, options);
        }
        let mut spec = Spec::parse(text).map_err(|e| {
            format!(
                "unknown resource {:?}: not one of {NAMES}, and not a spec string: {}",
                excerpt(text),
                bounded(e.message())
            )
        })?;
        options.apply(&mut spec, false)?;
        Ok(StackName {
            name: text.trim().to_owned(),
            spec,
            host: false,
        })
    }
}

/// Sizes and shapes of the sub-allocators, from the command line.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Options {
    pub initial_size: usize,
    pub max_size: Option<usize>,
    /// The arena's size; `None`: half the memory.
    pub arena_size: Option<usize>,
    pub bin_min: u32,
    pub bin_max: u32,
    pub fixed_block: usize,
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
        }
    }
}

impl Options {
    /// Puts the options into `spec`'s base where it leaves them to their defaults; a
    /// plain `name`'s bins and block size too (a spec string's are its own), checked by
    /// the spec form's rules (`--bin-min 40 --bin-max 2` is refused as
    /// `binning:min=40,max=2` is). One option of spec strings does not apply to a
    /// replay: `virtual_pool`'s `reserve=` (a replay reserves what its memory source has).
    fn apply(&self, spec: &mut Spec, name: bool) -> Result<(), String> {
        if name && matches!(spec.base_mut(), Spec::Binning { .. }) {
            let text = format!("binning:min={},max={}", self.bin_min, self.bin_max);
            *spec.base_mut() = Spec::parse(&text).map_err(|e| {
                format!(
                    "--bin-min {} --bin-max {}: {}",
                    self.bin_min,
                    self.bin_max,
                    e.message()
                )
            })?;
        }
        match spec.base_mut() {
            Spec::Pool { initial, max, .. } | Spec::VirtualPool { initial, max, .. } => {
                initial.get_or_insert(self.initial_size);
                if max.is_none() {
                    *max = self.max_size;
                }
            }
            Spec::Arena { size } if size.is_none() => *size = self.arena_size,
            Spec::FixedSize { block, .. } if name => *block = self.fixed_block,
            _ => {}
        }
        Ok(())
    }
}

/// A built stack: the top that replays go through (erased: stacks differ in type), the
/// footprint it takes from its memory, and the pool's figures where it has a pool.
pub(crate) struct Stack {
    pub top: AnyResource<()>,
    footprint: Box<dyn Fn() -> Counter + Send + Sync>,
    pool: Option<PoolFigures>,
    tiers: Option<TierFigures>,
}

/// Reads a pool's figures.
type PoolFigures = Box<dyn Fn() -> PoolStats + Send + Sync>;

/// Reads a `fallback(..)`'s figures per tier.
type TierFigures = Box<dyn Fn() -> [StatisticsSnapshot; 2] + Send + Sync>;

impl Stack {
    /// Bytes the stack holds from its memory: now, and the most it held.
    pub(crate) fn footprint(&self) -> Counter {
        (self.footprint)()
    }

    /// The pool's figures (size, free bytes, largest free block), where there is a pool.
    pub(crate) fn pool_stats(&self) -> Option<PoolStats> {
        self.pool.as_ref().map(|f| f())
    }

    /// What each tier of a `fallback(..)` served, where the stack has one.
    pub(crate) fn tiers(&self) -> Option<[StatisticsSnapshot; 2]> {
        self.tiers.as_ref().map(|f| f())
    }
}

/// `U` with every block it hands out counted (exact: the replay interleaves threads,
/// where `Statistics`' per-thread counting may be off by a few ops).
pub(crate) struct Counted<U> {
    memory: Arc<U>,
    count: Arc<ExactCounter>,
}

impl<U> PartialEq for Counted<U> {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.memory, &other.memory)
    }
}

// SAFETY: every call goes to `memory`, which keeps the contract; the wrapper only counts.
unsafe impl<U: Resource> SyncResource for Counted<U> {
    type Properties = U::Properties;

    fn allocate_sync(&self, layout: Layout) -> Result<NonNull<u8>, Error> {
        let p = self.memory.allocate_sync(layout)?;
        self.count.add(layout.size() as i64); // a layout's size is at most isize::MAX
        Ok(p)
    }

    unsafe fn deallocate_sync(&self, ptr: NonNull<u8>, layout: Layout) {
        self.count.sub(layout.size() as i64);
        // SAFETY: the caller hands back a block `allocate_sync` returned, from `memory`
        // with this layout.
        unsafe { self.memory.deallocate_sync(ptr, layout) }
    }
}

// SAFETY: as for `SyncResource` above.
unsafe impl<U: Resource> Resource for Counted<U> {
    fn allocate(&self, stream: StreamRef<'_>, layout: Layout) -> Result<NonNull<u8>, Error> {
        let p = self.memory.allocate(stream, layout)?;
        self.count.add(layout.size() as i64);
        Ok(p)
    }

    unsafe fn deallocate(&self, stream: StreamRef<'_>, ptr: NonNull<u8>, layout: Layout) {
        self.count.sub(layout.size() as i64);
        // SAFETY: the caller hands back a block `allocate` returned, from `memory` with
        // this layout, under `Resource::deallocate`'s contract.
        unsafe { self.memory.deallocate(stream, ptr, layout) }
    }
}

/// What makes a replay's virtual-memory leaf, given the spec's granule (if any).
type MakeLeaf<B> = dyn FnMut(Option<usize>) -> Result<Virtual<B>, Error>;

/// A replay's memory for the spec builder: `memory` (counted) for chunks and `cuda`,
/// `leaf` for a `virtual_pool`, the driver's pool and managed memory where `gpu`.
pub(crate) struct Replay<U, B: Backend> {
    memory: Arc<U>,
    count: Arc<ExactCounter>,
    /// Makes a leaf of the granule given (`None`: the replay's default).
    leaf: Box<MakeLeaf<B>>,
    /// The size of an arena whose spec gives none.
    arena_size: usize,
    gpu: bool,
    /// Set where a `virtual_pool` is built: its leaf's mapped bytes.
    mapped: Option<Box<dyn Fn() -> Counter + Send + Sync>>,
    pool: Option<PoolFigures>,
    tiers: Option<TierFigures>,
}

impl<U, B> Replay<U, B>
where
    U: Resource<Properties: Contains<()>> + Send + Sync + 'static,
    B: Backend<Properties: Contains<()>>,
{
    pub(crate) fn new(
        memory: U,
        leaf: impl FnMut(Option<usize>) -> Result<Virtual<B>, Error> + 'static,
        arena_size: usize,
        gpu: bool,
    ) -> Self {
        Replay {
            memory: Arc::new(memory),
            count: Arc::default(),
            leaf: Box::new(leaf),
            arena_size,
            gpu,
            mapped: None,
            pool: None,
            tiers: None,
        }
    }

    /// Builds `spec` over this memory. The footprint is what the stack's virtual-memory
    /// leaf mapped where it has one, else the bytes it took from the memory.
    pub(crate) fn build(mut self, spec: &Spec) -> Result<Stack, Error> {
        let top = spec.build(&mut self)?;
        let count = self.count;
        Ok(Stack {
            top,
            footprint: self
                .mapped
                .unwrap_or_else(|| Box::new(move || count.read())),
            pool: self.pool,
            tiers: self.tiers,
        })
    }

    fn counted<V>(&self, memory: V) -> AnyResource<()>
    where
        V: Resource<Properties: Contains<()>> + Send + Sync + 'static,
    {
        AnyResource::new(Counted {
            memory: Arc::new(memory),
            count: Arc::clone(&self.count),
        })
    }
}

impl<U, B> Target for Replay<U, B>
where
    U: Resource<Properties: Contains<()>> + Send + Sync + 'static,
    B: Backend<Properties: Contains<()>>,
{
    type Properties = ();
    type Memory = Counted<U>;
    type Backend = B;

    fn memory(&mut self) -> Result<Counted<U>, Error> {
        Ok(Counted {
            memory: Arc::clone(&self.memory),
            count: Arc::clone(&self.count),
        })
    }

    fn virtual_leaf(&mut self, leaf: &LeafOptions) -> Result<Virtual<B>, Error> {
        (self.leaf)(leaf.granule)
    }

    fn arena_size(&mut self) -> Result<usize, Error> {
        Ok(self.arena_size)
    }

    /// The driver's pool on device 0 with the spec's `initial=` and `release=`.
    fn driver_pool(
        &mut self,
        initial: Option<usize>,
        release_threshold: Option<u64>,
    ) -> Result<AnyResource<()>, Error> {
        if !self.gpu {
            return Err(Error::unsupported("cuda_async without a GPU"));
        }
        let config = CudaAsyncConfig::new()
            .initial_size(initial)
            .release_threshold(release_threshold);
        Ok(self.counted(CudaAsync::on(DeviceId::new(0), config)?))
    }

    fn managed(&mut self) -> Result<AnyResource<()>, Error> {
        if !self.gpu {
            return Err(Error::unsupported("managed memory without a GPU"));
        }
        Ok(self.counted(Managed::new()?))
    }

    /// Pinned host memory on a GPU; host memory elsewhere (what a replay on simulated
    /// device memory falls back to). Host memory: not in the device footprint.
    fn pinned(&mut self) -> Result<AnyResource<()>, Error> {
        if self.gpu {
            Ok(AnyResource::new(PinnedHost::new()?))
        } else {
            Ok(AnyResource::new(HostHeap))
        }
    }

    fn built(&mut self, layer: Built<'_, Self>) {
        match layer {
            Built::ChunkedPool(pool) => {
                let pool = Arc::clone(pool);
                self.pool = Some(Box::new(move || pool.stats()));
            }
            Built::Tiers(tiers) => {
                let tiers = Arc::clone(tiers);
                self.tiers = Some(Box::new(move || tiers.tiers()));
            }
            Built::VirtualPool(pool) => {
                let (held, stats) = (Arc::clone(pool), Arc::clone(pool));
                self.mapped = Some(Box::new(move || Counter {
                    current: held.upstream().mapped_bytes() as i64,
                    peak: held.upstream().peak_mapped_bytes() as i64,
                    total: 0,
                }));
                self.pool = Some(Box::new(move || stats.stats()));
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use memres::suballoc::Growth;

    fn host(spec: &str) -> Result<Stack, Error> {
        let leaf =
            |g: Option<usize>| memres::upstream::HostVirtual::new(1 << 30, g.unwrap_or(2 << 20));
        let name = StackName::parse_with(spec, &Options::default()).unwrap();
        Replay::new(memres::HostHeap, leaf, 64 << 20, false).build(&name.spec)
    }

    /// `binning` puts its bins over a pool growing in place: a small request then takes
    /// a whole bin's chunk, and the footprint is what the leaf mapped.
    #[test]
    fn binning_puts_bins_over_the_virtual_pool() {
        for (name, mapped) in [("virtual_pool", false), ("binning", true)] {
            let stack = host(name).unwrap();
            let (l, s) = (Layout::from_size_align(100, 8).unwrap(), StreamRef::HOST);
            let p = stack.top.allocate(s, l).unwrap();
            // The bins took their first chunks (128 blocks each) when they were made.
            assert_eq!(stack.footprint().current > (2 << 20), mapped, "{name}");
            assert!(stack.pool_stats().is_some(), "{name}");
            // SAFETY: allocated above with `l` on `s`.
            unsafe { stack.top.deallocate(s, p, l) };
        }
    }

    /// A spec's `granule=` reaches the replay's leaf: one small block maps one granule.
    #[test]
    fn a_specs_granule_is_replayed() {
        for (name, granule) in [
            ("virtual_pool", 2 << 20),
            ("virtual_pool:granule=8MiB", 8 << 20),
        ] {
            let stack = host(name).unwrap();
            let (l, s) = (Layout::from_size_align(100, 8).unwrap(), StreamRef::HOST);
            let p = stack.top.allocate(s, l).unwrap();
            assert_eq!(stack.footprint().current, granule, "{name}");
            // SAFETY: allocated above with `l` on `s`.
            unsafe { stack.top.deallocate(s, p, l) };
        }
    }

    /// Without a GPU, the driver's pool and managed memory are refused as unsupported,
    /// not built over other memory.
    #[test]
    fn gpu_only_stacks_are_refused_without_a_gpu() {
        for name in ["cuda_async", "managed"] {
            assert!(matches!(host(name), Err(Error::Unsupported(_))), "{name}");
        }
    }

    /// Plain names take the command line's options; spec strings keep their own and
    /// take the command line's only where they leave an option to its default.
    #[test]
    fn options_fill_what_a_spec_leaves_open() {
        let options = Options {
            initial_size: 1 << 20,
            max_size: Some(1 << 30),
            bin_min: 12,
            fixed_block: 4096,
            ..Options::default()
        };
        let spec = |text| StackName::parse_with(text, &options).unwrap().spec;
        let pool = |initial, max| Spec::Pool {
            initial: Some(initial),
            max: Some(max),
            growth: Growth::default(),
        };
        assert_eq!(spec("pool"), pool(1 << 20, 1 << 30));
        assert_eq!(spec("pool:initial=2MiB"), pool(2 << 20, 1 << 30));
        assert_eq!(spec("binning"), Spec::Binning { min: 12, max: 22 });
        assert_eq!(spec("binning:min=11"), Spec::Binning { min: 11, max: 22 });
        assert_eq!(
            spec("fixed"),
            Spec::FixedSize {
                block: 4096,
                blocks: 128
            }
        );
        assert!(StackName::parse("host-cuda_async", &options).is_err());
    }
}
