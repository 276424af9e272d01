#!/usr/bin/env bash
# A/B of two builds of the workload bench on the GPU machine, alternating, in one call:
# target/ab/old-wl and target/ab/new-wl (copies of the `workloads` bench binary, built
# here at the two commits; carry target/ab). Instances differ by up to 2x, so only
# figures from one call compare.
#
#   ROUNDS=4 MEMRES_WORKLOADS=random bash benches/gpu/ab.sh 'binning(pool)' pool
#   ROUNDS=2 PAIRED=100 bash benches/gpu/ab.sh          # the adaptors' paired mode
set -u
ROUNDS=${ROUNDS:-3}
nvidia-smi --query-gpu=name --format=csv,noheader; date -u +%T
for r in $(seq "$ROUNDS"); do
  for b in old new; do
    if [ -n "${PAIRED:-}" ]; then
      MEMRES_PAIRED=$PAIRED timeout 300 target/ab/$b-wl 2>/dev/null | sed "s/^/$b,/"
    else
      for s in "$@"; do timeout 150 target/ab/$b-wl "$s" 2>/dev/null | grep -v '^impl' | sed "s/^/$b,/"; done
    fi
  done
done
date -u +%T
