# accelerate_c/sharding/statedict.py: the full state dict of a model under the sharded strategy, as
# `Accelerator.get_state_dict` hands it out (strategies/sharded.py picks, per face, who keeps it and in which dtype).
# Every rank takes part (the gather is collective under stage 3 and under a compute copy), one unit at a time: a
# rank that does not keep the dict holds at most one gathered unit on top of its shards (the engine's
# gathered_units scratch), a rank that keeps it copies each unit out before the next one is gathered. What is kept
# are fresh CPU tensors (HF: FSDP's offload_to_cpu / cpu_offload, DeepSpeed's consolidated dict on the CPU), floating
# ones in `dtype` when one is given, a tensor registered under two names (tied weights) copied once and shared.
# Not for: the writing of model files (checkpointing/model.py streams from the shards and never gathers) or which
# face gets what (the strategy).
from __future__ import annotations

from typing import Any, Optional

import torch


def _cpu_copy(t: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    dt = dtype if dtype is not None and t.is_floating_point() else t.dtype
    return t.detach().to(device="cpu", dtype=dt, copy=True)


def full_state_dict(model: torch.nn.Module, engine: Optional[Any], keep: bool,
                    dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
    """`model`'s state dict (the user module, its own names) with full logical values: the fp32 masters of the unit
    parameters and of frozen parameters under a compute copy, buffers in their original dtype (FSDP1's
    buffer_dtype undone). `engine`: the model's ShardEngine, None for a model held whole (stage 0). keep=False:
    take part in the gather and return {}."""
    sd = model.state_dict(keep_vars=True)
    copies: dict[int, torch.Tensor] = {}  # id(tensor as registered) -> its copy (tied names share it)
    if engine is not None:
        for u, values in engine.gathered_units():
            if keep:
                for e, v in zip(u.entries, values):
                    copies[id(e.param)] = _cpu_copy(v, dtype)
    if not keep:
        return {}
    from .buffers import full_precision
    out: dict[str, torch.Tensor] = {}
    for k, t in sd.items():
        if id(t) not in copies:
            if engine is not None:
                t = engine.mixed.fp32(t) if engine.mixed is not None else t  # (a frozen parameter's fp32 value)
                t = full_precision(engine.buffer_orig, t)
            copies[id(sd[k])] = _cpu_copy(t, dtype)
        out[k] = copies[id(sd[k])]
    return out
