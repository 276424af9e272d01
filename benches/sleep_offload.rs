//! How fast a [`VirtualPool`] over device memory sleeps with `Offload` and wakes (issue 51
//! item 3: a 20 GiB pool's first sleep at 20 GiB/s or more, its wake at 40 or more), on
//! the current GPU, without PyTorch.
//!
//! The pool holds `GIB` buffers of 1 GiB (default 20), every 8-byte word a function of its
//! place; each offload round checks every word after the wake. Rounds: a first sleep (the
//! pool holds no host memory) woken at once, a second (it uses the host copies and staging
//! buffers the first wake kept, as registered as the time between allowed), `trim` (frees
//! them), another first sleep whose wake waits until the copies are registered (the time
//! the registration took printed: an RL step's rollout between sleep and wake), a sleep
//! and wake of registered copies, `trim`, `prepare_offload` (the host memory made ahead,
//! timed, then its registration awaited), a first sleep after it, and a discard round
//! (what unmapping and mapping alone cost). The copy limit is a pinned-to-device copy of 1
//! GiB, measured in the same process. Exits 1 when a word differs or the GPU cannot be
//! used.
//!
//!     cargo bench --bench sleep_offload -- 20
//!     MEMRES_OFFLOAD_THREADS=8 cargo bench --bench sleep_offload -- 20
//!     MEMRES_OFFLOAD_MAP_THREADS=1 cargo bench --bench sleep_offload -- 20
//!     MEMRES_OFFLOAD_HUGE_PAGES=0 cargo bench --bench sleep_offload -- 20
//!     SLEEP_OFFLOAD_GRANULE_MIB=32 cargo bench --bench sleep_offload -- 20
//!     SLEEP_OFFLOAD_EXPORT=1 cargo bench --bench sleep_offload -- 20
//!
//! `MEMRES_OFFLOAD_MAP_THREADS` sets the threads that map on a wake and unmap on a
//! discarding sleep (1 unless set); `SLEEP_OFFLOAD_GRANULE_MIB` the leaf's granularity
//! (`CudaVirtualConfig::granularity`: fewer, larger allocations for the driver to make);
//! `SLEEP_OFFLOAD_EXPORT=1` makes the leaf's memory exportable as POSIX file descriptors,
//! as the C ABI's leaves are (`CudaVirtualConfig::export`).
//!
//! The header gives the kernel's transparent-huge-page settings and the memory free in
//! blocks of 2 MiB or more (`/proc/buddyinfo`) before the first sleep; each sleep's row,
//! the huge pages faulted in during it and the faults that wanted one and fell back
//! (`/proc/vmstat`), so that a first sleep's time can be read against how its copies
//! were backed (`MEMRES_OFFLOAD_HUGE_PAGES=0`: the copies ask for no huge pages; unset,
//! they ask unless the kernel's setting is `[never]`).
//!
//! With `--host`, the same rounds over host pages (`HostVirtual`, 2 MiB granules), where
//! the "device" copies are the host's too: the staging pipeline's cost on the CPU alone,
//! runnable anywhere (no copy limit).

use std::process::ExitCode;
use std::time::Instant;

use memres::container::DeviceBuffer;
use memres::device::DeviceId;
use memres::suballoc::SleepMode;
use memres::upstream::{CudaVirtualConfig, ExportHandle, HostVirtual, PinnedHost};
use memres::{
    CudaVirtual, Error, Resource, StreamRef, SyncResource, VirtualPool, VirtualPoolConfig, layout,
};

const GIB: usize = 1 << 30;

fn main() -> ExitCode {
    // `cargo bench` passes `--bench` too: the first number is the size.
    let gib = std::env::args()
        .skip(1)
        .find_map(|a| a.parse::<usize>().ok())
        .unwrap_or(20)
        .max(1);
    let host = std::env::args().any(|a| a == "--host");
    match if host { run_host(gib) } else { run(gib) } {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("sleep_offload: {e}");
            ExitCode::FAILURE
        }
    }
}

/// One step of the rounds.
enum Step {
    /// A sleep and a wake; with `true`, the wake waits until the copies are registered.
    Sleep(&'static str, SleepMode, bool),
    Trim,
    Prepare,
}

/// Waits (at most 300 s) until `bytes` of the pool's host copies are registered, and says
/// how long it took.
fn await_registration(pool: &VirtualPool<CudaVirtual>, bytes: usize) {
    let t0 = Instant::now();
    let mut last = (pool.registered_host_bytes(), Instant::now());
    loop {
        let now = pool.registered_host_bytes();
        if now >= bytes {
            let s = t0.elapsed().as_secs_f64();
            println!(
                "| (registration awaited) | {:.2} GiB registered | {s:.3} s | | | | | |",
                now as f64 / GIB as f64
            );
            return;
        }
        if now != last.0 {
            last = (now, Instant::now());
        } else if last.1.elapsed().as_secs() >= 10 || t0.elapsed().as_secs() >= 300 {
            println!(
                "| (registration stopped) | {:.2} of {:.2} GiB registered | | | | | | |",
                now as f64 / GIB as f64,
                bytes as f64 / GIB as f64
            );
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// The kernel's transparent-huge-page settings (`enabled`, `defrag`) and
/// `MEMRES_OFFLOAD_HUGE_PAGES`, for the header.
fn huge_page_settings() -> String {
    let read = |name: &str| {
        std::fs::read_to_string(format!("/sys/kernel/mm/transparent_hugepage/{name}"))
            .map_or_else(|_| "unreadable".into(), |s| s.trim().to_string())
    };
    // Bytes free in blocks of 2 MiB or more (orders 9 up of 4 KiB pages), every zone.
    let free: u64 = std::fs::read_to_string("/proc/buddyinfo")
        .unwrap_or_default()
        .lines()
        .flat_map(|l| l.split_whitespace().skip(4 + 9).enumerate())
        .map(|(o, n)| n.parse::<u64>().unwrap_or(0) << (21 + o))
        .sum();
    format!(
        "transparent huge pages: enabled {}, defrag {}; MEMRES_OFFLOAD_HUGE_PAGES: {}; free in blocks of 2 MiB or more: {:.2} GiB",
        read("enabled"),
        read("defrag"),
        std::env::var("MEMRES_OFFLOAD_HUGE_PAGES").unwrap_or_else(|_| "unset".into()),
        free as f64 / GIB as f64
    )
}

/// The kernel's counts of huge pages faulted in and of faults that wanted one and fell
/// back to small pages (`/proc/vmstat`: `thp_fault_alloc`, `thp_fault_fallback`).
fn huge_page_faults() -> (u64, u64) {
    let vmstat = std::fs::read_to_string("/proc/vmstat").unwrap_or_default();
    let count = |name: &str| {
        vmstat
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or(0)
    };
    (count("thp_fault_alloc"), count("thp_fault_fallback"))
}

/// The huge pages faulted in since `before` (a [`huge_page_faults`]), and the fallbacks,
/// for a table's cell.
fn huge_pages_since(before: (u64, u64)) -> String {
    let now = huge_page_faults();
    format!(
        "{} ({} fell back)",
        now.0.saturating_sub(before.0),
        now.1.saturating_sub(before.1)
    )
}

/// Word `k` of buffer `i`: differs from word to word and from buffer to buffer, so a
/// chunk restored at the wrong place shows.
fn word(i: usize, k: usize) -> u64 {
    ((i as u64) << 40 ^ k as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

fn fill(host: &mut [u8], i: usize) {
    for (k, w) in host.chunks_exact_mut(8).enumerate() {
        w.copy_from_slice(&word(i, k).to_le_bytes());
    }
}

/// The first word of `host` that is not buffer `i`'s.
fn first_wrong(host: &[u8], i: usize) -> Option<usize> {
    host.chunks_exact(8)
        .enumerate()
        .position(|(k, w)| w != word(i, k).to_le_bytes())
}

fn run(gib: usize) -> Result<bool, Error> {
    let device = DeviceId::current()?;
    let mut config = CudaVirtualConfig::new().reserve(2 * gib * GIB);
    if let Some(mib) = granule_mib() {
        config = config.granularity(mib << 20);
    }
    let export = std::env::var("SLEEP_OFFLOAD_EXPORT").is_ok_and(|v| v == "1");
    if export {
        config = config.export(ExportHandle::PosixFd);
    }
    let leaf = CudaVirtual::with_config(device, config)?;
    println!(
        "granularity: {} MiB (SLEEP_OFFLOAD_GRANULE_MIB; the device's minimum unless set), \
         exportable: {export} (SLEEP_OFFLOAD_EXPORT)",
        memres::upstream::GrowInPlace::granularity(&leaf) >> 20
    );
    let pool = leaf.virtual_pool(VirtualPoolConfig::new())?;
    let stream = StreamRef::DEFAULT;
    let mut host = vec![0u8; GIB];
    let mut buffers = Vec::with_capacity(gib);
    for i in 0..gib {
        fill(&mut host, i);
        buffers.push(DeviceBuffer::from_host(&host, stream, &pool)?);
    }
    let limit = copy_limit(&mut buffers[0])?;
    fill(&mut host, 0);
    buffers[0].copy_from_host(&host)?;
    println!(
        "{gib} GiB pool; pinned-to-device copy limit, same process: {:.1} GiB/s; offload threads: {}; map threads: {}",
        limit / GIB as f64,
        std::env::var("MEMRES_OFFLOAD_THREADS").unwrap_or_else(|_| "default".into()),
        std::env::var("MEMRES_OFFLOAD_MAP_THREADS").unwrap_or_else(|_| "default (1)".into())
    );
    println!("{}", huge_page_settings());
    println!(
        "| round | given back | sleep | sleep GiB/s | wake | wake GiB/s | wake of the copy limit | huge pages faulted in the sleep |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    let mut right = true;
    let offload = SleepMode::Offload;
    let rounds = [
        Step::Sleep("offload, first, woken at once", offload, false),
        Step::Sleep("offload again (host memory kept)", offload, false),
        Step::Trim,
        Step::Sleep(
            "offload, first after trim, woken once registered",
            offload,
            true,
        ),
        Step::Sleep("offload again (copies registered)", offload, false),
        Step::Trim,
        Step::Prepare,
        Step::Sleep("offload, first after prepare_offload", offload, false),
        Step::Sleep("discard", SleepMode::Discard, false),
    ];
    for step in rounds {
        let (label, mode, registered) = match step {
            Step::Sleep(label, mode, registered) => (label, mode, registered),
            Step::Trim => {
                pool.trim()?;
                let kept = pool.stats().host_copy_bytes;
                if kept != 0 {
                    println!("FAILED: trim left {kept} bytes of host memory");
                    right = false;
                }
                continue;
            }
            Step::Prepare => {
                let t0 = Instant::now();
                let made = pool.prepare_offload()?;
                let s = t0.elapsed().as_secs_f64();
                let g = made as f64 / GIB as f64;
                println!(
                    "| prepare_offload (not a sleep) | {g:.2} GiB made | {s:.3} s | {:.1} | | | | |",
                    g / s
                );
                await_registration(&pool, pool.stats().pool_size);
                continue;
            }
        };
        let huge = huge_page_faults();
        let t0 = Instant::now();
        // SAFETY: no work uses the buffers until the pool wakes (the default stream was
        // synchronised by every copy above, and the sleep waits for the device).
        let released = unsafe { pool.sleep(mode) }?;
        let sleep_s = t0.elapsed().as_secs_f64();
        let huge = huge_pages_since(huge);
        if registered {
            await_registration(&pool, released);
        }
        let t0 = Instant::now();
        let mapped = pool.wake()?;
        let wake_s = t0.elapsed().as_secs_f64();
        let g = released as f64 / GIB as f64;
        println!(
            "| {label} | {g:.2} GiB | {sleep_s:.3} s | {:.1} | {wake_s:.3} s | {:.1} | {:.2} | {huge} |",
            g / sleep_s,
            g / wake_s,
            released as f64 / wake_s / limit
        );
        if mapped != released {
            println!(
                "FAILED: {label}: the wake mapped {mapped} bytes, the sleep gave back {released}"
            );
            right = false;
        }
        if mode == SleepMode::Offload {
            for (i, buf) in buffers.iter().enumerate() {
                buf.copy_to_host(&mut host)?;
                if let Some(k) = first_wrong(&host, i) {
                    println!("FAILED: {label}: buffer {i}, word {k} differs after the wake");
                    right = false;
                    break;
                }
            }
        }
    }
    println!(
        "host memory the pool holds while awake: {:.2} GiB, of which registered (page-locked) copies {:.2} GiB",
        pool.stats().host_copy_bytes as f64 / GIB as f64,
        pool.registered_host_bytes() as f64 / GIB as f64
    );
    println!(
        "{}",
        if right {
            "all checks passed"
        } else {
            "checks failed"
        }
    );
    Ok(right)
}

/// Bytes a second of a pinned-to-device copy of 1 GiB into `buf` (three copies).
fn copy_limit(buf: &mut DeviceBuffer<'_, &VirtualPool<CudaVirtual>>) -> Result<f64, Error> {
    let pinned = PinnedHost::new()?;
    let l = layout(GIB)?;
    let p = pinned.allocate_sync(l)?;
    // SAFETY: a fresh block of `GIB` bytes of host memory, written before it is read.
    let bytes = unsafe {
        p.as_ptr().write_bytes(5, GIB);
        std::slice::from_raw_parts(p.as_ptr(), GIB)
    };
    let copied = (|| {
        buf.copy_from_host(bytes)?;
        let t0 = Instant::now();
        for _ in 0..3 {
            buf.copy_from_host(bytes)?;
        }
        Ok(3.0 * GIB as f64 / t0.elapsed().as_secs_f64())
    })();
    // SAFETY: allocated above with `l`; every copy from it was waited for.
    unsafe { pinned.deallocate_sync(p, l) };
    copied
}

/// The rounds over host pages: `gib` blocks of 1 GiB, filled and checked in place.
fn run_host(gib: usize) -> Result<bool, Error> {
    let pool = HostVirtual::new(2 * gib * GIB, 2 << 20)?.virtual_pool(VirtualPoolConfig::new())?;
    let l = layout(GIB)?;
    let blocks = (0..gib)
        .map(|_| pool.allocate(StreamRef::HOST, l))
        .collect::<Result<Vec<_>, _>>()?;
    let bytes = |i: usize| {
        // SAFETY: a live block of `GIB` bytes of host memory, mapped while the pool is
        // awake (the only time this is called).
        unsafe { std::slice::from_raw_parts_mut(blocks[i].as_ptr(), GIB) }
    };
    for i in 0..gib {
        fill(bytes(i), i);
    }
    println!(
        "{gib} GiB pool of host pages; offload threads: {}; map threads: {}",
        std::env::var("MEMRES_OFFLOAD_THREADS").unwrap_or_else(|_| "default".into()),
        std::env::var("MEMRES_OFFLOAD_MAP_THREADS").unwrap_or_else(|_| "default (1)".into())
    );
    println!("{}", huge_page_settings());
    println!(
        "| round | given back | sleep | sleep GiB/s | wake | wake GiB/s | huge pages faulted in the sleep |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    let mut right = true;
    for (label, mode) in [
        ("offload, first", SleepMode::Offload),
        ("offload again (host memory kept)", SleepMode::Offload),
        ("offload, first after prepare_offload", SleepMode::Offload),
        ("discard", SleepMode::Discard),
    ] {
        if label.ends_with("prepare_offload") {
            pool.trim()?;
            let t0 = Instant::now();
            let made = pool.prepare_offload()?;
            let s = t0.elapsed().as_secs_f64();
            let g = made as f64 / GIB as f64;
            println!(
                "| prepare_offload (not a sleep) | {g:.2} GiB made | {s:.3} s | {:.1} | | | |",
                g / s
            );
        }
        let huge = huge_page_faults();
        let t0 = Instant::now();
        // SAFETY: nothing touches the blocks until the pool wakes.
        let released = unsafe { pool.sleep(mode) }?;
        let sleep_s = t0.elapsed().as_secs_f64();
        let huge = huge_pages_since(huge);
        let t0 = Instant::now();
        pool.wake()?;
        let wake_s = t0.elapsed().as_secs_f64();
        let g = released as f64 / GIB as f64;
        println!(
            "| {label} | {g:.2} GiB | {sleep_s:.3} s | {:.1} | {wake_s:.3} s | {:.1} | {huge} |",
            g / sleep_s,
            g / wake_s
        );
        if mode == SleepMode::Offload {
            for i in 0..gib {
                if let Some(k) = first_wrong(bytes(i), i) {
                    println!("FAILED: {label}: block {i}, word {k} differs after the wake");
                    right = false;
                    break;
                }
            }
        }
    }
    for p in blocks {
        // SAFETY: allocated above with `l` on the host stream; not used afterwards.
        unsafe { pool.deallocate(StreamRef::HOST, p, l) };
    }
    println!(
        "{}",
        if right {
            "all checks passed"
        } else {
            "checks failed"
        }
    );
    Ok(right)
}

/// The granularity asked for through `SLEEP_OFFLOAD_GRANULE_MIB`, in MiB, if set.
fn granule_mib() -> Option<usize> {
    std::env::var("SLEEP_OFFLOAD_GRANULE_MIB")
        .ok()
        .and_then(|v| v.trim().parse().ok())
}
