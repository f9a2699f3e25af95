# accelerate_c/sharding/recompute.py: activation checkpointing per unit of a ShardEngine (FSDP's
# activation_checkpointing): each unit's forward keeps only its inputs and is recomputed in backward; fp8 layers
# replay the forward's scales.
# Not for: when units are gathered (zero3.py) or the engine itself (engine.py).
from __future__ import annotations

from typing import Any

import torch

from ..precision.fp8 import recompute_context_fn


def checkpoint_units(units: list, restore: list) -> None:
    """Activation checkpointing per unit (not the root), non-reentrant: each unit's forward keeps only its
    inputs and is recomputed in backward. The recomputation calls the unit's own forward, not the module, so
    no forward hook runs again: under stage 3 the unit is already gathered by its pre-backward hook."""
    from torch.utils.checkpoint import checkpoint

    for u in units:
        if not u.name:
            continue
        inner = u.module.forward
        fn = recompute_context_fn(u.module)  # fp8 layers: the recomputation replays the forward's scales
        ctx = {"context_fn": fn} if fn is not None else {}

        def forward(*args: Any, _inner: Any = inner, _ctx: dict = ctx, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return _inner(*args, **kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, **_ctx, **kwargs)
        u.module.forward = forward
        restore.append((u.module, inner))
