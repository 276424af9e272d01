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

from ._native import (
    ERROR_INVALID_ARGUMENT,
    SLEEP_DISCARD,
    SLEEP_OFFLOAD,
    MemresError,
    c_string,
    check,
    device_ordinal,
    lib,
    quote,
)

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


def _names(tags: Any, what: str) -> List[str]:
    """``tags`` as a list of tag names (a name, or an iterable of names), each checked as
    a string the C ABI can read; TypeError or ValueError naming ``what`` otherwise."""
    if isinstance(tags, str):
        items = [tags]
    elif isinstance(tags, (bytes, bytearray)):
        raise TypeError(f"{what} must be a tag name (str) or a list of them, not {type(tags).__name__} {quote(tags)}")
    else:
        try:
            items = list(tags)
        except TypeError:
            raise TypeError(
                f"{what} must be None, a tag name (str) or a list of them, not "
                f"{type(tags).__name__} {quote(tags)}"
            ) from None
    for i, name in enumerate(items):
        c_string(name, f"{what}[{i}]" if not isinstance(tags, str) else what, "weights")
    return items


def _mode(how: Any, what: str) -> int:
    """A sleep mode's C value: TypeError or ValueError naming ``what`` for anything but
    "discard" or "offload"."""
    if not isinstance(how, str):
        raise TypeError(f"{what} must be 'discard' or 'offload', not {type(how).__name__} {quote(how)}")
    if how not in _MODES:
        raise ValueError(f"{what} is {quote(how)}: neither 'discard' nor 'offload'")
    return _MODES[how]


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
        c_string(name, "memres.tag(): the name", "weights")
        if not name:
            raise ValueError("memres.tag(): the name is empty; give the tag a name such as 'weights'")
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
    tag_name = c_string(name, "memres.is_asleep(): the name", "weights")
    device = device_ordinal(device, "memres.is_asleep(): device")
    return bool(check(lib().memres_is_asleep(device, tag_name)))


def _plan(tags: Union[None, str, Iterable[str], Dict[str, str]], mode: str) -> List[tuple]:
    if isinstance(tags, dict):
        names = _names(list(tags), "memres.sleep(): tags")
        return [(name, _mode(tags[name], f"memres.sleep(): the mode of tags[{quote(name)}]")) for name in names]
    how = _mode(mode, "memres.sleep(): mode")
    if tags is None:
        return [(None, how)]
    return [(name, how) for name in _names(tags, "memres.sleep(): tags")]


def sleep(tags: Union[None, str, Iterable[str], Dict[str, str]] = None, mode: str = "discard", device: int = 0) -> int:
    """Gives the device memory of the pools ``tags`` names back to the driver, keeping
    their addresses; returns the bytes given back.

    ``tags``: ``None`` for every pool that can sleep (every tag's, and the untagged pool,
    ``"default"``, when it is the virtual pool, memres's default), a name, a list of
    names, or a dict from name to mode. ``mode``: ``"discard"`` (the contents are lost:
    activations, the KV cache) or ``"offload"`` (copied to pageable host memory, through
    pinned staging buffers of 4 MiB, two per copying thread, and back on wake: the
    weights; ``MEMRES_OFFLOAD_THREADS`` sets how many threads copy, by default the cores,
    one per 256 MiB to copy, at most 16; ``MEMRES_OFFLOAD_MAP_THREADS`` how many map the memory on wake and give it
    back on sleep, by default 1). The copying threads register the copies with the driver
    as they go (page-lock them, 32 MiB at a time, after backing each piece) and the device
    copies into them directly; what a failed registration left is registered by a thread
    of its own once the call returns, and staged until then. A wake copies the registered
    part back directly, at the bus's speed (``MEMRES_OFFLOAD_REGISTER=0`` stages every
    copy, both ways). The copies
    ask the kernel for transparent huge pages unless it says ``[never]``
    (``MEMRES_OFFLOAD_HUGE_PAGES=0`` turns that off). All work on the device is waited for
    first.

    Until the pools wake, tensors in them must not be used (a kernel that reads one
    faults), and allocating from them raises :class:`MemresError` (code
    ``ERROR_ASLEEP``). Every named pool is checked first (it exists, it is awake), and
    offloads run before discards, so that a failure for want of host memory comes before
    anything is discarded; on a failure the pools this call put to sleep wake again (a
    discarded one without its contents) and the error is raised.

    >>> memres.sleep({"weights": "offload", "default": "discard"})
    """
    plan = _plan(tags, mode)
    device = device_ordinal(device, "memres.sleep(): device")
    # Every named pool must exist and be awake before any sleeps; offloads go first, so
    # that what can fail for want of host memory fails before anything is discarded.
    for name, _ in plan:
        if name is not None and is_asleep(name, device):
            raise MemresError(ERROR_INVALID_ARGUMENT, f"memres.sleep(): {quote(name)} is asleep already")
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
    and can be woken later. The host copies of offloaded pools (their size; page-locked as
    far as they are registered) and
    their staging buffers (pinned, at most 128 MiB a pool) are kept while awake for their
    next sleep (which then only copies) until :func:`memres.trim` or
    ``torch.cuda.empty_cache()``."""
    names: List[Optional[str]] = [None] if tags is None else list(_names(tags, "memres.wake(): tags"))
    device = device_ordinal(device, "memres.wake(): device")
    mapped = 0
    for name in names:
        mapped += check(lib().memres_wake(device, _c(name)))
    return mapped


def prepare_offload(tags: Union[None, str, Iterable[str]] = None, device: int = 0) -> int:
    """Makes ahead the host memory that ``memres.sleep(tags, mode="offload")`` would make
    for what the pools hold now: the copies (pageable, their pages backed now, on several
    threads, then registered in the background) and, with ``MEMRES_OFFLOAD_REGISTER=0``,
    the pinned staging buffers, less what they keep already; returns the
    bytes made. The first offloading sleep then only copies, as later ones do (backing
    fresh host memory is far slower than copying into it on some machines). ``None``:
    every awake pool that can sleep. The memory stays while the pools are awake, until
    :func:`memres.trim` or ``torch.cuda.empty_cache()``; raises :class:`MemresError`
    for a sleeping pool named, or when the host lacks the room.

    >>> memres.prepare_offload("weights")
    """
    names: List[Optional[str]] = [None] if tags is None else list(
        _names(tags, "memres.prepare_offload(): tags"))
    device = device_ordinal(device, "memres.prepare_offload(): device")
    made = 0
    for name in names:
        made += check(lib().memres_prepare_offload(device, _c(name)))
    return made
