# accelerate_c/sharding/checkpoint.py: what one rank of the sharded engine holds, described for universal
# checkpoints (checkpointing/slices.py): each unit parameter as its piece of this rank's fp32 master shard (a
# TensorSlice / ParamSlot cut here), buffers, replicated and frozen parameters as tensors held whole.
# checkpointing/layout.py computes the layout from that (which rank writes each whole tensor); the strategy
# (strategies/sharded.py model_slices / optimizer_layout) picks the engine.
# Not for: the files (checkpointing/) or the full state dict handed to user code (statedict.py).
from __future__ import annotations

from typing import Any

import torch

from ..checkpointing.layout import model_layout, optimizer_slots
from ..checkpointing.slices import ParamSlot, TensorSlice


def engine_model_slices(engine: Any, rank: int, world: int) -> list[TensorSlice]:
    """The engine's model under every name each tensor is registered by, in state-dict order. Every logical tensor
    is listed on every rank, an empty piece included (the checkpoint loader checks names); HYBRID_SHARD: every
    host holds the shards, the first one writes them. Frozen parameters under a compute dtype: their fp32 values."""
    sd = engine.model.state_dict(keep_vars=True)
    byname = dict(engine.model.named_parameters(remove_duplicate=False))
    held: dict[str, Any] = {}
    for k, t in sd.items():
        if id(byname.get(k)) not in engine.index:
            held[k] = engine.mixed.fp32(t) if engine.mixed is not None else t
            continue
        i = engine.index[id(byname[k])]
        e, u = engine.entries[i], engine.unit_of[i]
        a, b = u.shard_slice(e)
        held[k] = TensorSlice(k, e.shape, torch.float32, e.lo, engine.master_shard(u)[a:b],
                              owner=engine.comm.replica == 0)
    return model_layout(held, rank, world)


def engine_optimizer_layout(engine: Any, sharded: Any, optimizer: torch.optim.Optimizer, rank: int,
                            world: int) -> list[ParamSlot]:
    """Each parameter of the optimizer `sharded` (optim_shard.py) re-pointed: a shard piece (start, numel, local
    1-D shape) or a whole replicated parameter of the engine's model."""
    inner = getattr(optimizer, "optimizer", optimizer)
    params = [p for g in inner.param_groups for p in g["params"]]
    names = {id(p): n for n, p in engine.model.named_parameters()}
    held: list[Any] = []
    for i, p in enumerate(params):
        hit = sharded.slot(p)
        if hit is not None:
            e = hit[0]
            held.append(ParamSlot(i, e.name, e.shape, e.lo, e.piece_numel, (e.piece_numel,),
                                  owner=engine.comm.replica == 0))
        elif id(p) in names:
            held.append(names[id(p)])
        else:
            raise ValueError(f"optimizer parameter {i} is not a parameter of the model being checkpointed")
    return optimizer_slots(params, held, rank, world)
