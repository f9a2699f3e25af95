# outbuf.py: memory for the large new tensors that everyday collectives return (accelerator.reduce /
# gather of multi-MiB CPU tensors). Why: a fresh 64 MiB tensor is a fresh mmap whose pages the kernel
# must fault in and zero on first touch; on a VM that costs more than the whole shared-memory all-reduce
# (~70-150 ms against ~5 ms for 64 MiB on the 2-core box). Outputs of at least 1 MiB therefore come from
# a small cache of blocks whose pages are already resident: when the caller drops the result (and every
# view of it), its block goes back to the cache for the next call. At most ACCELERATE_C_OUTPUT_CACHE_MB
# (default 256, 0 turns the cache off) of free blocks are kept; the oldest go first.
# The tensors are ordinary CPU tensors (no `_base`, not views) except that their storage cannot grow
# (resize_ to more elements raises, as for torch.frombuffer tensors).
# Not for: memory the collectives use internally (shm segments: shm.py / csrc/shm) or GPU memory.
from __future__ import annotations

import ctypes
import math
import weakref
from typing import Optional, Sequence

import torch

from ..base import settings

_MIN_BYTES = 1 << 20  # below this, glibc's heap reuses freed memory and a tensor is cheap anyway
_GRAIN = 1 << 16  # block sizes are rounded up to this, so sizes that differ a little share blocks

_free: dict = {}  # id(block) -> uint8 tensor nobody uses, oldest first (dict ops are atomic under the GIL)
_limit: Optional[int] = None


def limit_bytes() -> int:
    """Bytes of free blocks the cache may hold (ACCELERATE_C_OUTPUT_CACHE_MB, default 256; read once)."""
    global _limit
    if _limit is None:
        _limit = int(settings.get("OUTPUT_CACHE_MB") * (1 << 20))
    return _limit


def held_bytes() -> int:
    """Bytes of free blocks in the cache now."""
    return sum(b.numel() for b in list(_free.values()))


def _take(nbytes: int) -> Optional[torch.Tensor]:
    """The smallest free block of nbytes .. 2*nbytes bytes (the most recently returned of equal ones: its
    pages are the likeliest still in cache), removed from the cache, or None."""
    while True:
        fits = [b for b in reversed(list(_free.values())) if nbytes <= b.numel() <= 2 * nbytes]
        if not fits:
            return None
        best = min(fits, key=lambda b: b.numel())
        if _free.pop(id(best), None) is best:  # a finalizer may have trimmed it meanwhile: look again
            return best


def _give_back(block: torch.Tensor) -> None:
    _free[id(block)] = block
    while _free and held_bytes() > limit_bytes():
        try:
            _free.pop(next(iter(_free)), None)
        except (StopIteration, RuntimeError):  # emptied / changed by another finalizer meanwhile
            break


def empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """torch.empty(shape, dtype=dtype) on the CPU; from the cache when it is at least 1 MiB."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < _MIN_BYTES or limit_bytes() == 0:
        return torch.empty(shape, dtype=dtype)
    block = _take(nbytes)
    if block is None:
        block = torch.empty((nbytes + _GRAIN - 1) // _GRAIN * _GRAIN, dtype=torch.uint8)
    # The result's storage holds `window` (a ctypes view of the block's first nbytes) until the storage dies;
    # then the finalizer returns the block, which the cache kept alive meanwhile through the closure.
    window = (ctypes.c_char * nbytes).from_address(block.data_ptr())
    weakref.finalize(window, _give_back, block).atexit = False
    storage = torch.frombuffer(window, dtype=torch.uint8).untyped_storage()
    return torch.empty(0, dtype=dtype).set_(storage, 0, tuple(shape))


def empty_like(t: torch.Tensor) -> torch.Tensor:
    """empty(t.shape, t.dtype) for a contiguous CPU tensor, with torch.empty_like's speed below 1 MiB."""
    if t.numel() * t.element_size() < _MIN_BYTES:
        return torch.empty_like(t)
    return empty(t.shape, t.dtype)
