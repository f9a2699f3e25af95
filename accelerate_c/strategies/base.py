# accelerate_c/strategies/base.py: the contract every backend implements, and the context it receives.
# The Accelerator calls only these methods; it never asks which backend it has. Adding a backend means
# one new file in this folder with a @register'ed Strategy subclass (see strategies/__init__.py).
# Not for: precision (precision.py) or data loading (data_loader.py), which are backend-independent.
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Optional

import torch

from ..utils.dataclasses import DistributedType


@dataclass
class StrategyContext:
    """What a strategy may know about the run: the process state, the precision object and the user's
    kwargs handlers (keyed by class name, e.g. "DistributedDataParallelKwargs")."""

    state: Any                      # AcceleratorState
    precision: Any                  # precision.Precision
    handlers: dict[str, Any] = field(default_factory=dict)

    def handler(self, name: str) -> Optional[Any]:
        return self.handlers.get(name)


class Strategy:
    """Base class: single-process behaviour. Subclasses override what differs."""

    name = "base"
    priority = 0  # higher wins when several strategies apply

    def __init__(self, ctx: StrategyContext) -> None:
        self.ctx = ctx
        self.state = ctx.state

    # -- selection -------------------------------------------------------------------------------------
    @classmethod
    def applies(cls, state: Any, handlers: dict[str, Any]) -> bool:
        return False

    @property
    def distributed_type(self) -> DistributedType:
        return self.state.distributed_type

    # -- preparation -----------------------------------------------------------------------------------
    def prepare_model(self, model: torch.nn.Module, device_placement: bool, evaluation_mode: bool = False) -> torch.nn.Module:
        if device_placement:
            model = model.to(self.state.device)
        return model

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return optimizer

    # -- the step --------------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        loss.backward(**kwargs)

    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module) -> Iterator[None]:
        yield

    @contextlib.contextmanager
    def join(self, joinables: list, enable: bool = True) -> Iterator[None]:
        """Uneven inputs across ranks (Accelerator.join_uneven_inputs): nothing to do on one process."""
        yield

    def zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool) -> bool:
        """Optionally zero the optimizer's gradients itself (e.g. in flat buffers); True if it did."""
        return False

    def clip_grad_norm_(self, parameters: Iterable[torch.nn.Parameter], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        grads = [p.grad for p in params if p.grad is not None]
        if grads and all(g.device.type == "cpu" for g in grads):
            from ..ops import clip_grad_norm_  # one fused norm pass + one scale pass (C)
            return clip_grad_norm_(grads, max_norm, norm_type=norm_type)
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)

    def clip_grad_value_(self, parameters: Iterable[torch.nn.Parameter], clip_value: float) -> None:
        torch.nn.utils.clip_grad_value_(list(parameters), clip_value)

    # -- state -----------------------------------------------------------------------------------------
    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        from ..utils.other import extract_model_from_parallel
        return (extract_model_from_parallel(model) if unwrap else model).state_dict()

    def close(self) -> None:
        """Release communication resources (end_training)."""
