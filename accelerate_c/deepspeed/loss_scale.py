# accelerate_c/deepspeed/loss_scale.py: DeepSpeed's fp16 loss scaling for runs configured through a
# DeepSpeedPlugin: the JSON "fp16" block (loss_scale, initial_scale_power, loss_scale_window, hysteresis,
# consecutive_hysteresis, min_loss_scale) read into a scaler with DeepSpeed's rules (its DynamicLossScaler / static
# LossScaler), on the surface of torch.amp.GradScaler (scale, unscale_, step, update, get_scale, state_dict), so
# precision/policy.py's fp16 path drives it exactly as it drives torch's scaler. The overflow decision it is given
# is already agreed across ranks (Strategy.unscale_): every rank updates the same state.
# Not for: when to unscale or step (precision/policy.py, strategies/base.py Strategy.step), the JSON schema
# (schema.py).
from __future__ import annotations

from collections import defaultdict
from typing import Any, Mapping, Optional

import torch
from torch.amp.grad_scaler import _refresh_per_optimizer_state

# DeepSpeed's defaults when the fp16 block names at least one dynamic-scaling key; with none of them DeepSpeed
# builds DynamicLossScaler() with its constructor defaults (2**32, window 1000, no hysteresis, minimum 1).
_DYNAMIC_KEYS = ("initial_scale_power", "loss_scale_window", "min_loss_scale", "hysteresis", "consecutive_hysteresis")
_BLOCK_DEFAULTS = {"initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2,
                   "consecutive_hysteresis": False, "min_loss_scale": 1}
_CTOR_DEFAULTS = {"initial_scale_power": 32, "loss_scale_window": 1000, "hysteresis": 1,
                  "consecutive_hysteresis": False, "min_loss_scale": 1}


def _number(block: Mapping[str, Any], key: str, kind: type, default: Any) -> Any:
    v = block.get(key, default)
    if isinstance(v, bool) and kind is not bool or not isinstance(v, (int, float, bool)):
        raise ValueError(f"DeepSpeed config `fp16.{key}`: expected a number, got {v!r}")
    if kind is int and float(v) != int(v):
        raise ValueError(f"DeepSpeed config `fp16.{key}`: expected an integer, got {v!r}")
    return kind(v)


def deepspeed_scaler_args(block: Mapping[str, Any]) -> dict[str, Any]:
    """The scaler's arguments from DeepSpeed's "fp16" block (errors name the field)."""
    static = _number(block, "loss_scale", float, 0)
    if static < 0:
        raise ValueError(f"DeepSpeed config `fp16.loss_scale`: must be 0 (dynamic) or positive, got {static}")
    defaults = _BLOCK_DEFAULTS if any(k in block for k in _DYNAMIC_KEYS) else _CTOR_DEFAULTS
    args = {"static_scale": static or None,
            "init_scale": 2.0 ** _number(block, "initial_scale_power", int, defaults["initial_scale_power"]),
            "scale_window": _number(block, "loss_scale_window", int, defaults["loss_scale_window"]),
            "hysteresis": _number(block, "hysteresis", int, defaults["hysteresis"]),
            "consecutive_hysteresis": _number(block, "consecutive_hysteresis", bool,
                                              defaults["consecutive_hysteresis"]),
            "min_scale": _number(block, "min_loss_scale", float, defaults["min_loss_scale"])}
    for key, name in (("scale_window", "loss_scale_window"), ("hysteresis", "hysteresis")):
        if args[key] < 1:
            raise ValueError(f"DeepSpeed config `fp16.{name}`: must be >= 1, got {args[key]}")
    if args["min_scale"] <= 0:
        raise ValueError(f"DeepSpeed config `fp16.min_loss_scale`: must be positive, got {args['min_scale']}")
    return args


class DeepSpeedLossScaler(torch.amp.GradScaler):
    """DeepSpeed's loss scaling rules on GradScaler's machinery. Dynamic: an overflow halves the scale (not below
    min_scale; an overflow already at min_scale is an error, as DeepSpeed's) once `hysteresis` overflows have been
    absorbed: each overflow before that only uses one up. The scale doubles when the number of steps since the last
    overflow is a multiple of scale_window; the hysteresis budget is restored then (or after every clean step with
    consecutive_hysteresis). Static (static_scale): the scale never changes; an overflowing step is still skipped."""

    def __init__(self, device: str, static_scale: Optional[float] = None, init_scale: float = 2.0 ** 16,
                 scale_window: int = 1000, hysteresis: int = 2, consecutive_hysteresis: bool = False,
                 min_scale: float = 1.0) -> None:
        super().__init__(device, init_scale=float(static_scale or init_scale), growth_factor=2.0, backoff_factor=0.5,
                         growth_interval=int(scale_window))
        self._dynamic = static_scale is None
        self._min_scale = float(min_scale)
        self._hysteresis = int(hysteresis)
        self._cur_hysteresis = int(hysteresis)
        self._consecutive_hysteresis = bool(consecutive_hysteresis)
        self._cur_iter = 0
        self._last_overflow_iter = -1

    def _current(self) -> float:
        if self._scale is None:
            self._lazy_init_scale_growth_tracker(torch.device(self._device))
        return float(self._scale.item())

    def apply_overflow(self, found_inf: bool) -> None:
        """One step's update: `found_inf` is the (cross-rank) overflow decision of the step."""
        cur = self._current()
        if self._dynamic:
            if found_inf:
                if self._hysteresis == 1 or self._cur_hysteresis == 1:
                    if cur == self._min_scale:
                        raise RuntimeError("fp16 loss scale is already at DeepSpeed's "
                                           f"min_loss_scale={self._min_scale} and the gradients overflowed again: "
                                           "cannot decrease the scale further")
                    cur = max(cur / 2.0, self._min_scale)
                else:
                    self._cur_hysteresis -= 1
                self._last_overflow_iter = self._cur_iter
            else:
                if self._consecutive_hysteresis:
                    self._cur_hysteresis = self._hysteresis
                if (self._cur_iter - self._last_overflow_iter) % self._growth_interval == 0:
                    if not self._consecutive_hysteresis:
                        self._cur_hysteresis = self._hysteresis
                    cur *= 2.0
            self._scale.fill_(cur)
        self._cur_iter += 1

    def update(self, new_scale: Optional[Any] = None) -> None:
        if new_scale is not None:
            super().update(new_scale)
            return
        found = sum(float(v) for st in self._per_optimizer_states.values()
                    for v in st.get("found_inf_per_device", {}).values())
        self.apply_overflow(found > 0)
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        out.update(dynamic=self._dynamic, min_scale=self._min_scale, hysteresis=self._hysteresis,
                   cur_hysteresis=self._cur_hysteresis, consecutive_hysteresis=self._consecutive_hysteresis,
                   cur_iter=self._cur_iter, last_overflow_iter=self._last_overflow_iter)
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        missing = [k for k in ("cur_hysteresis", "cur_iter", "last_overflow_iter") if k not in state_dict]
        if missing:
            raise RuntimeError(f"DeepSpeed loss scaler state: missing {', '.join(missing)} (a checkpoint saved "
                               "without a DeepSpeed fp16 config?)")
        super().load_state_dict(dict(state_dict))
        self._dynamic = bool(state_dict["dynamic"])
        self._min_scale = float(state_dict["min_scale"])
        self._hysteresis = int(state_dict["hysteresis"])
        self._cur_hysteresis = int(state_dict["cur_hysteresis"])
        self._consecutive_hysteresis = bool(state_dict["consecutive_hysteresis"])
        self._cur_iter = int(state_dict["cur_iter"])
        self._last_overflow_iter = int(state_dict["last_overflow_iter"])


def update_scale(scaler: torch.amp.GradScaler, found_inf: bool) -> None:
    """A step's scale update after the fused kernels decided `found_inf` (torch's rule, or DeepSpeed's)."""
    if isinstance(scaler, DeepSpeedLossScaler):
        scaler.apply_overflow(found_inf)
    else:
        torch._amp_update_scale_(scaler._scale, scaler._growth_tracker, torch.tensor([1.0 if found_inf else 0.0]),
                                 scaler._growth_factor, scaler._backoff_factor, scaler._growth_interval)
    scaler._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
