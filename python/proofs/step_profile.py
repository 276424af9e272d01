"""Where a training step's time goes under each allocator: CUDA API calls on the host and
the GPU's idle time, from `torch.profiler` traces of the same steps.

    pip install ./python      # once: the memres package
    python3 python/proofs/step_profile.py [--model resnet50] [--steps 30] [--skip 10]
                                          [--modes torch,expandable,memres] [--top 15]
                                          [--rounds R] [--batch-on-device] [--fixed-shape]

Each allocator runs in a process of its own (R of them with --rounds, alternating which
goes first), as in `models_proof.py`, whose models and steps this uses. The first `--skip` steps warm up (cuDNN's choices, the pool's growth);
the next `--steps` are timed one by one (synchronised before and after, as the proofs do)
and then run again under `torch.profiler` (CPU and CUDA activities). Printed per
allocator:
- the median step without the profiler, and the mean step under it; the median of each
  phase (the model's `scope`s: forward, backward, optimizer, each timed between two
  synchronisations) and of the rest (making the batch, copying it to the device);
- the GPU's busy time per profiled step (the union of its kernels, copies and memsets)
  and so its idle time: a step whose idle time grows is one the host could not keep fed, because of
  a synchronisation or slow calls between launches;
- the CUDA runtime and driver calls the host made in the profiled steps, with counts and
  host time, largest first: the allocator's own calls (`cuMemMap`, `cuMemCreate`,
  `cuStreamSynchronize`, `cuEventRecord`, `cudaMalloc`, ...) are among them, as are the
  synchronisations it caused.
The last line is one JSON object with everything, for tables.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models_proof  # noqa: E402  (the models and their steps)


def busy_us(events):
    """The union of the intervals (start, end) in microseconds."""
    spans = sorted(events)
    total, end = 0.0, None
    for s, e in spans:
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


class Phases:
    """A `scope` for `models_proof.build`: times each named phase of a step (the device
    synchronised at both ends), so a step splits into its data (what comes before the
    first phase), forward, backward and optimizer parts."""

    def __init__(self, torch):
        self.torch, self.times = torch, {}

    def __call__(self, name):
        phases = self

        class Timed:
            def __enter__(self):
                phases.torch.cuda.synchronize()
                self.t0 = time.perf_counter()

            def __exit__(self, *exc):
                phases.torch.cuda.synchronize()
                phases.times.setdefault(name, []).append(time.perf_counter() - self.t0)

        return Timed()


def child(model, mode, steps, skip, top):
    import torch

    if mode == "memres":
        import memres

        memres.setup()
    torch.manual_seed(0)
    torch.cuda.init()
    phases = Phases(torch)
    step = models_proof.build(model, torch.device("cuda"), torch, phases)
    for _ in range(skip):
        step()
    torch.cuda.synchronize()
    times = []
    phases.times.clear()
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step().item()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    parts = {name: statistics.median(t) * 1e3 for name, t in phases.times.items()}
    parts["rest"] = statistics.median(
        t - sum(phases.times[name][i] for name in phases.times) for i, t in enumerate(times)
    ) * 1e3
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            torch.cuda.synchronize()
            step().item()
        torch.cuda.synchronize()
        profiled = (time.perf_counter() - t0) / steps
    gpu, calls, span = [], {}, [float("inf"), 0.0]
    for e in prof.events():
        kind = str(e.device_type)
        start, end = e.time_range.start, e.time_range.end
        if kind.endswith("CUDA"):
            gpu.append((start, end))
            span = [min(span[0], start), max(span[1], end)]
        elif e.name.startswith(("cu", "cuda")) and not e.name.startswith("cudnn"):
            c = calls.setdefault(e.name, [0, 0.0])
            c[0] += 1
            c[1] += end - start
    busy = busy_us(gpu) / steps
    ranked = sorted(calls.items(), key=lambda kv: -kv[1][1])[:top]
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
    out = {
        "model": model,
        "mode": mode,
        "median_step_ms": statistics.median(times) * 1e3,
        "step_ms": [round(t * 1e3, 3) for t in times],
        "median_phase_ms": parts,
        "profiled_step_ms": profiled * 1e3,
        "gpu_busy_ms_per_step": busy / 1e3,
        "calls": {name: {"count": c, "host_us": round(t, 1)} for name, (c, t) in ranked},
        "self_cpu_ops": {
            e.key: {"count": e.count, "self_us": round(e.self_cpu_time_total, 1)} for e in ops
        },
    }
    if mode == "memres":
        out["memres_stats"] = memres.stats(0)
    print(json.dumps(out))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="resnet50")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--skip", type=int, default=10)
    p.add_argument("--modes", default="torch,expandable,memres")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--rounds", type=int, default=1, help="processes per allocator, alternating")
    p.add_argument("--batch-on-device", action="store_true", help="as models_proof.py's")
    p.add_argument(
        "--fixed-shape",
        action="store_true",
        help="ResNet-50: every batch 64 x 224 x 224 (MEMRES_PROOF_FIXED_SHAPE=1), so no step meets a new shape",
    )
    p.add_argument("--child", nargs=2, metavar=("MODEL", "MODE"))
    a = p.parse_args()
    if a.child:
        child(a.child[0], a.child[1], a.steps, a.skip, a.top)
        return
    if a.batch_on_device:
        os.environ["MEMRES_PROOF_BATCH_ON_DEVICE"] = "1"  # the children inherit it
    if a.fixed_shape:
        os.environ["MEMRES_PROOF_FIXED_SHAPE"] = "1"
    results, modes = [], a.modes.split(",")
    order = [m for n in range(max(1, a.rounds)) for m in (modes if n % 2 == 0 else modes[::-1])]
    for mode in order:
        env = dict(os.environ)
        if mode == "expandable":
            env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        args = [sys.executable, os.path.abspath(__file__), "--child", a.model, mode]
        args += ["--steps", str(a.steps), "--skip", str(a.skip), "--top", str(a.top)]
        done = subprocess.run(args, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stdout[-3000:], done.stderr[-3000:])
            raise SystemExit(f"{a.model} under {mode} failed with {done.returncode}")
        r = json.loads(done.stdout.strip().splitlines()[-1])
        results.append(r)
        idle = r["profiled_step_ms"] - r["gpu_busy_ms_per_step"]
        print(
            f"{a.model} {mode:10s} median step {r['median_step_ms']:8.2f} ms; profiled "
            f"{r['profiled_step_ms']:8.2f} ms, GPU busy {r['gpu_busy_ms_per_step']:8.2f}, "
            f"idle {idle:7.2f}"
        )
        print("    phases (median ms): " + ", ".join(f"{k} {v:.2f}" for k, v in r["median_phase_ms"].items()))
        for name, c in r["calls"].items():
            print(f"    {name:40s} {c['count']:8d} calls {c['host_us'] / 1e3:10.2f} ms")
        print("    host time by operator (self):")
        for name, c in r["self_cpu_ops"].items():
            print(f"    {name[:40]:40s} {c['count']:8d} calls {c['self_us'] / 1e3:10.2f} ms")
    # Every process draws the same shapes in the same order, so step i of one allocator and
    # step i of another did the same work: the median of their ratios compares the
    # allocators without the spread between steps of different shapes.
    for n in range(max(1, a.rounds)):
        group = {r["mode"]: r["step_ms"] for r in results[n * len(modes) : (n + 1) * len(modes)]}
        for i, m in enumerate(modes):
            for other in modes[:i]:
                if m in group and other in group:
                    ratios = [x / y for x, y in zip(group[m], group[other])]
                    print(f"round {n + 1}: {m} / {other} step by step, median {statistics.median(ratios):.3f}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
