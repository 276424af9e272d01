"""One call that configures memres and installs it for PyTorch and CuPy."""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional

import ctypes
import importlib.util

from ._device import configure, init_device, reset_peak, stats, trim
from ._native import ERROR_CUDA, ERROR_INVALID_ARGUMENT, MemresError, c_string, device_ordinal, quote


def _require(module: str, flag: str, install: str) -> None:
    """A MemresError saying what to install, where ``module`` is missing."""
    if importlib.util.find_spec(module) is None:
        raise MemresError(
            ERROR_INVALID_ARGUMENT,
            f"memres.setup({flag}=True) needs {module}, which is not installed ({install}); "
            f"pass {flag}=False to set up memres without it",
        )


def _require_driver() -> None:
    """A MemresError at once where there is no CUDA driver (rather than at the first
    allocation)."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        raise MemresError(
            ERROR_CUDA,
            "memres.setup(): no CUDA driver on this machine (libcuda.so.1 cannot be loaded); "
            "memres allocates GPU memory, so it needs one",
        ) from None


class Setup:
    """What :func:`setup` did; reads and trims the devices it set up."""

    def __init__(self, spec: Optional[str], devices: Optional[List[int]], torch: bool, cupy: bool) -> None:
        self.spec = spec
        #: The devices whose stacks were built up front; ``None``: each device's stack is
        #: built on its first allocation.
        self.devices = devices
        self.torch = torch
        self.cupy = cupy

    def _devices(self, device: Optional[int]) -> List[int]:
        if device is not None:
            return [device]
        if self.devices is not None:
            return self.devices
        return _visible_devices()

    def stats(self, device: Optional[int] = None) -> Dict[int, Dict[str, int]]:
        """``{device: memres.stats(device)}`` for ``device``, or for every device set up
        (every visible device when they were not listed)."""
        return {d: stats(d) for d in self._devices(device)}

    def trim(self, device: Optional[int] = None) -> None:
        """Gives unused pool memory back to the driver, on ``device`` or on all."""
        for d in self._devices(device):
            trim(d)

    def reset_peak(self, device: Optional[int] = None) -> None:
        """Starts ``peak_live_bytes`` afresh, on ``device`` or on all."""
        for d in self._devices(device):
            reset_peak(d)

    def __repr__(self) -> str:
        return f"Setup(spec={self.spec!r}, devices={self.devices!r}, torch={self.torch}, cupy={self.cupy})"


def _visible_devices() -> List[int]:
    try:
        import torch

        return list(range(torch.cuda.device_count()))
    except ImportError:
        pass
    try:
        import cupy

        return list(range(cupy.cuda.runtime.getDeviceCount()))
    except ImportError:
        return [0]


def _ordinals(devices: Iterable[int]) -> List[int]:
    """``setup``'s ``devices``, each checked as a device ordinal."""
    if isinstance(devices, (str, bytes)):
        raise TypeError(f"memres.setup(): devices must be a list of ints, not {type(devices).__name__} {quote(devices)}")
    try:
        items = list(devices)
    except TypeError:
        raise TypeError(
            f"memres.setup(): devices must be a list of ints (or None), not {type(devices).__name__} "
            f"{quote(devices)}"
        ) from None
    return [device_ordinal(d, f"memres.setup(): devices[{i}]") for i, d in enumerate(items)]


def setup(
    spec: Optional[str] = None,
    devices: Optional[Iterable[int]] = None,
    torch: bool = True,
    cupy: bool = False,
) -> Setup:
    """Sets memres up for the whole process in one call (RMM's ``rmm.reinitialize``):

    1. ``configure(spec)`` when a spec is given (else env ``MEMRES_RESOURCE``, else the
       default ``"virtual_pool"``), for every device;
    2. makes memres PyTorch's CUDA allocator (``torch=True``; before torch's first CUDA
       allocation: the native backend, so that ``record_stream``, ``memory_stats`` and
       ``empty_cache`` reach memres, and peer access comes on demand; see
       :func:`memres.install_torch`);
    3. builds the stacks of ``devices`` now, so that a device that cannot serve the spec
       fails here (``None``: each device's stack is built on its first allocation, and
       devices the program never touches cost nothing); the backend is in already (its
       pools then take peers on demand), so such a failure leaves memres as torch's
       allocator;
    4. makes memres CuPy's allocator (``cupy=True``).

    Raises :class:`MemresError` at once, saying what is missing, where torch (or CuPy)
    is asked for and not installed, or where the machine has no CUDA driver; TypeError or
    ValueError, before anything is done, for a spec that is not a string the C ABI can
    read or ``devices`` that are not device ordinals.

    Returns a :class:`Setup` that reads the figures of those devices::

        import memres
        mr = memres.setup("virtual_pool")
        ...                      # train
        print(mr.stats())        # {0: {"live_bytes": ..., "peak_live_bytes": ..., ...}}
    """
    # Arguments first: a bad one is a TypeError or ValueError whatever the machine has.
    if spec is not None:
        c_string(spec, "memres.setup(): the spec", "virtual_pool")
    listed = None if devices is None else _ordinals(devices)
    if torch:
        _require("torch", "torch", "pip install torch")
    if cupy:
        _require("cupy", "cupy", "pip install cupy-cuda12x or cupy-cuda13x")
    if spec is not None:
        configure(spec)
    _require_driver()
    if torch:
        from ._torch import install

        # Before the stacks are built: under the native backend their pools give a peer
        # access when torch asks for it, not from the start.
        install()
    for device in listed or []:
        init_device(device)
    if cupy:
        import cupy as _cupy

        from ._cupy import cupy_allocator

        _cupy.cuda.set_allocator(cupy_allocator)
    return Setup(spec, listed, torch, cupy)
