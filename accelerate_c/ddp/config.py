# accelerate_c/ddp/config.py: the configuration objects of the strategies, each read once from its sources
# (`from_sources`): StrategyConfig (what every strategy reads: fused optimizer, DeepSpeed's or Megatron-LM's
# gradient clipping)
# and DDPConfig (both data-parallel strategies: DistributedDataParallelKwargs, then ACCELERATE_C_* through
# base/settings.py); the sharded engine's ShardedConfig extends DDPConfig (sharding/config.py).
# Here, below the strategies, so that the engines they configure read them without importing a strategy.
# Not for: the strategies themselves (strategies/) or the settings table (base/settings.py).
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch

from ..base import settings
from ..base.dtypes import select
from ..deepspeed.face import deepspeed_face
from ..deepspeed.schema import gradient_clipping
from .powersgd import HOOKS as POWERSGD_HOOKS, WRAPPERS as POWERSGD_WRAPPERS, PowerSGDSpec


@dataclass(frozen=True)
class StrategyConfig:
    """What every strategy reads from its configuration sources. `from_sources` is the one place it is read:
    the user's kwargs handlers/plugins (keyed by class name), then the environment (the launcher turns YAML
    and CLI values into ACCELERATE_* variables; ACCELERATE_C_* are ours, read through base/settings.py, which
    also checks every other one of ours then, so a bad value stops the run when the Accelerator is built).
    Subclasses add their fields and extend `_fields`; `env` None is os.environ."""

    fused_optimizer: bool = True  # ACCELERATE_C_FUSED_OPTIMIZER: optimizer steps on the fused C kernels
    gradient_clipping: Optional[float] = None  # DeepSpeed's / Megatron-LM's gradient_clipping: applied in every step

    @classmethod
    def from_sources(cls, handlers: Optional[Mapping[str, Any]] = None,
                     env: Optional[Mapping[str, str]] = None) -> "StrategyConfig":
        settings.check(env)
        return cls(**cls._fields(handlers or {}, env))

    @classmethod
    def _fields(cls, handlers: Mapping[str, Any], env: Optional[Mapping[str, str]]) -> dict[str, Any]:
        fields: dict[str, Any] = {"fused_optimizer": settings.get("FUSED_OPTIMIZER", env)}
        fields.update(deepspeed_face(handlers.get("DeepSpeedPlugin")).config_fields())
        megatron = handlers.get("MegatronLMPlugin")  # (never with DeepSpeed: the layout refuses the pair)
        if megatron is not None and megatron.clip_norm:
            fields["gradient_clipping"] = megatron.clip_norm
        return fields

    def with_deepspeed_json(self, config: Mapping[str, Any]) -> "StrategyConfig":
        """This config with the fields a DeepSpeed JSON sets re-read from it (after prepare filled its "auto"
        values): gradient_clipping here; subclasses add theirs."""
        return dataclasses.replace(self, gradient_clipping=gradient_clipping(config))


_COMPRESS = select(("fp16", "bf16"), {"no": None})  # comm_hook -> reduction dtype


def _name(value: Any) -> str:
    return str(getattr(value, "value", value)).lower()


def _comm_hook(kwargs: Any) -> tuple[Optional[torch.dtype], Optional[PowerSGDSpec]]:
    """DistributedDataParallelKwargs.comm_hook / comm_wrapper / comm_state_option -> (the dtype gradients are
    reduced in, None: their own; the PowerSGD hook, None: none)."""
    hook = "no" if kwargs is None else _name(kwargs.comm_hook)
    if hook in _COMPRESS:
        return _COMPRESS[hook], None
    if hook in POWERSGD_HOOKS:
        wrapper = _name(kwargs.comm_wrapper)
        if wrapper not in POWERSGD_WRAPPERS:
            raise ValueError(f"DistributedDataParallelKwargs(comm_wrapper={wrapper!r}): unknown wrapper; allowed: "
                             + ", ".join(POWERSGD_WRAPPERS))
        return None, PowerSGDSpec(hook, wrapper, dict(kwargs.comm_state_option or {}))
    raise ValueError(f"DistributedDataParallelKwargs(comm_hook={hook!r}): unknown hook; allowed: no, fp16, bf16, "
                     "power_sgd, batched_power_sgd")


@dataclass(frozen=True)
class DDPConfig(StrategyConfig):
    """Data parallelism (ddp.py, ddp_bucketed.py): DistributedDataParallelKwargs, then ACCELERATE_C_* variables
    (HF's YAML and launcher have no DDP fields of their own)."""

    grad_sync: str = "bucketed"       # ACCELERATE_C_GRAD_SYNC: bucketed (ddp_bucketed.py) | reference (ddp.py)
    transport: str = "auto"           # ACCELERATE_C_COMM: auto (shared memory for CPU tensors) | torch
    sharded_step: bool = True         # ACCELERATE_C_SHARDED_STEP: split the optimizer step between a host's ranks
    bucket_cap_mb: float = 25.0       # DistributedDataParallelKwargs.bucket_cap_mb
    broadcast_buffers: bool = True    # DistributedDataParallelKwargs.broadcast_buffers
    compress_dtype: Optional[torch.dtype] = None  # DistributedDataParallelKwargs.comm_hook: fp16 / bf16 reduction
    powersgd: Optional[PowerSGDSpec] = None       # ... comm_hook power_sgd / batched_power_sgd (ddp/powersgd.py)

    @classmethod
    def _fields(cls, handlers: Mapping[str, Any], env: Optional[Mapping[str, str]]) -> dict[str, Any]:
        fields = super()._fields(handlers, env)
        kw = handlers.get("DistributedDataParallelKwargs")
        fields.update(grad_sync=settings.get("GRAD_SYNC", env), transport=settings.get("COMM", env),
                      sharded_step=settings.get("SHARDED_STEP", env))
        fields["compress_dtype"], fields["powersgd"] = _comm_hook(kw)
        if kw is not None:
            try:
                fields["bucket_cap_mb"] = float(kw.bucket_cap_mb)
            except (TypeError, ValueError):
                raise ValueError(f"DistributedDataParallelKwargs(bucket_cap_mb={kw.bucket_cap_mb!r}): "
                                 "expected a number of megabytes") from None
            fields["broadcast_buffers"] = bool(kw.broadcast_buffers)
        return fields
