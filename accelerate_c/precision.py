# accelerate_c/precision.py: precision policies as objects that always exist (a no-op one when
# mixed_precision="no"), so the Accelerator and strategies call them unconditionally:
# autocast in forward, loss scaling with dynamic scale (fp16), unscale/skip logic around the step.
# Not for: fp8 module swapping internals (fp8.py) or the fused kernels (ops.py, optim/).
from __future__ import annotations

import contextlib
import functools
import os
from collections import defaultdict
from typing import Any, Callable, Iterator, Optional

import torch
from torch.amp.grad_scaler import OptState, _refresh_per_optimizer_state


def fused_optimizer_enabled() -> bool:
    """Whether optimizer steps may run on the fused C kernels (ACCELERATE_C_FUSED_OPTIMIZER=0 turns it off)."""
    return os.environ.get("ACCELERATE_C_FUSED_OPTIMIZER", "1") != "0"


def _to_fp32(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.float() if obj.dtype in (torch.float16, torch.bfloat16) else obj
    if isinstance(obj, (list, tuple)):
        out = [_to_fp32(o) for o in obj]
        return type(obj)(*out) if hasattr(obj, "_fields") else type(obj)(out)
    if isinstance(obj, dict):
        return type(obj)({k: _to_fp32(v) for k, v in obj.items()}) if type(obj) is dict else _map_mapping(obj)
    return obj


def _map_mapping(obj: Any) -> Any:
    for k in list(obj.keys()):
        obj[k] = _to_fp32(obj[k])
    return obj


class Precision:
    """Full precision: every hook is a no-op."""

    mode = "no"
    autocast_dtype: Optional[torch.dtype] = None

    def __init__(self, device: torch.device, handlers: dict[str, Any]) -> None:
        self.device = device
        self.handlers = handlers
        self.scaler: Optional[Any] = None

    @contextlib.contextmanager
    def autocast(self, handler: Any = None) -> Iterator[None]:
        handler = handler or self.handlers.get("AutocastKwargs")
        enabled = self.autocast_dtype is not None and (handler is None or handler.enabled)
        if not enabled:
            yield
            return
        kw = {}
        if handler is not None and handler.cache_enabled is not None:
            kw["cache_enabled"] = handler.cache_enabled
        with torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype, **kw):
            yield

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Patch forward to run under autocast and return fp32 outputs (HF's behaviour)."""
        if self.autocast_dtype is None or getattr(model, "_accelerate_c_autocast", False):
            return model
        original = model.forward
        precision = self

        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            with precision.autocast():
                out = original(*args, **kwargs)
            return _to_fp32(out)

        model._original_forward = original
        model.forward = forward
        model._accelerate_c_autocast = True
        return model

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        pass

    def step(self, optimizer: torch.optim.Optimizer, closure: Optional[Callable] = None) -> bool:
        """Runs optimizer.step; returns True when the step was skipped (never, here)."""
        optimizer.step(closure) if closure is not None else optimizer.step()
        return False


class BF16Precision(Precision):
    mode = "bf16"
    autocast_dtype = torch.bfloat16


class FP16Precision(Precision):
    """fp16 autocast with dynamic loss scaling: torch.amp.GradScaler's semantics and state (GradScalerKwargs),
    with the CPU work done by the fused C kernels: the unscale + non-finite check is folded into the
    optimizer pass (accelerate_c.optim.fused_step(grad_scale=1/scale, skip_if_nonfinite=True)), or, when
    the user unscaled first (clip_grad_norm_), done by accelerate_c.ops in one pass. A step with a
    non-finite gradient changes nothing and backs the scale off; `step` reports it as skipped."""

    mode = "fp16"
    autocast_dtype = torch.float16

    def __init__(self, device: torch.device, handlers: dict[str, Any]) -> None:
        super().__init__(device, handlers)
        kw = handlers.get("GradScalerKwargs")
        kwargs = kw.to_kwargs() if kw is not None else {}
        self.scaler = torch.amp.GradScaler(device.type, **kwargs)
        self.use_fused = device.type == "cpu" and fused_optimizer_enabled()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def _state(self, optimizer: torch.optim.Optimizer) -> dict:
        return self.scaler._per_optimizer_states[id(optimizer)]

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        state = self._state(optimizer)
        if state["stage"] is OptState.UNSCALED or not self.scaler.is_enabled():
            return
        if not self.use_fused:
            self.scaler.unscale_(optimizer)
            return
        from .ops import non_finite_check_and_unscale_
        inv_scale = self.scaler._scale.double().reciprocal().float()
        found_inf = torch.zeros(1, dtype=torch.float32)
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        state["found_inf_per_device"] = {found_inf.device: found_inf}
        state["stage"] = OptState.UNSCALED

    def step(self, optimizer: torch.optim.Optimizer, closure: Optional[Callable] = None) -> bool:
        if not self.use_fused or closure is not None or not self.scaler.is_enabled():
            return self._torch_step(optimizer, closure)
        from .optim import fused_step
        state = self._state(optimizer)
        if state["stage"] is OptState.UNSCALED:
            found = sum(float(v) for v in state["found_inf_per_device"].values()) > 0
            if not found and fused_step(optimizer) is False:
                optimizer.step()
        else:
            inv_scale = float(self.scaler._scale.double().reciprocal().float())
            result = fused_step(optimizer, grad_scale=inv_scale, skip_if_nonfinite=True)
            if result is False:  # configuration the kernels do not take: torch's GradScaler path
                return self._torch_step(optimizer, closure)
            found = result is None
        self._update(found)
        return found

    def _update(self, found_inf: bool) -> None:
        s = self.scaler
        torch._amp_update_scale_(s._scale, s._growth_tracker, torch.tensor([1.0 if found_inf else 0.0]),
                                 s._growth_factor, s._backoff_factor, s._growth_interval)
        s._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    def _torch_step(self, optimizer: torch.optim.Optimizer, closure: Optional[Callable]) -> bool:
        self.scaler.step(optimizer, closure) if closure is not None else self.scaler.step(optimizer)
        found = sum(float(v) for v in self._state(optimizer).get("found_inf_per_device", {}).values()) > 0
        self.scaler.update()
        return found


PRECISIONS: dict[str, type[Precision]] = {"no": Precision, "bf16": BF16Precision, "fp16": FP16Precision}


def make_precision(mode: str, device: torch.device, handlers: dict[str, Any]) -> Precision:
    if mode == "fp8":
        from .fp8 import FP8Precision
        return FP8Precision(device, handlers)
    try:
        return PRECISIONS[mode](device, handlers)
    except KeyError:
        raise ValueError(f"mixed_precision={mode!r} is not supported; choose one of no, fp16, bf16, fp8") from None
