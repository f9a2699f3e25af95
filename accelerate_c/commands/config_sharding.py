# The two sharding blocks of a config file, `fsdp_config` (distributed_type: FSDP) and `deepspeed_config`
# (distributed_type: DEEPSPEED), with HF 1.15's keys, `launch` flags (--fsdp_*, --zero_stage, ...; booleans take a
# value, `--fsdp_offload_params true`, as in HF) and the variables HF's launcher hands the ranks (FSDP_*,
# ACCELERATE_DEEPSPEED_*), which the plugins' __post_init__ read. FSDP's defaults are HF's launcher defaults, so a
# bare `--use_fsdp` gives the ranks the same variables as HF's.
# Not for: the plugins (base/fsdp_plugin.py, deepspeed/plugin.py) or the generic block machinery
# (config_blocks.py).
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .config_blocks import _Block, env_str, setting

_FSDP_ENV_NAMES = {"transformer_layer_cls_to_wrap": "FSDP_TRANSFORMER_CLS_TO_WRAP"}


@dataclass
class FSDPBlock(_Block):
    """`fsdp_config`: keys written `fsdp_`-prefixed (HF's `config`); both spellings are read."""
    PREFIX = "fsdp_"
    FILE_PREFIX = True
    VALUED_BOOLS = True
    LEGACY = {"fsdp_backward_prefetch_policy": "backward_prefetch", "backward_prefetch_policy": "backward_prefetch"}
    version: int = setting(1, "int", "FSDP version; 1 is mapped to FSDP2 as `accelerate to-fsdp2` maps it",
                           choices=(1, 2))
    sharding_strategy: Any = setting("FULL_SHARD", "scalar", "FULL_SHARD | SHARD_GRAD_OP | NO_SHARD | HYBRID_SHARD | "
                                     "HYBRID_SHARD_ZERO2 (or 1-5); read with fsdp_version 1")
    reshard_after_forward: Any = setting("true", "scalar", "FSDP2: true (ZeRO-3) | false (ZeRO-2); FSDP1: a "
                                         "sharding strategy name")
    offload_params: bool = setting(False, "bool", "offload parameters and gradients to CPU (a no-op on CPU runs)")
    min_num_params: int = setting(100_000_000, "int", "size_based_wrap: the smallest unit, in parameters",
                                  bounds=(0, None))
    auto_wrap_policy: str | None = setting(None, "str", "TRANSFORMER_BASED_WRAP | SIZE_BASED_WRAP | NO_WRAP",
                                           norm=str.upper)
    transformer_layer_cls_to_wrap: str | None = setting(None, "str", "transformer_based_wrap: comma-separated "
                                                        "layer class names (default: model._no_split_modules)")
    backward_prefetch: str | None = setting(None, "str", "FSDP1 only (dropped under FSDP2)", norm=str.upper)
    state_dict_type: str | None = setting(None, "str", "FULL_STATE_DICT | SHARDED_STATE_DICT", norm=str.upper)
    forward_prefetch: bool = setting(False, "bool", "FSDP1 only (dropped under FSDP2)")
    use_orig_params: bool = setting(True, "bool", "FSDP1 only (FSDP2 always uses the original parameters)")
    cpu_ram_efficient_loading: bool = setting(True, "bool", "build the model shard by shard (rank 0 loads weights)")
    sync_module_states: bool = setting(True, "bool", "broadcast rank 0's module states at prepare")
    activation_checkpointing: bool = setting(False, "bool", "recompute each unit's activations in backward")
    activation_checkpointing_offload: bool = setting(False, "bool", "FSDP2: keep checkpointed inputs in CPU memory")
    ignored_modules: str | None = setting(None, "str", "regex of module names kept out of every unit")

    @classmethod
    def env_of(cls, name: str) -> str:
        return _FSDP_ENV_NAMES.get(name, "FSDP_" + name.upper())

    def check(self, key: str) -> None:
        # HF's launcher rule (its strings "false" are truthy, so it fires for a false read from the file only)
        if self.cpu_ram_efficient_loading and self.sync_module_states is False:
            raise ValueError(f"config key `{key}.fsdp_sync_module_states`: must be true when "
                             "fsdp_cpu_ram_efficient_loading is true (When using `--fsdp_cpu_ram_efficient_loading` "
                             "set `--fsdp_sync_module_states` to `True`)")


_DS_ENV_NAMES = {"zero_stage": "ACCELERATE_DEEPSPEED_ZERO_STAGE",
                 "offload_optimizer_device": "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
                 "offload_param_device": "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
                 "offload_optimizer_nvme_path": "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH",
                 "offload_param_nvme_path": "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH",
                 "zero3_init_flag": "ACCELERATE_DEEPSPEED_ZERO3_INIT",
                 "zero3_save_16bit_model": "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL",
                 "deepspeed_config_file": "ACCELERATE_DEEPSPEED_CONFIG_FILE",
                 "deepspeed_moe_layer_cls_names": "ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES",
                 "gradient_accumulation_steps": "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
                 "gradient_clipping": "ACCELERATE_GRADIENT_CLIPPING"}
_DEVICES = ("none", "cpu", "nvme")


@dataclass
class DeepSpeedBlock(_Block):
    """`deepspeed_config`: HF's keys; flags without a prefix (--zero_stage, --offload_param_device, ...)."""
    PREFIX = ""
    VALUED_BOOLS = True
    FILE_ONLY = ("gradient_accumulation_steps", "gradient_clipping", "deepspeed_multinode_launcher")  # flags: top level
    zero_stage: int | None = setting(None, "int", "ZeRO stage 0-3 (default 2)", choices=(0, 1, 2, 3))
    deepspeed_config_file: str | None = setting(None, "str", "DeepSpeed JSON config (the fields here that it "
                                                "covers must then be left out)")
    offload_optimizer_device: str | None = setting(None, "str", "none | cpu (a no-op on CPU runs); nvme is "
                                                   "refused", choices=_DEVICES, norm=str.lower)
    offload_param_device: str | None = setting(None, "str", "none | cpu (a no-op on CPU runs); nvme is refused",
                                               choices=_DEVICES, norm=str.lower)
    offload_optimizer_nvme_path: str | None = setting(None, "str", "nvme offload path (nvme is refused)")
    offload_param_nvme_path: str | None = setting(None, "str", "nvme offload path (nvme is refused)")
    zero3_init_flag: bool | None = setting(None, "bool", "ZeRO-3: build the model shard by shard")
    zero3_save_16bit_model: bool | None = setting(None, "bool", "ZeRO-3: save the model gathered in 16 bit")
    deepspeed_moe_layer_cls_names: str | None = setting(None, "str", "MoE leaf classes (refused: not supported)")
    gradient_accumulation_steps: int | None = setting(None, "int", "GA steps (file key; the flag is top-level)",
                                                      bounds=(1, None))
    gradient_clipping: float | None = setting(None, "float", "clip value (file key; the flag is top-level)",
                                                bounds=(0, None))
    deepspeed_multinode_launcher: str | None = setting(None, "str", "accepted, no effect: every machine runs "
                                                       "`accelerate_c launch` itself (HF's 'standard')")

    @classmethod
    def env_of(cls, name: str) -> str:
        return _DS_ENV_NAMES.get(name, "")

    def env(self) -> dict[str, str]:
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {self.env_of(k): env_str(v) for k, v in values.items() if v is not None and self.env_of(k)}
