# accelerate_c/sharding/buffers.py: FSDP1's MixedPrecision.buffer_dtype for the sharded engine. torch's FSDP1 casts
# every floating-point buffer of the root module to buffer_dtype once, before training computes with it (lazy
# init), keeps it there, and gives it back in its original dtype in a full state dict; integer buffers (BatchNorm's
# num_batches_tracked) are left alone. FSDP2's MixedPrecisionPolicy has no buffer_dtype: buffers keep their dtype.
# Not for: parameters (the engine's compute copy, param_dtype) or the state-dict plumbing (strategies/sharded.py).
from __future__ import annotations

from typing import Iterable, Optional

import torch


@torch.no_grad()
def cast_buffers(model: torch.nn.Module, dtype: Optional[torch.dtype],
                 keep: Iterable[torch.nn.Module] = ()) -> dict[int, torch.dtype]:
    """Casts model's floating buffers to `dtype` in place (the module keeps the same buffer objects), except those
    of the modules `keep` (kept in full precision: mixed.py); returns {id(buffer): original dtype} of those it
    changed ({} for dtype None)."""
    if dtype is None:
        return {}
    if not dtype.is_floating_point:
        raise TypeError(f"sharded engine: buffer_dtype={dtype} is not a floating-point dtype")
    orig: dict[int, torch.dtype] = {}
    kept = {id(b) for m in keep for b in m.buffers()}
    for b in model.buffers():
        if b.is_floating_point() and b.dtype != dtype and id(b) not in kept:
            orig[id(b)] = b.dtype
            b.data = b.data.to(dtype)
    return orig


def full_precision(orig: dict[int, torch.dtype], t: torch.Tensor) -> torch.Tensor:
    """A buffer as a full state dict holds it: in its original dtype (a copy) when buffer_dtype changed it."""
    dt = orig.get(id(t))
    return t.detach() if dt is None else t.detach().to(dt)
