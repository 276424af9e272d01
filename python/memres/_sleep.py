"""Tagged memory and sleep/wake: ``with memres.tag("weights"):``, ``memres.sleep(..)``,
``memres.wake(..)``.

A pool that sleeps gives its device memory back to the driver while its addresses stay
reserved, so that after :func:`wake` every tensor (and every CUDA graph captured before
the sleep) is where it was. Memory allocated under a tag has a pool of its own, which
sleeps and wakes on its own: the weights can come back before the KV cache.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, Iterable, List, Optional, Union

from ._native import ERROR_INVALID_ARGUMENT, SLEEP_DISCARD, SLEEP_OFFLOAD, MemresError, check, lib

DEFAULT = "default"
_MODES = {"discard": SLEEP_DISCARD, "offload": SLEEP_OFFLOAD}

# The tags entered and not yet left, in the order entered (the tag is process-wide: so is
# this list; a block that leaves removes its own entry, wherever it is).
_STACK: List["tag"] = []
_STACK_LOCK = threading.Lock()


def _set(name: Optional[str]) -> None:
    check(lib().memres_set_tag(None if name is None else name.encode("utf-8")))


def _c(name: Optional[str]) -> Optional[bytes]:
    return None if name is None else name.encode("utf-8")


class tag:
    """Allocations made inside ``with memres.tag(name):`` come from the pool of ``name``
    (on every device; made on first use), whichever thread makes them: the tag is
    process-wide, as PyTorch runs a model on more than one thread. Leaving the block goes
    back to the tag around it (or the default pool). Frees find their pool by address,
    whatever tag is set then.

    >>> with memres.tag("weights"):
    ...     model = build_model().cuda()
    """

    def __init__(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise TypeError(f"memres.tag() takes a tag name such as 'weights', not {name!r}")
        self.name = name

    def __enter__(self) -> "tag":
        with _STACK_LOCK:
            _set(self.name)
            _STACK.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        with _STACK_LOCK:
            for i in range(len(_STACK) - 1, -1, -1):
                if _STACK[i] is self:
                    del _STACK[i]
                    break
            _set(_STACK[-1].name if _STACK else None)


def is_asleep(name: str = DEFAULT, device: int = 0) -> bool:
    """Whether the pool of tag ``name`` (``"default"``: the untagged memory) sleeps on
    ``device``. Raises :class:`MemresError` for a tag with no memory there."""
    return bool(check(lib().memres_is_asleep(device, _c(name))))


def _plan(tags: Union[None, str, Iterable[str], Dict[str, str]], mode: str) -> List[tuple]:
    if isinstance(tags, dict):
        items = list(tags.items())
    elif tags is None:
        items = [(None, mode)]
    elif isinstance(tags, str):
        items = [(tags, mode)]
    else:
        items = [(t, mode) for t in tags]
    plan = []
    for name, how in items:
        if how not in _MODES:
            raise ValueError(f"memres.sleep: mode {how!r} is neither 'discard' nor 'offload'")
        plan.append((name, _MODES[how]))
    return plan


def sleep(tags: Union[None, str, Iterable[str], Dict[str, str]] = None, mode: str = "discard", device: int = 0) -> int:
    """Gives the device memory of the pools ``tags`` names back to the driver, keeping
    their addresses; returns the bytes given back.

    ``tags``: ``None`` for every pool that can sleep (every tag's, and the untagged pool,
    ``"default"``, when it is the in-place pool, memres's default), a name, a list of
    names, or a dict from name to mode. ``mode``: ``"discard"`` (the contents are lost:
    activations, the KV cache) or ``"offload"`` (copied to pinned host memory and back on
    wake: the weights). All work on the device is waited for first.

    Until the pools wake, tensors in them must not be used (a kernel that reads one
    faults), and allocating from them raises :class:`MemresError` (code
    ``ERROR_ASLEEP``). Every named pool is checked first (it exists, it is awake), and
    offloads run before discards, so that a failure for want of pinned memory comes before
    anything is discarded; on a failure the pools this call put to sleep wake again (a
    discarded one without its contents) and the error is raised.

    >>> memres.sleep({"weights": "offload", "default": "discard"})
    """
    plan = _plan(tags, mode)
    # Every named pool must exist and be awake before any sleeps; offloads go first, so
    # that what can fail for want of pinned memory fails before anything is discarded.
    for name, _ in plan:
        if name is not None and is_asleep(name, device):
            raise MemresError(ERROR_INVALID_ARGUMENT, f"memres.sleep: `{name}` is asleep already")
    plan.sort(key=lambda step: step[1] != SLEEP_OFFLOAD)
    done: List[Optional[str]] = []
    released = 0
    try:
        for name, how in plan:
            released += check(lib().memres_sleep(device, _c(name), how))
            done.append(name)
    except BaseException as error:
        stuck = []
        for name in reversed(done):
            if lib().memres_wake(device, _c(name)) < 0:
                stuck.append(name or "every pool")
        if stuck and isinstance(error, MemresError):
            error.args = (f"{error.args[0]}; could not be woken again, still asleep: {', '.join(stuck)}",)
        raise
    return released


def wake(tags: Union[None, str, Iterable[str]] = None, device: int = 0) -> int:
    """Maps the memory of the sleeping pools ``tags`` names again, at the same addresses,
    restoring what was offloaded; returns the bytes mapped. ``None`` wakes every sleeping
    pool; a name or a list of names wakes those, in that order (a staged wake: the weights
    before the KV cache). Raises :class:`MemresError` (code ``ERROR_OUT_OF_MEMORY``) when
    the device cannot back the memory (another process holds it); the pool stays asleep
    and can be woken later. The pinned host memory of offloaded pools is kept for their
    next sleep (which then only copies) until :func:`memres.trim` or
    ``torch.cuda.empty_cache()``."""
    if tags is None:
        names: List[Optional[str]] = [None]
    elif isinstance(tags, str):
        names = [tags]
    else:
        names = list(tags)
    mapped = 0
    for name in names:
        mapped += check(lib().memres_wake(device, _c(name)))
    return mapped
