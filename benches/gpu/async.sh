#!/usr/bin/env bash
# CudaAsync against RMM's cuda_async: N alternating runs of the whole suite each.
# Run on the GPU machine from the repository root, carrying target/gpu-bundle (built by
# benches/gpu/bundle.sh) and .whl (librmm-cu13 26.10 and rapids-logger wheels: see
# benches/anchor/run.sh); results go to $OUT. See BENCHMARKS.md.
set -uo pipefail
N=${1:-5}
B=${B:-target/gpu-bundle/tests/workloads}
W=${WORK:-/tmp/memres-anchors}
[ -x $W/rmm_bench ] || WHEELS=.whl WORK=$W benches/anchor/run.sh build > /dev/null 2>&1
for i in $(seq $N); do
  $W/rmm_bench cuda_async 2>/dev/null | grep cuda_async
  timeout 200 $B cuda_async 2>/dev/null | grep cuda_async
done | tee $OUT/async.csv
python3 - $OUT/async.csv <<'PY'
import csv, sys, collections
mins = collections.defaultdict(list)
for r in csv.reader(open(sys.argv[1])):
    mins[(r[2], r[0])].append(float(r[5]))
for w in sorted({k[0] for k in mins}):
    a, b = mins.get((w, "rmm"), []), mins.get((w, "memres"), [])
    if a and b:
        print(f"{w:14s} rmm min of {len(a)} mins {min(a):9.1f}  memres {min(b):9.1f}  ratio {min(b)/min(a):.3f}")
PY
