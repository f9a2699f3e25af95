# accelerate_c/precision/contexts.py: HF's two stand-alone precision helpers (accelerate.utils.modeling): the autocast
# context of the process's mixed-precision mode (`get_mixed_precision_context_manager`, what HF's prepared forward
# runs under) and a GradScaler for the process's device (`get_grad_scaler`). For code that builds its own loop
# pieces; a prepared model and optimizer do not need them.
# Not for: the precision policies of prepared objects (policy.py, fp8.py, cpu_bf16.py).
from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch

from ..base.dataclasses import DistributedType
from ..runtime.state import AcceleratorState


def get_mixed_precision_context_manager(native_amp: bool = False, autocast_kwargs: Optional[Any] = None) -> Any:
    """torch.autocast in the state's fp16 / bf16 (fp8 computes in bf16 around its own layers) on its device, when
    `native_amp`; otherwise a context that does nothing. Like HF's, bf16 under the FSDP and DeepSpeed faces gets
    no autocast (their engines cast the parameters)."""
    state = AcceleratorState()
    kwargs = autocast_kwargs.to_kwargs() if autocast_kwargs is not None else {}
    if not native_amp:
        return contextlib.nullcontext()
    if state.mixed_precision == "fp16":
        return torch.autocast(device_type=state.device.type, dtype=torch.float16, **kwargs)
    if state.mixed_precision in ("bf16", "fp8") and state.distributed_type in (DistributedType.NO,
                                                                              DistributedType.MULTI_CPU,
                                                                              DistributedType.MULTI_GPU):
        return torch.autocast(device_type=state.device.type, dtype=torch.bfloat16, **kwargs)
    return contextlib.nullcontext()


def get_grad_scaler(distributed_type: Optional[DistributedType] = None, **kwargs: Any) -> Any:
    """A GradScaler for this process's device (torch's sharded one under the FSDP face, as HF)."""
    if distributed_type == DistributedType.FSDP:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
        return ShardedGradScaler(**kwargs)
    device = "cuda" if torch.cuda.is_available() else ("mps" if torch.backends.mps.is_available() else "cpu")
    return torch.amp.GradScaler(device, **kwargs)
