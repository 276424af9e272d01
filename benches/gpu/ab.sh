#!/usr/bin/env bash
# A/B of two builds of the workload bench on the GPU machine, alternating, in one call:
# target/ab/old-wl and target/ab/new-wl (copies of the `workloads` bench binary, built
# here at the two commits; carry target/ab). Instances differ by up to 2x, so only
# figures from one call compare. The order of old and new swaps every round (the second
# process of a pair can run slower); include a stack whose code did not change as the
# control. A stack renamed between the builds is written OLD=NEW.
#
#   ROUNDS=4 MEMRES_WORKLOADS=random bash benches/gpu/ab.sh 'binning(pool)' pool
#   ROUNDS=6 bash benches/gpu/ab.sh floor arena pool pool_in_place=virtual_pool
#   ROUNDS=2 PAIRED=100 bash benches/gpu/ab.sh          # the adaptors' paired mode
set -u
ROUNDS=${ROUNDS:-3}
nvidia-smi --query-gpu=name --format=csv,noheader; date -u +%T
for r in $(seq "$ROUNDS"); do
  if [ $((r % 2)) = 1 ]; then order="old new"; else order="new old"; fi
  if [ -n "${PAIRED:-}" ]; then
    for b in $order; do
      MEMRES_PAIRED=$PAIRED timeout 300 target/ab/$b-wl 2>/dev/null | sed "s/^/$b,/"
    done
  else
    for s in "$@"; do
      for b in $order; do
        case "$s" in
          *=*) if [ "$b" = old ]; then stack=${s%%=*}; else stack=${s#*=}; fi ;;
          *) stack=$s ;;
        esac
        timeout 150 target/ab/$b-wl "$stack" 2>/dev/null | grep -v '^impl' | sed "s/^/$b,/"
      done
    done
  fi
done
date -u +%T
