"""GPT-2 trained data-parallel (DDP, NCCL, one process per GPU) under PyTorch's caching
allocator (as it is, and with expandable_segments:True) and under memres, same seeds:
losses, per-rank peak memory and step time.

    pip install ./python      # once: the memres package (or PYTHONPATH=python, MEMRES_LIB=...)
    python3 python/proofs/ddp_proof.py [--gpus N] [--steps 40] [--no-deterministic] [--rounds R]
                                       [--profile-steps K]

N defaults to every visible GPU (1 works too: NCCL with one rank). Each allocator runs as
its own group of N processes (rank r on GPU r, env:// rendezvous on localhost). Under
memres every rank calls `memres.setup()` before touching CUDA, so all of PyTorch's
allocations on its device come from memres: activations, gradients, DDP's gradient
buckets and the tensors NCCL's collectives read and write (NCCL's own internal buffers
are cudaMalloc'd by NCCL and stay outside any PyTorch allocator). Ranks run with
TORCH_NCCL_AVOID_RECORD_STREAMS=0, so NCCL's process group records its stream on the
tensors of each collective (Tensor.record_stream, memres's native backend).

The model is transformers' GPT-2 small from its config (random weights, seed 0 on every
rank, so DDP starts from equal replicas), bf16 autocast, AdamW; per step the batch
(2..8 per rank) and sequence length (128..1024) come from one generator shared by all
ranks, the tokens from a generator of (rank, step). With deterministic algorithms
(torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG=:4096:8, NCCL's ring
all-reduce over a fixed set of ranks) rank 0's losses must equal PyTorch's bit for bit.
Peak memory is cudaMemGetInfo's "used" after each step less what was used before the
rank's CUDA work, next to the allocator's peak live bytes.

--modes (default torch,expandable,memres) picks the allocators; `memres:SPEC` is memres
with the stack SPEC (`MEMRES_RESOURCE`, e.g. `memres:pool` for the chunked pool rather
than the default virtual pool), compared step by step as `memres` is; any mode followed
by `@VAR=VALUE` runs with that variable set (`memres@MEMRES_PEER_ACCESS=all`: the
in-place pools' memory reachable from the other GPU from the start, as before 2026-11-28).
The total of each rank 0's steps is printed too: the steps that grow the pools are in it,
not in the medians; and, for each round, each step in which the allocator called the driver
(`memory_stats()`'s `num_device_alloc` / `num_device_free`: torch's cudaMalloc / cudaFree
and expandable segments' maps, memres's pools' maps and unmaps) with its time, the time of
those steps in all, and each memres mode's step-by-step median over the other modes' on
the steps in which neither called the driver (the allocators' steady cost).

--rounds R (default 1) runs R rounds, each a group per allocator, alternating which goes
first, and prints every round's median step per allocator (rank 0's; the ranks wait for
each other every step), so that step times compare in pairs on the same machine. Losses
are checked in every round.

--profile-steps K runs K more steps on each rank under torch.profiler (after the timed
ones, not in their figures) and prints rank 0's CUDA runtime and driver calls: how many
synchronisations, event records and waits, and allocator driver calls a step makes under
each allocator.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

MODES = ("torch", "expandable", "memres")


def is_memres(mode):
    """`memres`, or `memres:SPEC` (memres with the stack SPEC), either with `@VAR=VALUE`."""
    base = mode.split("@", 1)[0]
    return base == "memres" or base.startswith("memres:")


def mode_env(mode):
    """The environment a mode's ranks get beyond the run's: `expandable`'s setting,
    `memres:SPEC`'s stack, and `@VAR=VALUE` (any mode) as given."""
    base, _, extra = mode.partition("@")
    env = {}
    if base == "expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if base.startswith("memres:"):
        env["MEMRES_RESOURCE"] = base.split(":", 1)[1]
    if extra:
        name, _, value = extra.partition("=")
        env[name] = value
    return env


def rank_main(mode, steps, deterministic):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if is_memres(mode):
        import memres

        memres.setup()  # before CUDA: this rank's PyTorch allocations come from memres
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from transformers import GPT2Config, GPT2LMHeadModel

    if deterministic:
        torch.use_deterministic_algorithms(True)
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    free0, total = torch.cuda.mem_get_info(dev)
    base_used = total - free0
    dist.init_process_group("nccl", device_id=dev)
    torch.manual_seed(0)
    model = DistributedDataParallel(GPT2LMHeadModel(GPT2Config()).to(dev), device_ids=[rank])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    shapes = torch.Generator().manual_seed(42)
    losses, times, peak_used, device_calls = [], [], 0, []

    def allocator_calls():
        # The allocator's own driver calls so far: torch's cudaMalloc / cudaFree (its
        # expandable segments' maps and unmaps), memres's pools' maps and unmaps.
        s = torch.cuda.memory_stats(dev)
        return s.get("num_device_alloc", 0), s.get("num_device_free", 0)

    for step in range(steps):
        calls_before = allocator_calls()
        batch = int(torch.randint(2, 9, (1,), generator=shapes))
        seq = int(torch.randint(128, 1025, (1,), generator=shapes))
        tokens = torch.Generator().manual_seed(1000 * step + rank)
        ids = torch.randint(0, 50257, (batch, seq), generator=tokens).to(dev)
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
        device_calls.append([a - b for a, b in zip(allocator_calls(), calls_before)])
        free, _ = torch.cuda.mem_get_info(dev)
        peak_used = max(peak_used, total - free - base_used)
    calls = {}
    profile_steps = int(os.environ.get("MEMRES_DDP_PROFILE_STEPS", "0"))
    if profile_steps > 0:
        # The same steps again under torch.profiler: the CUDA runtime and driver calls
        # of the step (synchronisations, event records and waits, the allocator's own
        # driver calls), largest host time first, as step_profile.py prints them.
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            for step in range(profile_steps):
                batch = int(torch.randint(2, 9, (1,), generator=shapes))
                seq = int(torch.randint(128, 1025, (1,), generator=shapes))
                ids = torch.randint(0, 50257, (batch, seq), device=dev)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize(dev)
        for e in prof.events():
            if str(e.device_type).endswith("CPU") and e.name.startswith(("cu", "cuda")) and not e.name.startswith("cudnn"):
                c = calls.setdefault(e.name, [0, 0.0])
                c[0] += 1
                c[1] += e.time_range.end - e.time_range.start
        ranked = sorted(calls.items(), key=lambda kv: -kv[1][1])[:15]
        calls = {name: {"count": c, "host_us": round(t, 1)} for name, (c, t) in ranked}
    if is_memres(mode):
        peak_live = memres.stats(rank)["peak_live_bytes"]
    else:
        peak_live = torch.cuda.max_memory_allocated(dev)
    dist.destroy_process_group()
    print(
        json.dumps(
            {
                "rank": rank,
                "world": world,
                "losses": losses,
                "median_step_s": statistics.median(times[3:]),
                "step_s": times,
                "device_calls": device_calls,
                "profiled_calls": calls,
                "peak_device_used": peak_used,
                "peak_live": peak_live,
            }
        )
    )


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_group(mode, gpus, steps, deterministic):
    """Starts `gpus` ranks of one allocator; returns their results, by rank."""
    port = str(free_port())
    procs = []
    for rank in range(gpus):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(gpus))
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        # NCCL's process group calls Tensor.record_stream on the tensors its collectives
        # use (on its own stream) unless told to avoid it: the native backend's
        # record_stream path is exercised under memres.
        env.setdefault("TORCH_NCCL_AVOID_RECORD_STREAMS", "0")
        env.update(mode_env(mode))
        if deterministic:
            env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        args = [sys.executable, os.path.abspath(__file__), "--rank", mode, str(steps)]
        args.append("1" if deterministic else "0")
        procs.append(subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for rank, proc in enumerate(procs):
        out, err = proc.communicate()
        if proc.returncode != 0:
            print(out[-3000:])
            print(err[-3000:])
            raise SystemExit(f"rank {rank} under {mode} failed with {proc.returncode}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--gpus", type=int, default=0, help="ranks (default: every visible GPU)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--no-deterministic", action="store_true")
    p.add_argument("--rounds", type=int, default=1, help="groups per allocator, alternating")
    p.add_argument(
        "--modes",
        default=",".join(MODES),
        help="allocators, comma-separated: torch, expandable, memres, memres:SPEC",
    )
    p.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="then K more steps under torch.profiler: each rank's CUDA calls (printed for rank 0)",
    )
    a = p.parse_args()
    import torch

    gpus = a.gpus or torch.cuda.device_count()
    os.environ["MEMRES_DDP_PROFILE_STEPS"] = str(a.profile_steps)  # the ranks inherit it
    deterministic = not a.no_deterministic
    modes = tuple(m for m in a.modes.split(",") if m)
    unknown = [m for m in modes if m.split("@", 1)[0] not in MODES and not is_memres(m)]
    if unknown or not modes:
        raise SystemExit(f"--modes: unknown {unknown or 'empty'}; use torch, expandable, memres, memres:SPEC, each with @VAR=VALUE or not")
    print(f"{gpus} x {torch.cuda.get_device_name(0)}; torch {torch.__version__}; nccl {torch.cuda.nccl.version()}")
    failures, rounds = [], []
    for n in range(max(1, a.rounds)):
        order = modes if n % 2 == 0 else modes[::-1]
        runs = {mode: run_group(mode, gpus, a.steps, deterministic) for mode in order}
        rounds.append(runs)
        for mode in modes:
            for r in runs[mode]:
                print(
                    f"round {n} {mode:7s} rank {r['rank']}: peak used {r['peak_device_used'] / 2**30:7.3f} GiB  "
                    f"peak live {r['peak_live'] / 2**30:7.3f} GiB  ratio {r['peak_device_used'] / r['peak_live']:.3f}  "
                    f"median step {r['median_step_s'] * 1e3:8.2f} ms"
                )
        # Every group draws the same batches in the same order: step i did the same work
        # under each allocator, so the median of the ratios compares them step by step.
        for mine in filter(is_memres, modes):
            for other in (m for m in modes if not is_memres(m)):
                ours, theirs = runs[mine][0], runs[other][0]
                ratios = [m / o for m, o in zip(ours["step_s"][3:], theirs["step_s"][3:])]
                # The steps in which neither allocator called the driver: the allocators'
                # steady cost, growth left out of both.
                quiet = [
                    m / o
                    for i, (m, o) in enumerate(zip(ours["step_s"], theirs["step_s"]))
                    if i >= 3 and not any(ours["device_calls"][i]) and not any(theirs["device_calls"][i])
                ]
                steady = f", steady steps only ({len(quiet)}) {statistics.median(quiet):.3f}" if quiet else ""
                print(f"round {n}: {mine} / {other} step by step (rank 0), median {statistics.median(ratios):.3f}{steady}")
        for mode in modes:
            for name, c in runs[mode][0].get("profiled_calls", {}).items():
                print(f"round {n} {mode:10s} rank 0 {name:36s} {c['count']:7d} calls {c['host_us'] / 1e3:9.2f} ms")
        if "torch" in runs:
            ref = runs["torch"][0]["losses"]
            for mine in filter(is_memres, modes):
                got = runs[mine][0]["losses"]
                same = ref == got
                diff = max(abs(x - y) for x, y in zip(ref, got))
                print(f"round {n}: rank 0 losses under {mine} {'bit for bit equal to' if same else f'differ (max {diff:.3g}) from'} PyTorch's")
                if deterministic and not same:
                    failures.append(f"{mine}'s losses differ in deterministic round {n}")
    for mode in modes:
        steps = [f"{runs[mode][0]['median_step_s'] * 1e3:.2f}" for runs in rounds]
        print(f"{mode:7s} rank 0 median step by round (ms): {' / '.join(steps)}")
        totals = [f"{sum(runs[mode][0]['step_s']):.2f}" for runs in rounds]
        print(f"{mode:7s} rank 0 all steps by round (s): {' / '.join(totals)}")
        growing = [
            sum(t for c, t in zip(runs[mode][0]["device_calls"], runs[mode][0]["step_s"]) if any(c))
            for runs in rounds
        ]
        print(f"{mode:7s} rank 0 steps with allocator driver calls, their time by round (s): {' / '.join(f'{g:.2f}' for g in growing)}")
        # The steps in which the allocator called the driver, with their times: where
        # the medians leave out the growth.
        for n, runs in enumerate(rounds):
            r = runs[mode][0]
            busy = [
                f"{i}: +{c[0]}/-{c[1]} {t * 1e3:.0f} ms"
                for i, (c, t) in enumerate(zip(r["device_calls"], r["step_s"]))
                if c[0] or c[1]
            ]
            print(f"{mode:7s} rank 0 round {n} steps with allocator driver calls (maps/unmaps): {'; '.join(busy) or 'none'}")
    same = all(
        runs["torch"][0]["losses"] == runs[m][0]["losses"] for runs in rounds if "torch" in runs for m in filter(is_memres, modes)
    )
    print(json.dumps({"gpus": gpus, "steps": a.steps, "deterministic": deterministic, "runs": rounds[0], "rounds": rounds, "losses_equal": same}))
    if failures:
        print("FAILED: " + "; ".join(failures))
        raise SystemExit(1)
    print("all checks passed")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        rank_main(sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1")
    else:
        main()
