#!/bin/sh
# Compiles python/memres/torch_backend.cpp against PyTorch's and CUDA's headers without a
# GPU or an installed torch (syntax and types only; nothing is linked or run), so a change
# to the backend is known to build before it reaches the GPU machine, where a backend that
# does not build falls back to torch's pluggable allocator with a warning.
#
#     sh python/check_backend_builds.sh            # from the repository root
#
# Downloads, once, into target/torch-headers: torch 2.11.0's wheel (about 530 MB; only its
# headers are kept) and the CUDA 13 runtime and crt headers' wheels, from PyPI.
set -eu
dir=target/torch-headers
mkdir -p "$dir/wheels"
if [ ! -d "$dir/x/torch/include" ]; then
  pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 torch==2.11.0 -d "$dir/wheels"
  pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 nvidia-cuda-runtime==13.0.96 nvidia-cuda-crt -d "$dir/wheels"
  mkdir -p "$dir/x"
  (cd "$dir/x" && unzip -q -o ../wheels/torch-*.whl 'torch/include/*' \
    && for w in ../wheels/nvidia_cuda_*.whl; do unzip -q -o "$w" 'nvidia/*'; done)
  rm -f "$dir"/wheels/torch-*.whl
fi
python_include=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
x="$dir/x"
${CXX:-g++} -fsyntax-only -std=c++20 -D_GLIBCXX_USE_CXX11_ABI=1 -Icapi/include \
  -I"$x/torch/include" -I"$x/torch/include/torch/csrc/api/include" \
  -I"$x/nvidia/cu13/include" -I"$python_include" python/memres/torch_backend.cpp
echo "torch_backend.cpp builds against torch 2.11.0's headers"
