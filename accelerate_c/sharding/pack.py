# accelerate_c/sharding/pack.py: the engine's copy-in and the switch between its C paths and plain torch copies.
# pack() fills a flat buffer with tensors at element offsets, converting to the buffer's dtype, zeroing the rest
# (gaps, padding): one C call (csrc/ops/pack.c, GIL released, threaded for big units) where every tensor is a
# contiguous CPU float tensor; one launch of accelerate_c._C_cuda's multi-tensor copy (optim/cuda.py) where
# every tensor is a contiguous float tensor on out's CUDA device and the extension is loaded; torch copies
# otherwise. ACCELERATE_C_SHARD_KERNELS=0 selects the torch copies
# everywhere, and the separate master -> compute cast after the step (benchmarks/zero_step.py compares the two).
# Not for: the layout (flat.py) or when buffers are packed (engine.py, zero3.py).
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .. import _C
from ..base import settings
from ..optim import cuda
from ..base.dtypes import C_FLOAT_INPUTS

_FLOATS = C_FLOAT_INPUTS


def kernels_enabled() -> bool:
    """False when ACCELERATE_C_SHARD_KERNELS=0: the engine packs and casts with torch copies (the baseline)."""
    return settings.get("SHARD_KERNELS")


def _c_ok(out: torch.Tensor, tensors: Sequence[Optional[torch.Tensor]]) -> bool:
    if out.device.type != "cpu" or out.dtype not in _FLOATS or not out.is_contiguous():
        return False
    return all(t is None or (t.device.type == "cpu" and t.dtype in _FLOATS and t.is_contiguous()) for t in tensors)


@torch.no_grad()
def pack(out: torch.Tensor, offsets: Sequence[int], tensors: Sequence[Optional[torch.Tensor]]) -> None:
    """out (1-D) = each tensor (flattened; None = zeros) at its offset, in out's dtype; every other element 0.
    Offsets increasing, pieces not overlapping and inside `out` (the C path checks; ValueError names the piece)."""
    if kernels_enabled() and _c_ok(out, tensors):
        _C.pack(out, tensors, offsets, torch.get_num_threads())
        return
    if kernels_enabled() and out.is_cuda and cuda.serves_floats([out, *tensors]):
        _pack_cuda(out, offsets, tensors)
        return
    end = 0
    for off, t in zip(offsets, tensors):
        if off > end:
            out[end:off].zero_()
        if t is not None:
            out[off:off + t.numel()].copy_(t.reshape(-1))
            end = off + t.numel()
    if out.numel() > end:
        out[end:].zero_()


def _pack_cuda(out: torch.Tensor, offsets: Sequence[int], tensors: Sequence[Optional[torch.Tensor]]) -> None:
    """pack() on one CUDA device: the gaps zeroed by torch, every piece copied (converted) in one launch."""
    srcs, dsts, end = [], [], 0
    for off, t in zip(offsets, tensors):
        if off < end or (t is not None and off + t.numel() > out.numel()):
            raise ValueError(f"pack: the piece at offset {off} overlaps the previous one or runs past the buffer's "
                             f"{out.numel()} elements")
        if off > end:
            out[end:off].zero_()
        if t is not None and t.numel():
            srcs.append(t)
            dsts.append(out[off:off + t.numel()])
            end = off + t.numel()
        else:
            end = max(end, off)
    if out.numel() > end:
        out[end:].zero_()
    if srcs:
        cuda.multi_copy(srcs, dsts)
