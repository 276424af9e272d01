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

from ._native import SLEEP_DISCARD, SLEEP_OFFLOAD, check, lib

DEFAULT = "default"
_MODES = {"discard": SLEEP_DISCARD, "offload": SLEEP_OFFLOAD}

# The tags entered and not yet left, innermost last (the tag is process-wide: so is
# this stack).
_STACK: List[Optional[str]] = []
_STACK_LOCK = threading.Lock()


def _set(name: Optional[str]) -> None:
    check(lib().memres_set_tag(None if name is None else name.encode("utf-8")))


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
            _STACK.append(self.name)
        return self

    def __exit__(self, *exc: Any) -> None:
        with _STACK_LOCK:
            _STACK.pop()
            _set(_STACK[-1] if _STACK else None)


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
    ``ERROR_ASLEEP``). If one pool fails (out of pinned memory), those this call put to
    sleep wake again and the error is raised.

    >>> memres.sleep({"weights": "offload", "default": "discard"})
    """
    plan = _plan(tags, mode)
    done: List[Optional[str]] = []
    released = 0
    try:
        for name, how in plan:
            released += check(lib().memres_sleep(device, None if name is None else name.encode("utf-8"), how))
            done.append(name)
    except BaseException:
        for name in reversed(done):
            lib().memres_wake(device, None if name is None else name.encode("utf-8"))
        raise
    return released


def wake(tags: Union[None, str, Iterable[str]] = None, device: int = 0) -> int:
    """Maps the memory of the sleeping pools ``tags`` names again, at the same addresses,
    restoring what was offloaded; returns the bytes mapped. ``None`` wakes every sleeping
    pool; a name or a list of names wakes those, in that order (a staged wake: the weights
    before the KV cache). Raises :class:`MemresError` (code ``ERROR_OUT_OF_MEMORY``) when
    the device cannot back the memory (another process holds it); the pool stays asleep
    and can be woken later."""
    if tags is None:
        names: List[Optional[str]] = [None]
    elif isinstance(tags, str):
        names = [tags]
    else:
        names = list(tags)
    mapped = 0
    for name in names:
        mapped += check(lib().memres_wake(device, None if name is None else name.encode("utf-8")))
    return mapped
