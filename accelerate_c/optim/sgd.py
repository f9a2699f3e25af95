# sgd.py: accelerate_c.optim.SGD: a torch.optim.SGD subclass (same constructor and state_dict layout,
# 'momentum_buffer' per param) whose step() runs the fused C kernel for supported groups and torch for the rest.
# Not for: the kernel plumbing (_fused.py).
from __future__ import annotations

from typing import Callable

import torch

from .step import fused_or_torch_step


class SGD(torch.optim.SGD):
    """torch.optim.SGD (momentum, dampening, nesterov, weight_decay, maximize) with a fused CPU step."""

    fused_kind = "sgd"  # optim/_fused.py: optimizer_kind (this exact class, not a subclass)

    def step(self, closure: Callable | None = None):  # type: ignore[override]
        return fused_or_torch_step(self, "sgd", torch.optim.SGD, closure)
