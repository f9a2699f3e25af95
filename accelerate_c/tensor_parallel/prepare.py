# accelerate_c/tensor_parallel/prepare.py: what Accelerator.prepare does to a model under tp_size > 1 (through the
# façade's one seam, facade/parallel.py apply_model_parallelism): slice it over the layout's TP group with its plan,
# materialise a meta model slice by slice, make the replicated tensors equal across the TP group.
# Not for: the engine itself (apply.py and the layers), what a TP rank holds in logical terms for checkpoints
# (logical.py), data parallelism (the strategies).
from __future__ import annotations

from typing import Any

from torch import nn

from ..sharding.materialize import has_meta, materialize_model
from .apply import apply_tensor_parallel
from .state import broadcast_replicated, init_rng


def prepare_tensor_parallel(model: nn.Module, layout: Any) -> nn.Module:
    """Slices `model` in place over the layout's TP group (every rank of it calls this on the same logical model):
    the plan is the user's `model.tp_plan` when set ({module-name pattern: style}), else transformers' own; sequence
    parallelism from the layout (MegatronLMPlugin(sequence_parallelism=True)). A model built on the meta device gets
    only its slices allocated and initialised (a per-rank random stream for the slices, the shared one for the
    replicated tensors), then TP rank 0's replicated tensors everywhere. Returns the model."""
    if getattr(model, "_tp_state", None) is not None:
        return model
    plan = getattr(model, "tp_plan", None)
    apply_tensor_parallel(model, layout.tp_group, plan=dict(plan) if plan else None,
                          sequence_parallel=layout.sequence_parallel)
    if has_meta(model):
        materialize_model(model, "cpu", around_init=init_rng(model))
        broadcast_replicated(model)
    return model

