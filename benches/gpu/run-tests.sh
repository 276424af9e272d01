#!/usr/bin/env bash
# Runs the bundled test binaries (benches/gpu/bundle.sh copies this file to
# target/gpu-bundle/run.sh), ignored (GPU) tests included, and ends with a summary: the
# binaries that failed, and every test that printed "memres-skip: REASON" (it could not do
# its work here: it is listed as skipped, with its reason, not counted as passed).
# ONLY=regex limits the run to matching binary names, SKIP=regex leaves matching ones out,
# TIMEOUT=seconds bounds each binary; extra arguments go to each binary. Each binary's
# time is printed after its output.
cd "$(dirname "$0")"
# The command's tests run the bundled binary, on the repository this bundle lies in
# (target/gpu-bundle under its root), not the paths of the machine that built them.
export MEMRES_BIN="$PWD/bin/memres"
MEMRES_REPO="$(cd ../.. && pwd)"
export MEMRES_REPO
log=$(mktemp)
failed=()
for t in tests/*; do
  name=$(basename "$t")
  case "$name" in ui*) echo "=== $t left out (compile-fail tests need cargo)"; continue ;; esac
  if [ -n "${ONLY:-}" ] && ! [[ "$name" =~ $ONLY ]]; then continue; fi
  if [ -n "${SKIP:-}" ] && [[ "$name" =~ $SKIP ]]; then continue; fi
  echo "=== $t"
  start=$SECONDS
  # --show-output prints what passing tests printed, so their skip lines reach the log.
  # TIMEOUT=seconds ends a binary that runs longer (it then counts as failed).
  if [ -n "${TIMEOUT:-}" ]; then
    timeout "$TIMEOUT" "./$t" --include-ignored --show-output "$@" > "$log.one" 2>&1
  else
    "./$t" --include-ignored --show-output "$@" > "$log.one" 2>&1
  fi
  status=$?
  echo "    ($((SECONDS - start)) s, exit $status)"
  cat "$log.one" >> "$log"
  grep -v -e '^---- .* stdout ----$' -e '^memres-skip: ' -e '^successes:$' -e '^$' "$log.one" || true
  [ "$status" -eq 0 ] || failed+=("$name")
done
python3 - "$log" <<'PY'
import re, sys
test, skipped = None, []
for line in open(sys.argv[1], errors="replace"):
    m = re.match(r"^---- (\S+) stdout ----$", line)
    if m:
        test = m.group(1)
    elif line.startswith("memres-skip: "):
        skipped.append((test or "?", line[len("memres-skip: "):].strip()))
print(f"\nskipped (not passed): {len(skipped)}")
for test, why in skipped:
    print(f"  {test}: {why}")
PY
rm -f "$log" "$log.one"
if [ ${#failed[@]} -gt 0 ]; then
  echo "failed binaries: ${failed[*]}"
  exit 1
fi
echo "failed binaries: none"
