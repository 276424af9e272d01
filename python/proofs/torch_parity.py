"""What a PyTorch program does with its allocator, under torch's own and under memres.

    python3 python/proofs/torch_parity.py [--checks a,b]   # both allocators: a table
    python3 python/proofs/torch_parity.py CHECK ALLOCATOR   # one, in this process (JSON)

Each check runs in a fresh process per allocator (an allocator is chosen before CUDA is
first used): ``torch`` (PyTorch's caching allocator) or ``memres`` (``memres.setup()``,
the native backend). A check prints one JSON object: ``ok`` (whether it did what torch's
allocator does) and what it saw. The table shows both; exit status 0 when memres passes
every check that torch passes.

Checks:
  record_stream - x written on the current stream, read on a side stream after a long
                  kernel there, x.record_stream(side), del x, a new tensor of the same
                  size written at once on the current stream: the side stream must read
                  x's bytes; 100 trials, wrong ones counted.
  stats         - memory_allocated / max_memory_allocated / memory_reserved /
                  max_memory_reserved / memory_stats / reset_peak_memory_stats /
                  reset_accumulated_memory_stats / memory_summary around a 256 MiB tensor.
  empty_cache   - a freed 1 GiB tensor's memory goes back to the device on empty_cache().
  oom           - an impossible tensor raises torch.OutOfMemoryError; work goes on after.
  cudnn         - torch.backends.cudnn.benchmark = True on a convolution (cacheInfo).
  graphs        - two torch.cuda.graph captures replayed in turn, results checked.
  graph_pools   - two graphs sharing one private pool (pool=), a temporary freed inside
                  the first capture, an eager tensor made after capture: replays give
                  the right values and never write the eager tensor; once the graphs and
                  their outputs are gone, empty_cache() gives their memory back.
  pool_record_stream - the record_stream row inside torch.cuda.use_mem_pool (a private
                  pool): 20 trials, wrong ones counted.
  compile       - torch.compile(mode="reduce-overhead") on a small MLP matches eager.
  snapshot      - torch.cuda.memory._record_memory_history, two tensors, one freed,
                  _snapshot(): the live tensor is an allocated block of a segment, the
                  history has its allocation with this file's stack and the free, the
                  segments add up to memory_reserved(), the visualiser's plots render.
  ipc           - two CUDA tensors (one a view at an offset) sent to another process with
                  torch.multiprocessing, receiver on the same allocator: it reads both and
                  writes one, which the sender then reads.
  bad_input     - a malformed IPC handle (an expandable segment's of no granules), a
                  graph pool released twice: exceptions with a message, and work goes
                  on (what each says is shown).
  ipc_pool      - the same with memres on a chunked pool (MEMRES_RESOURCE=pool) sending to
                  a receiver on torch's own allocator.
  fraction      - set_per_process_memory_fraction(0.5): get returns it, a tensor of 45% of
                  the device fits, one of 50% is torch.OutOfMemoryError, work goes on;
                  back at 1.0 a tensor of 60% fits; fractions outside (0, 1] are refused.
  oom_text      - an impossible tensor's error says "CUDA out of memory. Tried to
                  allocate" with the device's capacity, and an observer attached with
                  torch._C._cuda_attach_out_of_memory_observer was called once with the
                  device and the request's size.
  oom_observer_raises - an observer that raises: the allocation raises, the process goes
                  on (memres must pass, whatever torch does).
  profiler      - torch.profiler(profile_memory=True) around a 64 MiB tensor made and
                  freed: the trace has [memory] events of +64 MiB and -64 MiB on CUDA.
  ipc_to_torch  - the ipc row with the receiver on torch's own allocator, whatever the
                  sender's (under memres: its default virtual pool).
  ipc_to_torch_expandable - the same, the receiver with expandable segments.
  ipc_from_torch_expandable - a sender on torch's allocator with expandable segments;
                  this process reads the tensor and writes it, the sender reads it back.
  mempool_other_allocator - torch.cuda.MemPool(another CUDAPluggableAllocator): allocations
                  inside use_mem_pool come from it, go back to it once the pool is gone;
                  one that returns no memory gives an exception and work goes on.
  mempool_snapshot - MemPool.snapshot(): the pool's segments only (its id on each), its
                  tensor allocated in them, a tensor made outside it absent.
  mempool_beside_default - a MemPool's segment made between two 1 MiB tensors of the
                  default pool (the second on another thread): a snapshot shows two
                  segments, the pool's and the default pool's holding both tensors.
  graph_pool_blocks - a graph's outputs: memory_snapshot() shows the graph pool's
                  segments with its id and one allocated block per live output; deleting
                  outputs lowers the count; memory_allocated() counts the blocks, not
                  the pool's whole segments.
  history_options - _record_memory_history(skip_actions=["free_requested"]) leaves that
                  action out of the trace; _set_memory_metadata("..") is on every event
                  recorded while it is set.
  caching_off   - torch.cuda.caching_allocator_enable(False): a raw allocation is not
                  counted in requested_bytes; enabled again, it is.
  roundup       - _set_allocator_settings("roundup_power2_divisions:4"): an 84 MiB tensor
                  takes 96 MiB of active bytes and 84 MiB of requested bytes.
  block_sizes   - tensors of 1 byte to 3 MiB + 100: memory_allocated(), active_bytes and
                  requested_bytes grow as torch's allocator rounds (whole blocks of 512
                  bytes; the bytes asked for), the history records the bytes asked for,
                  and a graph-safe generator state registered with a graph adds two
                  blocks of 512 bytes.
  nested_pools  - use_mem_pool nested three deep: each tensor lands in the innermost pool.
  no_split      - MemPool(no_split=True): one block per segment, more segments and fewer
                  blocks than a splitting pool with the same tensors.
  ipc_second_gpu, ipc_to_torch_second_gpu, ipc_from_torch_second_gpu - the ipc,
                  ipc_to_torch and ipc_from_torch_expandable rows with the tensors on the
                  second GPU, the receiver also copying them to the first (two GPUs;
                  not in the default list).
  checkpoint_pending - a graph pool's output freed while a busy side stream uses it
                  (record_stream), then the pool's checkpoint taken before restored: the
                  block is live again and a new allocation of the pool does not get it
                  (not in the default list).
  capture_reuse - graph_capture_record_stream_reuse:True: inside a capture, a block used on
                  a second stream (record_stream) and freed is not taken again before the
                  streams join, and is taken again after.
"""

import json
import os
import subprocess
import sys
import traceback

CHECKS = ["record_stream", "stats", "empty_cache", "oom", "cudnn", "graphs", "graph_pools", "pool_record_stream", "compile", "snapshot", "ipc", "ipc_pool", "bad_input", "fraction", "oom_text", "oom_observer_raises", "profiler", "ipc_to_torch", "ipc_to_torch_expandable", "ipc_from_torch_expandable", "mempool_other_allocator", "mempool_snapshot", "mempool_beside_default", "graph_pool_blocks", "history_options", "caching_off", "roundup", "block_sizes", "nested_pools", "no_split", "capture_reuse"]
# Run where two GPUs are visible (python/proofs/two_devices.py runs them).
TWO_GPU_CHECKS = ["ipc_second_gpu", "ipc_to_torch_second_gpu", "ipc_from_torch_second_gpu"]
# Checks of the backend's own bookkeeping, run where asked (not in the default list).
EXTRA_CHECKS = ["checkpoint_pending"]
MIB = 1 << 20


def record_stream():
    import torch

    n = 64 * MIB // 4
    side = torch.cuda.Stream()
    wrong = 0
    for _ in range(100):
        x = torch.full((n,), 1.0, device="cuda")
        out = torch.empty(n, device="cuda")
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(20_000_000)  # a long kernel first
            out.copy_(x)
        x.record_stream(side)
        del x
        y = torch.full((n,), 2.0, device="cuda")  # may reuse x's memory
        torch.cuda.synchronize()
        wrong += int((out != 1.0).any().item())
        del y, out
    return {"ok": wrong == 0, "wrong_trials": wrong, "trials": 100}


def stats():
    import torch

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    x = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda")
    during = torch.cuda.memory_allocated()
    peak = torch.cuda.max_memory_allocated()
    reserved = torch.cuda.memory_reserved()
    max_reserved = torch.cuda.max_memory_reserved()
    s = torch.cuda.memory_stats()
    del x
    after = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    peak_after_reset = torch.cuda.max_memory_allocated()
    torch.cuda.reset_accumulated_memory_stats()
    acc = torch.cuda.memory_stats()["allocation.all.allocated"]
    summary = torch.cuda.memory_summary()
    seen = {
        "grew_by": during - base,
        "peak": peak,
        "reserved": reserved,
        "max_reserved": max_reserved,
        "after": after - base,
        "peak_after_reset": peak_after_reset - base,
        "allocations_after_accumulated_reset": acc,
        "num_ooms": s.get("num_ooms"),
        "summary_lines": len(summary.splitlines()),
    }
    ok = (
        during - base >= 256 * MIB
        and peak >= during
        and reserved >= during
        and max_reserved >= reserved
        and after == base
        and peak_after_reset - base < 256 * MIB
        and acc == 0
        and "allocated_bytes.all.current" in s
        and "reserved_bytes.all.peak" in s
        and "num_alloc_retries" in s
        and len(summary.splitlines()) > 5
    )
    return {"ok": ok, **seen}


def empty_cache():
    import torch

    calls = lambda: [torch.cuda.memory_stats().get(k, 0) for k in ("num_device_alloc", "num_device_free")]
    torch.cuda.empty_cache()  # nothing cached: the 1 GiB below is new memory
    before = calls()
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    x.fill_(1)
    del x
    torch.cuda.synchronize()
    held = torch.cuda.memory_reserved()
    grown = calls()
    free_before, _ = torch.cuda.mem_get_info()
    torch.cuda.empty_cache()
    free_after, _ = torch.cuda.mem_get_info()
    back = free_after - free_before
    emptied = calls()
    # The driver calls that took the 1 GiB and gave it back are counted
    # (num_device_alloc, num_device_free), as torch's allocator counts its own.
    counted = grown[0] > before[0] and emptied[1] > grown[1]
    return {
        "ok": back >= (1 << 30) - 64 * MIB and counted,
        "returned_mib": back // MIB,
        "reserved_mib": held // MIB,
        "device_alloc_and_free_calls": [before, grown, emptied],
    }


def oom():
    import torch

    try:
        torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
        raised = "nothing"
    except torch.OutOfMemoryError:
        raised = "OutOfMemoryError"
    except RuntimeError as e:
        raised = f"RuntimeError: {e}"
    y = torch.ones(1024, device="cuda").sum().item()
    return {"ok": raised == "OutOfMemoryError" and y == 1024, "raised": raised}


def cudnn():
    import torch

    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(64, 64, 3, padding=1).cuda()
    x = torch.randn(32, 64, 56, 56, device="cuda")
    y = conv(x).sum().item()
    ref = torch.nn.functional.conv2d(x.double(), conv.weight.double(), conv.bias.double(), padding=1)
    close = abs(y - ref.sum().item()) < 1e-2 * max(1.0, abs(y))
    return {"ok": close, "sum": y}


def graphs():
    import torch

    a = torch.ones(1024, device="cuda")
    outs = []
    gs = []
    for k in (2.0, 3.0):
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            (a * k).sum()  # warm up
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            out = (a * k) + 1
        gs.append(g)
        outs.append(out)
    results = []
    for _ in range(3):
        for g, out, k in zip(gs, outs, (2.0, 3.0)):
            g.replay()
            torch.cuda.synchronize()
            results.append(bool((out == k + 1).all().item()))
    return {"ok": all(results), "replays_right": sum(results), "replays": len(results)}


def graph_pools():
    import gc

    import torch

    torch.cuda.synchronize()
    base = torch.cuda.memory_reserved()
    n = 1 << 20
    x = torch.ones(n, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        (x * 2 + 1).sum()  # warm up
    torch.cuda.current_stream().wait_stream(s)
    g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(g1):
        t = x * 2 + 1  # a temporary, freed inside the capture
        z1 = t * 3
        del t
    with torch.cuda.graph(g2, pool=g1.pool()):
        z2 = z1 + 1
    e = torch.full((n,), 7.0, device="cuda")  # may not take the temporary's memory
    x.fill_(2.0)
    right = []
    for _ in range(3):
        g1.replay()
        g2.replay()
        torch.cuda.synchronize()
        right.append(bool((z1 == 15).all().item() and (z2 == 16).all().item() and (e == 7).all().item()))
    held = torch.cuda.memory_reserved()
    del g1, g2, z1, z2, e
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    back = torch.cuda.memory_reserved()
    # The graphs' memory (z1, z2 and the temporary: 12 MiB) and the eager tensor's come
    # back; what stays is x and what the allocator keeps for itself (torch: cuBLAS
    # workspaces of the capture stream).
    ok = all(right) and held - back >= 3 * 4 * n and back - base < held - base
    return {"ok": ok, "replays_right": sum(right), "held_mib": held // MIB, "after_mib": back // MIB}


def pool_record_stream():
    import torch

    n = 16 * MIB // 4
    side = torch.cuda.Stream()
    pool = torch.cuda.MemPool()
    wrong = 0
    for _ in range(20):
        with torch.cuda.use_mem_pool(pool):
            x = torch.full((n,), 1.0, device="cuda")
            out = torch.empty(n, device="cuda")
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(20_000_000)
            out.copy_(x)
        x.record_stream(side)
        del x
        with torch.cuda.use_mem_pool(pool):
            y = torch.full((n,), 2.0, device="cuda")
        torch.cuda.synchronize()
        wrong += int((out != 1.0).any().item())
        del y, out
    return {"ok": wrong == 0, "wrong_trials": wrong, "trials": 20}


def compile_():
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8)).cuda().eval()
    compiled = torch.compile(model, mode="reduce-overhead")
    worst = 0.0
    with torch.no_grad():
        for batch in (4, 8, 4, 8):
            x = torch.randn(batch, 64, device="cuda")
            for _ in range(3):
                got = compiled(x)
            worst = max(worst, (got - model(x)).abs().max().item())
    return {"ok": worst < 1e-4, "max_diff": worst}


def snapshot():
    import torch
    from torch.cuda import _memory_viz

    torch.cuda.memory._record_memory_history(max_entries=100000)
    x = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
    y = torch.empty(MIB, dtype=torch.uint8, device="cuda")
    y_ptr = y.data_ptr()
    del y
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    blocks = [b for seg in snap["segments"] for b in seg["blocks"]]
    x_block = [b for b in blocks if b.get("address") == x.data_ptr() and b["state"] == "active_allocated"]
    trace = snap["device_traces"][0]
    alloc_x = [e for e in trace if e["action"] == "alloc" and e["addr"] == x.data_ptr()]
    freed_y = [e for e in trace if e["action"] == "free_completed" and e["addr"] == y_ptr]
    here = lambda e: any("torch_parity" in f.get("filename", "") for f in e.get("frames", []))
    held = sum(seg["total_size"] for seg in snap["segments"])
    segment_html = _memory_viz.segment_plot(snap)
    trace_html = _memory_viz.trace_plot(snap)
    ok = (
        len(x_block) == 1
        and x_block[0]["size"] >= 64 * MIB
        and len(alloc_x) == 1
        and here(alloc_x[0])
        and len(freed_y) == 1
        and held == torch.cuda.memory_reserved()
        and len(segment_html) > 1000
        and len(trace_html) > 1000
    )
    return {
        "ok": ok,
        "segments": len(snap["segments"]),
        "x_block": len(x_block),
        "alloc_with_stack": bool(alloc_x and here(alloc_x[0])),
        "free_seen": len(freed_y),
        "held_is_reserved": held == torch.cuda.memory_reserved(),
    }


def bad_input():
    """Misuse gives a Python exception with a message, and the process goes on."""
    import torch

    seen = {}
    # A malformed IPC handle: an expandable segment's ('e') of no granules.
    try:
        torch.UntypedStorage._new_shared_cuda(0, b"\x02e" + bytes(40), 64, 0, b"nosuch", 0, bytes(64), False)
        seen["foreign_ipc"] = "accepted"
    except Exception as e:
        seen["foreign_ipc"] = f"{type(e).__name__}: {e}".splitlines()[0][:160]
    # A graph pool released twice.
    pool = torch.cuda.graph_pool_handle()
    g = torch.cuda.CUDAGraph()
    x = torch.ones(1024, device="cuda")
    with torch.cuda.graph(g, pool=pool):
        y = x * 2
    del g, y
    torch.cuda.synchronize()
    try:
        torch._C._cuda_releasePool(0, pool)
        seen["pool_released_twice"] = "accepted"
    except Exception as e:
        seen["pool_released_twice"] = f"{type(e).__name__}: {e}".splitlines()[0][:160]
    after = float((torch.ones(1 << 20, device="cuda") * 3).sum().item())
    seen["ok"] = (
        after == 3.0 * (1 << 20)
        and seen["foreign_ipc"] != "accepted"
        and seen["pool_released_twice"] != "accepted"
    )
    return seen


def _child_allocator(child):
    """Chooses the child's allocator before its first CUDA use: "memres", "torch", or
    "torch-expandable" (torch's own with expandable segments)."""
    if child == "torch-expandable":
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    else:
        os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if child == "memres":
        import memres

        memres.setup()


def _ipc_child(queue, done, child):
    _child_allocator(child)
    import torch

    a, b = queue.get()
    # Read on the tensor's own device and, where there is another, copied to it.
    other = (a.device.index + 1) % torch.cuda.device_count()
    copied = float(a.to(f"cuda:{other}").sum().item())
    done.put((float(a.sum().item()), float(b.double().sum().item()), copied))
    a.add_(1.0)  # written here, read by the sender
    torch.cuda.synchronize()
    done.put("written")
    queue.get()  # hold the tensors until the sender has read
    del a, b


def _ipc(child, device=0):
    import torch
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_ipc_child, args=(queue, done, child), daemon=True)
    p.start()
    try:
        n = 1 << 20
        a = torch.full((n,), 2.0, device=f"cuda:{device}")
        big = torch.arange(6 << 20, device=f"cuda:{device}", dtype=torch.float32)  # 24 MiB
        b = big[1000:]  # a view: the storage's offset travels with it
        queue.put((a, b))
        sum_a, sum_b, copied = done.get(timeout=180)
        assert done.get(timeout=60) == "written"
        seen = float(a.sum().item())
        queue.put("bye")
        p.join(60)
        want_b = float(b.double().sum().item())
    finally:
        if p.is_alive():
            p.terminate()
            p.join(60)
    ok = sum_a == 2.0 * n and sum_b == want_b and seen == 3.0 * n and copied == 2.0 * n
    seen = {"sum_a": sum_a, "sum_b_ok": sum_b == want_b, "copied_ok": copied == 2.0 * n, "written_back": seen == 3.0 * n}
    return {"ok": ok, "device": device, **seen}


def ipc():
    """Sender and receiver on the same allocator; the receiver writes, the sender reads."""
    return _ipc(child=os.environ.get("PARITY_ALLOCATOR"))


def ipc_to_torch():
    """The sender (memres's default pool under memres) to a receiver on torch's own
    allocator."""
    return _ipc(child="torch")


def ipc_to_torch_expandable():
    """The same, the receiver on torch's allocator with expandable segments."""
    return _ipc(child="torch-expandable")


def _ipc_sender_child(queue, done, device=0):
    _child_allocator("torch-expandable")
    import torch

    n = 1 << 20
    a = torch.full((n,), 2.0, device=f"cuda:{device}")
    queue.put(a)
    assert done.get(timeout=180) == "written"
    done.put(float(a.sum().item()))
    assert done.get(timeout=60) == "bye"


def ipc_from_torch_expandable(device=0):
    """A sender on torch's allocator with expandable segments to this process: it reads
    the tensor and writes it, the sender reads what was written."""
    import torch
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_ipc_sender_child, args=(queue, done, device), daemon=True)
    p.start()
    try:
        a = queue.get(timeout=180)
        n = a.numel()
        got = float(a.sum().item())
        a.add_(1.0)
        torch.cuda.synchronize()
        done.put("written")
        seen = done.get(timeout=60)
        del a
        done.put("bye")
        p.join(60)
    finally:
        if p.is_alive():
            p.terminate()
            p.join(60)
    ok = got == 2.0 * n and seen == 3.0 * n
    return {"ok": ok, "device": device, "read": got == 2.0 * n, "written_back": seen == 3.0 * n}


def ipc_second_gpu():
    """The ipc row with the tensors on the second GPU (needs two): the receiver reads
    them there and copied to the first."""
    return _ipc(child=os.environ.get("PARITY_ALLOCATOR"), device=1)


def ipc_to_torch_second_gpu():
    """ipc_to_torch on the second GPU."""
    return _ipc(child="torch", device=1)


def ipc_from_torch_second_gpu():
    """ipc_from_torch_expandable on the second GPU."""
    return ipc_from_torch_expandable(device=1)


def fraction():
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    seen = {"initial": torch.cuda.get_per_process_memory_fraction(0)}
    refused = []
    for bad in (-0.1, 1.5):
        try:
            torch.cuda.set_per_process_memory_fraction(bad, 0)
        except ValueError:
            refused.append(bad)
    x = torch.zeros(1024, device="cuda")
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(0.5, 0)
    seen["set"] = torch.cuda.get_per_process_memory_fraction(0)
    fits = int(total * 0.45) - torch.cuda.max_memory_reserved()
    y = torch.empty(fits, dtype=torch.uint8, device="cuda")
    del y
    torch.cuda.empty_cache()
    try:
        torch.empty(int(total * 0.5), dtype=torch.uint8, device="cuda")
        seen["half"] = "fit"
    except torch.OutOfMemoryError:
        seen["half"] = "OutOfMemoryError"
    x.fill_(1)
    seen["work_goes_on"] = bool((x == 1).all().item())
    torch.cuda.set_per_process_memory_fraction(1.0, 0)
    try:
        z = torch.empty(int(total * 0.6), dtype=torch.uint8, device="cuda")
        del z
        seen["lifted"] = "fit"
    except torch.OutOfMemoryError:
        seen["lifted"] = "OutOfMemoryError"
    ok = (
        seen["initial"] == 1.0
        and seen["set"] == 0.5
        and refused == [-0.1, 1.5]
        and seen["half"] == "OutOfMemoryError"
        and seen["work_goes_on"]
        and seen["lifted"] == "fit"
    )
    return {"ok": ok, **seen, "refused": refused}


def oom_text():
    import torch

    calls = []
    torch._C._cuda_attach_out_of_memory_observer(lambda *args: calls.append(args))
    text = ""
    try:
        torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError as e:
        text = str(e)
    total = torch.cuda.get_device_properties(0).total_memory
    words = ["CUDA out of memory. Tried to allocate", "GPU 0 has a total capacity of"]
    said = all(w in text for w in words)
    observed = len(calls) == 1 and calls[0][0] == 0 and calls[0][1] >= 1 << 50 and calls[0][2] == total
    y = torch.ones(1024, device="cuda").sum().item()
    return {"ok": said and observed and y == 1024, "text": text[:160], "observer_calls": [list(c) for c in calls]}


def oom_observer_raises():
    import torch

    def observer(*args):
        raise ValueError("an observer that raises")

    torch._C._cuda_attach_out_of_memory_observer(observer)
    try:
        torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
        raised = "nothing"
    except Exception as e:
        raised = type(e).__name__
    y = torch.ones(1024, device="cuda").sum().item()
    return {"ok": raised != "nothing" and y == 1024, "raised": raised}


def profiler():
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    size = 64 * MIB
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], profile_memory=True) as prof:
        x = torch.empty(size, dtype=torch.uint8, device="cuda")
        del x
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.load(open(f.name))
    memory = [
        e["args"]
        for e in trace.get("traceEvents", [])
        if e.get("name") == "[memory]" and e.get("args", {}).get("Device Type") == 1
    ]
    sizes = sorted(a.get("Bytes") for a in memory)
    return {"ok": -size in sizes and size in sizes, "cuda_memory_events": len(memory), "bytes": sizes[:4]}


_OTHER_ALLOCATOR = r"""
#include <cuda_runtime_api.h>
#include <stddef.h>
extern "C" {
int allocs = 0, frees = 0, fail = 0;
void* other_alloc(size_t size, int device, cudaStream_t stream) {
  void* p = NULL;
  if (fail || cudaMalloc(&p, size) != cudaSuccess) return NULL;
  ++allocs;
  return p;
}
void other_free(void* p, size_t size, int device, cudaStream_t stream) {
  ++frees;
  cudaFree(p);
}
}
"""


def mempool_other_allocator():
    """torch.cuda.MemPool of another allocator (a CUDAPluggableAllocator over cudaMalloc,
    built here with nvcc): inside use_mem_pool its allocations come from that allocator,
    the values are right, and once the pool and its tensors are gone its memory goes back
    to it; an allocator that returns nothing gives an exception, and work goes on."""
    import ctypes
    import shutil
    import tempfile

    import torch

    folder = tempfile.mkdtemp()
    src, lib = os.path.join(folder, "other.cu"), os.path.join(folder, "other.so")
    open(src, "w").write(_OTHER_ALLOCATOR)
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    subprocess.run([nvcc, "-shared", "-Xcompiler", "-fPIC", src, "-o", lib], check=True)
    counters = ctypes.CDLL(lib)
    count = lambda name: ctypes.c_int.in_dll(counters, name).value
    other = torch.cuda.memory.CUDAPluggableAllocator(lib, "other_alloc", "other_free")
    pool = torch.cuda.MemPool(other.allocator())
    with torch.cuda.use_mem_pool(pool):
        x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    outside = torch.ones(1024, device="cuda")
    seen = {"allocs_in_pool": count("allocs"), "right": float(x.sum().item()) == float((1 << 20) * ((1 << 20) - 1) / 2)}
    seen["outside_not_from_it"] = count("allocs") == seen["allocs_in_pool"]
    del x, pool
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    seen["freed_back"] = count("frees") == count("allocs")
    ctypes.c_int.in_dll(counters, "fail").value = 1
    failing = torch.cuda.MemPool(other.allocator())
    try:
        with torch.cuda.use_mem_pool(failing):
            torch.empty(1 << 20, device="cuda")
        seen["null"] = "accepted"
    except Exception as e:
        seen["null"] = type(e).__name__
    seen["work_goes_on"] = float(outside.sum().item()) == 1024.0
    ok = seen["allocs_in_pool"] >= 1 and seen["right"] and seen["outside_not_from_it"] and seen["freed_back"]
    ok = ok and seen["null"] != "accepted" and seen["work_goes_on"]
    return {"ok": ok, **seen}


def mempool_snapshot():
    """MemPool.snapshot(): the pool's own segments only, its tensor an allocated block of
    them, a tensor made outside the pool nowhere in it."""
    import torch

    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        a = torch.empty(4 * MIB, dtype=torch.uint8, device="cuda")
    outside = torch.empty(8 * MIB, dtype=torch.uint8, device="cuda")
    snap = pool.snapshot()
    within = lambda p, s: s["address"] <= p < s["address"] + s["total_size"]
    ids = sorted({tuple(s.get("segment_pool_id", ())) for s in snap})
    seen = {
        "segments": len(snap),
        "pool_ids_match": ids == [tuple(pool.id)],
        "tensor_in_it": any(within(a.data_ptr(), s) for s in snap),
        "allocated": sum(s["allocated_size"] for s in snap),
        "outside_absent": not any(within(outside.data_ptr(), s) for s in snap),
    }
    ok = seen["segments"] >= 1 and seen["pool_ids_match"] and seen["tensor_in_it"]
    ok = ok and seen["allocated"] >= 4 * MIB and seen["outside_absent"]
    return {"ok": ok, **seen}


def mempool_beside_default():
    """A MemPool's segment made between two 1 MiB tensors of the default pool (the second
    on another thread, while the pool's context is on): a snapshot shows two segments,
    the pool's (nothing active in it) and the default pool's holding both tensors."""
    import threading

    import torch

    torch.cuda.empty_cache()
    n = MIB
    made, done = threading.Event(), threading.Event()
    kept, snaps = [], []

    def in_pool():
        pool = torch.cuda.MemPool()
        kept.append(torch.empty(n, dtype=torch.int8, device="cuda"))
        with torch.cuda.use_mem_pool(pool):
            out = torch.empty(n, dtype=torch.int8, device="cuda")
            del out
            made.set()
            done.wait(timeout=30)

    def beside():
        made.wait(timeout=30)
        kept.append(torch.empty(n, dtype=torch.int8, device="cuda"))
        snaps.append(torch.cuda.memory._snapshot()["segments"])
        done.set()

    threads = [threading.Thread(target=in_pool), threading.Thread(target=beside)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    segments = snaps[0] if snaps else []
    active = {}
    for seg in segments:
        key = str(tuple(seg["segment_pool_id"]))
        active[key] = active.get(key, 0) + seg["active_size"]
    seen = {"segments": len(segments), "active_by_pool": active}
    ok = len(segments) == 2 and active.get("(0, 0)") == 2 * MIB and sum(active.values()) == 2 * MIB
    return {"ok": ok, **seen}


def _pool_segments(pool_id):
    import torch

    return [s for s in torch.cuda.memory_snapshot() if tuple(s["segment_pool_id"]) == tuple(pool_id)]


def _allocated_blocks(segments):
    return sum(b["state"] == "active_allocated" for s in segments for b in s["blocks"])


def graph_pool_blocks():
    """A graph pool's segments in memory_snapshot(), with one allocated block per live
    output, and memory_allocated() counting those blocks."""
    import torch

    static_in = torch.ones(1024, device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        g.capture_begin()
        outs = [static_in * k for k in (2, 3, 4)]  # 4 KiB each
        g.capture_end()
    torch.cuda.current_stream().wait_stream(side)
    g.replay()
    torch.cuda.synchronize()
    pool = g.pool()
    seen = {"blocks": _allocated_blocks(_pool_segments(pool))}
    seen["allocated_delta"] = torch.cuda.memory_allocated() - base
    seen["values"] = [round(float(o[0]), 1) for o in outs]
    del outs[0]
    seen["blocks_after_del"] = _allocated_blocks(_pool_segments(pool))
    ok = seen["blocks"] == 3 and seen["blocks_after_del"] == 2 and seen["values"] == [2.0, 3.0, 4.0]
    ok = ok and 3 * 4096 <= seen["allocated_delta"] < 2 * MIB
    return {"ok": ok, **seen}


def history_options():
    """skip_actions drops an action from the trace; user metadata marks every event."""
    import torch

    try:
        torch.cuda.memory._record_memory_history(context="all", stacks="python", skip_actions=["free_requested"])
        torch.cuda.memory._set_memory_metadata("parity")
        x = torch.rand(128, 128, device="cuda")
        del x
        torch.cuda.synchronize()
        trace = [e for t in torch.cuda.memory._snapshot()["device_traces"] for e in t]
        torch.cuda.memory._set_memory_metadata("")
    finally:
        torch.cuda.memory._record_memory_history(None)
    actions = sorted({e["action"] for e in trace})
    seen = {
        "actions": actions,
        "metadata_on_all": bool(trace) and all(e.get("user_metadata") == "parity" for e in trace),
    }
    ok = "alloc" in actions and "free_requested" not in actions and seen["metadata_on_all"]
    return {"ok": ok, **seen}


def caching_off():
    """caching_allocator_enable(False): a raw allocation goes around the allocator's
    figures; enabled again, it is counted."""
    import torch

    stream = torch.cuda.current_stream().cuda_stream

    def requested_by_raw_alloc():
        key = "requested_bytes.all.allocated"
        start = torch.cuda.memory_stats()[key]
        ptr = torch._C._cuda_cudaCachingAllocator_raw_alloc(MIB, stream)
        end = torch.cuda.memory_stats()[key]
        torch._C._cuda_cudaCachingAllocator_raw_delete(ptr)
        return end - start

    torch.cuda.caching_allocator_enable(False)
    try:
        off = requested_by_raw_alloc()
        t = torch.ones(1000, device="cuda")
        value_off = float(t.sum())
        del t
    finally:
        torch.cuda.caching_allocator_enable(True)
    on = requested_by_raw_alloc()
    seen = {"requested_off": off, "requested_on": on, "tensor_sum_off": value_off}
    return {"ok": off == 0 and on == MIB and value_off == 1000.0, **seen}


def roundup():
    """roundup_power2_divisions:4 rounds an 84 MiB request up to 96 MiB (active bytes),
    the requested bytes stay 84 MiB."""
    import torch

    stats = lambda: torch.cuda.memory_stats()
    torch.zeros(1, device="cuda")  # the allocator's figures exist once CUDA is in use
    torch.cuda.memory._set_allocator_settings("roundup_power2_divisions:4")
    try:
        before = stats()
        x = torch.empty(84 * MIB, dtype=torch.uint8, device="cuda")
        after = stats()
        del x
    finally:
        torch.cuda.memory._set_allocator_settings("roundup_power2_divisions:1")
    seen = {
        "active": after["active_bytes.all.allocated"] - before["active_bytes.all.allocated"],
        "requested": after["requested_bytes.all.allocated"] - before["requested_bytes.all.allocated"],
    }
    before = stats()
    y = torch.empty(84 * MIB, dtype=torch.uint8, device="cuda")
    seen["active_after_reset"] = stats()["active_bytes.all.allocated"] - before["active_bytes.all.allocated"]
    del y
    ok = seen["active"] == 96 * MIB and seen["requested"] == 84 * MIB and seen["active_after_reset"] == 84 * MIB
    return {"ok": ok, **seen}


def block_sizes():
    """Tensors of 1, 4, 513, 1 MiB + 1 and 3 MiB + 100 bytes: memory_allocated() and
    active_bytes grow by whole blocks of 512 bytes (at least one), requested_bytes by the
    bytes asked for, and the history records the bytes asked for; a cloned graph-safe
    generator state registered with a graph adds two blocks of 512 bytes (its seed and
    offset)."""
    import torch

    whole = lambda n: max(512, (n + 511) // 512 * 512)
    keys = ("allocated_bytes", "active_bytes", "requested_bytes", "active")
    current = lambda: {k: torch.cuda.memory_stats()[k + ".all.current"] for k in keys}
    torch.zeros(1, device="cuda")
    sizes = [1, 4, 513, MIB + 1, 3 * MIB + 100]
    seen, wrong = {}, []
    torch.cuda.memory._record_memory_history(max_entries=10_000)
    try:
        for n in sizes:
            before = current()
            x = torch.empty(n, dtype=torch.uint8, device="cuda")
            after = current()
            seen[str(n)] = {k: after[k] - before[k] for k in keys}
            if seen[str(n)] != {"allocated_bytes": whole(n), "active_bytes": whole(n), "requested_bytes": n, "active": 1}:
                wrong.append(n)
            ptr = x.data_ptr()
            del x
            events = [e for e in torch.cuda.memory._snapshot()["device_traces"][0] if e["addr"] == ptr]
            sizes_seen = {e["action"]: e["size"] for e in events if e["action"] in ("alloc", "free_completed")}
            if sizes_seen != {"alloc": n, "free_completed": n}:
                wrong.append(("history", n, sizes_seen))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    before = current()
    state = torch.cuda.default_generators[0].clone_state()
    graph = torch.cuda.CUDAGraph()
    graph.register_generator_state(state)  # its seed and offset go to the device now
    after = current()
    seen["generator_state"] = {"active": after["active"] - before["active"], "active_bytes": after["active_bytes"] - before["active_bytes"]}
    del graph, state
    ok = not wrong and seen["generator_state"] == {"active": 2, "active_bytes": 1024}
    return {"ok": ok, "wrong": wrong, **seen}


def nested_pools():
    """Nested use_mem_pool: each tensor goes to the innermost pool."""
    import torch

    pools = [torch.cuda.MemPool() for _ in range(3)]
    where = {}
    with torch.cuda.use_mem_pool(pools[0]):
        a = torch.empty(20 * MIB, dtype=torch.uint8, device="cuda")
        with torch.cuda.use_mem_pool(pools[1]):
            b = torch.empty(20 * MIB, dtype=torch.uint8, device="cuda")
            with torch.cuda.use_mem_pool(pools[2]):
                c = torch.empty(20 * MIB, dtype=torch.uint8, device="cuda")
    within = lambda p, s: s["address"] <= p < s["address"] + s["total_size"]
    for name, t in (("a", a), ("b", b), ("c", c)):
        where[name] = [i for i, pool in enumerate(pools) if any(within(t.data_ptr(), s) for s in pool.snapshot())]
    return {"ok": where == {"a": [0], "b": [1], "c": [2]}, "pools_of": where}


def no_split():
    """MemPool(no_split=True): a block per segment, never split."""
    import torch

    split, whole = torch.cuda.MemPool(), torch.cuda.MemPool(no_split=True)
    kept = []
    for _ in range(2):
        for pool in (split, whole):
            with torch.cuda.use_mem_pool(pool):
                kept.append(torch.empty(4 * MIB, dtype=torch.uint8, device="cuda"))
    count = lambda pool: (len(pool.snapshot()), sum(len(s["blocks"]) for s in pool.snapshot()))
    seen = {"split": count(split), "no_split": count(whole)}
    one_each = all(len(s["blocks"]) == 1 for s in whole.snapshot())
    ok = one_each and seen["no_split"][0] > seen["split"][0] and seen["no_split"][1] < seen["split"][1]
    return {"ok": ok, "one_block_per_segment": one_each, **seen}


def capture_reuse():
    """graph_capture_record_stream_reuse:True: a block freed inside a capture after use on
    a second stream is taken again only once that stream's work is joined back."""
    import torch

    torch.cuda.memory._set_allocator_settings("graph_capture_record_stream_reuse:True")
    try:
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        g = torch.cuda.CUDAGraph(keep_graph=True)
        torch.cuda.synchronize()
        with torch.cuda.stream(s1):
            g.capture_begin()
            sink = torch.empty(8, device="cuda")
            first = torch.empty(8, device="cuda")
            first_ptr = first.data_ptr()
            s2.wait_stream(s1)
            with torch.cuda.stream(s2):
                out = torch.empty_like(first)
                torch.add(first, 2.0, out=out)
                first.record_stream(s2)
            del first
            before_join = torch.empty(8, device="cuda")
            s1.wait_stream(s2)
            sink.fill_(1.0)
            after_join = torch.empty(8, device="cuda")
            g.capture_end()
        torch.cuda.synchronize()
    finally:
        torch.cuda.memory._set_allocator_settings("graph_capture_record_stream_reuse:False")
    seen = {
        "reused_before_join": before_join.data_ptr() == first_ptr,
        "reused_after_join": after_join.data_ptr() == first_ptr,
    }
    return {"ok": not seen["reused_before_join"] and seen["reused_after_join"], **seen}


def checkpoint_pending():
    """A graph pool's output used on a busy side stream (record_stream) and freed, so
    that its block waits for that stream; then the pool's checkpoint, taken while the
    output was live, restored (as torch's cudagraph trees do): the block is live again,
    and once the side stream's work is done, no older pending free hands it out under a
    new allocation of the pool."""
    import torch

    dev = torch.cuda.current_device()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        g.capture_begin()
        out = torch.ones(1 << 20, device="cuda")
        g.capture_end()
    torch.cuda.current_stream().wait_stream(s)
    g.replay()
    torch.cuda.synchronize()
    pool = g.pool()
    state = torch._C._cuda_getCheckpointState(dev, pool)
    meta = (out.untyped_storage().data_ptr(), out.untyped_storage().nbytes())
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # the side stream busy for a while
        out.mul_(3.0)
    out.record_stream(side)
    del out
    storage = torch._C._construct_storage_from_data_pointer(meta[0], torch.device("cuda", dev), meta[1])
    restored = torch.empty([0], device="cuda", dtype=torch.float32)
    restored.set_(source=storage, storage_offset=0, size=(1 << 20,), stride=(1,))
    torch._C._cuda_setCheckpointPoolState(dev, state, [], [restored.untyped_storage()._cdata])
    torch.cuda.synchronize()  # the side stream's work, and any free waiting for it, done
    torch._C._cuda_beginAllocateCurrentThreadToPool(dev, pool)
    try:
        fresh = torch.zeros(1 << 20, device="cuda")
    finally:
        torch._C._cuda_endAllocateToPool(dev, pool)
        torch._C._cuda_releasePool(dev, pool)
    torch.cuda.synchronize()
    blocks = _allocated_blocks(_pool_segments(pool))
    seen = {
        "fresh_reused_restored": fresh.data_ptr() == meta[0],
        "live_blocks": blocks,
        "restored_value": float(restored[0]),
    }
    ok = not seen["fresh_reused_restored"] and blocks == 2 and seen["restored_value"] == 3.0
    return {"ok": ok, **seen}


def ipc_pool():
    """memres with a chunked pool (MEMRES_RESOURCE=pool) sends to a receiver on torch's own
    allocator (its handles are CUDA IPC handles, which any torch opens)."""
    return _ipc(child="torch")


def run_one(check, allocator):
    os.environ["PARITY_ALLOCATOR"] = allocator
    if allocator == "memres":
        import memres

        if check == "ipc_pool":
            os.environ["MEMRES_RESOURCE"] = "pool"
        memres.setup()
    fn = {"compile": compile_}.get(check) or globals()[check]
    try:
        result = fn()
    except Exception as e:  # the row's failure is its result
        result = {"ok": False, "error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
        traceback.print_exc(file=sys.stderr)
    if allocator == "memres":
        import memres

        result["backend"] = memres.torch_backend()
    print(json.dumps(result))


# Checks memres must pass whatever torch's allocator does: there, torch's own allocator
# dies (a foreign IPC handle ends the process with SIGSEGV) or refuses the restore
# ("could not find" the pending block), so comparing with it would let any memres
# result through.
MEMRES_MUST_PASS = {"bad_input", "oom_observer_raises", "checkpoint_pending"}


def main(checks):
    rows = []
    failed = False
    for check in checks:
        row = {"check": check}
        for allocator in ("torch", "memres"):
            done = subprocess.run(
                [sys.executable, os.path.abspath(__file__), check, allocator],
                capture_output=True,
                text=True,
                timeout=600,
            )
            lines = done.stdout.strip().splitlines()
            try:
                row[allocator] = json.loads(lines[-1])
            except (IndexError, ValueError):
                row[allocator] = {"ok": False, "error": f"exit {done.returncode}: {done.stderr.strip()[-300:]}"}
        if (row["torch"].get("ok") or check in MEMRES_MUST_PASS) and not row["memres"].get("ok"):
            failed = True
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| check | torch | memres |\n| --- | --- | --- |")
    for row in rows:
        cell = lambda r: ("pass" if r.get("ok") else "FAIL") + " " + json.dumps({k: v for k, v in r.items() if k != "ok"})
        print(f"| {row['check']} | {cell(row['torch'])} | {cell(row['memres'])} |")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] in CHECKS + TWO_GPU_CHECKS + EXTRA_CHECKS:
        run_one(sys.argv[1], sys.argv[2])
    elif len(sys.argv) == 3 and sys.argv[1] == "--checks":
        main(sys.argv[2].split(","))
    else:
        main(CHECKS)
