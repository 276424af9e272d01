#!/usr/bin/env bash
# Issue 18's single-thread figures with each process pinned to one core (one device call).
#
# The GPU host's processes land in speed modes up to 1.7x apart (BENCHMARKS.md): the
# same binary, a minute apart, on whichever vCPU the scheduler picks. This script first
# times `random`'s bare loop (`floor`) on every core, then runs the single-thread figures
# (Binning `random`, the adaptors' paired ratios) and RMM's binning anchor pinned to the
# fastest core, and the same unpinned, so that both protocols sit side by side.
#
# Run on the GPU machine from the repository root, carrying target/gpu-bundle (built by
# benches/gpu/bundle.sh), and .whl as for speed.sh; results go to $OUT.
#
#   bash benches/gpu/pinned.sh
set -uo pipefail
B=${B:-target/gpu-bundle/tests/workloads}
RUNS=${RUNS:-5}
export MEMRES_WORKLOADS=random
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
date -u +%FT%TZ
lscpu | grep -E 'Model name|^CPU\(s\)|Thread|MHz' || true

# RMM's binning anchor (built first: nvcc takes a minute, and no timing runs meanwhile).
W=${WORK:-/tmp/memres-anchors}
WHEELS=.whl WORK=$W benches/anchor/run.sh binning > "$OUT/rmm_binning_build.csv" \
  2> "$OUT/rmm_build.log"

# The bare loop on every core: the fastest core is the one the rest pins to.
for c in $(seq 0 $(($(nproc) - 1))); do
  echo "floor,core=$c,$(taskset -c "$c" "$B" floor 2>/dev/null | awk -F, '$2 == "floor" { print $6 }')"
done | tee "$OUT/cores.csv"
best=$(awk -F, '$3 != ""' "$OUT/cores.csv" | sort -t, -k3 -g | head -1 | cut -d, -f2 | cut -d= -f2)
echo "fastest core: $best"

for i in $(seq "$RUNS"); do
  echo "pinned,$(taskset -c "$best" "$B" 'binning(pool)' 2>/dev/null | grep '^memres')"
  echo "pinned,$(taskset -c "$best" "$B" floor 2>/dev/null | grep '^memres')"
  echo "pinned,$(taskset -c "$best" "$W/rmm_bench" binning 2>/dev/null | grep ',random,')"
  echo "unpinned,$($B 'binning(pool)' 2>/dev/null | grep '^memres')"
  echo "unpinned,$($W/rmm_bench binning 2>/dev/null | grep ',random,')"
done | tee "$OUT/binning.csv"

# The adaptors' paired ratios (three processes each way; `logging` runs a writer thread,
# so it is left out of the pinned runs).
for i in 1 2 3; do
  MEMRES_PAIRED=40 MEMRES_STACKS=statistics,limiting,tracking taskset -c "$best" "$B" 2>/dev/null \
    | sed 's/^/pinned,/'
  MEMRES_PAIRED=40 "$B" 2>/dev/null | sed 's/^/unpinned,/'
done | tee "$OUT/paired.csv"
date -u +%FT%TZ
