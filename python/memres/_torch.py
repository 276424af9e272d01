"""memres as PyTorch's CUDA allocator.

Two ways in, both built once with a C++ compiler and torch's headers (cached in
``~/.cache/memres``, env ``MEMRES_CACHE``, per torch version and libmemres):

- the **native backend** (``torch_backend.cpp``, what :func:`install` and
  :func:`memres.setup` use): a subclass of torch's ``CUDAPluggableAllocator`` that also
  gives torch ``record_stream``, the memory statistics (``memory_allocated``,
  ``max_memory_reserved``, ``memory_stats``, ``memory_summary``, the resets),
  ``empty_cache`` and ``cacheInfo``;
- the **pluggable allocator** (:func:`torch_allocator`): torch's own
  ``CUDAPluggableAllocator`` over two small functions, for ``torch.cuda.MemPool`` and for
  torch versions whose headers the backend does not build against. torch raises "does not
  yet support" for the hooks above there, and ``record_stream`` is lost.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import shutil
import subprocess
import tempfile
import warnings
from typing import Any, List, Optional

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

_HERE = pathlib.Path(__file__).resolve().parent


def _memres_library() -> pathlib.Path:
    memres = pathlib.Path(library_path())
    if not memres.is_file():
        raise MemresError(
            ERROR_INVALID_ARGUMENT,
            f"the PyTorch allocator needs the path of libmemres.so to link against; the "
            f"loader found {memres.name!r} by name only: set MEMRES_LIB to its path",
        )
    return memres.resolve()


def _header_dir() -> pathlib.Path:
    """Where memres.h is: in the installed package, else in a checkout's capi/include."""
    for d in (_HERE, _HERE.parent.parent / "capi" / "include"):
        if (d / "memres.h").is_file():
            return d
    raise MemresError(ERROR_INVALID_ARGUMENT, f"memres.h not found next to {_HERE}")


def _torch_paths(cuda: bool):
    from torch.utils import cpp_extension

    if not cuda:
        return cpp_extension.include_paths(), cpp_extension.library_paths()
    try:  # torch >= 2.6 names the device type; earlier versions take a bool
        return cpp_extension.include_paths("cuda"), cpp_extension.library_paths("cuda")
    except TypeError:
        return cpp_extension.include_paths(cuda=True), cpp_extension.library_paths(cuda=True)


def _build(stem: str, source: str, libs: List[str], includes: List[str], cuda: bool) -> str:
    """Compiles ``source`` into a shared library linked to libmemres and torch's ``libs``,
    once per content, torch version and libmemres (cached); returns its path."""
    import torch

    memres = _memres_library()
    key = hashlib.sha256(
        "\0".join([source, torch.__version__, str(memres), str(memres.stat().st_mtime_ns)]).encode()
    ).hexdigest()[:16]
    cache = pathlib.Path(os.environ.get("MEMRES_CACHE", pathlib.Path.home() / ".cache" / "memres"))
    out = cache / f"{stem}_{key}.so"
    if out.is_file():
        return str(out)
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise MemresError(
            ERROR_INVALID_ARGUMENT,
            "memres's PyTorch allocator needs a C++ compiler once, to build against torch's "
            "headers (PyTorch's pluggable allocator would take a failed allocation's null "
            "pointer as memory); install one (g++) or set CXX",
        )
    cache.mkdir(parents=True, exist_ok=True)
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    include_paths, library_paths = _torch_paths(cuda)
    # Built inside the cache folder and renamed into place (atomic on one file system), so
    # a process starting at the same time never loads a half-written library.
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        src = pathlib.Path(tmp) / f"{stem}.cpp"
        src.write_text(source)
        built = pathlib.Path(tmp) / out.name
        cmd = [cxx, "-O2", "-shared", "-fPIC", "-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
        cmd += [f"-I{d}" for d in includes + list(include_paths)]
        cmd += [str(src), "-o", str(built), f"-L{memres.parent}", f"-l:{memres.name}"]
        cmd += [f"-Wl,-rpath,{memres.parent}"]
        for d in library_paths:
            cmd += [f"-L{d}", f"-Wl,-rpath,{d}"]
        cmd += [f"-l{name}" for name in libs]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise MemresError(ERROR_INVALID_ARGUMENT, f"building {stem} failed:\n" + done.stderr)
        os.replace(built, out)
    return str(out)


def _shim() -> str:
    """Builds (once) the pluggable allocator's two functions; returns the library's path."""
    return _build("memres_torch", _SHIM, ["c10"], [], cuda=False)


def _backend() -> str:
    """Builds (once) the native backend; returns the library's path."""
    source = (_HERE / "torch_backend.cpp").read_text()
    libs = ["torch_cuda", "torch", "torch_cpu", "c10_cuda", "c10"]
    return _build("memres_torch_backend", source, libs, [str(_header_dir())], cuda=True)


_INSTALLED: Optional[str] = None


def install(backend: Optional[str] = None) -> str:
    """Makes memres PyTorch's CUDA allocator (before torch's first CUDA allocation) and
    returns which way it went in: ``"native"`` (the backend, see the module docs) or
    ``"pluggable"``.

    ``backend`` (else env ``MEMRES_TORCH_BACKEND``): ``"native"`` (fails if it cannot be
    built), ``"pluggable"``, or ``None``: native, falling back to pluggable with a warning
    when the backend does not build against this torch."""
    global _INSTALLED
    import torch

    choice = backend or os.environ.get("MEMRES_TORCH_BACKEND") or None
    if choice not in (None, "native", "pluggable"):
        raise MemresError(ERROR_INVALID_ARGUMENT, f"unknown PyTorch backend {choice!r} (native, pluggable)")
    lib()  # loads libmemres first, so the backend and this module share one instance
    if choice != "pluggable":
        try:
            loaded = ctypes.CDLL(_backend())
        except MemresError as e:
            if choice == "native":
                raise
            warnings.warn(f"memres: using the pluggable allocator: {e}", RuntimeWarning, stacklevel=2)
        else:
            loaded.memres_torch_install.restype = ctypes.c_char_p
            failed = loaded.memres_torch_install()
            if failed:
                raise MemresError(ERROR_INVALID_ARGUMENT, failed.decode("utf-8", "replace"))
            _INSTALLED = "native"
            return _INSTALLED
    torch.cuda.memory.change_current_allocator(torch_allocator())
    _INSTALLED = "pluggable"
    return _INSTALLED


def installed() -> Optional[str]:
    """How memres went in as PyTorch's allocator in this process (``"native"``,
    ``"pluggable"``), or ``None``."""
    return _INSTALLED


def torch_allocator() -> Any:
    """A ``CUDAPluggableAllocator`` over memres, for ``torch.cuda.MemPool`` or
    ``torch.cuda.memory.change_current_allocator`` (before torch's first CUDA
    allocation). :func:`memres.setup` installs the native backend instead (see the module
    docs for what the pluggable allocator lacks).

    A failed allocation raises ``torch.OutOfMemoryError`` (or ``RuntimeError`` for other
    failures) with memres's message; the first call builds a small C++ shim for that,
    cached in ``~/.cache/memres`` (env ``MEMRES_CACHE``)."""
    import torch

    lib()  # loads libmemres first, so the shim and this module share one instance
    return torch.cuda.memory.CUDAPluggableAllocator(_shim(), "memres_torch_malloc", "memres_torch_free")
