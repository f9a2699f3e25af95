# accelerate_c/bigmodel/regions.py: the memory that weights read from disk live in. Each large weight gets an
# anonymous mapping of its own (rounded up to 2 MiB), so that dropping it gives its pages back to the
# system rather than leaving them in malloc's heap. A RegionPool keeps the mappings of dropped weights, up to a byte
# cap, and hands them to the next read of the same size: an offloaded forward reads the same layer shapes over and
# over, and a reused mapping costs neither the kernel's page zeroing and faults nor an munmap in the thread that
# drops the weight (in a bf16 forward that was ~15 % of the time). Mappings come back when the tensor over them
# dies (a weak reference to the ctypes object torch holds as the buffer).
# Not for: the file format (checkpointing/stfile.py) or when weights are read (prefetch.py, hooks.py).
from __future__ import annotations

import ctypes
import mmap
import threading
import weakref

import torch

GRAIN = 2 << 20  # mapping sizes are multiples of this: weights of nearby sizes share one (untouched pages are free)


def _new_map(size: int) -> mmap.mmap:
    # 4 KiB pages on purpose: with MADV_HUGEPAGE the kernel compacts memory on the fault (THP defrag "madvise", the
    # common default), and the first forward of a bf16 Llama of 1.2 GB ran 0.62 s instead of 0.36 s; the pool makes
    # the faults a first-forward cost only.
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


class RegionPool:
    """Anonymous mappings for weights. `cap`: how many bytes the pool may keep mapped in all (in use and free);
    free mappings beyond it are unmapped. 0 keeps none: every dropped weight is unmapped at once."""

    def __init__(self, cap: int = 0) -> None:
        self.cap = cap
        self._free: dict[int, list[mmap.mmap]] = {}
        self._free_bytes = 0
        self._used_bytes = 0
        self._lock = threading.RLock()  # a collection inside a locked section can drop a weight: re-entry
        self.reused = 0  # reads served from a kept mapping (for tests and benchmarks)

    def set_cap(self, cap: int) -> None:
        with self._lock:
            self.cap = cap
            self._trim(0)

    def _trim(self, wanted: int) -> None:
        """Unmaps free mappings until in-use + free + `wanted` bytes fit the cap (caller holds the lock)."""
        for size in list(self._free):
            maps = self._free[size]
            while maps and self._used_bytes + self._free_bytes + wanted > self.cap:
                maps.pop()  # unmapped when the last reference goes (a dying exporter may still hold one)
                self._free_bytes -= size
            if not maps:
                del self._free[size]

    def empty(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """A 1-D tensor of `numel` elements over a mapping of its own (contents undefined)."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        size = max(GRAIN, -(-nbytes // GRAIN) * GRAIN)
        with self._lock:
            maps = self._free.get(size)
            region = maps.pop() if maps else None
            if region is not None:
                self._free_bytes -= size
                self.reused += 1
            else:
                self._trim(size)
            self._used_bytes += size
        if region is None:
            region = _new_map(size)
        exporter = (ctypes.c_char * size).from_buffer(region)
        weakref.finalize(exporter, self._give_back, region, size).atexit = False  # at exit the mappings just go
        return torch.frombuffer(exporter, dtype=dtype, count=numel)  # holds `exporter` until the tensor dies

    def _give_back(self, region: mmap.mmap, size: int) -> None:
        with self._lock:
            self._used_bytes -= size
            if self._used_bytes + self._free_bytes + size <= self.cap:
                self._free.setdefault(size, []).append(region)
                self._free_bytes += size
        # otherwise dropped: unmapped once the dying exporter lets go of it (it still holds an export here)
