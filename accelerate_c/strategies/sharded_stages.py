# accelerate_c/strategies/sharded_stages.py: the sharded strategy (strategies/sharded.py) over pipeline stages: ZeRO-1
# / ZeRO-2 (DeepSpeed zero_stage 1/2, FSDP SHARD_GRAD_OP / HYBRID_SHARD_ZERO2, FSDP2 reshard_after_forward=False)
# over the data-parallel group of each stage (pp_size > 1). The stage's ShardEngine is built over the user's pruned
# model (the PipelineEngine's `.module`: logical names, what unwrap_model gives); the pipeline's call runs its
# micro-batches' backward passes under no_sync and the data-parallel wrapper then reduces what the units hold once
# (ShardEngine.sync_held). Checkpoints: the engine's slices laid out over the stage's data-parallel ranks, written
# only by the pipeline rank that owns each logical tensor, the other stages' tensors listed empty
# (pipeline/holdings.py). What is refused, at construction: ZeRO-3 / FULL_SHARD (parameters sharded) over a stage,
# and tensor parallelism with ZeRO over stages.
# Not for: the engine (sharding/), the pipeline (pipeline/), the unsharded strategies over stages (ddp.py).
from __future__ import annotations

from typing import Any, Optional

import torch


def refuse_unsupported(stage: int, face: str, layout: Any) -> None:
    """With pp_size > 1: a NotImplementedError naming what is not implemented over pipeline stages and what works."""
    if layout.pp <= 1 or stage == 0:
        return
    what = ("DeepSpeed ZeRO stage 3" if face == "deepspeed" else
            "FSDP FULL_SHARD / HYBRID_SHARD (FSDP2 reshard_after_forward=True)")
    if stage == 3:
        raise NotImplementedError(
            f"{what} over a pipeline stage's data-parallel group (pp_size={layout.pp}) is not implemented in "
            "accelerate_c: the parameters of a stage stay whole. Use ZeRO stage 1 or 2 (DeepSpeedPlugin(zero_stage=1 "
            "or 2), FSDP sharding_strategy='SHARD_GRAD_OP' or 'HYBRID_SHARD_ZERO2', FSDP2 reshard_after_forward="
            "False), or dp_replicate_size (DDP over each stage)")
    if layout.tp > 1:
        raise NotImplementedError(
            f"ZeRO stage {stage} over pipeline stages with tensor parallelism (tp_size={layout.tp}, "
            f"pp_size={layout.pp}) is not implemented in accelerate_c: use dp_replicate_size (DDP over each "
            "stage's TP slices) with tp x pp, or ZeRO 1/2 over pipeline stages without tensor parallelism")


def attach(stage: torch.nn.Module, engine: Any, sharded: Any) -> Any:
    """Before each training call of the stage (it runs backward passes, as strategies/sharded.py's backward prepares
    one): a pass that raised midway forgotten, stage 1's averages moved aside, attached gradients dropped. Returns
    the hook's handle."""

    def before(module: torch.nn.Module, args: tuple) -> None:
        if module.training and torch.is_grad_enabled():
            engine.reset_pass()
            sharded.forget_attached()
    handle = stage.register_forward_pre_hook(before)
    stage.parameters_moved()  # (the engine put the parameters into its flat buffers)
    return handle


def pipeline(model: torch.nn.Module) -> Optional[Any]:
    from ..pipeline.holdings import pipeline_of
    return pipeline_of(model)


def model_slices(model: torch.nn.Module, engine: Any, layout: Any) -> list:
    """The stage's engine slices (whole tensors balanced over the stage's data-parallel ranks) as slices of the
    logical model."""
    from ..pipeline.holdings import on_stage
    from ..sharding.checkpoint import engine_model_slices
    dp = layout.dim("dp")
    return on_stage(pipeline(model), layout, engine_model_slices(engine, dp.rank, dp.size))


def optimizer_layout(model: torch.nn.Module, engine: Any, sharded: Any, optimizer: Any, layout: Any) -> list:
    from ..pipeline.holdings import on_stage
    from ..sharding.checkpoint import engine_optimizer_layout
    dp = layout.dim("dp")
    return on_stage(pipeline(model), layout, engine_optimizer_layout(engine, sharded, optimizer, dp.rank, dp.size))


def full_state_dict(model: torch.nn.Module, engine: Any, layout: Any, dtype: Optional[torch.dtype]) -> dict:
    """The logical model on every rank: the stage's full tensors (every rank keeps them), then each logical tensor
    broadcast from its owning stage (collective over the data-parallel and pipeline groups)."""
    from ..pipeline.holdings import full_state_dict as logical
    from ..runtime.models import extract_model_from_parallel
    from ..sharding.statedict import full_state_dict as stage_dict
    held = stage_dict(extract_model_from_parallel(model), engine, True, dtype)
    return logical(pipeline(model), layout, held=held, dtype=dtype)
