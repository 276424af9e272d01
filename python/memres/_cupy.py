"""memres as CuPy's allocator (``cupy.cuda.set_allocator``)."""

from __future__ import annotations

from typing import Any

from ._native import ERROR_CUDA, MemresError, last_error, lib


class _Block:
    """Owns one memres block for CuPy; frees it when CuPy lets go of the memory. It keeps
    CuPy's stream object, so the stream it is freed on is still alive then."""

    __slots__ = ("ptr", "size", "device", "stream", "handle", "free")

    def __init__(self, ptr: int, size: int, device: int, stream: Any, handle: int) -> None:
        self.ptr, self.size, self.device = ptr, size, device
        self.stream, self.handle = stream, handle
        self.free = lib().memres_free

    def __del__(self) -> None:
        self.free(self.ptr, self.size, self.device, self.handle)


# cudaStreamPerThread names another stream on every thread, and CuPy may drop memory on
# any thread: such blocks are ordered on the legacy default stream instead, which
# synchronises with every per-thread default stream.
_PER_THREAD = 2


def cupy_allocator(size: int) -> Any:
    """An allocator for ``cupy.cuda.set_allocator``: device memory from memres on the
    current device, stream-ordered on CuPy's current stream, freed through memres (on
    that stream) when CuPy drops it."""
    import cupy

    device = cupy.cuda.Device().id
    stream = cupy.cuda.get_current_stream()
    handle = 0 if stream.ptr == _PER_THREAD else stream.ptr
    if size == 0:
        # memres returns no memory for zero bytes; CuPy's own empty memory has address 0.
        return cupy.cuda.MemoryPointer(cupy.cuda.memory.Memory(0), 0)
    ptr = lib().memres_malloc(size, device, handle)
    if not ptr:
        message = last_error()
        if "out of memory" in message.lower():
            raise cupy.cuda.memory.OutOfMemoryError(size, 0, 0)
        raise MemresError(ERROR_CUDA, message)
    block = _Block(ptr, size, device, stream, handle)
    memory = cupy.cuda.UnownedMemory(ptr, size, block, device)
    return cupy.cuda.MemoryPointer(memory, 0)
