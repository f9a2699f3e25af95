# accelerate_c/sharding/flat.py: the layout of one unit's flat buffer. The unit's parameters lie one after the
# other (registration order) in a buffer of `numel` elements padded to `padded`, a multiple of the world size;
# rank r owns the contiguous shard [r * shard, (r + 1) * shard). The offsets table gives, for each parameter, its
# name, offset, numel and shape, and the piece of it inside this rank's shard (possibly empty).
# Where the buffers live (full, shard, shared memory) and how they move is the engine's business (engine.py).
# Not for: choosing units (units.py) or communication.
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .pack import pack as _pack


@dataclass
class FlatEntry:
    name: str
    param: torch.nn.Parameter
    offset: int
    numel: int
    shape: tuple[int, ...]
    lo: int = 0   # this rank's piece: elements [lo, hi) of the parameter (flattened), hi <= lo when empty
    hi: int = 0

    @property
    def piece_numel(self) -> int:
        return max(0, self.hi - self.lo)


class FlatUnit:
    """Layout of unit `index` for rank `rank` of `world`. `base` (set by the engine) is where this unit's shard
    starts in the engine's concatenated shard buffers; `fbase` where its full buffer starts in a concatenated full
    buffer (stages 1/2)."""

    def __init__(self, index: int, name: str, module: torch.nn.Module,
                 params: list[tuple[str, torch.nn.Parameter]], world: int, rank: int) -> None:
        self.index, self.name, self.module = index, name, module
        self.world, self.rank = world, rank
        self.entries: list[FlatEntry] = []
        off = 0
        for pname, p in params:
            self.entries.append(FlatEntry(pname, p, off, p.numel(), tuple(p.shape)))
            off += p.numel()
        self.numel = off
        self.shard = -(-off // world) if off else 0
        self.padded = self.shard * world
        self.lo, self.hi = rank * self.shard, (rank + 1) * self.shard
        for e in self.entries:
            e.lo = min(max(self.lo - e.offset, 0), e.numel)
            e.hi = max(e.lo, min(self.hi - e.offset, e.numel))
        self.base = 0
        self.fbase = 0

    def shard_slice(self, e: FlatEntry) -> tuple[int, int]:
        """Element range of entry e's piece inside this rank's shard of the unit ((0, 0) when empty)."""
        if not e.piece_numel:
            return 0, 0
        a = e.offset + e.lo - self.lo
        return a, a + e.piece_numel

    def pack(self, out: torch.Tensor, tensors: list[Optional[torch.Tensor]]) -> None:
        """out[:padded] = the unit's tensors (one per entry, None = zeros) one after the other, converted to out's
        dtype, padding zeroed (one C pass: pack.py)."""
        _pack(out[:self.padded], [e.offset for e in self.entries], tensors)

    def pack_window(self, out: torch.Tensor, flats: list[Optional[torch.Tensor]], start: int, n: int) -> None:
        """A window of the unit's padded buffer in reduce-scatter order: out[q * n:(q + 1) * n] = its elements
        [q * shard + start, q * shard + start + n) for each rank q (so reduce-scattering `out` yields elements
        [start, start + n) of each rank's shard). `flats`: each entry's tensor flattened (None = zeros)."""
        offsets, pieces = [], []
        for q in range(self.world):
            a = q * self.shard + start
            for e, t in zip(self.entries, flats):
                lo, hi = max(a, e.offset), min(a + n, e.offset + e.numel)
                if hi > lo and t is not None:
                    pieces.append(t[lo - e.offset:hi - e.offset])
                    offsets.append(q * n + lo - a)
        _pack(out[:n * self.world], offsets, pieces)

    def views(self, full: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's shaped view of a full unit buffer."""
        return [full[e.offset:e.offset + e.numel].view(e.shape) for e in self.entries]

    def table(self) -> list[tuple[str, int, int, tuple[int, ...]]]:
        """The offsets table: (name, offset, numel, shape) per parameter."""
        return [(e.name, e.offset, e.numel, e.shape) for e in self.entries]
