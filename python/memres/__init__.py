"""memres GPU memory pools for PyTorch and CuPy, through libmemres's C ABI (ctypes only).

    import memres
    mr = memres.setup()      # every device: memres's default pool; PyTorch allocates from it
    ...                      # train
    print(mr.stats())        # per device: live, peak live, pool size

    with memres.tag("weights"):       # a pool of its own
        model = build().cuda()
    memres.sleep({"weights": "offload", "default": "discard"})   # memory back to the driver
    memres.wake("weights"); memres.wake()                         # same addresses again

``setup(spec)`` takes a stack spec (``"virtual_pool"``, ``"pool:initial=8GiB"``,
``"statistics(virtual_pool)"``, ...; see ``capi/include/memres.h``). The scope profiler
attributes allocations to named regions::

    with memres.profile("forward"):
        loss = model(x)
    print(memres.profile_report())

The library is the ``libmemres.so`` installed inside this package (``pip install
./python`` from a checkout builds it), or the one named by env ``MEMRES_LIB``.
"""

from ._cupy import cupy_allocator
from ._device import (
    configure,
    enable_peer_access,
    init_device,
    reset_peak,
    stats,
    tier_stats,
    trim,
)
from ._native import (
    ERROR_ASLEEP,
    ERROR_CUDA,
    ERROR_IN_USE,
    ERROR_INVALID_ARGUMENT,
    ERROR_OUT_OF_MEMORY,
    ERROR_PANIC,
    MemresError,
    last_error,
    library_path,
)
from ._profile import ProfileReport, profile, profile_report, profile_reset
from ._setup import Setup, setup
from ._sleep import is_asleep, prepare_offload, sleep, tag, wake
from ._torch import install as install_torch
from ._torch import installed as torch_backend
from ._torch import torch_allocator

__version__ = "0.1.0"

__all__ = [
    "ERROR_ASLEEP",
    "ERROR_CUDA",
    "ERROR_IN_USE",
    "ERROR_INVALID_ARGUMENT",
    "ERROR_OUT_OF_MEMORY",
    "ERROR_PANIC",
    "MemresError",
    "ProfileReport",
    "Setup",
    "configure",
    "cupy_allocator",
    "enable_peer_access",
    "init_device",
    "is_asleep",
    "install_torch",
    "last_error",
    "library_path",
    "prepare_offload",
    "profile",
    "profile_report",
    "profile_reset",
    "reset_peak",
    "setup",
    "sleep",
    "stats",
    "tag",
    "tier_stats",
    "torch_allocator",
    "torch_backend",
    "trim",
    "wake",
]
