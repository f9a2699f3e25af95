# accelerate_c/base/pages.py: CPU buffers whose memory can be handed back to the system between uses. A PageBuffer
# is a zeroed 1-D tensor in an anonymous private mapping of its own, rounded up to 2 MiB and marked for
# transparent huge pages (where the kernel has them in "madvise" or "always" mode), so zero_() can give its pages
# back (MADV_DONTNEED: they read as zeros) and the next writes fault them in again as a few huge pages instead of
# thousands of small ones. Used by the sharded engine for its gradient shard, freed at zero_grad as FSDP2 frees its
# gradients. huge_zeros carves several zeroed tensors out of one such mapping: the low-precision optimizer state,
# streamed through once per step, where each 4 KiB page costs the step a TLB miss (a nested page walk in a VM).
# Not for: shared memory between processes (comm/shm.py) or torch's allocator.
from __future__ import annotations

import mmap

import torch

HUGE = 2 << 20


def available() -> bool:
    """Whether this platform has what PageBuffer needs (POSIX anonymous private mappings and MADV_DONTNEED)."""
    return all(hasattr(mmap, n) for n in ("MAP_PRIVATE", "MAP_ANONYMOUS", "MADV_DONTNEED"))


class PageBuffer:
    def __init__(self, numel: int, dtype: torch.dtype = torch.float32) -> None:
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.nbytes = int(numel) * itemsize
        self._mm = mmap.mmap(-1, max(HUGE, -(-self.nbytes // HUGE) * HUGE),
                             flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            self._mm.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError):  # no THP here: small pages, still given back
            pass
        self.tensor = (torch.frombuffer(self._mm, dtype=dtype, count=int(numel)) if numel
                       else torch.empty(0, dtype=dtype))

    def zero_(self) -> torch.Tensor:
        """Zeroes the whole buffer by giving its pages back to the system."""
        if self.nbytes:
            self._mm.madvise(mmap.MADV_DONTNEED, 0, len(self._mm))
        return self.tensor


def huge_zeros(specs: list[tuple[tuple[int, ...], torch.dtype]], min_bytes: int = HUGE) -> list[torch.Tensor]:
    """Zeroed contiguous tensors of the given (shape, dtype)s, carved 64-byte aligned out of ONE anonymous mapping
    marked for transparent huge pages (the kernel zero-fills it: nothing is written here). The mapping lives as long
    as any of the tensors. Below `min_bytes` in all, or where the platform lacks the mappings, plain torch.zeros."""
    sizes, total = [], 0
    for shape, dtype in specs:
        n = 1
        for d in shape:
            n *= int(d)
        nbytes = n * torch.empty((), dtype=dtype).element_size()
        sizes.append((n, nbytes, total))
        total += -(-nbytes // 64) * 64
    if total < min_bytes or not available():
        return [torch.zeros(shape, dtype=dtype) for shape, dtype in specs]
    buf = PageBuffer(total, torch.uint8).tensor
    return [buf[off:off + nbytes].view(dtype).view(shape) for (shape, dtype), (n, nbytes, off) in zip(specs, sizes)]
