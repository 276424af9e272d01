//! `memres`: replay allocation logs (RMM's or memres's CSV) through any resource stack,
//! compare stacks, look inside a log, plot memory over time, and run the standard
//! workloads.
//!
//! ```text
//! memres replay LOG.csv --compare pool,arena,binning      # which stack would have done better
//! memres stats LOG.csv                                     # what the log holds
//! memres plot LOG.csv -o memory.svg                        # live bytes over time
//! ```

mod bench;
mod human;
mod plot;
mod replay;
mod simulated;
mod stacks;
mod stats;

use std::io::{BufReader, IsTerminal};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Args, CommandFactory, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use memres::log::Event;
use memres::spec::Spec;
use memres::units::parse_size;
use memres::{Cuda, HostHeap, StreamRef};

pub(crate) use crate::human::bytes;
use crate::replay::{Outcome, Plan};
use crate::stacks::{Memory, Options, Replay, Stack, StackName};

#[derive(Parser)]
#[command(
    name = "memres",
    version,
    about = "Replay, compare and plot GPU memory allocation logs (RMM's CSV format) through memres resource stacks.",
    // Our own `help` command, which takes `--help` like the others.
    disable_help_subcommand = true
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Replay a log through one stack (--resource) or several (--compare).
    Replay(ReplayArgs),
    /// Events, threads, streams, sizes, peak live bytes and leaks of a log.
    Stats {
        /// The log (CSV, or gzip-compressed .csv.gz).
        log: PathBuf,
    },
    /// Live bytes over time as SVG.
    Plot {
        /// The log (CSV, or gzip-compressed .csv.gz).
        log: PathBuf,
        /// The SVG to write.
        #[arg(short, long)]
        output: PathBuf,
    },
    /// The standard workloads (defined in workloads/src/lib.rs) over the main stacks: on
    /// the GPU if there is one, else on host memory.
    Bench(bench::BenchArgs),
    /// Print this message or the help of the given command.
    Help {
        /// The command whose help to print.
        command: Option<String>,
    },
}

#[derive(Args)]
struct ReplayArgs {
    /// The log (CSV, or gzip-compressed .csv.gz).
    log: PathBuf,
    /// The stack: pool, virtual_pool, arena, binning, fixed_size, cuda, cuda_async, managed, a
    /// host variant (host, host-pool, host-virtual_pool, host-arena, host-binning,
    /// host-fixed_size), or a spec string as the C ABI takes it (`statistics(pool:initial=1GiB)`, `limiting(virtual_pool,limit=8GiB)`).
    #[arg(short, long, default_value = "pool", conflicts_with = "compare")]
    resource: String,
    /// Several stacks, one table: names or spec strings, each its own argument
    /// (`--compare pool 'statistics(arena)'`); plain names may also be comma-separated
    /// (`pool,arena,binning`).
    #[arg(long, num_args = 1..)]
    compare: Vec<String>,
    /// Replay against simulated device memory of this size, at least 1 MiB (default where
    /// there is no GPU: 80GiB).
    #[arg(long, value_parser = simulated_size)]
    simulate: Option<usize>,
    /// The pool's initial size.
    #[arg(long, value_parser = size_arg, default_value = "0")]
    initial_size: usize,
    /// The pool's maximum size.
    #[arg(long, value_parser = size_arg)]
    max_size: Option<usize>,
    /// The arena's size (default: half the memory).
    #[arg(long, value_parser = size_arg)]
    arena_size: Option<usize>,
    /// The fixed-size resource's block size (256 bytes at least).
    #[arg(long, value_parser = block_size, default_value = "1MiB")]
    fixed_block: usize,
    /// The smallest and largest bin of `binning`, as powers of two.
    #[arg(long, default_value_t = 10)]
    bin_min: u32,
    #[arg(long, default_value_t = 22)]
    bin_max: u32,
    /// Also write memory over time (live bytes, footprints, largest free blocks) as SVG.
    #[arg(long)]
    plot: Option<PathBuf>,
}

fn size_arg(text: &str) -> Result<usize, String> {
    parse_size(text).map_err(|e| e.to_string())
}

/// A simulated device's size: at least 1 MiB (a smaller one fails every request).
fn simulated_size(text: &str) -> Result<usize, String> {
    let size = size_arg(text)?;
    if size < 1 << 20 {
        return Err(format!(
            "{size} bytes of simulated memory: give at least 1MiB"
        ));
    }
    Ok(size)
}

/// A fixed-size block: at least 256 bytes (the granule every block is rounded to).
fn block_size(text: &str) -> Result<usize, String> {
    let size = size_arg(text)?;
    if size < 256 {
        return Err(format!("blocks of {size} bytes: give at least 256"));
    }
    Ok(size)
}

/// Reads a log, naming the file in every error.
fn read_log(path: &Path) -> Result<Vec<Event>, String> {
    let file = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let events = if path.extension().is_some_and(|e| e == "gz") {
        memres::log::read_events(BufReader::new(flate2::read::GzDecoder::new(file)))
    } else {
        memres::log::read_events(BufReader::new(file))
    };
    let events = events.map_err(|e| format!("{}: {}", path.display(), message(&e)))?;
    if events.is_empty() {
        return Err(format!(
            "{}: the log has a header but no events",
            path.display()
        ));
    }
    Ok(events)
}

/// An error's message without the "invalid argument: " of its kind.
fn message(e: &memres::Error) -> String {
    match e {
        memres::Error::InvalidArgument(m) => m.to_string(),
        other => other.to_string(),
    }
}

fn gpu_present() -> bool {
    memres::driver::is_present() && memres::device::DeviceId::count().unwrap_or(0) > 0
}

/// A closed standard output (`memres replay LOG | head -1`) ends the command as it ends
/// `cat`: quietly, by SIGPIPE (exit status 141 in a shell), never a panic. Rust's
/// runtime ignores the signal, which turns the next `println!` into a panic.
fn end_quietly_on_a_closed_pipe() {
    #[cfg(unix)]
    // SAFETY: setting a signal's disposition to its default, before any thread starts;
    // no handler runs Rust code.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

fn main() -> ExitCode {
    end_quietly_on_a_closed_pipe();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Replay(args) => run_replay(args),
        Command::Stats { log } => read_log(&log).map(|events| {
            let plan = Plan::new(&events);
            print!(
                "{}",
                stats::report(&log.display().to_string(), &events, &plan)
            );
        }),
        Command::Plot { log, output } => plot::check_writable(&output, &log)
            .and_then(|()| read_log(&log))
            .and_then(|events| {
                let plan = Plan::new(&events);
                plot::write(&output, &title(&log), &plan, &[])?;
                println!("wrote {}", output.display());
                Ok(())
            }),
        Command::Bench(args) => bench::run(args),
        Command::Help { command } => help(command.as_deref()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("memres: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `memres help [COMMAND]`: the help of the whole command or of one of its commands.
fn help(command: Option<&str>) -> Result<(), String> {
    let mut cli = Cli::command();
    // Built, so that a command's usage line starts with `memres`.
    cli.build();
    let page = match command {
        None => cli.render_help(),
        Some(name) => match cli.find_subcommand_mut(name) {
            Some(sub) => sub.render_help(),
            None => {
                let names: Vec<_> = Cli::command()
                    .get_subcommands()
                    .map(|c| c.get_name().to_owned())
                    .collect();
                return Err(format!(
                    "no command named {name:?}; the commands: {}",
                    names.join(", ")
                ));
            }
        },
    };
    print!("{page}");
    Ok(())
}

fn title(log: &Path) -> String {
    let name = log.file_name().map_or_else(
        || log.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    format!("memory over time: {name}")
}

fn run_replay(args: ReplayArgs) -> Result<(), String> {
    if let Some(out) = &args.plot {
        plot::check_writable(out, &args.log)?;
    }
    let options = Options {
        initial_size: args.initial_size,
        max_size: args.max_size,
        arena_size: args.arena_size,
        bin_min: args.bin_min,
        bin_max: args.bin_max,
        fixed_block: args.fixed_block,
    };
    let texts: Vec<&str> = if args.compare.is_empty() {
        vec![args.resource.as_str()]
    } else {
        args.compare.iter().flat_map(|t| split_names(t)).collect()
    };
    let names: Vec<StackName> = texts
        .iter()
        .map(|t| StackName::parse_with(t, &options))
        .collect::<Result<_, _>>()?;
    let device_memory = match args.simulate {
        Some(size) => Memory::Simulated(size),
        None if gpu_present() => Memory::Gpu,
        None => Memory::Simulated(80 << 30),
    };
    let events = read_log(&args.log)?;
    let plan = Plan::new(&events);
    drop(events);
    println!(
        "{}: {} events ({} replayed) on {} threads and {} streams; peak live {}",
        args.log.display(),
        plan.len(),
        plan.replayed_ops(),
        plan.threads(),
        plan.streams.len(),
        bytes(plan.peak_live.0)
    );
    if plan.failures_in_log > 0 {
        println!(
            "  {} allocate-failure rows are left out",
            plan.failures_in_log
        );
    }
    for w in plan.warnings.iter().take(10) {
        println!("  warning: {w}");
    }
    if plan.warnings.len() > 10 {
        println!("  ... and {} more warnings", plan.warnings.len() - 10);
    }
    let sample_every = args.plot.as_ref().map(|_| plan.len().div_ceil(2000).max(1));
    let mut results: Vec<(String, Memory, Outcome)> = Vec::new();
    for name in &names {
        let memory = if name.host {
            Memory::Host
        } else {
            device_memory
        };
        let outcome = replay_one(&plan, name, memory, sample_every)
            .map_err(|e| format!("{}: {e}", name.name))?;
        results.push((name.name.clone(), memory, outcome));
    }
    print!("{}", table(&results));
    if sample_every.is_some() {
        println!("(timings include the sampling for the plot)");
    }
    if let Some(out) = &args.plot {
        let replays: Vec<(String, Outcome)> = results.into_iter().map(|(n, _, o)| (n, o)).collect();
        plot::write(out, &title(&args.log), &plan, &replays)?;
        println!("wrote {}", out.display());
    }
    Ok(())
}

/// `pool,arena,binning` as three names; anything else (a spec string, whose options are
/// comma-separated too) as one.
fn split_names(text: &str) -> Vec<&str> {
    let pieces: Vec<&str> = text.split(',').collect();
    let options = Options::default();
    if pieces.len() > 1 && pieces.iter().all(|p| StackName::parse(p, &options).is_ok()) {
        pieces
    } else {
        vec![text]
    }
}

/// Replays through one stack on its memory.
fn replay_one(
    plan: &Plan,
    name: &StackName,
    memory: Memory,
    sample_every: Option<usize>,
) -> Result<Outcome, String> {
    let fail = |e: memres::Error| message(&e);
    // Granules of 2 MiB, as CUDA's on an H100, where a virtual pool runs off the GPU.
    const GRANULE: usize = 2 << 20;
    const BINS_RESERVE: usize = 80 << 30;
    let base = name.spec.base();
    let stack: Stack = match memory {
        Memory::Simulated(size) if matches!(base, Spec::CudaAsync { .. } | Spec::Managed) => {
            return Err(format!(
                "needs a GPU (the driver's own pool and managed memory cannot be simulated); \
                 every other stack replays on simulated memory ({})",
                bytes(size as u64)
            ));
        }
        Memory::Simulated(size) => {
            let leaf = move |granule: Option<usize>| {
                let granule = granule.unwrap_or(GRANULE);
                memres::upstream::HostVirtual::new(size.max(granule), granule)
            };
            Replay::new(simulated::simulated(size), leaf, size / 2, false).build(&name.spec)
        }
        Memory::Host => {
            // Address space only (nothing is committed until mapped): twice the live
            // peak, and for bins as much as a large GPU's, so that their chunks (128
            // blocks each, taken up front) fit beside the pool.
            let twice_peak = (plan.peak_live.0 as usize).saturating_mul(2);
            let least = match base {
                Spec::Binning { .. } => BINS_RESERVE,
                _ => 1 << 30,
            };
            let reserve = twice_peak.max(least);
            let leaf = move |granule: Option<usize>| {
                memres::upstream::HostVirtual::new(reserve, granule.unwrap_or(GRANULE))
            };
            let arena = twice_peak.max(1 << 21) / 2;
            Replay::new(HostHeap, leaf, arena, false).build(&name.spec)
        }
        Memory::Gpu => {
            let free = memres::device::DeviceId::new(0)
                .memory_info()
                .map_err(fail)?
                .free;
            let leaf = |granule: Option<usize>| {
                let config = memres::upstream::CudaVirtualConfig::new();
                let config = match granule {
                    Some(g) => config.granularity(g),
                    None => config,
                };
                memres::CudaVirtual::with_config(memres::device::DeviceId::current()?, config)
            };
            Replay::new(Cuda::new().map_err(fail)?, leaf, free / 2, true).build(&name.spec)
        }
    }
    .map_err(fail)?;
    // One replay stream per logged stream: CUDA streams on the GPU, host streams else.
    let owned: Vec<memres::stream::Stream> = if memory == Memory::Gpu {
        (0..plan.streams.len())
            .map(|_| memres::stream::Stream::with_flags(memres::stream::StreamFlags::NonBlocking))
            .collect::<Result<_, _>>()
            .map_err(fail)?
    } else {
        Vec::new()
    };
    let streams: Vec<StreamRef<'_>> = if owned.is_empty() {
        plan.streams
            .iter()
            .enumerate()
            // Every logged stream (CUDA or host) is a host stream on simulated memory.
            .map(|(i, _)| StreamRef::host(i as u32))
            .collect()
    } else {
        owned.iter().map(|s| s.as_ref()).collect()
    };
    let bar = if std::io::stderr().is_terminal() && plan.len() > 200_000 {
        ProgressBar::with_draw_target(Some(plan.len() as u64), ProgressDrawTarget::stderr())
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template("{msg:>12} [{bar:40}] {pos}/{len} events ({eta})")
            .map_err(|e| e.to_string())?,
    );
    bar.set_message(name.name.clone());
    let outcome = replay::replay(plan, &stack, &streams, sample_every, &|done| {
        bar.set_position(done)
    });
    bar.finish_and_clear();
    let outcome = outcome?;
    for s in &owned {
        s.synchronize().map_err(fail)?;
    }
    Ok(outcome)
}

/// The results as a table, one row per stack.
fn table(results: &[(String, Memory, Outcome)]) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let mut memories: Vec<String> = Vec::new();
    for (_, memory, _) in results {
        let memory = memory.to_string();
        if !memories.contains(&memory) {
            memories.push(memory);
        }
    }
    let _ = writeln!(out, "memory: {}", memories.join("; "));
    // Spec strings can be long: the first column is as wide as the longest name.
    let w = results
        .iter()
        .map(|(n, _, _)| n.len())
        .max()
        .unwrap_or(0)
        .max(14);
    let _ = writeln!(
        out,
        "{:<w$} {:>10} {:>9} {:>9} {:>13} {:>15} {:>14} {:>20}",
        "resource",
        "time",
        "per op",
        "failures",
        "first failure",
        "peak footprint",
        "fragmentation",
        "leaks (freed)"
    );
    for (name, _, o) in results {
        let first = o
            .first_failure
            .as_ref()
            .map_or("-".to_owned(), |(line, _, _)| format!("line {line}"));
        let _ = writeln!(
            out,
            "{:<w$} {:>10} {:>9} {:>9} {:>13} {:>15} {:>14} {:>20}",
            name,
            format!("{:.2} ms", o.elapsed.as_secs_f64() * 1e3),
            format!("{:.0} ns", o.ns_per_op()),
            o.failures,
            first,
            bytes(o.peak_footprint.max(0) as u64),
            o.fragmentation
                .map_or("-".to_owned(), |f| format!("{f:.3}")),
            format!("{} ({})", o.leaks.0, bytes(o.leaks.1)),
        );
    }
    for (name, _, o) in results {
        if let Some([first, then]) = &o.tiers {
            let _ = writeln!(
                out,
                "{name}: the first tier served {} blocks (at most {} at once), the next {} \
                 (at most {})",
                first.allocations.total,
                bytes(first.bytes.peak.max(0) as u64),
                then.allocations.total,
                bytes(then.bytes.peak.max(0) as u64),
            );
        }
        if let Some((line, size, error)) = &o.first_failure {
            let _ = writeln!(
                out,
                "{name}: first failure at line {line} ({}): {error}",
                bytes(*size as u64)
            );
        }
    }
    out
}
