#!/usr/bin/env python3
"""One-line mutations of the PyTorch backend's bookkeeping (python/memres/torch_backend.cpp),
each of which a check of python/proofs/torch_parity.py must kill. Runs on a GPU machine with
torch and the memres package installed:

    python3 tests/mutants/torch_backend.py [NAME ...]     # from the repository root
    python3 tests/mutants/torch_backend.py --check        # no GPU, no torch: each snippet
                                                          # in the repository's source once?

The backend is compiled at run time against the installed torch (memres/_torch.py), so a
mutation is a changed copy of the source in the installed package, built into a cache
folder of its own (MEMRES_CACHE), and the checks that cover it run under memres alone
(``torch_parity.py CHECK memres``, the native backend forced). A mutation whose checks all
still pass "survived". The installed source is put back afterwards. Prints one line per
mutation and exits 1 if any survived; docs/mutation-testing.md records the last run.
"""

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
PARITY = ROOT / "python" / "proofs" / "torch_parity.py"

# (name, snippet, replacement, checks that must fail with it)
MUTATIONS = [
    (
        "nested use_mem_pool: the outermost pool wins",
        "for (auto capture = captures.rbegin(); capture != captures.rend(); ++capture) {",
        "for (auto capture = captures.begin(); capture != captures.end(); ++capture) {",
        ["nested_pools"],
    ),
    # "a block freed in a capture is never taken again in it" left with the code it
    # mutated: the in-capture reuse is the library's now (Deferred::take_ordered), and
    # tests/mutants/run.py has that mutation ("held blocks: a block freed in a capture ...").
    (
        "requested bytes keep roundup_power2_divisions' rounding",
        "    requested.current -= rounding_live;\n    requested.allocated -= rounding_added - base.rounding_added;",
        "    requested.current -= 0;\n    requested.allocated -= 0;",
        ["roundup"],
    ),
    (
        "snapshots drop the pools' ids",
        "    info.owner_private_pool_id = id;\n",
        "",
        ["graph_pool_blocks", "mempool_snapshot"],
    ),
    (
        "caching_allocator_enable(False) is ignored",
        "    g_uncached.caching.store(value, std::memory_order_relaxed);",
        "    (void)value;",
        ["caching_off"],
    ),
]


def installed_source():
    import memres

    return pathlib.Path(memres.__file__).resolve().parent / "torch_backend.cpp"


def check_passes(check, cache):
    env = dict(os.environ, MEMRES_CACHE=cache, MEMRES_TORCH_BACKEND="native")
    done = subprocess.run(
        [sys.executable, str(PARITY), check, "memres"], capture_output=True, text=True, env=env, timeout=600
    )
    lines = done.stdout.strip().splitlines()
    try:
        return bool(json.loads(lines[-1]).get("ok"))
    except (IndexError, ValueError):
        return False  # a crash or a build failure kills the mutation too


def run(selected):
    source = installed_source()
    original = source.read_text()
    survived = []
    try:
        for name, snippet, replacement, checks in MUTATIONS:
            if selected and not any(s.lower() in name.lower() for s in selected):
                continue
            if original.count(snippet) != 1:
                print(f"STALE     {name}: the snippet is not in the backend exactly once", flush=True)
                survived.append(name)
                continue
            source.write_text(original.replace(snippet, replacement))
            start = time.time()
            with tempfile.TemporaryDirectory() as cache:
                killed_by = [c for c in checks if not check_passes(c, cache)]
            source.write_text(original)
            verdict = "killed" if killed_by else "SURVIVED"
            by = f" by {', '.join(killed_by)}" if killed_by else ""
            print(f"{verdict:9} {name}{by} ({time.time() - start:.0f} s)", flush=True)
            if not killed_by:
                survived.append(name)
    finally:
        source.write_text(original)
    print(f"{len(survived)} survived" + (": " + "; ".join(survived) if survived else ""))
    return 1 if survived else 0


def check():
    """Lists each mutation whose snippet is not in the repository's copy of the backend
    exactly once; needs neither torch nor a GPU."""
    source = (ROOT / "python" / "memres" / "torch_backend.cpp").read_text()
    stale = [name for name, snippet, *_ in MUTATIONS if source.count(snippet) != 1]
    for name in stale:
        print(f"STALE     {name}: the snippet is not in the backend exactly once")
    print(f"{len(MUTATIONS) - len(stale)} of {len(MUTATIONS)} snippets found once")
    return 1 if stale else 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--check"]:
        sys.exit(check())
    sys.exit(run(sys.argv[1:]))
