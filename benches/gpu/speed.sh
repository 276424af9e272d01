#!/usr/bin/env bash
# Speed figures side by side with RMM 26.10 (one device call).
# Run on the GPU machine from the repository root, carrying target/gpu-bundle (built by
# benches/gpu/bundle.sh) and .whl (librmm-cu13 26.10 and rapids-logger wheels: see
# benches/anchor/run.sh); results go to $OUT. See BENCHMARKS.md. ROUNDS=N runs memres's
# stacks N times (2 by default), each in a process of its own.
set -uo pipefail
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
date -u +%FT%TZ
B=${B:-target/gpu-bundle/tests/workloads}
W=${WORK:-/tmp/memres-anchors}
# rmm_bench's suite includes random-1stream (8 and 16 threads on one stream).
WHEELS=.whl WORK=$W benches/anchor/run.sh pool > $OUT/rmm_pool.csv \
  2> $OUT/rmm_build.log
cat $OUT/rmm_pool.csv
for round in $(seq "${ROUNDS:-2}"); do
  for s in floor pool arena 'binning(pool)' fixed_size_1MiB; do timeout 150 $B "$s" 2>/dev/null; done
done | tee $OUT/memres.csv
$W/rmm_bench arena | tee $OUT/rmm_more.csv
$W/rmm_bench binning | tee -a $OUT/rmm_more.csv
date -u +%FT%TZ
