# accelerate_c/precision/policy.py: precision policies as objects that always exist (a no-op one when
# mixed_precision="no"), so the Accelerator and strategies call them unconditionally:
# autocast in forward, loss scaling with dynamic scale (fp16), unscale/skip logic around the step.
# The optimizer step itself belongs to the strategy (strategies/base.py: Strategy.step); a precision only
# answers its hooks: kernel_scale (how the fused kernels must treat the gradients), after_kernel_step and
# torch_step (the optimizer's own step, wrapped in GradScaler's under fp16). bf16 on a CPU without native bf16
# matmuls installs cpu_bf16's kernels (fp32 speed, bf16 rounding), or warns once per process where the setting
# keeps torch's (warn_slow_cpu_bf16).
# Not for: fp8 module swapping internals (fp8.py) or the fused kernels (ops.py, optim/).
from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
from torch.amp.grad_scaler import OptState

from ..base.dtypes import LOW_PRECISION
from . import cpu_bf16


@dataclass(frozen=True)
class KernelScale:
    """How a step on the fused kernels treats the gradients: multiply them by `grad_scale` inside the pass,
    first check them (times the scale) for inf/NaN and skip the step if any (`check_nonfinite`), or skip it
    outright (`skip`: the gradients were unscaled already and found non-finite)."""

    grad_scale: Optional[float] = None
    check_nonfinite: bool = False
    skip: bool = False


NO_SCALING = KernelScale()


def _to_fp32(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.float() if obj.dtype in LOW_PRECISION else obj
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

    def __init__(self, device: torch.device, handlers: dict[str, Any], fused_kernels: bool = True) -> None:
        """fused_kernels: the strategy config's fused_optimizer (whether C kernels may do the precision's work;
        nothing to do here)."""
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

    def unscale_(self, optimizer: torch.optim.Optimizer,
                 agree: Optional[Callable[[torch.Tensor], None]] = None) -> None:
        """Unscale the optimizer's gradients in place (no-op without loss scaling). `agree`: the strategy's
        all-reduce (max, in place) of the found-inf flag when each rank sees only part of the gradients
        (Strategy.unscale_), so every rank skips the same steps and keeps the same scale."""

    # -- the optimizer step's hooks (called by Strategy.step) ----------------------------------------------
    def kernel_scale(self, optimizer: torch.optim.Optimizer) -> Optional[KernelScale]:
        """How the fused kernels must treat the gradients for this step; None when they cannot express this
        precision's scaling (the strategy then runs torch_step). No scaling here."""
        return NO_SCALING

    def after_kernel_step(self, optimizer: torch.optim.Optimizer, skipped: bool) -> bool:
        """After a step on the kernels (or skipped before them); returns whether the step counts as skipped."""
        return skipped

    def torch_step(self, optimizer: torch.optim.Optimizer, closure: Optional[Callable] = None) -> bool:
        """The optimizer's own step(); returns True when it was skipped (never, here)."""
        optimizer.step(closure) if closure is not None else optimizer.step()
        return False


@functools.lru_cache(maxsize=None)
def cpu_has_native_bf16() -> bool:
    """Whether torch's CPU matmuls run bf16 natively here (oneDNN with AVX512-BF16 or AMX); without, torch emulates
    them through fp32, tens of times slower than fp32 itself (58x for a 256x512x512 matmul on an AVX2 host)."""
    check = getattr(getattr(torch.ops, "mkldnn", None), "_is_mkldnn_bf16_supported", None)
    try:
        return bool(check()) if check is not None else True  # unknown: no warning
    except Exception:
        return True


_warned_slow_bf16 = False


def warn_slow_cpu_bf16(device: torch.device) -> None:
    """One RuntimeWarning per process when bf16 autocast is asked for on a CPU without native bf16 matmuls: the
    run works and gives bf16 results, but slower than mixed_precision="no" would (a choice HF Accelerate leaves
    silent; docs/differences.md)."""
    global _warned_slow_bf16
    if device.type != "cpu" or _warned_slow_bf16 or cpu_has_native_bf16():
        return
    _warned_slow_bf16 = True
    warnings.warn(f"mixed_precision='bf16' on a CPU without native bf16 matmuls (no AVX512-BF16 or AMX; torch's CPU "
                  f"capability here: {torch.backends.cpu.get_cpu_capability()}): torch emulates them, typically "
                  "tens of times slower than fp32, so this run will be slower than with mixed_precision='no'",
                  RuntimeWarning, stacklevel=5)


class BF16Precision(Precision):
    mode = "bf16"
    autocast_dtype = torch.bfloat16

    def __init__(self, device: torch.device, handlers: dict[str, Any], fused_kernels: bool = True) -> None:
        super().__init__(device, handlers, fused_kernels)
        if device.type == "cpu" and not cpu_has_native_bf16() and cpu_bf16.install():
            return  # bf16 autocast at fp32 matmul speed (cpu_bf16.py): nothing to warn about
        warn_slow_cpu_bf16(device)


class FP16Precision(Precision):
    """fp16 autocast with dynamic loss scaling: torch.amp.GradScaler's semantics and state (GradScalerKwargs),
    with the CPU work done by the fused C kernels: the unscale + non-finite check is folded into the
    optimizer pass (accelerate_c.optim.fused_step(grad_scale=1/scale, skip_if_nonfinite=True)), or, when
    the user unscaled first (clip_grad_norm_), done by accelerate_c.optim.gradops in one pass. A step with a
    non-finite gradient changes nothing and backs the scale off; the strategy's step reports it as skipped.
    Under a DeepSpeedPlugin the scaler follows the JSON "fp16" block with DeepSpeed's rules (loss_scale.py).
    Where each rank holds part of the gradients (sharded), the strategy unscales first and passes `agree`."""

    mode = "fp16"
    autocast_dtype = torch.float16

    def __init__(self, device: torch.device, handlers: dict[str, Any], fused_kernels: bool = True) -> None:
        super().__init__(device, handlers, fused_kernels)
        ds = handlers.get("DeepSpeedPlugin")
        if ds is not None:  # DeepSpeed's fp16 block: its scaler's rules (hysteresis, minimum, static scale)
            from ..deepspeed.loss_scale import DeepSpeedLossScaler, deepspeed_scaler_args
            block = (getattr(ds, "deepspeed_config", None) or {}).get("fp16", {})
            self.scaler = DeepSpeedLossScaler(device.type, **deepspeed_scaler_args(block))
        else:
            kw = handlers.get("GradScalerKwargs")
            kwargs = kw.to_kwargs() if kw is not None else {}
            self.scaler = torch.amp.GradScaler(device.type, **kwargs)
        # the kernels work on CPU tensors; the scale state lives on the device
        self.use_fused = device.type == "cpu" and fused_kernels

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def _state(self, optimizer: torch.optim.Optimizer) -> dict:
        return self.scaler._per_optimizer_states[id(optimizer)]

    def unscale_(self, optimizer: torch.optim.Optimizer,
                 agree: Optional[Callable[[torch.Tensor], None]] = None) -> None:
        state = self._state(optimizer)
        if state["stage"] is OptState.UNSCALED or not self.scaler.is_enabled():
            return
        if not self.use_fused:
            self.scaler.unscale_(optimizer)
        else:
            from ..optim.gradops import non_finite_check_and_unscale_
            inv_scale = self.scaler._scale.double().reciprocal().float()
            found_inf = torch.zeros(1, dtype=torch.float32)
            grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            non_finite_check_and_unscale_(grads, found_inf, inv_scale)
            state["found_inf_per_device"] = {found_inf.device: found_inf}
            state["stage"] = OptState.UNSCALED
        if agree is not None:  # one flag, the same on every rank (a rank without gradients contributes 0)
            found = torch.zeros(1, dtype=torch.float32, device=self.scaler._scale.device)
            for v in state["found_inf_per_device"].values():
                found += v.to(found.device)
            agree(found)
            state["found_inf_per_device"] = {found.device: found}

    def kernel_scale(self, optimizer: torch.optim.Optimizer) -> Optional[KernelScale]:
        """Gradients still scaled: unscale inside the kernels' pass, checking for inf/NaN first. Unscaled already
        (unscale_ for clipping): step as they are, or skip when that found a non-finite one. None (GradScaler's
        own path) off CPU, with the kernels turned off or with a disabled scaler."""
        if not self.use_fused or not self.scaler.is_enabled():
            return None
        state = self._state(optimizer)
        if state["stage"] is OptState.UNSCALED:
            found = sum(float(v) for v in state["found_inf_per_device"].values()) > 0
            return KernelScale(skip=True) if found else NO_SCALING
        return KernelScale(grad_scale=float(self.scaler._scale.double().reciprocal().float()), check_nonfinite=True)

    def after_kernel_step(self, optimizer: torch.optim.Optimizer, skipped: bool) -> bool:
        self._update(skipped)
        return skipped

    def _update(self, found_inf: bool) -> None:
        from ..deepspeed.loss_scale import update_scale
        update_scale(self.scaler, found_inf)

    def torch_step(self, optimizer: torch.optim.Optimizer, closure: Optional[Callable] = None) -> bool:
        self.scaler.step(optimizer, closure) if closure is not None else self.scaler.step(optimizer)
        found = sum(float(v) for v in self._state(optimizer).get("found_inf_per_device", {}).values()) > 0
        self.scaler.update()
        return found
