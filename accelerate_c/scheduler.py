# accelerate_c/scheduler.py: AcceleratedScheduler, HF's semantics exactly: no step while accumulating
# (but _step_count advances when adjust_scheduler), no step after a skipped (overflowed) optimizer step,
# and num_processes steps per optimizer step unless split_batches (OneCycle capped at total_steps).
# Not for: an "optimizer-step" scheduling mode; HF scripts expect the behaviour above.
from __future__ import annotations

from typing import Any

from .runtime.state import AcceleratorState, GradientState


class AcceleratedScheduler:
    def __init__(self, scheduler: Any, optimizers: Any, step_with_optimizer: bool = True,
                 split_batches: bool = False) -> None:
        self.scheduler = scheduler
        self.optimizers = optimizers if isinstance(optimizers, (list, tuple)) else [optimizers]
        self.split_batches = split_batches
        self.step_with_optimizer = step_with_optimizer
        self.gradient_state = GradientState()

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not self.step_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        if not self.gradient_state.sync_gradients:
            if self.gradient_state.adjust_scheduler:
                self.scheduler._step_count += 1
            return
        if any(getattr(opt, "step_was_skipped", False) for opt in self.optimizers):
            return
        repeats = 1 if self.split_batches else AcceleratorState().num_processes
        for _ in range(repeats):
            total = getattr(self.scheduler, "total_steps", None)
            if total is not None and self.scheduler._step_count > total:
                break
            self.scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> Any:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.scheduler.load_state_dict(state_dict)

    def get_lr(self) -> Any:
        return self.scheduler.get_lr()

    def print_lr(self, *args: Any, **kwargs: Any) -> Any:
        return self.scheduler.print_lr(*args, **kwargs)


class DeepSpeedSchedulerWrapper(AcceleratedScheduler):
    """HF's wrapper for a scheduler a DeepSpeed engine steps itself: `step` does nothing. accelerate_c's prepare
    never makes one (its DeepSpeed face runs on our own engines, which step through AcceleratedScheduler); the class
    is here for code that builds one or checks isinstance (transformers' Trainer)."""

    def step(self, *args: Any, **kwargs: Any) -> None:
        return None
