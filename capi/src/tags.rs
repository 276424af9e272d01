//! Tagged memory and sleep/wake (`memres_set_tag`, `memres_sleep`, `memres_wake`).
//!
//! While a tag is set (process-wide, as vLLM's and SGLang's sleep modes have it: the
//! threads PyTorch runs a model on all allocate under it), `memres_malloc` serves each
//! device from that tag's own pool, an in-place pool over its own virtual-memory
//! reservation, made on the tag's first allocation on the device. Each such pool, and the
//! device's default stack (tag `"default"`) when the device memory it holds is in-place
//! pools', can sleep and wake on its own: the weights can wake before the KV cache. Frees
//! find their pool by address (each reservation is its own range).
//!
//! The default stack sleeps as one: every in-place pool of it, on every tier of a
//! `fallback(..)`. Pinned host memory beside them (`pinned`, `pinned_pool` tiers) stays
//! as it is: it holds no device memory, and its blocks stay usable. A stack with any
//! other part that holds device memory (`pool`, `arena`, `fixed_size`, `cuda`,
//! `cuda_async`, `managed`, or `binning`, whose bins keep the pool's blocks) cannot
//! sleep: a sleep by name is refused with a message saying which part, and a sleep of
//! every pool (NULL) skips it, as it skips a stack with no in-place pool.

use std::ffi::{CStr, c_char, c_int};
use std::sync::{Mutex, PoisonError};

use mr::device::DeviceId;
use mr::{suballoc::SleepMode, upstream::GrowInPlace};

use crate::routed::{TagPool, set_current};
use crate::{
    Failure, MEMRES_OK, MEMRES_SLEEP_DISCARD, MEMRES_SLEEP_OFFLOAD, describe, guarded, quoted,
    stack,
};

/// The name of the memory allocated with no tag set: the device's own stack.
pub(crate) const DEFAULT_TAG: &str = "default";

/// Tag names, in the order they were first set: a tag's id is its index plus one.
static NAMES: Mutex<Vec<String>> = Mutex::new(Vec::new());
fn names() -> std::sync::MutexGuard<'static, Vec<String>> {
    NAMES.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The id of `name`, if it was ever set.
fn id_of(name: &str) -> Option<usize> {
    names().iter().position(|n| n == name).map(|i| i + 1)
}

/// The tag named by a C string: `None` for NULL (every pool), `Some("")` never (the empty
/// name is the default).
fn tag_name(tag: *const c_char, what: &str) -> Result<Option<String>, Failure> {
    if tag.is_null() {
        return Ok(None);
    }
    // SAFETY: non-null and NUL-terminated (the caller's promise).
    let text = unsafe { CStr::from_ptr(tag) }
        .to_str()
        .map_err(|_| Failure::invalid(format!("{what}: the tag is not UTF-8")))?;
    Ok(Some(
        if text.is_empty() { DEFAULT_TAG } else { text }.to_owned(),
    ))
}

/// Sets the tag that `memres_malloc` serves every device from, process-wide: NULL, `""`
/// and `"default"` go back to the device's own stack.
///
/// # Safety
/// `tag` is null or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memres_set_tag(tag: *const c_char) -> c_int {
    guarded(
        |code| code,
        || {
            let id = match tag_name(tag, "memres_set_tag")? {
                None => 0,
                Some(name) if name == DEFAULT_TAG => 0,
                Some(name) => {
                    let mut names = names();
                    match names.iter().position(|n| *n == name) {
                        Some(i) => i + 1,
                        None => {
                            names.push(name);
                            names.len()
                        }
                    }
                }
            };
            set_current(id);
            Ok(MEMRES_OK)
        },
    )
}

/// The pools of `device` that `tag` names, each with its name, and whether the tag was
/// NULL (every pool that can sleep).
fn pools_named(
    device: c_int,
    tag: *const c_char,
    what: &str,
) -> Result<(Vec<(String, TagPool)>, bool), Failure> {
    let stack = stack(device)?;
    let name = tag_name(tag, what)?;
    let mut out = Vec::new();
    let every = name.is_none();
    if name.as_deref().is_none_or(|n| n == DEFAULT_TAG) {
        // Every in-place pool of the stack, on every tier, sleeps and wakes as the one
        // "default": a stack whose other parts hold device memory that cannot sleep is
        // refused (pinned host memory stays as it is).
        match stack.sleepable_pools() {
            Ok(pools) if !pools.is_empty() => {
                out.extend(pools.into_iter().map(|pool| (DEFAULT_TAG.to_owned(), pool)));
            }
            // Both are the caller's choice of stack: an invalid argument, not a CUDA error.
            Ok(_) if !every => {
                return Err(Failure::invalid(format!(
                    "{what}: device {device}'s stack has no pool that grows in place (spec \
                     `virtual_pool`), so its untagged memory cannot sleep; tag what should"
                )));
            }
            Err(e) if !every => return Err(Failure::invalid(format!("{what}: {e}"))),
            Ok(_) | Err(_) => {}
        }
    }
    // The pools first: a tag's name is set before its pool is made, and names are only
    // ever added, so every pool's name is in the copy taken after.
    let tagged = stack.tags();
    let all_names = names().clone();
    for (id, pool) in tagged {
        let Some(tag) = all_names.get(id - 1) else {
            continue;
        };
        if name.as_deref().is_none_or(|n| n == tag) {
            out.push((tag.clone(), pool));
        }
    }
    if let Some(n) = &name
        && out.is_empty()
    {
        let known = id_of(n).is_some();
        return Err(Failure::invalid(format!(
            "{what}: no memory tagged {} on device {device}{}",
            quoted(n),
            if known {
                ""
            } else {
                " (the tag was never set)"
            }
        )));
    }
    Ok((out, every))
}

/// `MEMRES_SLEEP_DISCARD` / `MEMRES_SLEEP_OFFLOAD`.
fn mode_of(mode: c_int) -> Result<SleepMode, Failure> {
    match mode {
        MEMRES_SLEEP_DISCARD => Ok(SleepMode::Discard),
        MEMRES_SLEEP_OFFLOAD => Ok(SleepMode::Offload),
        other => Err(Failure::invalid(format!(
            "memres_sleep: mode {other} is neither MEMRES_SLEEP_DISCARD (0) nor \
             MEMRES_SLEEP_OFFLOAD (1)"
        ))),
    }
}

/// Puts the pools of `device` that `tag` names to sleep (NULL: every pool that can and
/// is awake): see `memres.h`. Returns the bytes given back to the driver.
///
/// # Safety
/// `tag` is null or a NUL-terminated string; until the pools wake, nothing uses the
/// memory of their blocks (on the host or on any stream).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memres_sleep(device: c_int, tag: *const c_char, mode: c_int) -> i64 {
    guarded(i64::from, || {
        let mode = mode_of(mode)?;
        let (pools, every) = pools_named(device, tag, "memres_sleep")?;
        let stack = stack(device)?;
        // An exported block's memory lives on in the processes that opened it: sleep
        // could neither give it back nor keep the processes sharing after the wake.
        for (name, pool) in &pools {
            let (base, len) = pool.upstream().reservation();
            if stack.exported().any_in(base, len) {
                return Err(Failure::invalid(format!(
                    "memres_sleep {}: blocks of it are shared with other processes \
                     (memres_ipc_export, a CUDA tensor sent to another process); free them \
                     first",
                    quoted(name)
                )));
            }
        }
        let _on = mr::device::DeviceGuard::new(DeviceId::new(device))?;
        let mut released = 0usize;
        let mut slept: Vec<(&String, &TagPool)> = Vec::new();
        for (name, pool) in &pools {
            if every && pool.is_asleep() {
                continue;
            }
            // SAFETY: the caller's promise: nothing uses the memory until it wakes.
            match unsafe { pool.sleep(mode) } {
                Ok(bytes) => {
                    released += bytes;
                    slept.push((name, pool));
                }
                Err(e) => {
                    let mut failure =
                        Failure::from(e).within(&format!("memres_sleep {}", quoted(name)));
                    // All or nothing: those put to sleep by this call wake again (their
                    // contents discarded, where the mode said so).
                    for (other, pool) in slept {
                        if let Err(again) = pool.wake() {
                            failure.message += &format!(
                                "; and {}, put to sleep by this call, could not be woken \
                                 again ({}): it is still asleep",
                                quoted(other),
                                describe(&again)
                            );
                        }
                    }
                    return Err(failure);
                }
            }
        }
        Ok(released as i64)
    })
}

/// Makes ahead the host memory that an offloading sleep of the pools of `device` that
/// `tag` names (NULL: every awake pool that can sleep) would make: see `memres.h`.
/// Returns the bytes made.
///
/// # Safety
/// `tag` is null or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memres_prepare_offload(device: c_int, tag: *const c_char) -> i64 {
    guarded(i64::from, || {
        let (pools, every) = pools_named(device, tag, "memres_prepare_offload")?;
        let _on = mr::device::DeviceGuard::new(DeviceId::new(device))?;
        let mut made = 0usize;
        for (name, pool) in &pools {
            if every && pool.is_asleep() {
                continue;
            }
            made += pool.prepare_offload().map_err(|e| {
                Failure::from(e).within(&format!("memres_prepare_offload {}", quoted(name)))
            })?;
        }
        Ok(made as i64)
    })
}

/// 1 if the pool of `device` that `tag` names sleeps, 0 if it is awake, or a negative
/// code (`MEMRES_ERROR_INVALID_ARGUMENT` for a tag with no pool there): see `memres.h`.
///
/// # Safety
/// `tag` is a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memres_is_asleep(device: c_int, tag: *const c_char) -> c_int {
    guarded(
        |code| code,
        || {
            if tag.is_null() {
                return Err(Failure::invalid("memres_is_asleep: the tag is null"));
            }
            let (pools, _) = pools_named(device, tag, "memres_is_asleep")?;
            Ok(c_int::from(pools.iter().any(|(_, pool)| pool.is_asleep())))
        },
    )
}

/// Wakes the pools of `device` that `tag` names (NULL: every sleeping pool): see
/// `memres.h`. Returns the bytes mapped again.
///
/// # Safety
/// `tag` is null or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memres_wake(device: c_int, tag: *const c_char) -> i64 {
    guarded(i64::from, || {
        let (pools, every) = pools_named(device, tag, "memres_wake")?;
        let _on = mr::device::DeviceGuard::new(DeviceId::new(device))?;
        // A name wakes the pools it names that sleep: the stack's own memory may be
        // several in-place pools (one per tier), of which a failed wake may have left
        // some asleep. A name none of whose pools sleeps is refused (by the first wake).
        let any_asleep = pools.iter().any(|(_, pool)| pool.is_asleep());
        let mut mapped = 0usize;
        for (name, pool) in &pools {
            if (every || any_asleep) && !pool.is_asleep() {
                continue;
            }
            mapped += pool
                .wake()
                .map_err(|e| Failure::from(e).within(&format!("memres_wake {}", quoted(name))))?;
        }
        Ok(mapped as i64)
    })
}
