"""Loading libmemres.so and the ctypes prototypes of its C ABI (capi/include/memres.h)."""

from __future__ import annotations

import ctypes
import ctypes.util
import operator
import os
import pathlib
import threading
from typing import Any, Optional

OK = 0
ERROR_INVALID_ARGUMENT = -1
ERROR_IN_USE = -2
ERROR_CUDA = -3
ERROR_PANIC = -4
ERROR_OUT_OF_MEMORY = -5
ERROR_ASLEEP = -6
SLEEP_DISCARD = 0
SLEEP_OFFLOAD = 1


#: The most characters of an argument that a message quotes (the rest is counted).
QUOTE_LIMIT = 200

_C_INT_MIN, _C_INT_MAX = -(2**31), 2**31 - 1


class MemresError(RuntimeError):
    """A failed memres call; ``code`` is the C ABI's (negative) code."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"memres: {message} (code {code})")
        self.code = code


def quote(value: Any) -> str:
    """``repr(value)`` for a message, cut to ``QUOTE_LIMIT`` characters with its whole
    size stated (a 100 kB argument must not make a 100 kB message)."""
    if isinstance(value, (str, bytes)) and len(value) > QUOTE_LIMIT:
        unit = "characters" if isinstance(value, str) else "bytes"
        return f"{value[:QUOTE_LIMIT]!r}... ({len(value)} {unit} in all)"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**QUOTE_LIMIT:
        # Python refuses to write an int of more than 4300 digits; none is shown whole.
        return f"an int of {value.bit_length()} bits"
    try:
        text = repr(value)
    except Exception:  # a broken __repr__ must not hide the error being reported
        return f"a {type(value).__name__}"
    if len(text) > QUOTE_LIMIT:
        return f"{text[:QUOTE_LIMIT]}... ({len(text)} characters in all)"
    return text


def c_string(value: Any, what: str, example: str) -> bytes:
    """``value`` as the NUL-terminated UTF-8 text the C ABI reads. ``what`` names the
    argument in the errors: TypeError for anything but a ``str`` (``example`` shows one),
    ValueError for a NUL character (C would read only what comes before it) or text that
    UTF-8 cannot encode (lone surrogates)."""
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str such as {example!r}, not {type(value).__name__} {quote(value)}")
    nul = value.find("\0")
    if nul >= 0:
        raise ValueError(
            f"{what} holds a NUL character at index {nul} (C would read only what comes "
            f"before it): {quote(value)}"
        )
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid UTF-8 text ({e.reason} at index {e.start}): {quote(value)}") from None


def device_ordinal(device: Any, what: str) -> int:
    """``device`` as the C ABI's ``int`` device ordinal: TypeError naming ``what`` for
    anything but an int (``bool`` included), ValueError for one a C int cannot hold (it
    would wrap round to another device). Ordinals a C int holds are the C ABI's to check
    (MemresError for one memres does not serve)."""
    if isinstance(device, bool):
        raise TypeError(f"{what} must be an int (a CUDA device ordinal), not bool {device!r}")
    try:
        ordinal = operator.index(device)
    except TypeError:
        raise TypeError(
            f"{what} must be an int (a CUDA device ordinal), not {type(device).__name__} {quote(device)}"
        ) from None
    if not _C_INT_MIN <= ordinal <= _C_INT_MAX:
        raise ValueError(f"{what} is {quote(ordinal)}, which a C int cannot hold: not a CUDA device ordinal")
    return ordinal


class Stats(ctypes.Structure):
    """``memres_stats_t``."""

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
        ("allocated_bytes", ctypes.c_int64),
        ("live_allocations", ctypes.c_int64),
        ("peak_live_allocations", ctypes.c_int64),
        ("allocations", ctypes.c_int64),
        ("out_of_memory", ctypes.c_int64),
        ("pool_peak_size", ctypes.c_uint64),
        ("pool_host_copy_bytes", ctypes.c_uint64),
        ("pool_alloc_calls", ctypes.c_uint64),
        ("pool_free_calls", ctypes.c_uint64),
    ]


_LOCK = threading.Lock()
_LIB: Optional[ctypes.CDLL] = None
_PATH: Optional[str] = None

_HERE = pathlib.Path(__file__).resolve().parent


def library_path() -> str:
    """The path of the libmemres.so this package uses: env ``MEMRES_LIB``, else the one
    installed inside the package, else a checkout's ``target/release`` or
    ``target/debug`` (running from ``python/`` without installing), else the loader's
    search path."""
    global _PATH
    if _PATH is not None:
        return _PATH
    candidates = []
    if os.environ.get("MEMRES_LIB"):
        candidates.append(pathlib.Path(os.environ["MEMRES_LIB"]))
    candidates.append(_HERE / "libmemres.so")
    repo = _HERE.parent.parent
    candidates += [repo / "target" / "release" / "libmemres.so", repo / "target" / "debug" / "libmemres.so"]
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
        "libmemres.so not found (install the package with `pip install ./python` from a "
        "checkout, or set MEMRES_LIB); looked in " + ", ".join(str(c) for c in candidates),
    )


def _prototypes(lib: ctypes.CDLL) -> None:
    c = ctypes
    table = {
        "memres_configure": ([c.c_char_p], c.c_int),
        "memres_init_device": ([c.c_int], c.c_int),
        "memres_malloc": ([c.c_ssize_t, c.c_int, c.c_void_p], c.c_void_p),
        "memres_free": ([c.c_void_p, c.c_ssize_t, c.c_int, c.c_void_p], None),
        "memres_stats": ([c.c_int, c.POINTER(Stats)], c.c_int),
        "memres_trim": ([c.c_int], c.c_int),
        "memres_enable_peer_access": ([c.c_int, c.c_int], c.c_int),
        "memres_reset_peak": ([c.c_int], c.c_int),
        "memres_record_stream": ([c.c_void_p, c.c_int, c.c_void_p], c.c_int),
        "memres_last_error": ([], c.c_char_p),
        "memres_profile_push": ([c.c_char_p, c.c_int], c.c_int64),
        "memres_profile_pop": ([c.c_int64], c.c_int),
        "memres_profile_report": ([c.c_char_p, c.c_size_t], c.c_ssize_t),
        "memres_profile_reset": ([], None),
        "memres_set_tag": ([c.c_char_p], c.c_int),
        "memres_tier_stats": ([c.c_int, c.POINTER(Stats), c.c_size_t], c.c_int64),
        "memres_sleep": ([c.c_int, c.c_char_p, c.c_int], c.c_int64),
        "memres_wake": ([c.c_int, c.c_char_p], c.c_int64),
        "memres_prepare_offload": ([c.c_int, c.c_char_p], c.c_int64),
        "memres_is_asleep": ([c.c_int, c.c_char_p], c.c_int),
    }
    for name, (args, ret) in table.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ret


def lib() -> ctypes.CDLL:
    """libmemres, loaded once, with its prototypes set."""
    global _LIB
    with _LOCK:
        if _LIB is None:
            loaded = ctypes.CDLL(library_path())
            _prototypes(loaded)
            _LIB = loaded
        return _LIB


def last_error() -> str:
    """The message of the last failure on this thread ("" if none)."""
    return (lib().memres_last_error() or b"").decode("utf-8", "replace")


def check(code: int) -> int:
    """Raises MemresError for a negative code; returns it otherwise."""
    if code < 0:
        raise MemresError(code, last_error())
    return code
