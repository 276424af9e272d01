"""memres pools under PyTorch and CuPy, through libmemres's C ABI (ctypes only).

    import memres_alloc, torch
    memres_alloc.configure("statistics(virtual_pool)")   # optional; default "virtual_pool"
    torch.cuda.memory.change_current_allocator(memres_alloc.torch_allocator())
    ...                                                        # torch now allocates from memres
    print(memres_alloc.stats(0))

    import cupy
    cupy.cuda.set_allocator(memres_alloc.cupy_allocator)

The library is found in env MEMRES_LIB, next to this file, in the repository's
target/release or target/debug, or on the loader's path. Build it with
`cargo build --release -p memres-capi`.
"""

import ctypes
import ctypes.util
import os
import pathlib

__all__ = [
    "MemresError",
    "library_path",
    "configure",
    "stats",
    "trim",
    "last_error",
    "torch_allocator",
    "cupy_allocator",
]

OK = 0
ERROR_INVALID_ARGUMENT = -1
ERROR_IN_USE = -2
ERROR_CUDA = -3
ERROR_PANIC = -4
ERROR_OUT_OF_MEMORY = -5


class MemresError(RuntimeError):
    """A failed memres call: `code` is the C ABI's (negative) code."""

    def __init__(self, code, message):
        super().__init__(f"memres: {message} (code {code})")
        self.code = code


class _Stats(ctypes.Structure):
    _fields_ = [
        ("has_statistics", ctypes.c_int32),
        ("has_pool", ctypes.c_int32),
        ("current_bytes", ctypes.c_int64),
        ("peak_bytes", ctypes.c_int64),
        ("total_bytes", ctypes.c_int64),
        ("current_allocations", ctypes.c_int64),
        ("peak_allocations", ctypes.c_int64),
        ("total_allocations", ctypes.c_int64),
        ("pool_size", ctypes.c_uint64),
        ("pool_free_bytes", ctypes.c_uint64),
        ("pool_largest_free_block", ctypes.c_uint64),
        ("live_bytes", ctypes.c_int64),
        ("peak_live_bytes", ctypes.c_int64),
    ]


_LIB = None
_PATH = None


def library_path():
    """The path of libmemres.so that this module uses."""
    global _PATH
    if _PATH is not None:
        return _PATH
    here = pathlib.Path(__file__).resolve().parent
    candidates = []
    if os.environ.get("MEMRES_LIB"):
        candidates.append(pathlib.Path(os.environ["MEMRES_LIB"]))
    candidates += [
        here / "libmemres.so",
        here.parent / "target" / "release" / "libmemres.so",
        here.parent / "target" / "debug" / "libmemres.so",
    ]
    for candidate in candidates:
        if candidate.is_file():
            _PATH = str(candidate)
            return _PATH
    found = ctypes.util.find_library("memres")
    if found:
        _PATH = found
        return _PATH
    raise MemresError(
        ERROR_INVALID_ARGUMENT,
        "libmemres.so not found (set MEMRES_LIB, or build it with "
        "`cargo build --release -p memres-capi`); looked in "
        + ", ".join(str(c) for c in candidates),
    )


def _lib():
    global _LIB
    if _LIB is None:
        lib = ctypes.CDLL(library_path())
        lib.memres_configure.argtypes = [ctypes.c_char_p]
        lib.memres_configure.restype = ctypes.c_int
        lib.memres_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        lib.memres_malloc.restype = ctypes.c_void_p
        lib.memres_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        lib.memres_free.restype = None
        lib.memres_stats.argtypes = [ctypes.c_int, ctypes.POINTER(_Stats)]
        lib.memres_stats.restype = ctypes.c_int
        lib.memres_trim.argtypes = [ctypes.c_int]
        lib.memres_trim.restype = ctypes.c_int
        lib.memres_reset_peak.argtypes = [ctypes.c_int]
        lib.memres_reset_peak.restype = ctypes.c_int
        lib.memres_last_error.argtypes = []
        lib.memres_last_error.restype = ctypes.c_char_p
        _LIB = lib
    return _LIB


def last_error():
    """The message of the last failure on this thread ("" if none)."""
    return (_lib().memres_last_error() or b"").decode("utf-8", "replace")


def _check(code):
    if code != OK:
        raise MemresError(code, last_error())


def configure(spec):
    """Chooses every device's stack, e.g. "virtual_pool:release=2GiB" (the default: a
    pool growing in place over CUDA virtual memory), "pool:initial=8GiB" or
    "statistics(virtual_pool)".

    Must come before the first allocation (a MemresError with code ERROR_IN_USE after).
    """
    _check(_lib().memres_configure(spec.encode("utf-8")))


def stats(device=0):
    """The figures of `device`'s stack as a dict: `live_bytes` and `peak_live_bytes`
    always (counted exactly by the C ABI, whatever the spec); the statistics keys when the
    stack has a statistics layer, the pool keys when it has a pool."""
    out = _Stats()
    _check(_lib().memres_stats(device, ctypes.byref(out)))
    figures = {"live_bytes": out.live_bytes, "peak_live_bytes": out.peak_live_bytes}
    if out.has_statistics:
        for name in (
            "current_bytes",
            "peak_bytes",
            "total_bytes",
            "current_allocations",
            "peak_allocations",
            "total_allocations",
        ):
            figures[name] = getattr(out, name)
    if out.has_pool:
        figures["pool_size"] = out.pool_size
        figures["pool_free_bytes"] = out.pool_free_bytes
        figures["pool_largest_free_block"] = out.pool_largest_free_block
    return figures


def reset_peak(device=0):
    """Starts `device`'s `peak_live_bytes` afresh from what is live now."""
    _check(_lib().memres_reset_peak(device))


def trim(device=0):
    """Gives the entirely free memory of `device`'s pool back to the driver."""
    _check(_lib().memres_trim(device))


# PyTorch's pluggable allocator (2.11) takes a null pointer from its malloc function as
# memory: a failed allocation would become a tensor over address 0. So torch gets two
# small C++ functions that call memres and turn a failure into PyTorch's own exception
# (torch.OutOfMemoryError for out of memory), built once with torch's headers.
_TORCH_SHIM = r"""
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


def _torch_shim():
    """Builds (once, cached by content) the shim library and returns its path."""
    import hashlib
    import shutil
    import subprocess
    import tempfile

    import torch
    from torch.utils import cpp_extension

    lib = pathlib.Path(library_path())
    if not lib.is_file():
        raise MemresError(
            ERROR_INVALID_ARGUMENT,
            f"torch_allocator needs the path of libmemres.so to link its shim against; the "
            f"loader found {lib.name!r} by name only: set MEMRES_LIB to its path",
        )
    lib = lib.resolve()
    key = hashlib.sha256(
        "\0".join([_TORCH_SHIM, torch.__version__, str(lib), str(lib.stat().st_mtime_ns)]).encode()
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
            "take a null pointer as memory); set CXX",
        )
    cache.mkdir(parents=True, exist_ok=True)
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    # Built inside the cache folder and renamed into place (atomic on one file system), so
    # a process starting at the same time never loads a half-written library.
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        src = pathlib.Path(tmp) / "memres_torch.cpp"
        src.write_text(_TORCH_SHIM)
        built = pathlib.Path(tmp) / out.name
        cmd = [cxx, "-O2", "-shared", "-fPIC", "-std=c++17", f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
        cmd += [f"-I{d}" for d in cpp_extension.include_paths()]
        cmd += [str(src), "-o", str(built), f"-L{lib.parent}", f"-l:{lib.name}"]
        cmd += [f"-Wl,-rpath,{lib.parent}"]
        for d in cpp_extension.library_paths():
            cmd += [f"-L{d}", f"-Wl,-rpath,{d}"]
        cmd += ["-lc10"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise MemresError(ERROR_INVALID_ARGUMENT, "building the torch shim failed:\n" + done.stderr)
        os.replace(built, out)
    return str(out)


def torch_allocator():
    """A CUDAPluggableAllocator over memres, for
    torch.cuda.memory.change_current_allocator (before any CUDA allocation).

    A failed allocation raises torch.OutOfMemoryError (or RuntimeError for other
    failures) with memres's message; the first call builds a small C++ shim for that
    (see _TORCH_SHIM), cached in ~/.cache/memres (env MEMRES_CACHE)."""
    import torch

    _lib()  # loads libmemres first, so the shim and this module share one instance
    return torch.cuda.memory.CUDAPluggableAllocator(
        _torch_shim(), "memres_torch_malloc", "memres_torch_free"
    )


class _Block:
    """Owns one memres block for CuPy; frees it when CuPy lets go of the memory. It keeps
    CuPy's stream object, so the stream it is freed on is still alive then."""

    __slots__ = ("ptr", "size", "device", "stream", "handle", "free")

    def __init__(self, ptr, size, device, stream, handle):
        self.ptr, self.size, self.device = ptr, size, device
        self.stream, self.handle = stream, handle
        self.free = _lib().memres_free

    def __del__(self):
        self.free(self.ptr, self.size, self.device, self.handle)


# cudaStreamPerThread names another stream on every thread, and CuPy may drop memory on
# any thread: such blocks are ordered on the legacy default stream instead, which
# synchronises with every per-thread default stream.
_PER_THREAD = 2


def cupy_allocator(size):
    """An allocator for cupy.cuda.set_allocator: device memory from memres on the
    current device, stream-ordered on CuPy's current stream, freed through memres (on
    that stream) when CuPy drops it."""
    import cupy

    device = cupy.cuda.Device().id
    stream = cupy.cuda.get_current_stream()
    handle = 0 if stream.ptr == _PER_THREAD else stream.ptr
    ptr = _lib().memres_malloc(size, device, handle)
    if not ptr:
        message = last_error()
        if "out of memory" in message.lower():
            raise cupy.cuda.memory.OutOfMemoryError(size, 0, 0)
        raise MemresError(ERROR_CUDA, message)
    block = _Block(ptr, size, device, stream, handle)
    memory = cupy.cuda.UnownedMemory(ptr, size, block, device)
    return cupy.cuda.MemoryPointer(memory, 0)
