//! Building the stack a [`Spec`] names: one set of rules and defaults for every program
//! that reads specs (the C ABI, `MEMRES_RESOURCE`, the `memres` command, the fuzz
//! target). A program says what its leaves are with a [`Target`]; the layers are built
//! here.

use std::path::Path;
use std::sync::Arc;

use super::Spec;
use crate::adaptor::{Fallback, Limiting, Logging, Statistics};
use crate::property::Contains;
use crate::suballoc::{
    Arena, Binning, FixedSize, Pool, PoolConfig, VirtualPool, VirtualPoolConfig,
};
use crate::upstream::{Backend, Virtual};
use crate::{AnyResource, Error, Resource};

/// What a `virtual_pool`'s spec asks of its leaf ([`Target::virtual_leaf`]); `None` leaves
/// the choice to the target.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LeafOptions {
    /// `reserve=`: bytes of address space to reserve.
    pub reserve: Option<usize>,
    /// `granule=`: the bytes mapped, and given back, at a time: a power of two, which the
    /// target uses as its leaf takes it (`CudaVirtual` raises it to the device's minimum,
    /// `HostVirtual` refuses one below 4 KiB). A struct of public fields: a later option
    /// is a new field. Larger granules make fewer driver calls: a sleep
    /// and wake of 20 GiB make 10,240 `cuMemCreate`s and `cuMemMap`s at 2 MiB, 640 at
    /// 32 MiB; but a pool grows and gives back whole granules.
    pub granule: Option<usize>,
}

/// The leaves a spec is built over, and where the program keeps handles on the layers
/// it will read later (figures, trimming, flushing logs).
///
/// The defaults are the C ABI's: a `virtual_pool`'s leaf reserves what the target
/// decides, an `arena` without `size=` takes [`arena_size`](Target::arena_size).
///
/// ```
/// use memres::spec::{LeafOptions, Spec, Target};
/// use memres::upstream::{HostPages, Virtual};
/// use memres::{
///     AnyResource, Error, Host, HostHeap, Resource, StreamRef, layout,
///     upstream::HostVirtual,
/// };
///
/// /// Host memory: heap blocks, and a 1 GiB reservation of 2 MiB granules.
/// struct OnTheHost;
///
/// impl Target for OnTheHost {
///     type Properties = Host;
///     type Memory = HostHeap;
///     type Backend = HostPages;
///
///     fn memory(&mut self) -> Result<HostHeap, Error> {
///         Ok(HostHeap)
///     }
///     fn virtual_leaf(&mut self, leaf: &LeafOptions) -> Result<HostVirtual, Error> {
///         HostVirtual::new(leaf.reserve.unwrap_or(1 << 30), leaf.granule.unwrap_or(2 << 20))
///     }
///     fn arena_size(&mut self) -> Result<usize, Error> {
///         Ok(64 << 20)
///     }
/// }
///
/// let stack: AnyResource<Host> = Spec::parse("statistics(virtual_pool)")?.build(&mut OnTheHost)?;
/// let l = layout(4096)?;
/// let p = stack.allocate(StreamRef::HOST, l)?;
/// // SAFETY: allocated just above with `l` on the same stream; not used afterwards.
/// unsafe { stack.deallocate(StreamRef::HOST, p, l) };
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub trait Target {
    /// What every layer of the built stack gives (e.g. [`Device`](crate::Device)).
    type Properties: Contains<Self::Properties>;
    /// The memory `cuda`, `pool`, `arena` and `fixed_size` take from (`Cuda` for the C
    /// ABI).
    type Memory: Resource<Properties: Contains<Self::Properties>> + Send + Sync + 'static;
    /// The backend of the leaf a `virtual_pool` grows in.
    type Backend: Backend<Properties: Contains<Self::Properties>>;

    /// The memory, for one layer (called once per layer that takes from it).
    fn memory(&mut self) -> Result<Self::Memory, Error>;

    /// A virtual-memory leaf for a `virtual_pool`, with the spec's `reserve=` and
    /// `granule=` where it gives them ([`LeafOptions`]; `None`: the target's default).
    fn virtual_leaf(&mut self, leaf: &LeafOptions) -> Result<Virtual<Self::Backend>, Error>;

    /// The size of an `arena` whose spec gives none (the C ABI's: half the device's free
    /// memory).
    fn arena_size(&mut self) -> Result<usize, Error>;

    /// The driver's stream-ordered pool of `cuda_async`. By default, refused as
    /// [`Error::Unsupported`].
    fn driver_pool(
        &mut self,
        initial: Option<usize>,
        release_threshold: Option<u64>,
    ) -> Result<AnyResource<Self::Properties>, Error> {
        let _ = (initial, release_threshold);
        Err(Error::unsupported(
            "cuda_async (a driver pool) on this target",
        ))
    }

    /// Managed memory, for `managed`. By default, refused as [`Error::Unsupported`].
    fn managed(&mut self) -> Result<AnyResource<Self::Properties>, Error> {
        Err(Error::unsupported("managed memory on this target"))
    }

    /// Pinned host memory, for `pinned` and under `pinned_pool`. By default, refused as
    /// [`Error::Unsupported`].
    fn pinned(&mut self) -> Result<AnyResource<Self::Properties>, Error> {
        Err(Error::unsupported("pinned host memory on this target"))
    }

    /// A layer just built, for the target to keep a handle on. By default, none is kept.
    fn built(&mut self, layer: Built<'_, Self>) {
        let _ = layer;
    }

    /// What the stack's outermost wrappers (`statistics(..)`, `logging(..)`,
    /// `limiting(..)`: every one above [`Spec::base`]) go over, given the base built
    /// (called once per build, after the base's layers were shown to
    /// [`built`](Target::built)). By default the base itself. The C ABI puts its
    /// address router here, the base its default member and the tags' pools its others,
    /// so that the spec's statistics, limit and log see every block, tagged ones too.
    ///
    /// # Errors
    /// The target's error, which the build returns.
    fn base(
        &mut self,
        base: AnyResource<Self::Properties>,
    ) -> Result<AnyResource<Self::Properties>, Error> {
        Ok(base)
    }
}

/// A stack as `Spec::build_ranged` makes it: with the address range all its blocks lie
/// in, where it knows one.
type Ranged<P> = (AnyResource<P>, Option<(usize, usize)>);

/// A `fallback(..)` as [`Spec::build`] makes it: two erased tiers.
pub type Tiers<P> = Fallback<AnyResource<P>, AnyResource<P>, P>;

/// A layer [`Spec::build`] made, shown to [`Target::built`] (inner layers first). (The
/// variants are not named as the types they hold, whose names rustc would then print
/// with their whole paths in its messages; but for `VirtualPool`, named as its spec word
/// and its type alike.)
#[non_exhaustive]
pub enum Built<'a, T: Target + ?Sized> {
    /// A chunked `pool`.
    ChunkedPool(&'a Arc<Pool<T::Memory>>),
    /// A `virtual_pool`, growing in place.
    VirtualPool(&'a Arc<VirtualPool<Virtual<T::Backend>>>),
    /// An `arena`.
    SuperblockArena(&'a Arc<Arena<T::Memory>>),
    /// A `statistics(..)` layer.
    WithStatistics(&'a Arc<Statistics<AnyResource<T::Properties>>>),
    /// A `logging(..)` layer.
    Logged(&'a Arc<Logging<AnyResource<T::Properties>>>),
    /// A `fallback(..)`: its two tiers, with their figures.
    Tiers(&'a Arc<Tiers<T::Properties>>),
    /// A `pinned_pool`: a chunked pool over the target's [pinned](Target::pinned) memory.
    PinnedPool(&'a Arc<Pool<AnyResource<T::Properties>>>),
    /// A `binning`'s bins (the virtual pool under them was shown before, as
    /// [`VirtualPool`](Built::VirtualPool)).
    Bins(&'a Arc<Binning<AnyResource<T::Properties>>>),
    /// A `fixed_size`.
    FixedBlocks(&'a Arc<FixedSize<T::Memory>>),
}

impl Spec {
    /// The stack this spec names, over `target`'s leaves, erased at its top.
    ///
    /// `binning`'s bins go over a default `virtual_pool` (the pool that holds least);
    /// `logging(..)` without `file=` logs where `MEMRES_LOG_FILE` says, else to standard
    /// error ([`Logging::from_env`]).
    pub fn build<T: Target>(&self, target: &mut T) -> Result<AnyResource<T::Properties>, Error> {
        self.build_ranged(target, true).map(|(built, _)| built)
    }

    /// [`build`](Self::build), with the address range `(base, len)` every block of the
    /// stack lies in where one virtual pool serves them all (wrappers pass their inner
    /// one's on): a `fallback(..)` tells its tiers apart by it. `outer`: this spec is the
    /// stack's, or a wrapper's of the stack's outermost chain, whose base goes through
    /// [`Target::base`] (the tiers of a `fallback(..)` and the pool under `binning` are
    /// parts of a base, not bases).
    fn build_ranged<T: Target>(
        &self,
        target: &mut T,
        outer: bool,
    ) -> Result<Ranged<T::Properties>, Error> {
        let (built, range) = self.build_layer(target, outer)?;
        if !outer || self.is_wrapper() {
            return Ok((built, range));
        }
        // What the target puts here may hand out blocks outside the base's range; and
        // nothing outside this stack reads its range.
        Ok((target.base(built)?, None))
    }

    /// Whether this spec is a wrapper (`statistics(..)`, `logging(..)`, `limiting(..)`).
    fn is_wrapper(&self) -> bool {
        matches!(
            self,
            Spec::Statistics(_) | Spec::Logging { .. } | Spec::Limiting { .. }
        )
    }

    /// The layer this spec names, over its inner specs built first (wrappers pass
    /// `outer` on to theirs).
    // long: one arm per spec word, each building one layer; a split only moves the match.
    fn build_layer<T: Target>(
        &self,
        target: &mut T,
        outer: bool,
    ) -> Result<Ranged<T::Properties>, Error> {
        Ok(match self {
            Spec::Cuda => (AnyResource::new(target.memory()?), None),
            Spec::CudaAsync {
                initial,
                release_threshold,
            } => (target.driver_pool(*initial, *release_threshold)?, None),
            Spec::Managed => (target.managed()?, None),
            Spec::Pinned => (target.pinned()?, None),
            Spec::PinnedPool => {
                let pool = Arc::new(Pool::new(target.pinned()?, PoolConfig::new())?);
                target.built(Built::PinnedPool(&pool));
                (AnyResource::new(pool), None)
            }
            Spec::Fallback { first, then } => {
                let (first, range) = first.build_ranged(target, false)?;
                let (then, _) = then.build_ranged(target, false)?;
                let mut tiers = Fallback::<_, _, T::Properties>::new(first, then);
                if let Some((base, len)) = range {
                    // SAFETY: every block of `first` comes from one virtual pool, inside
                    // its leaf's reservation (wrappers hand out their inner blocks
                    // unchanged); `then` was built over leaves of its own, outside it.
                    tiers = unsafe { tiers.with_first_range(base, len) };
                }
                let tiers = Arc::new(tiers);
                target.built(Built::Tiers(&tiers));
                (AnyResource::new(tiers), None)
            }
            Spec::Pool {
                initial,
                max,
                growth,
            } => {
                let mut config = PoolConfig::new().growth(*growth);
                if let Some(initial) = initial {
                    config = config.initial_size(*initial);
                }
                if let Some(max) = max {
                    config = config.maximum_size(*max);
                }
                let pool = Arc::new(Pool::new(target.memory()?, config)?);
                target.built(Built::ChunkedPool(&pool));
                (AnyResource::new(pool), None)
            }
            Spec::VirtualPool {
                initial,
                max,
                step,
                release,
                reserve,
                granule,
            } => {
                let config = virtual_pool_config(*initial, *max, *step, *release);
                let leaf = target.virtual_leaf(&LeafOptions {
                    reserve: *reserve,
                    granule: *granule,
                })?;
                let pool = Arc::new(leaf.virtual_pool(config)?);
                target.built(Built::VirtualPool(&pool));
                let range = crate::upstream::GrowInPlace::reservation(pool.upstream());
                (AnyResource::new(pool), Some(range))
            }
            Spec::Arena { size } => {
                let size = match size {
                    Some(size) => *size,
                    None => target.arena_size()?,
                };
                let arena = Arc::new(Arena::with_size(target.memory()?, size)?);
                target.built(Built::SuperblockArena(&arena));
                (AnyResource::new(arena), None)
            }
            Spec::FixedSize { block, blocks } => {
                let fixed = Arc::new(FixedSize::with_block_size(
                    target.memory()?,
                    *block,
                    *blocks,
                )?);
                target.built(Built::FixedBlocks(&fixed));
                (AnyResource::new(fixed), None)
            }
            Spec::Binning { min, max } => {
                // The bins' blocks come from the pool too.
                let (pool, range) = Spec::default_spec().build_ranged(target, false)?;
                let bins = Arc::new(Binning::new(pool, *min, *max)?);
                target.built(Built::Bins(&bins));
                (AnyResource::new(bins), range)
            }
            Spec::Statistics(inner) => {
                let (inner, range) = inner.build_ranged(target, outer)?;
                let counted = Arc::new(Statistics::new(inner));
                target.built(Built::WithStatistics(&counted));
                (AnyResource::new(counted), range)
            }
            Spec::Logging {
                inner,
                file,
                exact_times,
            } => {
                let (inner, range) = inner.build_ranged(target, outer)?;
                let logged = match file {
                    Some(path) => Logging::to_file(inner, Path::new(path))?,
                    None => Logging::from_env(inner)?,
                };
                let logged = Arc::new(logged.exact_times(*exact_times));
                target.built(Built::Logged(&logged));
                (AnyResource::new(logged), range)
            }
            Spec::Limiting { inner, limit } => {
                let (inner, range) = inner.build_ranged(target, outer)?;
                (AnyResource::new(Limiting::new(inner, *limit)), range)
            }
        })
    }
}

/// A virtual pool's configuration from a spec's options; `None` keeps
/// [`VirtualPoolConfig`]'s default.
fn virtual_pool_config(
    initial: Option<usize>,
    max: Option<usize>,
    step: Option<usize>,
    release: Option<usize>,
) -> VirtualPoolConfig {
    let mut config = VirtualPoolConfig::new();
    if let Some(initial) = initial {
        config = config.initial_size(initial);
    }
    if let Some(max) = max {
        config = config.maximum_size(max);
    }
    if let Some(step) = step {
        config = config.growth_step(step);
    }
    if let Some(release) = release {
        config = config.release_threshold(release);
    }
    config
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::upstream::HostPages;
    use crate::{Host, HostHeap, StreamRef, layout, upstream::HostVirtual};

    /// Host memory, keeping what it was shown.
    #[derive(Default)]
    struct Recording {
        reserved: Vec<Option<usize>>,
        /// The granule of each virtual pool's leaf.
        granules: Vec<usize>,
        built: Vec<&'static str>,
        /// Per `fallback(..)`: whether it tells its tiers apart by address.
        by_address: Vec<bool>,
        /// What [`Target::base`] put under the wrappers: a count of the base's blocks.
        base: Option<Arc<Statistics<AnyResource<Host>>>>,
    }

    impl Target for Recording {
        type Properties = Host;
        type Memory = HostHeap;
        type Backend = HostPages;

        fn memory(&mut self) -> Result<HostHeap, Error> {
            Ok(HostHeap)
        }
        fn virtual_leaf(&mut self, leaf: &LeafOptions) -> Result<HostVirtual, Error> {
            self.reserved.push(leaf.reserve);
            HostVirtual::new(
                leaf.reserve.unwrap_or(1 << 30),
                leaf.granule.unwrap_or(64 << 10),
            )
        }
        fn arena_size(&mut self) -> Result<usize, Error> {
            Ok(4 << 20)
        }
        fn built(&mut self, layer: Built<'_, Self>) {
            self.built.push(match layer {
                Built::ChunkedPool(_) => "pool",
                Built::VirtualPool(pool) => {
                    let leaf = pool.upstream();
                    self.granules
                        .push(crate::upstream::GrowInPlace::granularity(leaf));
                    "virtual_pool"
                }
                Built::SuperblockArena(_) => "arena",
                Built::WithStatistics(_) => "statistics",
                Built::Logged(_) => "logging",
                Built::Tiers(tiers) => {
                    self.by_address.push(tiers.first_range().is_some());
                    "fallback"
                }
                Built::PinnedPool(_) => "pinned_pool",
                Built::Bins(_) => "binning",
                Built::FixedBlocks(_) => "fixed_size",
            });
        }
        fn base(&mut self, base: AnyResource<Host>) -> Result<AnyResource<Host>, Error> {
            self.built.push("base");
            let counted = Arc::new(Statistics::new(base));
            self.base = Some(Arc::clone(&counted));
            Ok(AnyResource::new(counted))
        }
    }

    fn round_trip(stack: &AnyResource<Host>, bytes: usize) -> Result<(), Error> {
        let l = layout(bytes)?;
        let p = stack.allocate(StreamRef::HOST, l)?;
        // SAFETY: allocated just above with `l` on the same stream; not used afterwards.
        unsafe { stack.deallocate(StreamRef::HOST, p, l) };
        Ok(())
    }

    /// Every base the host can give builds and serves a request; the layers are shown
    /// to the target inner first, and the virtual leaf gets the spec's reservation.
    #[test]
    fn every_host_spec_builds_and_serves() {
        for (text, shown) in [
            ("cuda", &["base"][..]),
            ("pool:initial=1MiB,growth=rmm", &["pool", "base"][..]),
            (
                "virtual_pool:reserve=256MiB,step=1MiB",
                &["virtual_pool", "base"],
            ),
            ("arena", &["arena", "base"]),
            ("fixed_size:block=8KiB,blocks=4", &["fixed_size", "base"]),
            (
                "binning:min=10,max=14",
                &["virtual_pool", "binning", "base"],
            ),
            (
                "statistics(limiting(pool, limit=1GiB))",
                &["pool", "base", "statistics"],
            ),
            (
                "fallback(limiting(pool, limit=1MiB), virtual_pool)",
                &["pool", "virtual_pool", "fallback", "base"],
            ),
        ] {
            let mut target = Recording::default();
            let stack = Spec::parse(text).unwrap().build(&mut target).unwrap();
            round_trip(&stack, 4096).unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!(target.built, shown, "{text}");
        }
        let mut target = Recording::default();
        Spec::parse("virtual_pool:reserve=256MiB")
            .unwrap()
            .build(&mut target)
            .unwrap();
        assert_eq!(target.reserved, [Some(256 << 20)]);
    }

    /// `granule=` reaches the leaf: the pool maps that many bytes at a time; one the leaf
    /// cannot take (not a power of two) is the leaf's error, not a panic.
    #[test]
    fn a_virtual_pools_granule_reaches_its_leaf() {
        for (text, granule) in [
            ("virtual_pool", 64 << 10),
            ("virtual_pool:granule=1MiB", 1 << 20),
        ] {
            let mut target = Recording::default();
            let stack = Spec::parse(text).unwrap().build(&mut target).unwrap();
            round_trip(&stack, 4096).unwrap();
            assert_eq!(target.granules, [granule], "{text}");
        }
        let mut target = Recording::default();
        let refused = Spec::parse("virtual_pool:granule=3MiB")
            .unwrap()
            .build(&mut target);
        assert!(
            matches!(refused, Err(Error::InvalidArgument(_))),
            "{refused:?}"
        );
    }

    /// A `fallback(..)` whose first tier is one virtual pool (under any wrappers) tells
    /// its tiers apart by the pool's reservation; other first tiers keep the set. Either
    /// way a block past the first tier comes and goes through the second.
    #[test]
    fn a_fallback_over_a_virtual_pool_routes_by_address() {
        for (text, by_address) in [
            (
                "fallback(statistics(limiting(virtual_pool, limit=1MiB)), pool)",
                true,
            ),
            ("fallback(logging(binning, file=/dev/null), pool)", true),
            ("fallback(limiting(pool, limit=1MiB), virtual_pool)", false),
            (
                "fallback(fallback(limiting(virtual_pool, limit=1MiB), pool), pool)",
                false,
            ),
        ] {
            let mut target = Recording::default();
            let stack = Spec::parse(text).unwrap().build(&mut target).unwrap();
            assert_eq!(target.by_address.last(), Some(&by_address), "{text}");
            round_trip(&stack, 2 << 20).unwrap_or_else(|e| panic!("{text}: {e}"));
        }
    }

    /// The target's base goes under the stack's outermost wrappers, once, and over the
    /// whole base: every block of the stack passes through it (the C ABI's router of
    /// tagged pools sits there, so the wrappers see its blocks), a `fallback(..)`'s
    /// second tier's too, and a limit counts what it serves.
    #[test]
    fn the_targets_base_goes_under_the_outermost_wrappers() {
        for (text, bytes) in [
            (
                "statistics(logging(limiting(pool, limit=8MiB), file=/dev/null))",
                1 << 20,
            ),
            (
                "fallback(limiting(virtual_pool, limit=1MiB), pool)",
                4 << 20,
            ),
            ("binning:min=10,max=14", 4096),
        ] {
            let mut target = Recording::default();
            let stack = Spec::parse(text).unwrap().build(&mut target).unwrap();
            let base = target.base.clone().expect("a base");
            let l = layout(bytes).unwrap();
            let p = stack.allocate(StreamRef::HOST, l).unwrap();
            assert_eq!(base.bytes().current, bytes as i64, "{text}");
            // SAFETY: allocated just above with `l` on the same stream; not used afterwards.
            unsafe { stack.deallocate(StreamRef::HOST, p, l) };
            assert_eq!(base.bytes().current, 0, "{text}");
            let bases = target.built.iter().filter(|b| **b == "base").count();
            assert_eq!(bases, 1, "{text}");
        }
    }

    /// What a target cannot give is an error naming it, not a stack of another kind.
    #[test]
    fn a_target_without_a_leaf_refuses_its_spec() {
        for text in [
            "cuda_async",
            "managed",
            "pinned",
            "fallback(pool, pinned_pool)",
        ] {
            let built = Spec::parse(text).unwrap().build(&mut Recording::default());
            assert!(matches!(built, Err(Error::Unsupported(_))), "{text}");
        }
    }

    /// The spec's options reach the layers: a limit refuses what is past it, a fixed
    /// block size refuses a larger request, an arena's size is what the spec says.
    #[test]
    fn options_reach_the_layers() {
        let build = |text: &str| Spec::parse(text).unwrap().build(&mut Recording::default());
        let limited = build("limiting(pool, limit=1MiB)").unwrap();
        assert!(matches!(
            round_trip(&limited, 2 << 20),
            Err(Error::OutOfMemory { .. })
        ));
        let fixed = build("fixed_size:block=8KiB,blocks=4").unwrap();
        assert!(round_trip(&fixed, 8 << 10).is_ok());
        assert!(round_trip(&fixed, 16 << 10).is_err());
        assert!(matches!(
            build("arena:size=1KiB"),
            Err(Error::InvalidArgument(_))
        ));
        // What the first tier cannot hold, the second serves.
        let tiers = build("fallback(limiting(pool, limit=1MiB), virtual_pool)").unwrap();
        assert!(round_trip(&tiers, 4 << 20).is_ok());
    }
}
