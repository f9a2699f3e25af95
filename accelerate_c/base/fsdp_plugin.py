# accelerate_c/base/fsdp_plugin.py: HF Accelerate's FullyShardedDataParallelPlugin (HF 1.15 field names,
# defaults, FSDP_* variable fallbacks and validation; FSDP2 semantics, a version-1 setting is mapped the way
# `accelerate to-fsdp2` maps it). Field values are torch's own FSDP objects (ShardingStrategy, StateDictType,
# MixedPrecisionPolicy, OffloadPolicy, the wrap-policy functions), as HF stores them, so scripts that inspect the
# plugin keep working. DeepSpeedPlugin, DummyOptim and DummyScheduler live in deepspeed/plugin.py.
# Not for: turning a plugin into the engine's settings (sharding/config.py) or the engine (sharding/).
from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from . import settings
from .dtypes import COMPUTE_DTYPE_OF_MODE
from .imports import str_to_bool

logger = logging.getLogger(__name__)

SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")  # HF order
AUTO_WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
BACKWARD_PREFETCH = ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH")
STATE_DICT_TYPES = ("FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT")
# `accelerate to-fsdp2`: a v1 sharding strategy -> the v2 reshard_after_forward
RESHARD_OF_STRATEGY = {"FULL_SHARD": True, "SHARD_GRAD_OP": False, "HYBRID_SHARD": True, "HYBRID_SHARD_ZERO2": False,
                       "NO_SHARD": False}
MIXED_PRECISION_DTYPES = COMPUTE_DTYPE_OF_MODE  # the dtype table's (base/dtypes.py)
_ENV = "FSDP_"


def _env_bool(name: str, default: str = "False") -> bool:
    return settings.hf_bool(_ENV + name, os.environ.get(_ENV + name, default))


def _enum_member(enum_cls: Any, value: Any, names: tuple[str, ...], field: str) -> Any:
    """HF's accepted forms of an FSDP enum: the member, its name (any case), or its 1-based value (int or digits)."""
    if isinstance(value, enum_cls):
        return value
    text = str(value).strip()
    try:
        if isinstance(value, int) or text.isdigit():
            return enum_cls(int(text))
        if text.upper() in names:  # HF's name lists follow torch's enum values (1-based)
            return enum_cls(names.index(text.upper()) + 1)
        return enum_cls[text.upper()]
    except (KeyError, ValueError):
        allowed = ", ".join(names)
        raise ValueError(f"FullyShardedDataParallelPlugin: {field}={value!r} is not valid; allowed: {allowed} "
                         f"(any case), their 1-based index, or a {enum_cls.__module__}.{enum_cls.__name__}") from None


def strategy_name(strategy: Any) -> str:
    """HF's name of a torch ShardingStrategy (torch spells the last one _HYBRID_SHARD_ZERO2)."""
    return SHARDING_STRATEGIES[int(strategy.value) - 1]


@dataclass
class FullyShardedDataParallelPlugin:
    """Fully sharded data parallelism (HF 1.15 fields and defaults; FSDP2 semantics). Unset fields are read from
    the FSDP_* variables the launcher sets. Runs on accelerate_c's own sharded engine, on CPU processes too."""

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
    param_init_fn: Optional[Callable[[torch.nn.Module], None]] = None
    sync_module_states: Optional[bool] = None
    forward_prefetch: Optional[bool] = None
    activation_checkpointing: Optional[bool] = None
    activation_checkpointing_offload: Optional[bool] = None
    cpu_ram_efficient_loading: Optional[bool] = None
    transformer_cls_names_to_wrap: Optional[list] = None
    min_num_params: Optional[int] = None

    def __post_init__(self) -> None:
        from torch.distributed.fsdp import ShardingStrategy

        notes: list[str] = []
        if self.fsdp_version is None:
            raw = os.environ.get(_ENV + "VERSION", "1")
            if not str(raw).strip().isdigit():
                raise ValueError(f"environment variable FSDP_VERSION={raw!r}: allowed: 1 or 2")
            self.fsdp_version = int(raw)
        if self.fsdp_version not in (1, 2):
            raise ValueError(f"FullyShardedDataParallelPlugin: fsdp_version={self.fsdp_version!r}; allowed: 1 or 2")
        v1 = self.fsdp_version == 1
        if self.sharding_strategy is not None and not v1:
            notes.append("sharding_strategy is deprecated in favor of reshard_after_forward")
        if v1 and self.sharding_strategy is None:
            self.sharding_strategy = os.environ.get(_ENV + "SHARDING_STRATEGY", "FULL_SHARD")
        if self.sharding_strategy is not None:
            self.sharding_strategy = _enum_member(ShardingStrategy, self.sharding_strategy, SHARDING_STRATEGIES,
                                                  "sharding_strategy")
        self._set_reshard_after_forward(v1)

        if self.cpu_offload is None:
            self.cpu_offload = _env_bool("OFFLOAD_PARAMS")
        self._set_cpu_offload()

        self._set_backward_prefetch(v1, notes)

        self.set_state_dict_type()
        self._set_auto_wrap_policy()

        for name in ("use_orig_params", "sync_module_states"):
            if v1 and getattr(self, name) is None:
                setattr(self, name, _env_bool(name.upper()))
            elif not v1 and getattr(self, name) is not None:
                notes.append(f"{name} is obsolete in FSDP2. Setting {name} to None.")
                setattr(self, name, None)
        if self.forward_prefetch is None and v1:
            self.forward_prefetch = _env_bool("FORWARD_PREFETCH")
        if not v1 and self.forward_prefetch is not None:
            raise ValueError("forward_prefetch is not yet implemented in FSDP2, set to None or use `fsdp_version=1`")
        if v1:
            self.forward_prefetch = None  # `to-fsdp2`: not carried over (the engine prefetches one unit ahead)
            self.use_orig_params = None   # always the original parameters

        if self.activation_checkpointing is None:
            self.activation_checkpointing = _env_bool("ACTIVATION_CHECKPOINTING")
        if self.activation_checkpointing_offload is None:
            self.activation_checkpointing_offload = _env_bool("ACTIVATION_CHECKPOINTING_OFFLOAD")
        if self.activation_checkpointing_offload and not self.activation_checkpointing:
            raise ValueError("`activation_checkpointing_offload=True` requires `activation_checkpointing=True`.")
        if self.activation_checkpointing_offload and v1:
            raise ValueError("`activation_checkpointing_offload=True` requires `fsdp_version=2`.")

        if self.ignored_modules is None:
            self.ignored_modules = os.environ.get(_ENV + "IGNORED_MODULES")
        if self.cpu_ram_efficient_loading is None:
            self.cpu_ram_efficient_loading = _env_bool("CPU_RAM_EFFICIENT_LOADING")
        else:  # transformers' from_pretrained reads the variable (as with HF)
            os.environ[_ENV + "CPU_RAM_EFFICIENT_LOADING"] = str(self.cpu_ram_efficient_loading)
        if v1 and self.cpu_ram_efficient_loading and not self.sync_module_states:
            warnings.warn("sync_module_states cannot be False since efficient cpu ram loading enabled. "
                          "Setting sync_module_states to True.")
            self.sync_module_states = True

        if isinstance(self.mixed_precision_policy, str):
            self.set_mixed_precision(self.mixed_precision_policy, override=True)
        elif isinstance(self.mixed_precision_policy, dict):
            self.set_mixed_precision(self.mixed_precision_policy)
        if self.mixed_precision_policy is not None:
            self.validate_mixed_precision_policy()
        if not isinstance(self.limit_all_gathers, bool):
            raise ValueError(f"FullyShardedDataParallelPlugin: limit_all_gathers={self.limit_all_gathers!r}; "
                             "allowed: True or False")
        if v1 and self.param_init_fn is not None:
            notes.append("param_init_fn is not called: a model on the meta device is initialised by each module's "
                         "reset_parameters() (or the model's own weight init), as under FSDP2.")
        self.fsdp_version = 2  # FSDP2 semantics from here on (a version-1 setting was mapped above)
        if notes:
            logger.warning("FSDP2 conversion notes:\n" + "\n".join(notes))

    # -- pieces of __post_init__ -------------------------------------------------------------------------
    def _set_backward_prefetch(self, v1: bool, notes: list[str]) -> None:
        if self.backward_prefetch is None:
            self.backward_prefetch = os.environ.get(_ENV + "BACKWARD_PREFETCH")
        if self.backward_prefetch is not None:
            from torch.distributed.fsdp import BackwardPrefetch
            if not (isinstance(self.backward_prefetch, str) and self.backward_prefetch.upper() == "NO_PREFETCH"):
                _enum_member(BackwardPrefetch, self.backward_prefetch, BACKWARD_PREFETCH, "backward_prefetch")
            if not v1:
                notes.append("backward_prefetch is not supported in FSDP2. Setting backward prefetch to None.")
            self.backward_prefetch = None  # FSDP2: our units prefetch the next one themselves

    def _set_reshard_after_forward(self, v1: bool) -> None:
        rs = self.reshard_after_forward
        if v1:  # FSDP1: the sharding strategy decides (HF passes it first to torch); a given value is checked only
            if isinstance(rs, bool):
                raise ValueError(f"reshard_after_forward set to {rs}. This is not supported with FSDP1, please set "
                                 "to a `str` or an instance of `torch.distributed.fsdp.fully_sharded_data_parallel."
                                 "ShardingStrategy`")
            if rs is not None:
                from torch.distributed.fsdp import ShardingStrategy
                _enum_member(ShardingStrategy, rs, SHARDING_STRATEGIES, "reshard_after_forward")
            self.reshard_after_forward = RESHARD_OF_STRATEGY[strategy_name(self.sharding_strategy)]
            return
        if rs is None:
            if self.sharding_strategy is not None:  # ours: what `to-fsdp2` maps the strategy to (HF: an error)
                rs = RESHARD_OF_STRATEGY[strategy_name(self.sharding_strategy)]
            else:
                rs = os.environ.get(_ENV + "RESHARD_AFTER_FORWARD", "true")
        if isinstance(rs, str):
            try:
                rs = str_to_bool(rs.strip()) == 1
            except ValueError:
                pass
        if not isinstance(rs, bool):
            raise ValueError(f"reshard_after_forward set to {rs}. This is not supported with FSDP2, please set to a "
                             "`bool`")
        self.reshard_after_forward = rs

    def _set_cpu_offload(self) -> None:
        from torch.distributed.fsdp import CPUOffload, CPUOffloadPolicy, OffloadPolicy
        value = self.cpu_offload
        if isinstance(value, CPUOffload):  # FSDP1's class: mapped to FSDP2's
            value = bool(value.offload_params)
        if isinstance(value, bool):
            value = CPUOffloadPolicy() if value else OffloadPolicy()
        if not isinstance(value, OffloadPolicy):
            raise ValueError(f"`cpu_offload` must be an instance of `torch.distributed.fsdp.OffloadPolicy` in FSDP2, "
                             f"got {self.cpu_offload}")
        self.cpu_offload = value

    def set_state_dict_type(self, state_dict_type: Any = None) -> None:
        """HF's method: the state dict type (SHARDED_STATE_DICT by default under FSDP2) and its torch configs."""
        from torch.distributed.fsdp import (FullOptimStateDictConfig, FullStateDictConfig,
                                            ShardedOptimStateDictConfig, ShardedStateDictConfig, StateDictType)
        if state_dict_type is not None:
            self.state_dict_type = state_dict_type
        if self.state_dict_type is None:
            self.state_dict_type = os.environ.get(_ENV + "STATE_DICT_TYPE", "SHARDED_STATE_DICT")
        self.state_dict_type = _enum_member(StateDictType, self.state_dict_type, STATE_DICT_TYPES, "state_dict_type")
        if self.state_dict_type == StateDictType.LOCAL_STATE_DICT:
            raise ValueError("FSDP2 does not support LOCAL_STATE_DICT. Please set `fsdp_state_dict_type` to "
                             "`SHARDED_STATE_DICT` or `FULL_STATE_DICT`.")
        full = self.state_dict_type == StateDictType.FULL_STATE_DICT
        if self.state_dict_config is None:
            self.state_dict_config = (FullStateDictConfig(offload_to_cpu=True, rank0_only=True) if full
                                      else ShardedStateDictConfig(offload_to_cpu=True))
        if self.optim_state_dict_config is None:
            self.optim_state_dict_config = (FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True) if full
                                            else ShardedOptimStateDictConfig(offload_to_cpu=True))

    def _set_auto_wrap_policy(self) -> None:
        from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy
        if self.auto_wrap_policy is None:
            self.auto_wrap_policy = os.environ.get(_ENV + "AUTO_WRAP_POLICY", "NO_WRAP")
        if isinstance(self.auto_wrap_policy, str):
            name = self.auto_wrap_policy.upper()
            if name not in AUTO_WRAP_POLICIES:
                raise ValueError(f"Invalid auto wrap policy: {self.auto_wrap_policy}. Must be one of "
                                 f"{list(AUTO_WRAP_POLICIES)}")
            if name == "TRANSFORMER_BASED_WRAP":
                self.auto_wrap_policy = transformer_auto_wrap_policy
                if self.transformer_cls_names_to_wrap is None:
                    self.transformer_cls_names_to_wrap = os.environ.get(_ENV + "TRANSFORMER_CLS_TO_WRAP")
                if isinstance(self.transformer_cls_names_to_wrap, str):
                    self.transformer_cls_names_to_wrap = self.transformer_cls_names_to_wrap.split(",")
            elif name == "SIZE_BASED_WRAP":
                self.auto_wrap_policy = size_based_auto_wrap_policy
                if self.min_num_params is None:
                    raw = os.environ.get(_ENV + "MIN_NUM_PARAMS", "0")
                    if not str(raw).strip().isdigit():
                        raise ValueError(f"environment variable FSDP_MIN_NUM_PARAMS={raw!r}: expected an integer")
                    self.min_num_params = int(raw)
                elif not isinstance(self.min_num_params, int) or isinstance(self.min_num_params, bool):
                    raise ValueError(f"`min_num_params` must be an integer. Got {self.min_num_params} of type "
                                     f"{type(self.min_num_params)}")
            else:
                self.auto_wrap_policy = None
        elif not callable(self.auto_wrap_policy):
            raise ValueError(f"FullyShardedDataParallelPlugin: auto_wrap_policy={self.auto_wrap_policy!r}; allowed: "
                             f"a callable or one of {[p.lower() for p in AUTO_WRAP_POLICIES]}")

    # -- HF's public methods -----------------------------------------------------------------------------
    def set_auto_wrap_policy(self, model: torch.nn.Module) -> None:
        """HF resolves the class names against the model here; the sharded engine does that when it builds its
        units (sharding/), so this only fills the default class names from `model._no_split_modules`."""
        from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
        if self.auto_wrap_policy is transformer_auto_wrap_policy and self.transformer_cls_names_to_wrap is None:
            self.transformer_cls_names_to_wrap = list(getattr(model, "_no_split_modules", None) or [])

    def set_mixed_precision(self, mixed_precision: Any, buffer_autocast: bool = False, override: bool = False) -> None:
        """HF's method: a precision name or dtype -> a MixedPrecisionPolicy (param/reduce/output dtype); a dict is
        checked and converted (keys param_dtype, reduce_dtype, output_dtype; buffer_dtype, FSDP1's key, gives
        torch's MixedPrecision so that the buffers' dtype is kept)."""
        from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy
        dtype = mixed_precision
        if isinstance(mixed_precision, str):
            dtype = MIXED_PRECISION_DTYPES.get(mixed_precision)
            if dtype is None:
                raise ValueError(f"Invalid mixed precision: {mixed_precision}. Must be one of "
                                 f"{list(MIXED_PRECISION_DTYPES)}")
        elif isinstance(mixed_precision, torch.dtype) and mixed_precision not in MIXED_PRECISION_DTYPES.values():
            raise ValueError(f"Invalid mixed precision: {mixed_precision}. Must be one of "
                             f"{list(MIXED_PRECISION_DTYPES.values())}")
        if override or self.mixed_precision_policy is None:
            self.mixed_precision_policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype,
                                                               output_dtype=dtype)
        elif isinstance(self.mixed_precision_policy, dict):
            policy = self.mixed_precision_policy
            v1_keys = "buffer_dtype" in policy
            required = ["param_dtype", "reduce_dtype"] + (["buffer_dtype"] if v1_keys else ["output_dtype"])
            missing = [k for k in required if k not in policy]
            extra = [k for k in policy if k not in required]
            bad = [k for k, v in policy.items() if v not in MIXED_PRECISION_DTYPES.values()]
            if missing or extra or bad:
                raise ValueError(f"Invalid mixed precision policy: {policy}. Must be a `dict` with keys {required}"
                                 f" (missing: {missing}, unknown: {extra}, bad values: {bad}). Values must be one of "
                                 f"{list(MIXED_PRECISION_DTYPES.values())}")
            self.mixed_precision_policy = (MixedPrecision if v1_keys else MixedPrecisionPolicy)(**policy)

    def validate_mixed_precision_policy(self) -> None:
        from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy
        if not isinstance(self.mixed_precision_policy, (MixedPrecisionPolicy, MixedPrecision)):
            raise ValueError("mixed_precision_policy must be an instance of "
                             "`torch.distributed.fsdp.MixedPrecisionPolicy`.")

    def validate_cpu_offload(self) -> None:
        self._set_cpu_offload()

    def set_cpu_offload(self) -> None:
        self._set_cpu_offload()
