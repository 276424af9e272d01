"""The C ABI's proof on a GPU: PyTorch and CuPy allocating through memres.

    pip install ./python                   # once (or PYTHONPATH=python, MEMRES_LIB=...)
    python3 python/proofs/gpu_proof.py            # all checks; exit status 0 when all pass

Each check runs in its own process (an allocator must be installed before CUDA is used):
  train  - a small MLP, 200 steps, with memres ("statistics(pool)") and with PyTorch's
           own allocator, same seed: the loss sequences must agree; memres's statistics
           show the allocations; an over-large tensor raises torch.OutOfMemoryError and
           training goes on; after the tensors are gone and trim() the pool holds nothing;
           memres_configure after the first allocation is refused.
  empty  - many zero-byte tensors live at once (torch.empty(0), empty views and slices,
           empty results of real ops), freed in shuffled order: PyTorch's pluggable
           allocator keys its records by pointer, so every zero-byte request must get NULL
           (a shared dangling pointer aborted the process: "Trying to free a pointer not
           allocated here"); the counts return to where they were.
  cupy   - CuPy arithmetic on memres memory is right; the counts return to zero.
  speed  - 100,000 creations of small tensors of varied sizes on one stream, PyTorch's
           caching allocator against memres "pool", alternating runs in this process's
           children; memres must be within 1.1x of torch's time.
"""

import json
import os
import statistics
import subprocess
import sys
import time

STEPS = 200
SPEED_OPS = 100_000
RUNS = 9


def child(mode, *args):
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), mode, *args],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        print(out.stdout)
        print(out.stderr)
        raise SystemExit(f"child {mode} {args} failed with {out.returncode}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def train(allocator):
    import torch

    report = {}
    if allocator == "memres":
        import memres as m

        m.setup("statistics(pool)")  # configure + torch's allocator in one call
    torch.manual_seed(1234)
    dev = torch.device("cuda")
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 10),
    ).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x = torch.randn(2048, 256, device=dev)
    y = torch.randint(0, 10, (2048,), device=dev)
    losses = []

    def step():
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())

    for _ in range(STEPS):
        step()
    report["losses"] = list(losses)
    if allocator == "memres":
        import memres as m

        during = m.stats(0)
        report["stats_during"] = during
        try:
            m.configure("cuda")
            report["configure_after_use"] = "accepted"
        except m.MemresError as e:
            report["configure_after_use"] = f"refused: code {e.code}: {e}"
        try:
            huge = torch.empty(1 << 50, dtype=torch.uint8, device=dev)
            report["oom"] = f"no error ({huge.numel()})"
        except torch.OutOfMemoryError as e:
            report["oom"] = "torch.OutOfMemoryError: " + str(e).splitlines()[0][:160]
        except Exception as e:  # noqa: BLE001 - the report says what it was
            report["oom"] = f"{type(e).__name__}: {e}"
        for _ in range(5):
            step()  # training continues after the failure
        report["loss_after_oom"] = losses[-1]
        del model, opt, x, y
        import gc

        gc.collect()
        torch.cuda.synchronize()
        if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
            torch._C._cuda_clearCublasWorkspaces()
        report["stats_after_free"] = m.stats(0)
        m.trim(0)
        report["stats_after_trim"] = m.stats(0)
    print(json.dumps(report))


def empty_tensors():
    import random

    import torch

    import memres as m

    m.configure("statistics(virtual_pool)")
    torch.cuda.memory.change_current_allocator(m.torch_allocator())
    dev = torch.device("cuda")
    base = torch.randn(1000, device=dev)
    torch.cuda.synchronize()
    before = m.stats(0)
    held = []
    for i in range(20):
        held.append(torch.empty(0, device=dev))
        held.append(torch.zeros((0, 3 + i), device=dev))
        held.append(base[i:i])  # an empty view: no allocation of its own
        held.append(torch.cat([torch.empty(0, device=dev), torch.empty(0, device=dev)]))
        held.append(base[base > 1e9])  # an empty result of a real kernel
        held.append(torch.ones(7 + i, device=dev))  # and some that are not empty
    random.Random(5).shuffle(held)
    sizes = sorted({t.numel() for t in held})
    while held:
        held.pop()
    torch.cuda.synchronize()
    after = m.stats(0)
    print(json.dumps({"sizes": sizes[:5], "before": before, "after": after}))


def cupy_check():
    import cupy
    import numpy

    import memres as m

    m.setup("statistics(pool)", torch=False, cupy=True)
    rng = numpy.random.default_rng(7)
    a_host = rng.standard_normal((1000, 300)).astype(numpy.float32)
    b_host = rng.standard_normal((300, 200)).astype(numpy.float32)
    a, b = cupy.asarray(a_host), cupy.asarray(b_host)
    c = a @ b + 1.5
    d = cupy.sin(a).sum(axis=0)
    ok = bool(
        numpy.allclose(cupy.asnumpy(c), a_host @ b_host + 1.5, rtol=1e-4, atol=1e-3)
        and numpy.allclose(cupy.asnumpy(d), numpy.sin(a_host).sum(axis=0), rtol=1e-4, atol=1e-3)
    )
    during = m.stats(0)
    del a, b, c, d
    import gc

    gc.collect()
    cupy.cuda.Device().synchronize()
    print(json.dumps({"correct": ok, "stats_during": during, "stats_after": m.stats(0)}))


def log_at_exit(path):
    import torch

    import memres as m

    m.configure(f"logging(pool,file={path})")
    torch.cuda.memory.change_current_allocator(m.torch_allocator())
    for i in range(100):
        t = torch.empty(1024 + i, dtype=torch.uint8, device="cuda")
        del t
    torch.cuda.synchronize()
    # No flush: the library's exit handler writes the last rows.
    print(json.dumps({"done": True}))


def speed(allocator):
    # One core for every run of both sides: fewer migrations, less noise.
    if hasattr(os, "sched_setaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[min(2, len(cores) - 1)]})
    import torch

    if allocator == "memres":
        import memres as m

        m.configure("pool")
        torch.cuda.memory.change_current_allocator(m.torch_allocator())
    dev = torch.device("cuda")
    sizes = [(64 + 37 * (i % 97)) * (1 + i % 5) for i in range(1000)]  # 64 B .. ~18 KiB
    keep = []

    def loop(n):
        for i in range(n):
            t = torch.empty(sizes[i % 1000], dtype=torch.uint8, device=dev)
            if i % 10 == 0:
                keep.append(t)  # some live longer: a mix, not a stack
                if len(keep) > 50:
                    keep.pop(0)
        torch.cuda.synchronize()

    loop(10_000)  # warm up: the pools reach their working size
    start = time.perf_counter()
    loop(SPEED_OPS)
    elapsed = time.perf_counter() - start
    print(json.dumps({"seconds": elapsed}))


def main():
    import torch

    print(f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}")
    failures = []

    theirs = child("train", "torch")
    ours = child("train", "memres")
    diffs = [abs(a - b) for a, b in zip(theirs["losses"], ours["losses"])] or [float("inf")]
    same = len(ours["losses"]) == STEPS and max(diffs) <= 1e-5 * max(1.0, max(theirs["losses"]))
    print(
        f"train: {STEPS} steps; loss {theirs['losses'][0]:.6f} -> {theirs['losses'][-1]:.6f} "
        f"(torch) vs {ours['losses'][0]:.6f} -> {ours['losses'][-1]:.6f} (memres); "
        f"largest difference {max(diffs):.3g}: {'equal' if same else 'DIFFERENT'}"
    )
    print(f"train: memres stats during training: {ours['stats_during']}")
    print(f"train: memres_configure after use: {ours['configure_after_use']}")
    print(f"train: over-large tensor: {ours['oom']}; loss after 5 more steps {ours['loss_after_oom']:.6f}")
    print(f"train: after the tensors are gone: {ours['stats_after_free']}")
    print(f"train: after trim(): {ours['stats_after_trim']}")
    during = ours["stats_during"]
    if not same:
        failures.append("losses differ")
    if not (during.get("total_allocations", 0) > 0 and during.get("current_bytes", 0) > 0):
        failures.append("statistics show no allocations")
    if not ours["configure_after_use"].startswith("refused: code -2"):
        failures.append("configure after use was not refused")
    if not ours["oom"].startswith("torch.OutOfMemoryError"):
        failures.append("no torch.OutOfMemoryError")
    if ours["stats_after_trim"].get("pool_size", -1) != 0:
        failures.append("the pool holds memory after trim")

    e = child("empty")
    print(
        f"empty: 100 empty tensors, views and results plus 20 small ones live at once, freed "
        f"in shuffled order: no abort; bytes live {e['before']['current_bytes']} before, "
        f"{e['after']['current_bytes']} after; allocations {e['before']['current_allocations']} "
        f"-> {e['after']['current_allocations']}"
    )
    if (e["after"]["current_bytes"], e["after"]["current_allocations"]) != (
        e["before"]["current_bytes"],
        e["before"]["current_allocations"],
    ):
        failures.append("empty tensors changed the counts")

    try:
        import cupy  # noqa: F401

        c = child("cupy")
        print(f"cupy: arithmetic correct: {c['correct']}; during {c['stats_during']}; after {c['stats_after']}")
        if not c["correct"]:
            failures.append("cupy arithmetic wrong")
        if c["stats_after"].get("current_allocations") != 0 or c["stats_after"].get("current_bytes") != 0:
            failures.append("cupy counts did not return to zero")
        if c["stats_during"].get("total_allocations", 0) == 0:
            failures.append("cupy did not allocate through memres")
    except ImportError:
        failures.append("cupy is not installed")

    import tempfile

    log_path = os.path.join(tempfile.mkdtemp(), "memres-log.csv")
    child("log", log_path)
    with open(log_path) as f:
        rows = f.read().splitlines() or [""]
    allocs = sum(1 for r in rows if ",allocate," in r)
    frees = sum(1 for r in rows if ",free," in r)
    print(f"log: logging(pool) through torch, no explicit flush: header {rows[0]!r}, {allocs} allocations and {frees} frees logged at exit")
    if rows[0] != "Thread,Time,Action,Pointer,Size,Stream" or allocs < 100 or frees < 100:
        failures.append("the log lost rows at exit")

    runs = {"torch": [], "memres": []}
    for _ in range(RUNS):
        for who in ("torch", "memres"):
            runs[who].append(child("speed", who)["seconds"])
    t_min, m_min = min(runs["torch"]), min(runs["memres"])
    t_med, m_med = statistics.median(runs["torch"]), statistics.median(runs["memres"])
    print(
        f"speed: {SPEED_OPS} torch.empty of 64 B..18 KiB, {RUNS} alternating runs each (one core): "
        f"torch caching allocator min {t_min * 1e3:.1f} ms / median {t_med * 1e3:.1f} ms; "
        f"memres pool min {m_min * 1e3:.1f} ms / median {m_med * 1e3:.1f} ms; "
        f"ratio memres/torch {m_min / t_min:.3f} (min) {m_med / t_med:.3f} (median)"
    )
    print(f"speed: all runs (s): {json.dumps(runs)}")
    if m_med / t_med > 1.1:
        failures.append("memres is more than 1.1x torch's time")

    if failures:
        print("FAILED: " + "; ".join(failures))
        raise SystemExit(1)
    print("all checks passed")


if __name__ == "__main__":
    if len(sys.argv) == 1:
        main()
    elif sys.argv[1] == "train":
        train(sys.argv[2])
    elif sys.argv[1] == "empty":
        empty_tensors()
    elif sys.argv[1] == "cupy":
        cupy_check()
    elif sys.argv[1] == "log":
        log_at_exit(sys.argv[2])
    elif sys.argv[1] == "speed":
        speed(sys.argv[2])
    else:
        raise SystemExit(f"unknown mode {sys.argv[1]}")
