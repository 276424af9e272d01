//! `memres bench`: the standard workloads over the main stacks, on the GPU if there is
//! one, else on host memory. The workloads are `memres_workloads`, the same code
//! `benches/workloads.rs` runs.

use clap::Args;
use memres::stream::{Stream, StreamFlags};
use memres::suballoc::{Arena, Binning, FixedSize, Pool, PoolConfig};
use memres::{Cuda, HostHeap, Resource, StreamRef, upstream::CudaAsync};
use memres_workloads::{Row, Suite, suite};

#[derive(Args)]
pub(crate) struct BenchArgs {
    /// Only these stacks, comma-separated: on a GPU cuda, cuda_async, pool, arena,
    /// binning(pool), fixed_size_1MiB; on host memory host_heap, pool, arena,
    /// binning(pool), fixed_size_1MiB.
    #[arg(long, value_delimiter = ',')]
    stacks: Vec<String>,
    /// Only these workloads, comma-separated: pair-256B, pair-64KiB, pair-4MiB, random,
    /// random-mt, random-1stream (docs/workloads.md; code in workloads/src/lib.rs).
    #[arg(long, value_delimiter = ',')]
    workloads: Vec<String>,
    /// Divide every op count by this, at least 1 (the full counts take minutes on a small
    /// machine).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    scale: u64,
    /// Bytes the pools and the arena start with (default: 16 GiB on a GPU, 8 GiB of host
    /// memory without one, untouched until used: what the 16 threads of random-1stream
    /// hold at once, about 4.6 GB, fits).
    #[arg(long, value_parser = crate::size_arg)]
    pool_size: Option<usize>,
}

/// The stacks `memres bench` runs on a GPU and on host memory.
const GPU_STACKS: [&str; 6] = [
    "cuda",
    "cuda_async",
    "pool",
    "arena",
    "binning(pool)",
    "fixed_size_1MiB",
];
const HOST_STACKS: [&str; 5] = [
    "host_heap",
    "pool",
    "arena",
    "binning(pool)",
    "fixed_size_1MiB",
];
/// Every workload the suite runs.
const WORKLOADS: [&str; 6] = [
    "pair-256B",
    "pair-64KiB",
    "pair-4MiB",
    "random",
    "random-mt",
    "random-1stream",
];

/// An error naming the first of `asked` that is not among `known`, and what is.
fn check_names(what: &str, asked: &[String], known: &[&str], here: &str) -> Result<(), String> {
    match asked.iter().find(|a| !known.contains(&a.as_str())) {
        Some(bad) => Err(format!(
            "unknown {what} {bad:?}{here}; the {what}s are: {}",
            known.join(", ")
        )),
        None => Ok(()),
    }
}

const THREADS: usize = 8;

pub(crate) fn run(args: BenchArgs) -> Result<(), String> {
    let gpu = crate::gpu_present();
    let (stacks, here) = if gpu {
        (&GPU_STACKS[..], " on a GPU")
    } else {
        (&HOST_STACKS[..], " on host memory (no GPU found)")
    };
    check_names("stack", &args.stacks, stacks, here)?;
    check_names("workload", &args.workloads, &WORKLOADS, "")?;
    let streams: Vec<Stream> = if gpu {
        (0..=THREADS)
            .map(|_| Stream::with_flags(StreamFlags::NonBlocking))
            .collect::<Result<_, _>>()
            .map_err(|e| e.to_string())?
    } else {
        Vec::new()
    };
    let refs: Vec<StreamRef<'_>> = if gpu {
        streams.iter().map(Stream::as_ref).collect()
    } else {
        (0..=THREADS as u32).map(StreamRef::host).collect()
    };
    println!(
        "# memres bench on {}",
        if gpu {
            "the GPU (device 0)"
        } else {
            "host memory (no GPU found)"
        }
    );
    println!("{}", Row::CSV_HEADER);
    let mut rows = Vec::new();
    let mut bench = Bench {
        args: &args,
        refs: &refs,
        rows: &mut rows,
    };
    let fail = |e: memres::Error| e.to_string();
    if gpu {
        let pool_size = args.pool_size.unwrap_or(16 << 30);
        bench.one("cuda", &Cuda::new().map_err(fail)?, true, false)?;
        bench.one("cuda_async", &CudaAsync::new().map_err(fail)?, false, false)?;
        bench.suballocators(Cuda::new, pool_size)?;
    } else {
        let pool_size = args.pool_size.unwrap_or(8 << 30);
        bench.one("host_heap", &HostHeap::new(), false, false)?;
        bench.suballocators(|| Ok(HostHeap::new()), pool_size)?;
    }
    print!("{}", table(&rows));
    Ok(())
}

struct Bench<'a, 's> {
    args: &'a BenchArgs,
    refs: &'a [StreamRef<'s>],
    rows: &'a mut Vec<Row>,
}

impl Bench<'_, '_> {
    fn wanted(&self, name: &str) -> bool {
        self.args.stacks.is_empty() || self.args.stacks.iter().any(|s| s == name)
    }

    fn one<R: Resource + Sync>(
        &mut self,
        name: &str,
        r: &R,
        slow: bool,
        small_only: bool,
    ) -> Result<(), String> {
        if !self.wanted(name) {
            return Ok(());
        }
        let config = Suite {
            slow,
            small_only,
            scale: usize::try_from(self.args.scale).unwrap_or(usize::MAX),
        };
        let workloads = &self.args.workloads;
        let want = |w: &str| workloads.is_empty() || workloads.iter().any(|x| x == w);
        let rows = &mut *self.rows;
        suite(name, r, self.refs, config, &want, &mut |row| {
            println!("{}", row.csv());
            rows.push(row);
        })
        .map_err(|e| match e {
            memres::Error::OutOfMemory { .. } => format!(
                "{name}: {e} (the pools and the arena start with --pool-size bytes; give \
                 more, e.g. --pool-size 8GiB)"
            ),
            e => format!("{name}: {e}"),
        })
    }

    /// The sub-allocators as the anchors build theirs.
    fn suballocators<U: Resource + Send + Sync + 'static>(
        &mut self,
        base: impl Fn() -> Result<U, memres::Error>,
        pool_size: usize,
    ) -> Result<(), String> {
        let fail = |e: memres::Error| e.to_string();
        let pool = || Pool::new(base()?, PoolConfig::new().initial_size(pool_size));
        if self.wanted("pool") {
            self.one("pool", &pool().map_err(fail)?, false, false)?;
        }
        if self.wanted("arena") {
            let arena = Arena::with_size(base().map_err(fail)?, pool_size).map_err(fail)?;
            self.one("arena", &arena, false, false)?;
        }
        if self.wanted("binning(pool)") {
            let binning = Binning::new(pool().map_err(fail)?, 8, 22).map_err(fail)?;
            self.one("binning(pool)", &binning, false, false)?;
        }
        if self.wanted("fixed_size_1MiB") {
            let fixed =
                FixedSize::with_block_size(base().map_err(fail)?, 1 << 20, 1024).map_err(fail)?;
            self.one("fixed_size_1MiB", &fixed, false, true)?;
        }
        Ok(())
    }
}

/// The rows as a table: stacks down, workloads across, median ns per op.
fn table(rows: &[Row]) -> String {
    use std::fmt::Write as _;
    const WORKLOADS: [&str; 5] = [
        "pair-256B",
        "pair-64KiB",
        "pair-4MiB",
        "random",
        "random-mt",
    ];
    let mut out = String::from("\nmedian ns per op (min in parentheses):\n");
    let _ = write!(out, "{:<18}", "stack");
    for w in WORKLOADS {
        let _ = write!(out, "{w:>20}");
    }
    out.push('\n');
    let mut names: Vec<&str> = rows.iter().map(|r| r.resource.as_str()).collect();
    names.dedup();
    for name in names {
        let _ = write!(out, "{name:<18}");
        for w in WORKLOADS {
            match rows.iter().find(|r| r.resource == name && r.workload == w) {
                Some(r) => {
                    let _ = write!(
                        out,
                        "{:>20}",
                        format!("{:.1} ({:.1})", r.ns_per_op_median, r.ns_per_op_min)
                    );
                }
                None => {
                    let _ = write!(out, "{:>20}", "-");
                }
            }
        }
        out.push('\n');
    }
    out
}
