"""The C ABI's per-device stacks under PyTorch on two GPUs (run where two are visible).

    python3 python/proofs/two_devices.py     # exit status 0 when every check passes

memres.setup() installs the native backend; tensors on cuda:0 and cuda:1 come from each
device's own stack: memres.stats(d) and torch.cuda.memory_allocated(d) follow them per
device, a copy between the devices is right, record_stream of a side stream of device 1
holds the block, and empty_cache() gives both devices' memory back. Copies that torch
does with a kernel on one device writing the other's memory (strided, or changing the
type) are right too: torch enables peer access first, which memres's in-place pools
grant only then under the native backend (`memres_enable_peer_access`; device 1 has no
access to device 0's memory before the first copy, read and write after), on what they
hold and what they map after (a new 256 MiB tensor, a growth).

    MEMRES_RESOURCE=cuda_async python3 python/proofs/two_devices.py

runs the same over driver pools, whose memory the contexts' peer access does not reach
either: memres grants the peer on the pool (`cuMemPoolSetAccess`), as torch's
cudaMallocAsync backend does; the access shown is then the pool's. `empty_cache()` gives
each device's memory back in both cases (a driver pool's once the device's work is
waited for).
"""

import ctypes
import json
import os
import sys


def device_1_access(ptr, pool_memory):
    """The access device 1 has to device memory at `ptr` (0 none, 3 read and write): the
    mapping's (cuMemGetAccess) for an in-place pool's memory, the driver pool's
    (cuMemPoolGetAccess on the pool the pointer names) for a cuda_async pool's, whose
    blocks cuMemGetAccess reports as 0 whatever the pool grants. A driver error is
    returned negated."""

    class Location(ctypes.Structure):
        _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]

    cuda = ctypes.CDLL("libcuda.so.1")
    at = Location(1, 1)  # CU_MEM_LOCATION_TYPE_DEVICE, device 1
    if pool_memory:
        pool = ctypes.c_void_p()
        mempool_handle = 17  # CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE
        status = cuda.cuPointerGetAttribute(
            ctypes.byref(pool), mempool_handle, ctypes.c_ulonglong(ptr)
        )
        if status != 0:
            return -status
        flags = ctypes.c_int(0)
        status = cuda.cuMemPoolGetAccess(ctypes.byref(flags), pool, ctypes.byref(at))
    else:
        flags = ctypes.c_ulonglong(0)
        status = cuda.cuMemGetAccess(
            ctypes.byref(flags), ctypes.byref(at), ctypes.c_void_p(ptr)
        )
    return flags.value if status == 0 else -status


def main():
    import memres

    memres.setup()
    import torch

    assert torch.cuda.device_count() >= 2, "needs two visible GPUs"
    mib = 1 << 20
    a = torch.full((64 * mib,), 1, dtype=torch.uint8, device="cuda:0")
    b = torch.full((96 * mib,), 2, dtype=torch.uint8, device="cuda:1")
    live = {d: memres.stats(d)["live_bytes"] for d in (0, 1)}
    allocated = {d: torch.cuda.memory_allocated(d) for d in (0, 1)}
    # Peers on demand (the native backend's choice): device 1 reaches device 0's memory
    # only once torch enables peer access, before its first copy between them.
    every_peer = os.environ.get("MEMRES_PEER_ACCESS") == "all" or memres.torch_backend() != "native"
    pool_memory = "cuda_async" in os.environ.get("MEMRES_RESOURCE", "")
    access_before = device_1_access(a.data_ptr(), pool_memory)
    c = b.to("cuda:0")
    access_after = device_1_access(a.data_ptr(), pool_memory)
    peers_on_demand = access_after == 3 and access_before == (3 if every_peer else 0)
    copied = bool((c == 2).all().item())
    side = torch.cuda.Stream(device="cuda:1")
    with torch.cuda.device(1):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(10_000_000)
            d = b.sum()
        b.record_stream(side)
        del b
        e = torch.full((96 * mib,), 3, dtype=torch.uint8, device="cuda:1")
        torch.cuda.synchronize(1)
    summed = int(d.item())
    # Strided and type-changing copies between the devices: a kernel on the source device
    # writes the destination's memory (torch's copy with peer access), before and after
    # the destination's pool grows.
    src = torch.arange(32 * mib, dtype=torch.int32, device="cuda:1")
    strided = src[::2].to("cuda:0")
    widened = src.to("cuda:0", dtype=torch.int64)
    grown = torch.empty(64 * mib, dtype=torch.int32, device="cuda:0")
    grown[::2].copy_(src)
    # And the other way: device 0's memory strided into device 1's.
    there = torch.arange(32 * mib, dtype=torch.int32, device="cuda:0")
    back = there[::2].to("cuda:1")
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    expect = torch.arange(32 * mib, dtype=torch.int64, device="cuda:0")
    peer_copies = bool(
        (strided == expect[::2]).all().item()
        and (widened == expect).all().item()
        and (grown[::2] == expect).all().item()
        and (back == expect[::2].to("cuda:1")).all().item()
    )
    del src, strided, widened, grown, expect, there, back
    del a, c, d, e
    torch.cuda.synchronize(0)
    torch.cuda.empty_cache()
    after = {d: memres.stats(d) for d in (0, 1)}
    result = {
        "live_bytes": live,
        "memory_allocated": allocated,
        "device_1_access_to_device_0_before_and_after_the_first_copy": [access_before, access_after],
        "copy_right": copied,
        "peer_copies_right": peer_copies,
        "side_stream_sum": summed,
        "pool_size_after_empty_cache": {d: after[d].get("pool_size") for d in (0, 1)},
    }
    ok = (
        live[0] >= 64 * mib
        and live[1] >= 96 * mib
        and allocated == live
        and copied
        and peers_on_demand
        and peer_copies
        and summed == 2 * 96 * mib
        and all(after[d]["live_bytes"] == 0 for d in (0, 1))
        and all(after[d].get("pool_size", 0) == 0 for d in (0, 1))
    )
    print(json.dumps(result))
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
