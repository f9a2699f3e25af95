# accelerate_c/optimizer.py: AcceleratedOptimizer, the wrapper prepare() returns for a user optimizer.
# step()/zero_grad() are no-ops while gradients accumulate (sync_gradients False); a synchronising step
# goes through the precision object (loss-scale unscale/skip) and may use the fused C kernels
# (accelerate_c.optim.fused_step) on the user's own torch optimizer, whose state stays torch's.
# Not for: the kernels themselves (accelerate_c/optim/).
from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import torch

from .state import GradientState


class AcceleratedOptimizer(torch.optim.Optimizer):
    def __init__(self, optimizer: torch.optim.Optimizer, precision: Any = None, strategy: Any = None,
                 device_placement: bool = True, device: Optional[torch.device] = None,
                 use_fused: bool = False) -> None:
        self.optimizer = optimizer
        self.precision = precision
        self.scaler = getattr(precision, "scaler", None)
        self.strategy = strategy
        self.gradient_state = GradientState()
        self.device_placement = device_placement
        self.use_fused = use_fused
        self._is_overflow = False
        if device_placement and device is not None and device.type != "cpu":
            from .utils.operations import send_to_device
            self.optimizer.load_state_dict(send_to_device(self.optimizer.state_dict(), device))

    # The torch.optim.Optimizer surface, forwarded to the user's object.
    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict]) -> None:
        self.optimizer.param_groups = value

    @property
    def defaults(self) -> dict:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict) -> None:
        self.optimizer.defaults = value

    def add_param_group(self, param_group: dict) -> None:
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        if not self.gradient_state.sync_gradients:
            return
        if self.strategy is not None and self.strategy.zero_grad(self.optimizer, True if set_to_none is None else set_to_none):
            return
        if self._zero_grad_takes_set_to_none():
            self.optimizer.zero_grad(set_to_none=True if set_to_none is None else set_to_none)
        else:
            if set_to_none is not None:
                raise ValueError("`set_to_none` for Optimizer.zero_grad` is not supported by this optimizer.")
            self.optimizer.zero_grad()

    def _zero_grad_takes_set_to_none(self) -> bool:
        # inspect.signature costs ~15 us; the answer cannot change for a given zero_grad method
        fn = self.optimizer.zero_grad
        key = getattr(fn, "__func__", fn)
        if self.__dict__.get("_zg_key") is not key:
            self._zg_key = key
            self._zg_takes = "set_to_none" in inspect.signature(fn).parameters
        return self._zg_takes

    def _inner_step(self, closure: Optional[Callable] = None) -> Any:
        if self.use_fused and closure is None:
            try:
                from .optim import fused_step
            except ImportError:  # extension built without the optimizer kernels
                self.use_fused = False
            else:
                # True: stepped; False: unsupported configuration (fall through to torch's step)
                if fused_step(self.optimizer) is not False:
                    return None
        return self.optimizer.step(closure) if closure is not None else self.optimizer.step()

    def step(self, closure: Optional[Callable] = None) -> None:
        if not self.gradient_state.sync_gradients:
            return
        if self.precision is not None and self.scaler is not None:
            self._is_overflow = self.precision.step(self.optimizer, closure)
        else:
            self._inner_step(closure)
            self._is_overflow = False

    def train(self) -> None:
        if callable(getattr(self.optimizer, "train", None)):
            self.optimizer.train()

    def eval(self) -> None:
        if callable(getattr(self.optimizer, "eval", None)):
            self.optimizer.eval()

    @property
    def step_was_skipped(self) -> bool:
        return self._is_overflow

    def __repr__(self) -> str:
        return f"AcceleratedOptimizer({self.optimizer!r})"

    def __getstate__(self) -> dict:
        return dict(self.__dict__)

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
