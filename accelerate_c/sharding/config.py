# accelerate_c/sharding/config.py: ShardedConfig, the configuration of the sharded engine, read once from its
# sources: the user's FullyShardedDataParallelPlugin or DeepSpeedPlugin (kwargs handlers keyed by class name,
# put there by the Accelerator; either may have been built from FSDP_* / ACCELERATE_DEEPSPEED_* variables,
# which the launcher sets from YAML and flags), then ACCELERATE_C_* variables (transport, fused optimizer).
# Both faces map onto the same fields: ZeRO stage 0/1/2/3 == NO_SHARD / (optimizer only) / SHARD_GRAD_OP /
# FULL_SHARD; HYBRID_SHARD(_ZERO2) is `hybrid`.
# Not for: the plugin classes (utils/dataclasses.py) or DeepSpeed JSON parsing (sharding/deepspeed_json.py).
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch

from ..strategies.ddp import DDPConfig

FSDP_STAGES = {"NO_SHARD": 0, "SHARD_GRAD_OP": 2, "FULL_SHARD": 3, "HYBRID_SHARD": 3, "HYBRID_SHARD_ZERO2": 2}


@dataclass(frozen=True)
class ShardedConfig(DDPConfig):
    """The sharded engine's settings (both faces). Inherits DDP's transport/bucket/buffer fields: stage 0 is
    data parallelism."""

    face: str = "fsdp"                        # "fsdp" | "deepspeed": which plugin configured the run
    stage: int = 3                            # 0 NO_SHARD, 1 optimizer state, 2 + gradients, 3 + parameters
    hybrid: bool = False                      # HYBRID_SHARD: shard within a host, replicate across hosts
    reshard_after_forward: bool = True        # stage 3: free a unit's gathered parameters after its forward
    auto_wrap_policy: str = "no_wrap"         # "transformer_based_wrap" | "size_based_wrap" | "no_wrap"
    transformer_layer_cls: tuple[str, ...] = ()  # class names that start a unit (transformer_based_wrap)
    min_num_params: int = 100_000_000         # size_based_wrap threshold
    ignored_modules: tuple[Any, ...] = ()     # modules (or one regex string) kept out of every unit
    param_dtype: Optional[torch.dtype] = None   # mixed_precision_policy: compute copy of the parameters
    reduce_dtype: Optional[torch.dtype] = None  # gradient reduction dtype
    buffer_dtype: Optional[torch.dtype] = None  # buffers' dtype
    activation_checkpointing: bool = False    # per unit, non-reentrant
    cpu_offload: bool = False                 # params/optimizer state offloaded to CPU (a no-op on CPU runs)
    state_dict_type: str = "SHARDED_STATE_DICT"   # or "FULL_STATE_DICT"
    cpu_ram_efficient_loading: bool = False   # materialise a meta-device model shard by shard
    sync_module_states: bool = False          # broadcast rank 0's module states at prepare
    zero3_init: bool = False                  # DeepSpeed's zero3_init_flag (construction under sharding)
    gradient_clipping: Optional[float] = None  # DeepSpeed's gradient_clipping (applied in the step)
    gradient_accumulation_steps: Optional[int] = None  # DeepSpeed's value, checked against the Accelerator's
    deepspeed_config: Mapping[str, Any] = field(default_factory=dict)  # the resolved JSON ("auto" filled at prepare)

    @classmethod
    def _fields(cls, handlers: Mapping[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
        fields = super()._fields(handlers, env)
        plugin = handlers.get("FullyShardedDataParallelPlugin")
        if plugin is not None:
            fields.update(fields_from_fsdp_plugin(plugin))
        plugin = handlers.get("DeepSpeedPlugin")
        if plugin is not None:
            fields.update(fields_from_deepspeed_plugin(plugin))
        return fields


def fields_from_fsdp_plugin(plugin: Any) -> dict[str, Any]:
    """ShardedConfig fields from a FullyShardedDataParallelPlugin (minimal: the faces work completes this)."""
    strategy = getattr(plugin, "sharding_strategy", None)
    name = getattr(strategy, "name", strategy)
    fields: dict[str, Any] = {"face": "fsdp"}
    if isinstance(name, str) and name.upper() in FSDP_STAGES:
        fields["stage"] = FSDP_STAGES[name.upper()]
        fields["hybrid"] = name.upper().startswith("HYBRID")
    rs = getattr(plugin, "reshard_after_forward", None)
    if isinstance(rs, bool):
        fields["reshard_after_forward"] = rs
    return fields


def fields_from_deepspeed_plugin(plugin: Any) -> dict[str, Any]:
    """ShardedConfig fields from a DeepSpeedPlugin (minimal: the faces work completes this)."""
    stage = getattr(plugin, "zero_stage", None)
    fields: dict[str, Any] = {"face": "deepspeed", "stage": 2 if stage is None else int(stage),
                              "reshard_after_forward": True}
    clip = getattr(plugin, "gradient_clipping", None)
    if clip is not None:
        fields["gradient_clipping"] = float(clip)
    return fields
