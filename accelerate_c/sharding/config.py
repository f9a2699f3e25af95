# accelerate_c/sharding/config.py: ShardedConfig, the configuration of the sharded engine, read once from its
# sources: the user's FullyShardedDataParallelPlugin or DeepSpeedPlugin (kwargs handlers keyed by class name,
# put there by the Accelerator; either may have been built from FSDP_* / ACCELERATE_DEEPSPEED_* variables,
# which the launcher sets from YAML and flags), then ACCELERATE_C_* variables (transport, fused optimizer).
# Both faces map onto the same fields: ZeRO stage 0/1/2/3 == NO_SHARD / (optimizer only) / SHARD_GRAD_OP /
# FULL_SHARD; HYBRID_SHARD(_ZERO2) is `hybrid`.
# Not for: the plugin classes (base/fsdp_plugin.py, deepspeed/plugin.py) or DeepSpeed JSON parsing
# (deepspeed/schema.py).
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import torch

from ..base import settings
from ..deepspeed.schema import communication_dtype, gradient_clipping
from ..ddp.config import DDPConfig

FSDP_STAGES = {"NO_SHARD": 0, "SHARD_GRAD_OP": 2, "FULL_SHARD": 3, "HYBRID_SHARD": 3, "HYBRID_SHARD_ZERO2": 2}


@dataclass(frozen=True)
class ShardedConfig(DDPConfig):
    """The sharded engine's settings (both faces). Inherits DDP's transport/bucket/buffer fields: stage 0 is
    data parallelism."""

    face: str = "fsdp"                        # "fsdp" | "deepspeed": which plugin configured the run
    stage: int = 3                            # 0 NO_SHARD, 1 optimizer state, 2 + gradients, 3 + parameters
    hybrid: bool = False                      # HYBRID_SHARD: shard within a host, replicate across hosts
    reshard_after_forward: bool = True        # stage 3: free a unit's gathered parameters after its forward
    auto_wrap_policy: str = "no_wrap"         # "transformer_based_wrap" | "size_based_wrap" | "no_wrap" | "callable"
    transformer_layer_cls: tuple[str, ...] = ()  # class names that start a unit (transformer_based_wrap)
    min_num_params: int = 100_000_000         # size_based_wrap threshold
    ignored_modules: tuple[Any, ...] = ()     # modules (or one regex string) kept out of every unit
    param_dtype: Optional[torch.dtype] = None   # mixed_precision_policy: compute copy of the parameters
    reduce_dtype: Optional[torch.dtype] = None  # gradient reduction dtype
    buffer_dtype: Optional[torch.dtype] = None  # buffers' dtype
    fp32_module_classes: Optional[tuple[type, ...]] = None  # kept in fp32 under param_dtype (None: BatchNorm)
    activation_checkpointing: bool = False    # per unit, non-reentrant
    cpu_offload: bool = False                 # params/optimizer state offloaded to CPU (a no-op on CPU runs)
    state_dict_type: str = "SHARDED_STATE_DICT"   # or "FULL_STATE_DICT"
    cpu_ram_efficient_loading: bool = False   # materialise a meta-device model shard by shard
    sync_module_states: bool = False          # broadcast rank 0's module states at prepare
    zero3_init: bool = False                  # DeepSpeed's zero3_init_flag (construction under sharding)
    gradient_accumulation_steps: Optional[int] = None  # DeepSpeed's value, checked against the Accelerator's
    deepspeed_config: Mapping[str, Any] = field(default_factory=dict)  # the resolved JSON ("auto" filled at prepare)
    auto_wrap_callable: Optional[Callable[..., Any]] = None  # auto_wrap_policy "callable": the user's policy function
    activation_checkpointing_offload: bool = False  # FSDP2: checkpointed inputs kept in CPU memory (CPU runs: as is)
    staging_mb: float = 8.0                   # ACCELERATE_C_SHARD_STAGING_MB: each gradient staging window

    def with_resolved_deepspeed(self) -> "ShardedConfig":
        """This config with the DeepSpeed fields re-read from `deepspeed_config` after prepare filled its "auto"
        values (gradient_clipping "auto" -> 1.0, GA, reduce_bucket_size, ...); unchanged for the FSDP face."""
        if self.face != "deepspeed":
            return self
        return self.with_deepspeed_json(self.deepspeed_config)

    def with_deepspeed_json(self, config: Mapping[str, Any]) -> "ShardedConfig":
        """The fields a DeepSpeed JSON's "auto" values may hide until prepare, re-read from `config` (the
        strategy's DeepSpeed face calls this after prepare filled them)."""
        return dataclasses.replace(self, **_fields_from_deepspeed_json(config))

    @classmethod
    def _fields(cls, handlers: Mapping[str, Any], env: Optional[Mapping[str, str]]) -> dict[str, Any]:
        fields = super()._fields(handlers, env)
        fields["staging_mb"] = settings.get("SHARD_STAGING_MB", env)
        plugin = handlers.get("FullyShardedDataParallelPlugin")
        if plugin is not None:
            fields.update(fields_from_fsdp_plugin(plugin))
        plugin = handlers.get("DeepSpeedPlugin")
        if plugin is not None:
            fields.update(fields_from_deepspeed_plugin(plugin))
        return fields


def fields_from_fsdp_plugin(plugin: Any) -> dict[str, Any]:
    """ShardedConfig fields from a FullyShardedDataParallelPlugin (base/fsdp_plugin.py, FSDP2 semantics after
    its __post_init__; duck-typed, so HF's own plugin object maps too)."""
    from ..base.fsdp_plugin import RESHARD_OF_STRATEGY, strategy_name
    fields: dict[str, Any] = {"face": "fsdp"}
    strategy = getattr(plugin, "sharding_strategy", None)
    rs = getattr(plugin, "reshard_after_forward", None)
    if strategy is not None:
        name = strategy_name(strategy) if hasattr(strategy, "value") else str(strategy).upper()
        if name not in FSDP_STAGES:
            raise ValueError(f"FullyShardedDataParallelPlugin: sharding_strategy={strategy!r}; allowed: "
                             f"{', '.join(FSDP_STAGES)}")
        fields.update(stage=FSDP_STAGES[name], hybrid=name.startswith("HYBRID"),
                      reshard_after_forward=RESHARD_OF_STRATEGY[name])
    elif isinstance(rs, bool):  # FSDP2: True = FULL_SHARD (ZeRO-3), False = SHARD_GRAD_OP (ZeRO-2), as `to-fsdp2`
        fields.update(stage=3 if rs else 2, reshard_after_forward=rs)
    fields.update(_wrap_fields(plugin))
    ignored = getattr(plugin, "ignored_modules", None)
    if ignored is not None:
        fields["ignored_modules"] = (ignored,) if isinstance(ignored, str) else tuple(ignored)
    policy = getattr(plugin, "mixed_precision_policy", None)
    if policy is not None:
        fields.update(param_dtype=getattr(policy, "param_dtype", None),
                      reduce_dtype=getattr(policy, "reduce_dtype", None),
                      buffer_dtype=getattr(policy, "buffer_dtype", None))
        if hasattr(policy, "_module_classes_to_ignore"):  # FSDP1's MixedPrecision (default: BatchNorm)
            fields["fp32_module_classes"] = tuple(policy._module_classes_to_ignore)
    offload = getattr(plugin, "cpu_offload", None)
    fields["cpu_offload"] = bool(getattr(offload, "offload_params", False)) or type(offload).__name__ == \
        "CPUOffloadPolicy"
    sdt = getattr(plugin, "state_dict_type", None)
    if sdt is not None:
        fields["state_dict_type"] = getattr(sdt, "name", str(sdt)).upper()
    fields["activation_checkpointing"] = bool(getattr(plugin, "activation_checkpointing", False))
    fields["activation_checkpointing_offload"] = bool(getattr(plugin, "activation_checkpointing_offload", False))
    ram = bool(getattr(plugin, "cpu_ram_efficient_loading", False))
    fields["cpu_ram_efficient_loading"] = ram
    # FSDP2 drops sync_module_states: loading rank 0's weights with cpu_ram_efficient_loading implies the broadcast
    fields["sync_module_states"] = bool(getattr(plugin, "sync_module_states", False)) or ram
    return fields


def _wrap_fields(plugin: Any) -> dict[str, Any]:
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy
    policy = getattr(plugin, "auto_wrap_policy", None)
    names = getattr(plugin, "transformer_cls_names_to_wrap", None)
    if isinstance(names, str):
        names = names.split(",")
    if policy is None:
        return {"auto_wrap_policy": "no_wrap"}
    if policy is transformer_auto_wrap_policy:
        return {"auto_wrap_policy": "transformer_based_wrap", "transformer_layer_cls": tuple(names or ())}
    if policy is size_based_auto_wrap_policy:
        n = int(getattr(plugin, "min_num_params", None) or 0)
        # HF: a size-based policy with min_num_params 0 wraps nothing
        if n <= 0:
            return {"auto_wrap_policy": "no_wrap"}
        return {"auto_wrap_policy": "size_based_wrap", "min_num_params": n}
    if isinstance(policy, str):
        return {"auto_wrap_policy": policy.lower()}
    return {"auto_wrap_policy": "callable", "auto_wrap_callable": policy}


def fields_from_deepspeed_plugin(plugin: Any) -> dict[str, Any]:
    """ShardedConfig fields from a DeepSpeedPlugin (deepspeed/plugin.py) and its JSON. Values still "auto"
    are resolved at prepare (deepspeed/prepare.py), which updates `deepspeed_config` in place;
    `ShardedConfig.with_deepspeed_json()` then re-reads the fields that depend on them."""
    config = getattr(plugin, "deepspeed_config", None) or {}
    zero = config.get("zero_optimization", {})
    stage = zero.get("stage", getattr(plugin, "zero_stage", 2))
    fields: dict[str, Any] = {"face": "deepspeed", "stage": int(stage), "reshard_after_forward": True,
                              "deepspeed_config": config, "zero3_init": bool(getattr(plugin, "zero3_init_flag", False)),
                              "cpu_offload": any(zero.get(k, {}).get("device") in ("cpu", "nvme")
                                                 for k in ("offload_optimizer", "offload_param")),
                              "state_dict_type": "SHARDED_STATE_DICT"}
    fields.update(_fields_from_deepspeed_json(config))
    return fields


def _fields_from_deepspeed_json(config: Mapping[str, Any]) -> dict[str, Any]:
    """The fields that "auto" values may still hide until prepare (see ShardedConfig.with_resolved_deepspeed)."""
    zero = config.get("zero_optimization", {})
    # gradient_clipping is StrategyConfig's (every strategy's step applies it); absent or 0: no clipping.
    # stage3_gather_16bit_weights_on_model_save is read by Strategy.saved_weights_dtype (save_model, any strategy)
    fields: dict[str, Any] = {"gradient_clipping": gradient_clipping(config)}
    ga = config.get("gradient_accumulation_steps")
    if isinstance(ga, int) and not isinstance(ga, bool):
        fields["gradient_accumulation_steps"] = ga
    rdt = communication_dtype(config)  # gradients reduced (and the shard gradient kept) in it
    if rdt is not None:
        fields["reduce_dtype"] = rdt
    bucket = zero.get("reduce_bucket_size")
    if isinstance(bucket, (int, float)) and not isinstance(bucket, bool):
        fields["bucket_cap_mb"] = float(bucket) * 4 / 2**20  # DeepSpeed counts elements (fp32: 4 bytes each)
    return fields
