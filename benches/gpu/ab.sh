#!/usr/bin/env bash
# A/B of builds of the workload bench on the GPU machine, alternating, in one call:
# target/ab/NAME-wl for each NAME in BUILDS (default "old new": copies of the `workloads`
# bench binary, built here at the commits compared; carry target/ab). Instances differ by
# up to 2x, so only figures from one call compare. The order of the builds rotates every
# round (the second process of a pair can run slower); include a stack whose code did not
# change as the control. A stack renamed between two builds is written OLD=NEW (the first
# build gets OLD). PIN=N runs each process on core N (`taskset`): single-thread rows then
# move less with the co-tenants' load. Lines are `build,` then the bench's CSV row.
#
#   ROUNDS=4 MEMRES_WORKLOADS=random bash benches/gpu/ab.sh 'binning(pool)' pool
#   ROUNDS=6 bash benches/gpu/ab.sh floor arena pool pool_in_place=virtual_pool
#   ROUNDS=9 PIN=7 BUILDS="main caches" MEMRES_WORKLOADS=pair-256B,random \
#     bash benches/gpu/ab.sh floor pool arena
#   ROUNDS=2 PAIRED=100 bash benches/gpu/ab.sh          # the adaptors' paired mode
set -u
ROUNDS=${ROUNDS:-3}
read -r -a builds <<< "${BUILDS:-old new}"
pin=()
[ -n "${PIN:-}" ] && pin=(taskset -c "$PIN")
nvidia-smi --query-gpu=name --format=csv,noheader; date -u +%T
for r in $(seq "$ROUNDS"); do
  # Round r starts with build (r - 1) mod n, so each build leads in turn.
  n=${#builds[@]}
  order=()
  for i in $(seq 0 $((n - 1))); do order+=("${builds[$(((r - 1 + i) % n))]}"); done
  if [ -n "${PAIRED:-}" ]; then
    for b in "${order[@]}"; do
      MEMRES_PAIRED=$PAIRED timeout 300 "${pin[@]}" target/ab/$b-wl 2>/dev/null | sed "s/^/$b,/"
    done
  else
    for s in "$@"; do
      for b in "${order[@]}"; do
        case "$s" in
          *=*) if [ "$b" = "${builds[0]}" ]; then stack=${s%%=*}; else stack=${s#*=}; fi ;;
          *) stack=$s ;;
        esac
        timeout 150 "${pin[@]}" target/ab/$b-wl "$stack" 2>/dev/null | grep -v '^impl' | sed "s/^/$b,/"
      done
    done
  fi
done
date -u +%T
