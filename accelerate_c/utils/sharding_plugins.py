# accelerate_c/utils/sharding_plugins.py: HF Accelerate's two sharding plugins, FullyShardedDataParallelPlugin
# and DeepSpeedPlugin (same names, fields and defaults as HF 1.15), plus DummyOptim / DummyScheduler. They only
# carry the user's settings; sharding/config.py turns either into the engine's ShardedConfig.
# Not for: the engine (sharding/, strategies/sharded.py).
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from .dataclasses import KwargsHandler


@dataclass
class FullyShardedDataParallelPlugin(KwargsHandler):
    """FSDP settings (HF 1.15 field names). Skeleton: the FSDP_* variable fallbacks and validation come with the
    configuration-faces work."""

    fsdp_version: Optional[int] = None
    sharding_strategy: Any = None
    reshard_after_forward: Any = None
    backward_prefetch: Any = None
    mixed_precision_policy: Any = None
    auto_wrap_policy: Any = None
    cpu_offload: Any = None
    ignored_modules: Any = None
    state_dict_type: Any = None
    state_dict_config: Any = None
    optim_state_dict_config: Any = None
    limit_all_gathers: bool = True
    use_orig_params: Optional[bool] = None
    param_init_fn: Any = None
    sync_module_states: Optional[bool] = None
    forward_prefetch: Optional[bool] = None
    activation_checkpointing: Optional[bool] = None
    cpu_ram_efficient_loading: Optional[bool] = None
    transformer_cls_names_to_wrap: Optional[list] = None
    min_num_params: Optional[int] = None


@dataclass
class DeepSpeedPlugin(KwargsHandler):
    """DeepSpeed/ZeRO settings (HF 1.15 field names); DeepSpeed itself is never imported. Skeleton: the
    ACCELERATE_DEEPSPEED_* fallbacks, the JSON config and its "auto" values come with the configuration-faces
    work."""

    hf_ds_config: Any = None
    gradient_accumulation_steps: Any = None
    gradient_clipping: Any = None
    zero_stage: Optional[int] = None
    is_train_batch_min: bool = True
    offload_optimizer_device: Optional[str] = None
    offload_param_device: Optional[str] = None
    offload_optimizer_nvme_path: Optional[str] = None
    offload_param_nvme_path: Optional[str] = None
    zero3_init_flag: Optional[bool] = None
    zero3_save_16bit_model: Optional[bool] = None
    transformer_moe_cls_names: Optional[str] = None
    enable_msamp: Optional[bool] = None
    msamp_opt_level: Optional[str] = None
