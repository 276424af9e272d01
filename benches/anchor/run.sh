#!/usr/bin/env bash
# Builds the anchors of benches/anchor/ (RAPIDS RMM from its wheels; PyTorch's caching
# allocator against the installed torch) on a GPU machine with nvcc, and runs rmm_bench.
#
#   WHEELS=.whl benches/anchor/run.sh [stack]     CSV on stdout, build output on stderr
#
# stack: as rmm_bench.cu takes it (pool, arena, binning, fixed, cuda, cuda_async, ...;
# none: all, then the torch anchor; "build": build only). The RMM wheels (librmm-cu13 and
# rapids-logger, any Python tag: only their C++ libraries and headers are used) are
# downloaded on a machine with a network:
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 -d .whl \
#     librmm-cu13==26.10.0 rapids-logger==0.3.0
#
# Anchors are built into $WORK (default ${TMPDIR:-/tmp}/memres-anchors), each named after its
# .cu file: rmm_bench always, the others named in $BUILD (e.g. BUILD="rmm_footprint
# rmm_cuda_async_subset"; BUILD=all: every .cu file here), all with the same flags.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
wheels=${WHEELS:-.whl}
work=${WORK:-${TMPDIR:-/tmp}/memres-anchors}
cuda=${CUDA_HOME:-/usr/local/cuda}
mkdir -p "$work"
for w in "$wheels"/librmm_cu13-*.whl "$wheels"/rapids_logger-*.whl; do
  [ -f "$w" ] || { echo "run.sh: no $w (see this script's header for the download)" >&2; exit 2; }
  python3 -m zipfile -e "$w" "$work"
done
rmm="$work/librmm" logger="$work/rapids_logger"
build=${BUILD:-}
[ "$build" = all ] && build=$(cd "$here" && ls *.cu | sed 's/\.cu$//')
for name in rmm_bench $build; do
  src="$here/$name.cu" bin="$work/$name"
  [ -f "$src" ] || { echo "run.sh: no $src" >&2; exit 2; }
  [ "$bin" -nt "$src" ] && [ "$bin" -nt "$here/workloads.hpp" ] && [ "$bin" -nt "$here/rmm_adapter.hpp" ] && continue
  # cuda_async_probe uses the driver API directly, the others RMM.
  nvcc -O3 -std=c++20 --expt-relaxed-constexpr -I"$here" -I"$rmm/include/rapids" \
    -I"$rmm/include" -I"$logger/include" "$src" -o "$bin" \
    -L"$rmm/lib64" -lrmm -L"$logger/lib64" -lrapids_logger -lcuda \
    -Xlinker -rpath="$rmm/lib64:$logger/lib64" >&2
done
echo "impl,resource,workload,threads,ops,ns_per_op_min,ns_per_op_median"
"$work/rmm_bench" "${1:-}"
if [ -z "${1:-}" ] || [ "${1:-}" = torch ]; then
  torch=$(python3 -c 'import os, torch; print(os.path.dirname(torch.__file__))')
  if g++ -O3 -std=c++20 -I"$here" -I"$torch/include" -I"$cuda/include" "$here/torch_bench.cpp" \
    -o "$work/torch_bench" -L"$torch/lib" -lc10_cuda -lc10 -L"$cuda/lib64" -lcudart \
    -Wl,-rpath,"$torch/lib:$cuda/lib64" >&2; then
    "$work/torch_bench"
  else
    echo "run.sh: the torch anchor did not build" >&2
  fi
fi
