"""The C ABI's per-device stacks under PyTorch on two GPUs (run where two are visible).

    python3 python/proofs/two_devices.py     # exit status 0 when every check passes

memres.setup() installs the native backend; tensors on cuda:0 and cuda:1 come from each
device's own stack: memres.stats(d) and torch.cuda.memory_allocated(d) follow them per
device, a copy between the devices is right, record_stream of a side stream of device 1
holds the block, and empty_cache() gives both devices' memory back.
"""

import json
import sys


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
    c = b.to("cuda:0")
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
    del a, c, d, e
    torch.cuda.synchronize(0)
    torch.cuda.empty_cache()
    after = {d: memres.stats(d) for d in (0, 1)}
    result = {
        "live_bytes": live,
        "memory_allocated": allocated,
        "copy_right": copied,
        "side_stream_sum": summed,
        "pool_size_after_empty_cache": {d: after[d].get("pool_size") for d in (0, 1)},
    }
    ok = (
        live[0] >= 64 * mib
        and live[1] >= 96 * mib
        and allocated == live
        and copied
        and summed == 2 * 96 * mib
        and all(after[d]["live_bytes"] == 0 for d in (0, 1))
    )
    print(json.dumps(result))
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
