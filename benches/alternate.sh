#!/usr/bin/env bash
# Runs the workloads bench binary over several stacks in turn, N times, and prints each
# stack's min of the runs' minima and median of their medians: on a noisy machine only
# alternating runs compare stacks fairly.
#
#   benches/alternate.sh BIN N WORKLOAD STACK...
#   e.g. benches/alternate.sh target/gpu-bundle/tests/workloads 8 random pool 'statistics(pool)'
set -euo pipefail
bin=$1 n=$2 workload=$3
shift 3
out=$(mktemp)
for ((i = 0; i < n; i++)); do
  for s in "$@"; do
    MEMRES_WORKLOADS=$workload "$bin" "$s" 2>/dev/null | grep -F "memres,$s,$workload," >>"$out" || true
  done
done
python3 - "$out" "$@" <<'PY'
import csv, statistics, sys
rows = list(csv.reader(open(sys.argv[1])))
base = None
for s in sys.argv[2:]:
    r = [row for row in rows if row[1] == s]
    if not r:
        print(f"{s}: no rows"); continue
    mn = min(float(x[5]) for x in r)
    med = statistics.median(float(x[6]) for x in r)
    if base is None:
        base = (mn, med)
    print(f"{s:40s} runs={len(r):2d} min={mn:8.1f} ({mn/base[0]:.3f}x)  median={med:8.1f} ({med/base[1]:.3f}x)")
PY
rm -f "$out"
