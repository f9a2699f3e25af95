# accelerate_c/tensor_parallel/logical.py: a TP rank's holdings in logical terms, for the strategies that describe
# them to checkpoints (checkpointing/slices.py) and hand state dicts to user code. A TP slice is a block of its
# logical tensor along one dimension (TPSlice); a contiguous range of the local (sliced) tensor is one range of the
# logical tensor for a dimension-0 block, else one range per row of the dimensions before the block. Whatever a
# data-parallel strategy holds of the local tensors (whole, or a shard's piece of the flattened local tensor) is
# mapped through that: logical_slices (model), logical_slots (optimizer), gather_slices (full state dicts).
# Not for: the engine (apply.py), the checkpoint files (checkpointing/).
from __future__ import annotations

import dataclasses
import math
from typing import Any, Collection, Mapping, Optional

import torch

from ..checkpointing.layout import whole_param_slots
from ..checkpointing.slices import ParamSlot, TensorSlice
from .apply import TPSlice
from .comm import from_blocks


def segments(spec: TPSlice, lo: int, hi: int) -> list[tuple[int, int, int]]:
    """Elements [lo, hi) of the row-major local tensor of the block `spec` as (logical start, offset from lo, count)
    ranges of the logical tensor."""
    inner = math.prod(spec.shape[spec.dim + 1:])
    width, full = spec.length * inner, spec.shape[spec.dim] * inner
    if spec.dim == 0 or width == full:
        return [(spec.start * inner + lo, 0, hi - lo)] if hi > lo else []
    out, i = [], lo
    while i < hi:
        r, c = divmod(i, width)
        n = min(width - c, hi - i)
        out.append((r * full + spec.start * inner + c, i - lo, n))
        i += n
    return out


def specs_by_name(model: torch.nn.Module) -> dict[str, TPSlice]:
    """{state-dict name: TPSlice} of the model's TP slices (every name a tied tensor is registered by)."""
    return {k: t._tp_slice for k, t in model.state_dict(keep_vars=True).items()
            if getattr(t, "_tp_slice", None) is not None}


def logical_slices(slices: list[TensorSlice], specs: Mapping[str, TPSlice], owner: bool,
                   tp_first: bool = True, pieces: Collection[str] = ()) -> list[TensorSlice]:
    """A strategy's model slices of the LOCAL tensors as slices of the logical ones: a slice of a TP block becomes one
    slice per logical range. `pieces`: the names the strategy cut into pieces itself (a sharded engine's unit
    parameters; it chose their writers). A TP block held whole by the strategy (it chose one writer among every rank)
    is written by the `owner` ranks instead (one data-parallel replica: the other TP ranks hold other blocks); a
    replicated tensor cut into pieces (every TP rank holds the same piece) is written by the first TP rank (`tp_first`)
    only."""
    out: list[TensorSlice] = []
    for s in slices:
        spec = specs.get(s.name)
        if spec is None:
            if s.name in pieces and not tp_first and s.owner:
                s = TensorSlice(s.name, s.shape, s.dtype, s.start, s.data, owner=False)
            out.append(s)
            continue
        mine = s.owner if s.name in pieces else owner
        segs = segments(spec, s.start, s.start + s.numel) or [(0, 0, 0)]  # an empty piece is still listed
        out += [TensorSlice(s.name, tuple(spec.shape), s.dtype, start, s.data[off:off + n], owner=mine)
                for start, off, n in segs]
    return out


def logical_slots(slots: list[ParamSlot], specs: Mapping[str, TPSlice], owner: bool, tp_first: bool = True,
                  pieces: Collection[str] = ()) -> list[ParamSlot]:
    """The same for the optimizer's ParamSlots (a TP block's slot keeps its local shape; its ranges become
    segments)."""
    out: list[ParamSlot] = []
    for s in slots:
        spec = specs.get(s.name)
        if spec is None:
            if s.name in pieces and not tp_first and s.owner:
                s = dataclasses.replace(s, owner=False)
            out.append(s)
            continue
        seg = tuple((start, n) for start, _, n in segments(spec, s.start, s.start + s.numel))
        out.append(ParamSlot(s.index, s.name, tuple(spec.shape), seg[0][0] if seg else 0, s.numel, s.local_shape,
                             owner=s.owner if s.name in pieces else owner, segments=seg or None))
    return out


def optimizer_layout(optimizer: torch.optim.Optimizer, model: torch.nn.Module, rank: int, world: int,
                     owner: bool) -> list[ParamSlot]:
    """The optimizer's parameters (held whole: one process or DDP over the TP slices) as ParamSlots of the logical
    model: a TP block written by the `owner` ranks (one data-parallel replica), a replicated parameter by one of the
    `world` ranks."""
    whole = whole_param_slots(optimizer, model, rank, world)
    return logical_slots(whole, specs_by_name(model), owner)


def gather_slices(sd: dict[str, torch.Tensor], specs: Mapping[str, TPSlice], group: Any,
                  keep: bool = True) -> Optional[dict[str, torch.Tensor]]:
    """A state dict of LOCAL tensors (every TP rank's, in the same order) with each TP block all-gathered over the
    TP `group` into its logical tensor (collective over the group); None where not `keep`."""
    out: dict[str, torch.Tensor] = {}
    for k, t in sd.items():
        spec = specs.get(k)
        if spec is not None:
            local = t.detach().contiguous()
            buf = local.new_empty((group.size, *local.shape))
            group.all_gather(buf.view(-1), local.view(-1))
            t = from_blocks(buf, spec.dim).contiguous()
        out[k] = t
    return out if keep else None
