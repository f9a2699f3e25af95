# accelerate_c/pipeline/holdings.py: what one pipeline stage's rank holds, in the logical terms checkpoints and full
# state dicts need. A rank holds its stages' tensors (whole, or its TP blocks under tensor parallelism); every other
# logical tensor is listed as an empty slice (the checkpoint loader checks names against the whole model). A tensor
# is written by one rank: the pipeline rank the engine names (checkpoint_owner: the first holder of a tied weight),
# data-parallel replica 0, and for a tensor replicated over the TP group its TP rank 0 (TP blocks: every TP rank
# its own block). full_state_dict: the logical model on every rank (TP blocks gathered, then each tensor broadcast
# from its owner over the pipeline group).
# Not for: the engine (engine.py), the file format (checkpointing/).
from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Optional

import torch
from torch import nn

from ..checkpointing.layout import optimizer_params, whole_param_slots
from ..checkpointing.slices import ParamSlot, TensorSlice
from ..runtime.models import extract_model_from_parallel


def logical_state(model: nn.Module) -> dict[str, tuple]:
    """{state-dict name: (logical shape (a TP block: the full one), dtype)} of a model, taken before the engine
    prunes it (readable on the meta device)."""
    out = {}
    for k, t in model.state_dict(keep_vars=True).items():
        spec = getattr(t, "_tp_slice", None)
        out[k] = (tuple(spec.shape) if spec is not None else tuple(t.shape), t.dtype)
    return out


def link(engine: nn.Module, model: nn.Module, full_state: dict[str, tuple]) -> None:
    """Records the logical state on the engine and a back-reference from the (pruned) model, which unwrap_model
    returns, to its engine."""
    engine.full_state = full_state
    object.__setattr__(model, "_accelerate_c_pipeline", weakref.ref(engine))


def pipeline_of(model: nn.Module) -> Optional[Any]:
    """The PipelineEngine a prepared model runs in (None outside pipeline parallelism)."""
    ref = getattr(extract_model_from_parallel(model), "_accelerate_c_pipeline", None)
    return ref() if ref is not None else None


def _writes(engine: Any, layout: Any, name: str, tp_block: bool) -> bool:
    return (engine.checkpoint_owner(name) == layout.pp_rank and layout.dp_rank == 0
            and (tp_block or layout.tp_rank == 0))


def stored_name(engine: Any, name: str) -> str:
    """The name a logical tensor is checkpointed under: for a weight tied across stages, its group's first name held
    by the writing rank (checkpoint_owner), the name one process stores it under; `name` otherwise."""
    for names in engine.tied:
        if name in names:
            owner = engine.checkpoint_owner(name)
            return next(n for n in names if owner in {s % engine.p for s in engine.stage_of(n)})
    return name


def _alias(engine: Any, name: str) -> Optional[str]:
    stored = stored_name(engine, name)
    return stored if stored != name else None


def model_slices(engine: Any, layout: Any) -> list[TensorSlice]:
    """This rank's stage as slices of the logical model, every other logical tensor as an empty slice."""
    module = engine.module
    held = module.state_dict(keep_vars=True)
    out: list[TensorSlice] = []
    if layout.tp > 1:
        from ..tensor_parallel.state import tensor_slices
        for s in tensor_slices(module):
            out.append(TensorSlice(s.name, s.shape, s.dtype, s.start, s.data, owner=_writes(engine, layout, s.name,
                                                                                                True)))
    sliced = {s.name for s in out}
    written: set[int] = set()
    for k, t in held.items():
        if k in sliced:
            continue
        mine = _writes(engine, layout, k, False) and id(t) not in written  # tied names: the memory written once
        if mine:
            written.add(id(t))
        out.append(TensorSlice(k, tuple(t.shape), t.dtype, 0, t.detach().reshape(-1), owner=mine,
                               alias=_alias(engine, k)))
    for k, (shape, dtype) in engine.full_state.items():
        if k not in held:
            out.append(TensorSlice(k, shape, dtype, 0, torch.empty(0, dtype=dtype), owner=False))
    return out


def optimizer_layout(engine: Any, layout: Any, optimizer: torch.optim.Optimizer) -> list[ParamSlot]:
    """The optimizer's parameters (this rank's stage only) as ParamSlots of the logical model."""
    slots = whole_param_slots(optimizer, engine.module, 0, 1, "this pipeline stage")
    if layout.tp > 1:
        from ..tensor_parallel.logical import logical_slots, specs_by_name
        slots = logical_slots(slots, specs_by_name(engine.module), owner=True)
    params, out = optimizer_params(optimizer), []
    for s in slots:
        block = getattr(params[s.index], "_tp_slice", None) is not None
        out.append(ParamSlot(s.index, stored_name(engine, s.name), s.shape, s.start, s.numel, s.local_shape,
                             owner=_writes(engine, layout, s.name, block), segments=s.segments))
    return out


def on_stage(engine: Any, layout: Any, items: list) -> list:
    """A stage's own layout (TensorSlices or ParamSlots of the stage's tensors, laid out over its data-parallel
    ranks by another engine, e.g. the sharded one) as a layout of the logical model: a tensor is written only by the
    pipeline rank that owns it (checkpoint_owner: a tied weight's first holder), and for TensorSlices every logical
    tensor of the other stages is listed as an empty slice."""
    slices = bool(items) and isinstance(items[0], TensorSlice)
    out = []
    for s in items:
        owner = s.owner and engine.checkpoint_owner(s.name) == layout.pp_rank
        # a weight tied across stages is stored under one name: a TensorSlice aliases it, a ParamSlot is renamed
        out.append(dataclasses.replace(s, owner=owner, alias=_alias(engine, s.name)) if slices else
                   dataclasses.replace(s, owner=owner, name=stored_name(engine, s.name)))
    if slices:
        held = {s.name for s in items}
        out += [TensorSlice(k, shape, dtype, 0, torch.empty(0, dtype=dtype), owner=False)
                for k, (shape, dtype) in engine.full_state.items() if k not in held]
    return out


def full_state_dict(engine: Any, layout: Any, held: Optional[dict] = None,
                    dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
    """The logical model's state dict on every rank (collective over the TP and pipeline groups). `held`: this
    stage's full tensors when another engine gathered them (the sharded one; default: the stage module's own, TP
    blocks gathered); `dtype`: the dtype of its floating tensors (default: the logical dtype)."""
    import torch.distributed as dist
    module = engine.module
    if held is None and layout.tp > 1:
        from ..tensor_parallel import gather_full_state_dict
        held = gather_full_state_dict(module)
    elif held is None:
        held = {k: t.detach() for k, t in module.state_dict(keep_vars=True).items()}
    pp = layout.dim("pp")
    out = {}
    for k, (shape, dt) in engine.full_state.items():
        dt = dtype if dtype is not None and dt.is_floating_point else dt
        src = engine.checkpoint_owner(k)
        t = held[k].contiguous().clone() if pp.rank == src and k in held else torch.empty(shape, dtype=dt)
        if src == pp.rank and k not in held:  # a tied weight its owner holds under another name
            t = next(held[n] for names in engine.tied if k in names for n in names if n in held).clone()
        dist.broadcast(t, src=pp.ranks[src], group=pp.process_group)
        out[k] = t
    return out
