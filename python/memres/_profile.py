"""The scope profiler: ``with memres.profile("forward"):`` and ``@memres.profile(..)``."""

from __future__ import annotations

import contextlib
import ctypes
from typing import Any, Dict, List

from ._native import c_string, check, lib, quote

_FIELDS = ("calls", "allocations", "bytes", "peak_bytes", "retained_bytes")


class profile(contextlib.ContextDecorator):
    """A named scope of the profiler, as a context manager or a decorator.

    Every allocation and free that memres serves while the scope is open counts towards
    it (and towards every scope around it): allocations, bytes, the peak of bytes held
    above what was live when it opened, and what is still held when it closes. When it
    closes, its figures are added to the record of its name (see :func:`profile_report`).

    ``all_threads`` (the default) counts every thread's allocations, not only the calling
    thread's: PyTorch runs the backward pass on autograd threads of its own, so a scope
    around ``loss.backward()`` must count them. With ``all_threads=False`` the scope
    counts the calling thread only, and scopes of several threads stay apart.

    >>> with memres.profile("forward"):
    ...     y = model(x)
    >>> @memres.profile("optimizer")
    ... def step(): ...
    """

    def __init__(self, name: str, all_threads: bool = True) -> None:
        # Checked here, not when the scope opens: a decorator's mistake shows where it is
        # written.
        self._name = c_string(name, "memres.profile(): the name", "forward")
        if not isinstance(all_threads, (bool, int)):
            raise TypeError(
                f"memres.profile(): all_threads must be a bool, not {type(all_threads).__name__} "
                f"{quote(all_threads)}"
            )
        self.name = name
        self.all_threads = bool(all_threads)
        self._ids: List[int] = []

    def _recreate_cm(self) -> "profile":
        # A decorated function may be re-entered (recursion, threads): a scope per call.
        return profile(self.name, self.all_threads)

    def __enter__(self) -> "profile":
        self._ids.append(check(lib().memres_profile_push(self._name, int(self.all_threads))))
        return self

    def __exit__(self, *exc: Any) -> None:
        # The id is dropped only once closed: a failed close (on another thread) leaves the
        # scope open for the thread that opened it to close.
        check(lib().memres_profile_pop(self._ids[-1]))
        self._ids.pop()


def _unescape(name: str) -> str:
    out, chars = [], iter(name)
    for c in chars:
        if c == "\\":
            c = {"t": "\t", "n": "\n", "\\": "\\"}.get(next(chars, ""), "")
        out.append(c)
    return "".join(out)


class ProfileReport:
    """The profiler's records, highest peak first: ``print(report)`` shows a table,
    ``report.as_dict()`` gives ``{name: {"calls", "allocations", "bytes", "peak_bytes",
    "retained_bytes"}}``, ``report.records`` a list of dicts with a ``"name"`` too."""

    def __init__(self, records: List[Dict[str, Any]]) -> None:
        self.records = records

    def as_dict(self) -> Dict[str, Dict[str, int]]:
        return {r["name"]: {k: r[k] for k in _FIELDS} for r in self.records}

    def __str__(self) -> str:
        mib = float(1 << 20)
        width = max([len("scope")] + [len(r["name"]) for r in self.records])
        lines = [
            f"{'scope':<{width}}  {'calls':>8}  {'allocations':>12}  {'total MiB':>12}  "
            f"{'peak MiB':>12}  {'retained MiB':>12}"
        ]
        for r in self.records:
            lines.append(
                f"{r['name']:<{width}}  {r['calls']:>8}  {r['allocations']:>12}  "
                f"{r['bytes'] / mib:>12.1f}  {r['peak_bytes'] / mib:>12.1f}  "
                f"{r['retained_bytes'] / mib:>12.1f}"
            )
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"ProfileReport({self.records!r})"


def profile_report() -> ProfileReport:
    """The records of every scope closed so far (since the last :func:`profile_reset`)."""
    fn = lib().memres_profile_report
    size = 4096
    while True:
        buf = ctypes.create_string_buffer(size)
        n = check(fn(buf, size))
        if n < size:
            break
        size = n + 1
    records = []
    for line in buf.value.decode("utf-8", "replace").splitlines():
        name, *figures = line.split("\t")
        record: Dict[str, Any] = {"name": _unescape(name)}
        record.update(zip(_FIELDS, map(int, figures)))
        records.append(record)
    return ProfileReport(records)


def profile_reset() -> None:
    """Forgets every record (scopes still open are recorded when they close)."""
    lib().memres_profile_reset()
