"""memres as PyTorch's CUDA allocator (``torch.cuda.memory.CUDAPluggableAllocator``)."""

from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
import subprocess
import tempfile
from typing import Any

from ._native import ERROR_INVALID_ARGUMENT, MemresError, lib, library_path

# PyTorch's pluggable allocator (2.11) takes a null pointer from its malloc function as
# memory: a failed allocation would become a tensor over address 0. So torch gets two
# small C++ functions that call memres and turn a failure into PyTorch's own exception
# (torch.OutOfMemoryError for out of memory), built once with torch's headers.
_SHIM = r"""
#include <c10/util/Exception.h>
#include <string>
#include <sys/types.h>

extern "C" {
void* memres_malloc(ssize_t size, int device, void* stream);
void memres_free(void* ptr, ssize_t size, int device, void* stream);
const char* memres_last_error(void);

void* memres_torch_malloc(ssize_t size, int device, void* stream) {
  void* ptr = memres_malloc(size, device, stream);
  if (ptr == nullptr && size != 0) {
    std::string why = memres_last_error();
    TORCH_CHECK_WITH(OutOfMemoryError, why.rfind("out of memory", 0) != 0,
                     "memres: ", why);
    TORCH_CHECK(false, "memres: ", why);
  }
  return ptr;
}

void memres_torch_free(void* ptr, ssize_t size, int device, void* stream) {
  memres_free(ptr, size, device, stream);
}
}
"""


def _shim() -> str:
    """Builds (once, cached by content) the shim library and returns its path."""
    import torch
    from torch.utils import cpp_extension

    memres = pathlib.Path(library_path())
    if not memres.is_file():
        raise MemresError(
            ERROR_INVALID_ARGUMENT,
            f"torch_allocator needs the path of libmemres.so to link its shim against; the "
            f"loader found {memres.name!r} by name only: set MEMRES_LIB to its path",
        )
    memres = memres.resolve()
    key = hashlib.sha256(
        "\0".join([_SHIM, torch.__version__, str(memres), str(memres.stat().st_mtime_ns)]).encode()
    ).hexdigest()[:16]
    cache = pathlib.Path(os.environ.get("MEMRES_CACHE", pathlib.Path.home() / ".cache" / "memres"))
    out = cache / f"memres_torch_{key}.so"
    if out.is_file():
        return str(out)
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise MemresError(
            ERROR_INVALID_ARGUMENT,
            "torch_allocator needs a C++ compiler once, to build the shim that turns a failed "
            "allocation into torch.OutOfMemoryError (PyTorch's pluggable allocator would "
            "take a null pointer as memory); install one (g++) or set CXX",
        )
    cache.mkdir(parents=True, exist_ok=True)
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    # Built inside the cache folder and renamed into place (atomic on one file system), so
    # a process starting at the same time never loads a half-written library.
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        src = pathlib.Path(tmp) / "memres_torch.cpp"
        src.write_text(_SHIM)
        built = pathlib.Path(tmp) / out.name
        cmd = [cxx, "-O2", "-shared", "-fPIC", "-std=c++17", f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
        cmd += [f"-I{d}" for d in cpp_extension.include_paths()]
        cmd += [str(src), "-o", str(built), f"-L{memres.parent}", f"-l:{memres.name}"]
        cmd += [f"-Wl,-rpath,{memres.parent}"]
        for d in cpp_extension.library_paths():
            cmd += [f"-L{d}", f"-Wl,-rpath,{d}"]
        cmd += ["-lc10"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise MemresError(ERROR_INVALID_ARGUMENT, "building the torch shim failed:\n" + done.stderr)
        os.replace(built, out)
    return str(out)


def torch_allocator() -> Any:
    """A ``CUDAPluggableAllocator`` over memres, for
    ``torch.cuda.memory.change_current_allocator`` (before torch's first CUDA
    allocation). :func:`memres.setup` installs it for you.

    A failed allocation raises ``torch.OutOfMemoryError`` (or ``RuntimeError`` for other
    failures) with memres's message; the first call builds a small C++ shim for that,
    cached in ``~/.cache/memres`` (env ``MEMRES_CACHE``)."""
    import torch

    lib()  # loads libmemres first, so the shim and this module share one instance
    return torch.cuda.memory.CUDAPluggableAllocator(_shim(), "memres_torch_malloc", "memres_torch_free")
