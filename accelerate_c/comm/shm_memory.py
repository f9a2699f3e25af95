# accelerate_c/comm/shm_memory.py: the memory side of a shared-memory group (ShmGroup, shm.py, mixes it in): alloc()
# regions every rank maps (a tensor's peers' copies are readable in place, so collectives on it are zero-copy), the
# lookups that find a tensor's region and its peers' parts, page release (discard, unmap_peers), and the reclaiming
# of regions no rank uses any more. Every tensor over a region holds a small exporter object rather than the map
# itself, so the group sees (through a weak reference) when the last one is gone; alloc() first agrees with the
# peers on the regions dropped everywhere and gives them back, in the same order on every rank (collectives name
# regions by index). At most MAX_REGIONS live regions per group.
# Not for: the collectives (shm.py) or naming and opening the segments (shm_segments.py).
from __future__ import annotations

import ctypes
import gc
import mmap
import os
import weakref
from typing import Any, NamedTuple, Optional

import torch

from accelerate_c import _C
from accelerate_c.comm.shm_segments import open_region

_PAGE = 4096
MAX_REGIONS = 32  # live alloc() regions per group (csrc/shm/shm_internal.h: SHM_MAX_REGIONS)


class _Region(NamedTuple):
    """One alloc() region: its map (held by the group), a weak reference to the buffer every tensor over it holds,
    the address of its first part and the bytes per part."""

    map: mmap.mmap
    exporter: "weakref.ref[Any]"
    base: int
    part: int


class SharedRegions:
    """alloc() and the region lookups of a ShmGroup (which provides _h, rank, size, _regions and all_reduce)."""

    def alloc(self, numel: int, dtype: torch.dtype = torch.float32,
              device: Optional[torch.device] = None) -> torch.Tensor:
        """Collective: a zeroed 1-D tensor of `numel` elements living in shared memory. Collectives on it
        (or on any contiguous slice of it) read and write the peers' copies directly (no copy-in).
        Every rank must call alloc with the same sizes in the same order. A region lives while a tensor over it
        does; at most 32 live ones per group (the ones every rank has dropped are given back here first)."""
        self._reclaim()
        nbytes = int(numel) * torch.empty((), dtype=dtype).element_size()
        part = max(_PAGE, (nbytes + _PAGE - 1) // _PAGE * _PAGE)
        fd = open_region(self, part * self.size)
        try:
            mm = mmap.mmap(fd, part * self.size)
        finally:
            os.close(fd)
        # every tensor over the region holds this exporter (not the map), so the group can tell when none is left
        exporter = (ctypes.c_char * (part * self.size)).from_buffer(mm)
        whole = torch.frombuffer(exporter, dtype=torch.uint8)
        _C.shm_region_register(self._h, whole, part)
        self._regions.append(_Region(mm, weakref.ref(exporter), whole.data_ptr(), part))
        if nbytes == 0:
            return whole[:0].view(dtype)
        # A storage of its own covering only this rank's bytes (torch.save of a view writes its whole storage).
        return torch.frombuffer(exporter, dtype=dtype, count=int(numel), offset=self.rank * part)

    def _reclaim(self) -> None:
        """Collective (inside alloc): the regions no tensor uses on any rank are unregistered and unmapped, on every
        rank in the same order (the C group's region indices stay the same on all ranks)."""
        if not self._regions:
            return
        if len(self._regions) >= MAX_REGIONS:  # (the same on every rank) what only cycles still hold goes first
            gc.collect()
        used = torch.tensor([float(r.exporter() is not None) for r in self._regions])
        if self.size > 1:
            self.all_reduce(used, "max")
        keep = []
        for r, u in zip(self._regions, used.tolist()):
            if u:
                keep.append(r)
            else:
                _C.shm_region_unregister(self._h, r.base)
                r.map.close()
        self._regions = keep

    def _locate(self, t: torch.Tensor, what: str) -> tuple[mmap.mmap, torch.Tensor, int, int]:
        """(the map, the whole region, its bytes per part, t's byte offset inside this rank's part) of a tensor
        from alloc() or a contiguous slice of one."""
        ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
        for r in self._regions:
            off = ptr - r.base - self.rank * r.part
            exporter = r.exporter()
            if exporter is not None and 0 <= off and off + nbytes <= r.part:
                return r.map, torch.frombuffer(exporter, dtype=torch.uint8), r.part, off
        raise ValueError(f"ShmGroup.{what}: the tensor does not lie in this rank's part of a region from alloc()")

    @staticmethod
    def _whole_pages(start: int, nbytes: int) -> tuple[int, int]:
        """The byte range of the whole pages inside [start, start + nbytes) of a map (empty: end <= begin)."""
        return -(-start // _PAGE) * _PAGE, (start + nbytes) // _PAGE * _PAGE

    def region_of(self, t: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(the whole region, every rank's part, as one uint8 tensor; its bytes per part) of a tensor from alloc()."""
        _mm, whole, part, _off = self._locate(t, "region_of")
        return whole, part

    def parts(self, t: torch.Tensor) -> list[torch.Tensor]:
        """For a tensor from alloc() (or a contiguous slice of one): the same elements in every rank's part,
        indexed by group rank (entry `rank` is `t` itself). Peers' parts can be read and written directly;
        the caller orders such accesses (e.g. with barrier())."""
        _mm, whole, part, off = self._locate(t, "parts")
        nbytes = t.numel() * t.element_size()
        return [whole[q * part + off:q * part + off + nbytes].view(t.dtype).view(t.shape) for q in range(self.size)]

    def discard(self, t: torch.Tensor) -> int:
        """Gives back to the system the whole pages of a slice `t` of this rank's part of an alloc() region (they
        read as zeros afterwards and take memory again only when written). Local, no collective: the caller knows
        nobody needs the values. Returns the bytes released."""
        mm, _whole, part, off = self._locate(t, "discard")
        a, b = self._whole_pages(self.rank * part + off, t.numel() * t.element_size())
        if b <= a or not hasattr(mmap, "MADV_REMOVE"):  # (Linux; elsewhere the pages stay)
            return 0
        mm.madvise(mmap.MADV_REMOVE, a, b - a)
        return b - a

    def unmap_peers(self, t: torch.Tensor) -> None:
        """Drops from this process's page tables the pages of the peers' copies of `t` (a slice of this rank's part
        of an alloc() region) that reading them mapped here; their values stay (the peers own them), the next read
        maps them again. Local, no collective."""
        mm, _whole, part, off = self._locate(t, "unmap_peers")
        for q in range(self.size):
            a, b = self._whole_pages(q * part + off, t.numel() * t.element_size())
            if q != self.rank and b > a:
                mm.madvise(mmap.MADV_DONTNEED, a, b - a)
