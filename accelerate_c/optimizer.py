# accelerate_c/optimizer.py: AcceleratedOptimizer, the wrapper prepare() returns for a user optimizer.
# step()/zero_grad() are no-ops while gradients accumulate (sync_gradients False); a synchronising step is
# the strategy's (Strategy.step(optimizer, precision, closure): fused C kernels or the optimizer's own step,
# loss-scale unscale/skip through the precision object); the user's optimizer state stays torch's.
# The first step hands the heap's freed pages back to the system (runtime/memory.py), as prepare() does.
# Not for: deciding how to step (strategies/base.py) or the kernels themselves (accelerate_c/optim/).
from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import torch

from .runtime.memory import give_back_freed_memory
from .runtime.state import GradientState


class AcceleratedOptimizer(torch.optim.Optimizer):
    def __init__(self, optimizer: torch.optim.Optimizer, device_placement: bool = True, scaler: Any = None, *,
                 precision: Any = None, strategy: Any = None, device: Optional[torch.device] = None) -> None:
        """HF's signature (optimizer, device_placement, scaler). precision / strategy: the Accelerator's objects;
        without them (a wrapper built by hand) full precision, or fp16 loss scaling with the given `scaler`, and
        the single-process step, configured from the environment."""
        if precision is None:
            from .precision.policy import FP16Precision, Precision
            precision = (Precision if scaler is None else FP16Precision)(device or torch.device("cpu"), {})
            if scaler is not None:
                precision.scaler = scaler
        if strategy is None:
            from .strategies.base import Strategy, StrategyContext, standalone_state
            strategy = Strategy(StrategyContext(state=standalone_state(device)))
        self.optimizer = optimizer
        self.precision = precision
        self.scaler = precision.scaler
        self.strategy = strategy
        self.gradient_state = GradientState()
        self.device_placement = device_placement
        self._is_overflow = False
        self._stepped = False
        if device_placement and device is not None and device.type != "cpu":
            from .runtime.operations import send_to_device
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
        if self.strategy.zero_grad(self.optimizer, True if set_to_none is None else set_to_none):
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

    def step(self, closure: Optional[Callable] = None) -> None:
        if not self.gradient_state.sync_gradients:
            return
        self._is_overflow = self.strategy.step(self.optimizer, self.precision, closure)
        if not getattr(self, "_stepped", True):  # the first step's temporaries (e.g. state moved into shm) are freed
            self._stepped = True
            give_back_freed_memory()

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


class DeepSpeedOptimizerWrapper(AcceleratedOptimizer):
    """HF's name for the optimizer of a DeepSpeed engine (HF: step and zero_grad left to the engine). accelerate_c's
    prepare never makes one; the class is here for code that checks isinstance."""
