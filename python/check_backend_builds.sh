#!/bin/sh
# Compiles python/memres/torch_backend.cpp against PyTorch's and CUDA's headers without a
# GPU or an installed torch, and checks that every symbol of torch, c10 and the CUDA
# runtime the object needs is one those libraries export (a backend that builds but needs
# a symbol libtorch keeps hidden, such as a constructor of a struct without TORCH_API,
# does not load on the GPU machine, where memres then falls back to torch's pluggable
# allocator with a warning). Nothing is run.
#
#     sh python/check_backend_builds.sh            # from the repository root
#
# Exit status: 0 when it builds and links, 1 when it does not, 2 when the wheels could not
# be downloaded (no network: nothing was checked).
# Downloads, once, into target/torch-headers: torch 2.11.0's wheel (about 530 MB; only its
# headers and the names its libraries export are kept) and the CUDA 13 runtime and crt
# headers' wheels, from PyPI.
set -eu
dir=target/torch-headers
x="$dir/x"
mkdir -p "$dir/wheels"
if [ ! -d "$x/torch/include" ] || [ ! -s "$x/exported.txt" ]; then
  if ! ls "$dir"/wheels/torch-*.whl >/dev/null 2>&1; then
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 torch==2.11.0 -d "$dir/wheels" \
      || { echo "could not download torch 2.11.0's wheel: nothing checked" >&2; exit 2; }
  fi
  if ! ls "$dir"/wheels/nvidia_cuda_runtime-*.whl >/dev/null 2>&1; then
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux2014_x86_64 nvidia-cuda-runtime==13.0.96 \
      nvidia-cuda-crt -d "$dir/wheels" \
      || { echo "could not download the CUDA runtime's wheels: nothing checked" >&2; exit 2; }
  fi
  mkdir -p "$x"
  (cd "$x" && unzip -q -o ../wheels/torch-*.whl 'torch/include/*' \
    'torch/lib/libc10.so' 'torch/lib/libc10_cuda.so' 'torch/lib/libtorch.so' \
    'torch/lib/libtorch_cpu.so' 'torch/lib/libtorch_cuda.so' \
    && for w in ../wheels/nvidia_cuda_*.whl; do unzip -q -o "$w" 'nvidia/*'; done)
  # The names the libraries export (the backend links against these five and cudart).
  nm -D --defined-only "$x"/torch/lib/*.so "$x"/nvidia/cu13/lib/libcudart.so* 2>/dev/null \
    | awk 'NF == 3 { sub(/@.*/, "", $3); print $3 }' | sort -u > "$x/exported.txt"
  rm -rf "$x/torch/lib" "$dir"/wheels/torch-*.whl
fi
python_include=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
object="$dir/torch_backend.o"
${CXX:-g++} -c -O0 -fPIC -std=c++20 -D_GLIBCXX_USE_CXX11_ABI=1 -Icapi/include \
  -I"$x/torch/include" -I"$x/torch/include/torch/csrc/api/include" \
  -I"$x/nvidia/cu13/include" -I"$python_include" python/memres/torch_backend.cpp -o "$object"
# What the object needs from torch, c10, at and the CUDA runtime; memres's own and the C++
# library's symbols come from elsewhere.
nm --undefined-only "$object" | awk '{ print $NF }' \
  | grep -E '^(_ZN[K]?(3c10|5torch|2at)|_ZNK?St|cuda)' | grep -vE '^_ZNK?St' | sort -u > "$dir/needed.txt"
missing=$(comm -23 "$dir/needed.txt" "$x/exported.txt")
if [ -n "$missing" ]; then
  echo "torch_backend.cpp needs symbols torch 2.11.0 does not export (it would not load):" >&2
  echo "$missing" | (c++filt 2>/dev/null || cat) >&2
  exit 1
fi
echo "torch_backend.cpp builds against torch 2.11.0's headers; every torch, c10 and CUDA symbol it needs is exported"
