"""GPT-2 small training under three allocators: memory held against memory live.

    python3 python/gpt2_footprint.py [STEPS]     # default 40 steps; one process each

transformers' GPT-2 small built from its config (random weights, no download), bf16
autocast, AdamW, batch and sequence length drawn per step from a seeded generator.
Allocators: PyTorch's caching allocator ("torch"), the same with
expandable_segments:True ("expandable"), and memres's default stack under a statistics
layer ("memres": "statistics(virtual_pool)"). For each: peak device memory in use
(cudaMemGetInfo, sampled after every step, less what was in use before CUDA work began),
the allocator's own peak live bytes, their ratio, the median step time and the losses.
"""

import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def run(mode, steps):
    import torch

    if mode == "memres":
        import memres_alloc as m

        m.configure("statistics(virtual_pool)")
        torch.cuda.memory.change_current_allocator(m.torch_allocator())
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    torch.cuda.init()
    free0, total = torch.cuda.mem_get_info()
    base_used = total - free0
    dev = torch.device("cuda")
    model = GPT2LMHeadModel(GPT2Config()).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(42)
    losses, times, peak_used = [], [], 0
    for _ in range(steps):
        batch = int(torch.randint(4, 17, (1,), generator=gen))
        seq = int(torch.randint(128, 1025, (1,), generator=gen))
        ids = torch.randint(0, 50257, (batch, seq), generator=gen).to(dev)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        free, _ = torch.cuda.mem_get_info()
        peak_used = max(peak_used, total - free - base_used)
    if mode == "memres":
        import memres_alloc as m

        s = m.stats(0)
        peak_live = s["peak_bytes"]
        extra = {"pool_size_end": s.get("pool_size"), "pool_free_end": s.get("pool_free_bytes")}
    else:
        peak_live = torch.cuda.max_memory_allocated()
        extra = {"reserved_peak": torch.cuda.max_memory_reserved()}
    print(
        json.dumps(
            {
                "mode": mode,
                "peak_device_used": peak_used,
                "peak_live": peak_live,
                "ratio": peak_used / peak_live,
                "median_step_s": statistics.median(times[3:]),
                "losses": losses,
                **extra,
            }
        )
    )


def main():
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    results = {}
    for mode in ("torch", "expandable", "memres"):
        env = dict(os.environ)
        if mode == "expandable":
            env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        out = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--child", mode, str(steps)],
            capture_output=True,
            text=True,
            env=env,
        )
        if out.returncode != 0:
            print(out.stdout[-4000:])
            print(out.stderr[-4000:])
            raise SystemExit(f"{mode} failed with {out.returncode}")
        results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    ref = results["torch"]["losses"]
    for mode, r in results.items():
        diff = max(abs(a - b) for a, b in zip(r["losses"], ref))
        print(
            f"{mode:11s} peak used {r['peak_device_used'] / 2**30:7.3f} GiB  "
            f"peak live {r['peak_live'] / 2**30:7.3f} GiB  ratio {r['ratio']:.3f}  "
            f"median step {r['median_step_s'] * 1e3:8.2f} ms  "
            f"max |loss - torch's| {diff:.3g}"
        )
    print(json.dumps({m: {k: v for k, v in r.items() if k != "losses"} for m, r in results.items()}))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        run(sys.argv[2], int(sys.argv[3]))
    else:
        main()
