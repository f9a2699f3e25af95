# accelerate_c/precision: precision policies (no / fp16 / bf16 autocast and loss scaling: policy.py), fp8 training
# (fp8.py) and the scaled cast kernel they use (cast.py); `make_precision` picks the policy of a run.
# Not for: the optimizer step (strategies/base.py), DeepSpeed's fp16 scaler rules (deepspeed/loss_scale.py).
from __future__ import annotations

from typing import Any

import torch

from .fp8 import FP8Precision
from .policy import BF16Precision, FP16Precision, Precision

PRECISIONS: dict[str, type[Precision]] = {"no": Precision, "bf16": BF16Precision, "fp16": FP16Precision}


def make_precision(mode: str, device: torch.device, handlers: dict[str, Any], fused_kernels: bool = True) -> Precision:
    """fused_kernels: the strategy config's fused_optimizer (ddp/config.py: StrategyConfig)."""
    if mode == "fp8":
        return FP8Precision(device, handlers, fused_kernels)
    try:
        return PRECISIONS[mode](device, handlers, fused_kernels)
    except KeyError:
        raise ValueError(f"mixed_precision={mode!r} is not supported; choose one of no, fp16, bf16, fp8") from None
