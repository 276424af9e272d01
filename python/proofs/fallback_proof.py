"""Fallback under PyTorch on a GPU (issue 37): tensors past what the first tier may hold
come from the next one, pinned host memory, and compute correctly.

    python3 python/proofs/fallback_proof.py [--first-gib 1] [--total-gib 3]

memres is PyTorch's allocator with ``fallback(virtual_pool:max=1GiB, pinned_pool)``: a
pool growing in place over device memory, at most 1 GiB, then a pool of pinned host
memory (device-accessible, so kernels read and write it in place, over the bus). The
script allocates ``--total-gib`` of float32 tensors in 256 MiB pieces, fills each on the
GPU, checks every sum, and reports how much device memory the process took (against the
first tier's cap) and memres's figures; then frees everything. Exits 1 on any failed
check.
"""

import argparse
import sys

import memres


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--first-gib", type=int, default=1)
    parser.add_argument("--total-gib", type=int, default=3)
    args = parser.parse_args()
    spec = f"fallback(virtual_pool:max={args.first_gib}GiB, pinned_pool)"
    mr = memres.setup(spec)
    import torch

    free_before, _ = torch.cuda.mem_get_info()
    piece = 256 << 20
    n = args.total_gib * (1 << 30) // piece
    tensors = []
    for i in range(n):
        t = torch.empty(piece // 4, dtype=torch.float32, device="cuda")
        t.fill_(float(i + 1))
        tensors.append(t)
    torch.cuda.synchronize()
    free_during, _ = torch.cuda.mem_get_info()
    failures = []
    for i, t in enumerate(tensors):
        got = float(t.sum().item())
        want = float(i + 1) * t.numel()
        if got != want:
            failures.append(f"tensor {i}: sum {got}, expected {want}")
    device_taken = free_before - free_during
    cap = args.first_gib << 30
    stats = mr.stats()[0]
    print(f"spec: {spec}")
    print(f"{n} tensors of 256 MiB ({n * piece >> 20} MiB) allocated and filled on the GPU")
    print(f"device memory the process took: {device_taken >> 20} MiB (first tier cap {cap >> 20} MiB)")
    print(f"memres: {stats}")
    tiers = memres.tier_stats(0)
    print("bytes served by each tier now: "
          + ", ".join(f"{name} {t['current_bytes'] >> 20} MiB" for name, t in zip(("device", "pinned host"), tiers)))
    if len(tiers) != 2 or tiers[0]["current_bytes"] + tiers[1]["current_bytes"] < n * piece:
        failures.append(f"the tiers' figures {tiers} do not add up to the {n * piece} bytes live")
    elif tiers[1]["current_bytes"] < n * piece - cap:
        failures.append(f"the pinned tier served {tiers[1]['current_bytes']}, less than what passed the cap")
    if device_taken > cap + (256 << 20):
        failures.append(f"device memory {device_taken >> 20} MiB is past the cap")
    # The tensors, and the few small blocks torch's reductions took.
    if not n * piece <= stats.get("live_bytes", 0) < n * piece + (1 << 20):
        failures.append(f"live bytes {stats.get('live_bytes')}, expected {n * piece} and a little")
    del tensors, t
    torch.cuda.synchronize()
    after = mr.stats()[0]
    print(f"memres after the tensors are freed: {after}")
    # Only the small blocks torch keeps (the reductions' results) may stay.
    if after.get("live_bytes", 0) >= 1 << 20:
        failures.append(f"live bytes after freeing: {after.get('live_bytes')}")
    for f in failures:
        print(f"FAILED: {f}")
    print("all checks passed" if not failures else f"{len(failures)} checks failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
