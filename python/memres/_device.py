"""Configuring memres and reading each device's figures."""

from __future__ import annotations

import ctypes
from typing import Dict, List

from ._native import Stats, c_string, check, device_ordinal, lib

_STATISTICS_KEYS = (
    "current_bytes",
    "peak_bytes",
    "total_bytes",
    "current_allocations",
    "peak_allocations",
    "total_allocations",
)


def configure(spec: str) -> None:
    """Chooses every device's stack, before the first allocation.

    Examples: ``"virtual_pool"`` (the default: a pool growing in place over CUDA virtual
    memory, holding least), ``"virtual_pool:release=2GiB"``, ``"pool:initial=8GiB"``,
    ``"statistics(virtual_pool)"``, ``"cuda_async"``; ``"virtual_pool:granule=32MiB"`` maps
    and gives back 32 MiB at a time (the tags' pools too; the default is 2 MiB, which
    holds least and bounds ``set_per_process_memory_fraction`` as torch does, but makes 8x
    the driver calls of 16 MiB when the pool grows or sleeps). The syntax is in
    ``capi/include/memres.h``. Raises MemresError (code ERROR_INVALID_ARGUMENT) for a bad
    spec, and (code ERROR_IN_USE) once memres has allocated; TypeError for a spec that is
    not a ``str``, ValueError for one the C ABI cannot read (a NUL character in it).
    """
    check(lib().memres_configure(c_string(spec, "memres.configure(): the spec", "virtual_pool")))


def init_device(device: int) -> None:
    """Builds ``device``'s stack now rather than on its first allocation, so that a spec
    the device cannot serve (or a missing driver) fails here."""
    check(lib().memres_init_device(device_ordinal(device, "memres.init_device(): device")))


def stats(device: int = 0) -> Dict[str, int]:
    """The figures of ``device``'s stack: always ``live_bytes``, ``peak_live_bytes``,
    ``allocated_bytes`` (ever), ``live_allocations``, ``peak_live_allocations``,
    ``allocations`` (ever) and ``out_of_memory`` (failed calls), counted exactly by the C
    ABI whatever the spec; the statistics keys when the stack has a statistics layer;
    ``pool_size``, ``pool_free_bytes``, ``pool_largest_free_block``, ``pool_peak_size``,
    ``pool_host_copy_bytes`` (host copies of the pools' contents: during an offload
    sleep, and after its wake until ``empty_cache``), ``pool_alloc_calls`` and
    ``pool_free_calls`` (the device-memory pools' calls that took memory from the
    driver and gave it back: chunks, runs of granules mapped and unmapped; torch's
    ``num_device_alloc`` and ``num_device_free``) when it has a pool. All zero before the
    device's first allocation."""
    device = device_ordinal(device, "memres.stats(): device")
    out = Stats()
    check(lib().memres_stats(device, ctypes.byref(out)))
    figures = {
        k: getattr(out, k)
        for k in (
            "live_bytes",
            "peak_live_bytes",
            "allocated_bytes",
            "live_allocations",
            "peak_live_allocations",
            "allocations",
            "out_of_memory",
        )
    }
    if out.has_statistics:
        figures.update((k, getattr(out, k)) for k in _STATISTICS_KEYS)
    if out.has_pool:
        figures["pool_size"] = out.pool_size
        figures["pool_free_bytes"] = out.pool_free_bytes
        figures["pool_largest_free_block"] = out.pool_largest_free_block
        figures["pool_peak_size"] = out.pool_peak_size
        figures["pool_host_copy_bytes"] = out.pool_host_copy_bytes
        figures["pool_alloc_calls"] = out.pool_alloc_calls
        figures["pool_free_calls"] = out.pool_free_calls
    return figures


def tier_stats(device: int = 0) -> List[Dict[str, int]]:
    """What each tier of ``device``'s ``fallback(first, then)`` stack served (the first
    tier first): the statistics keys (``current_bytes``, ``peak_bytes``, ``total_bytes``,
    ``current_allocations``, ``peak_allocations``, ``total_allocations``). Empty for a
    stack without a fallback, and before the device's first allocation."""
    device = device_ordinal(device, "memres.tier_stats(): device")
    out = (Stats * 2)()
    n = check(lib().memres_tier_stats(device, out, 2))
    return [{k: getattr(out[i], k) for k in _STATISTICS_KEYS} for i in range(min(n, 2))]


def reset_peak(device: int = 0) -> None:
    """Starts ``device``'s peaks (``peak_live_bytes``, ``peak_live_allocations``,
    ``pool_peak_size``) afresh from what is live and held now."""
    check(lib().memres_reset_peak(device_ordinal(device, "memres.reset_peak(): device")))


def trim(device: int = 0) -> None:
    """Gives the memory ``device``'s pool holds but does not use back to the driver (what
    ``torch.cuda.empty_cache()`` does for PyTorch's own allocator). An ``arena`` stack
    keeps its one allocation while it lives, so trimming it frees nothing; a
    ``cuda_async`` stack's driver pool is trimmed after waiting for the device's work
    (so not while a CUDA graph capture is under way on it)."""
    check(lib().memres_trim(device_ordinal(device, "memres.trim(): device")))


def enable_peer_access(device: int, peer: int) -> None:
    """Lets ``peer`` read and write the memory memres's in-place pools map on ``device``
    and its ``cuda_async`` pools hold (what they hold and all they map later). Needed only where peers come on demand:
    under the native PyTorch backend, which does this itself when torch enables peer
    access (before its copies between devices); a program that reaches another device's
    memory outside torch there (a CuPy or custom kernel) calls it first. Elsewhere every
    peer-capable device has access from the start (``MEMRES_PEER_ACCESS`` chooses for the
    process: ``all`` or ``on_demand``)."""
    check(
        lib().memres_enable_peer_access(
            device_ordinal(device, "memres.enable_peer_access(): device"),
            device_ordinal(peer, "memres.enable_peer_access(): peer"),
        )
    )
