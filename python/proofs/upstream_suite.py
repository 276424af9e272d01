"""PyTorch's own allocator tests, run under torch's allocator and under memres.

    python3 python/proofs/upstream_suite.py PATH/test_cuda.py             # both, a summary
    python3 python/proofs/upstream_suite.py PATH/test_cuda.py --allocator A > A.out
    python3 python/proofs/upstream_suite.py - --compare torch.out memres.out

PATH/test_cuda.py is PyTorch's ``test/test_cuda.py``, kept outside the repository (it is
PyTorch's code: put it in a git-ignored folder such as ``.upstream/``, at a commit that
matches the installed torch, and say which in the figures). This script is memres's: it
chooses the allocator before CUDA is first used (``memres.setup()`` for memres), imports
the file, and runs the tests of PyTorch's allocator: the tests of ``TestCuda`` whose names
speak of memory, statistics, record_stream, out-of-memory, allocators, pools, snapshots
or segments, and the whole of ``TestCudaMallocAsync`` (which runs against whichever
allocator is active), ``TestBlockStateAbsorption``, ``TestMemPool`` and
``TestCachingHostAllocatorCudaGraph``. Each group runs in its own process per allocator
(a crash loses one group, and says so). The summary lists both pass counts and every test
that passes under torch's allocator and not under memres; exit status 0 when there is
none.
"""

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import unittest

GROUPS = ["TestCuda", "TestCudaMallocAsync", "TestBlockStateAbsorption", "TestMemPool", "TestCachingHostAllocatorCudaGraph"]
TESTCUDA_WORDS = re.compile(
    r"memory|mem_|stats|record_stream|out_of_memory|oom|alloc|caching|pool|empty_cache|fraction|snapshot|expandable|segment"
)


class Outcomes(unittest.TextTestResult):
    """A text result that also keeps the tests that passed."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.passed = []

    def addSuccess(self, test):
        super().addSuccess(test)
        self.passed.append(test.id())


def run_group(path, group, allocator, only=None):
    """Runs one group in this process (only the tests named in `only`, if given); prints
    one JSON object, and every failure's traceback on stderr."""
    if allocator == "memres":
        import memres

        memres.setup()
    # PyTorch's test helpers read the command line when imported.
    sys.argv = [path]
    spec = importlib.util.spec_from_file_location("test_cuda", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["test_cuda"] = module
    spec.loader.exec_module(module)
    cls = getattr(module, group)
    loader = unittest.TestLoader()
    names = loader.getTestCaseNames(cls)
    if group == "TestCuda":
        names = [n for n in names if TESTCUDA_WORDS.search(n)]
    if only:
        names = [n for n in names if n in only]
    suite = unittest.TestSuite(cls(n) for n in names)
    runner = unittest.TextTestRunner(stream=sys.stderr, verbosity=2, resultclass=Outcomes)
    result = runner.run(suite)
    def why(msg):
        lines = [l for l in msg.strip().splitlines() if "Error" in l or "assert" in l.lower()]
        return (lines or msg.strip().splitlines() or [""])[-1][:300]

    short = lambda pairs: {t.id(): why(msg) for t, msg in pairs}
    out = {
        "group": group,
        "allocator": allocator,
        "tests": len(names),
        "passed": result.passed,
        "failed": short(result.failures),
        "errors": short(result.errors),
        "skipped": {t.id(): str(why)[:200] for t, why in result.skipped},
    }
    if allocator == "memres":
        import memres

        out["backend"] = memres.torch_backend()
    print("UPSTREAM-RESULT " + json.dumps(out), flush=True)


def run_all(path, timeout, allocators, only=None):
    """Runs every group under each allocator, each in its own process; prints a line per
    group (``UPSTREAM-GROUP`` and its JSON, every test's outcome) and the comparison."""
    results = {}
    for allocator in allocators:
        for group in GROUPS:
            cmd = [sys.executable, os.path.abspath(__file__), path, "--group", group, "--allocator", allocator]
            if only:
                cmd += ["--only", *only]
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
                if only:
                    sys.stderr.write(done.stderr)
                lines = [l for l in done.stdout.splitlines() if l.startswith("UPSTREAM-RESULT ")]
                if lines:
                    r = json.loads(lines[-1][len("UPSTREAM-RESULT "):])
                else:
                    last = [l for l in done.stderr.splitlines() if " ... " in l][-1:]
                    r = {"group": group, "allocator": allocator, "crashed": f"exit {done.returncode}", "last": last}
            except subprocess.TimeoutExpired:
                r = {"group": group, "allocator": allocator, "crashed": f"over {timeout} s"}
            results[(allocator, group)] = r
            print("UPSTREAM-GROUP " + json.dumps(r), flush=True)
            print(json.dumps({"allocator": allocator, "group": group, **summary(r)}), flush=True)
    return compare(results)


def compare(results):
    """Both pass counts and the tests that pass under torch's allocator only."""
    passed = {a: set() for a in ("torch", "memres")}
    for (allocator, _), r in results.items():
        passed[allocator].update(r.get("passed", []))
    lost = sorted(passed["torch"] - passed["memres"])
    print(f"\npassed under torch's allocator: {len(passed['torch'])}; under memres: {len(passed['memres'])}")
    print(f"passed under memres only: {len(passed['memres'] - passed['torch'])}")
    print(f"passing under torch's allocator, not under memres ({len(lost)}):")
    for test in lost:
        why = ""
        for (allocator, _), r in results.items():
            if allocator == "memres":
                why = r.get("failed", {}).get(test) or r.get("errors", {}).get(test) or why
        print(f"  {test}: {why}")
    return 1 if lost else 0


def read_outputs(files):
    """The ``UPSTREAM-GROUP`` lines of earlier runs' outputs (one allocator a run, say)."""
    results = {}
    for name in files:
        for line in open(name):
            if line.startswith("UPSTREAM-GROUP "):
                r = json.loads(line[len("UPSTREAM-GROUP "):])
                results[(r["allocator"], r["group"])] = r
    return results


def summary(r):
    if "crashed" in r:
        return r
    return {
        "tests": r["tests"],
        "passed": len(r["passed"]),
        "failed": len(r["failed"]),
        "errors": len(r["errors"]),
        "skipped": len(r["skipped"]),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="PyTorch's test/test_cuda.py (kept outside the repository)")
    parser.add_argument("--group", choices=GROUPS)
    parser.add_argument("--allocator", choices=["torch", "memres"])
    parser.add_argument("--timeout", type=int, default=600, help="seconds per group and allocator")
    parser.add_argument("--only", nargs="+", metavar="TEST", help="run only these tests (by method name)")
    parser.add_argument(
        "--compare", nargs="+", metavar="OUTPUT", help="compare the printed outputs of earlier runs (path unused)"
    )
    args = parser.parse_args()
    if args.compare:
        sys.exit(compare(read_outputs(args.compare)))
    elif args.group:
        run_group(args.path, args.group, args.allocator or "torch", args.only)
    else:
        allocators = [args.allocator] if args.allocator else ["torch", "memres"]
        sys.exit(run_all(args.path, args.timeout, allocators, args.only))
