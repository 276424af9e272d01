#!/usr/bin/env bash
# Builds every test, bench and example binary of the workspace in release mode (no CUDA
# is needed to build: cudarc loads the driver at run time) into target/gpu-bundle/, with
# a run.sh, ready to carry to a machine with a GPU (which needs no Rust toolchain).
#
#   benches/gpu/bundle.sh [cargo arguments]     # e.g. --test record_stream_cuda
#   on the GPU machine:  target/gpu-bundle/run.sh [test binary arguments]
#
# run.sh runs each test binary with --include-ignored (the GPU tests are #[ignore]d so
# that CI, which has no GPU, skips them by name). A test that cannot run where it is run
# (two GPUs needed, a driver present where it tests the driverless path, ...) prints a
# line starting "memres-skip: " and returns: run.sh lists every such test with its reason
# in a summary and does not count it as passed. ONLY=regex limits the run to matching
# binaries; test binaries named ui* (compile-fail tests: they need cargo) are left out.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
out=target/gpu-bundle
rm -rf "$out"
mkdir -p "$out/tests" "$out/benches" "$out/examples" "$out/bin"
cargo build --release --workspace --tests --benches --examples --message-format=json "$@" \
  | python3 -c '
import json, os, shutil, sys
out = sys.argv[1]
for line in sys.stdin:
    try:
        msg = json.loads(line)
    except ValueError:
        continue
    if msg.get("reason") != "compiler-artifact" or not msg.get("executable"):
        continue
    target = msg["target"]
    kind = target["kind"][0]
    if msg["profile"].get("test"):
        # A library target is named after its package: the C ABI library is called
        # `memres` as well, and would overwrite the crate library tests.
        package = msg["package_id"].split("#")[-1].split("@")[0].split("/")[-1]
        folder, name = "tests", (package + "-lib" if kind.endswith("lib") else target["name"])
    elif kind == "bin":
        folder, name = "bin", target["name"]
    elif kind in ("bench", "example"):
        folder, name = kind + "s" if kind == "example" else "benches", target["name"]
    else:
        continue
    shutil.copy2(msg["executable"], os.path.join(out, folder, name))
    print(f"{folder}/{name}", file=sys.stderr)
' "$out"
cp benches/gpu/run-tests.sh "$out/run.sh"
chmod +x "$out/run.sh"
# The device tool carries at most 64 MiB: strip the binaries.
if command -v strip >/dev/null 2>&1; then
  find "$out" -type f -perm -u+x ! -name run.sh -exec strip -s {} + 2>/dev/null || true
fi
echo "$out: $(du -sm "$out" | cut -f1) MiB"
