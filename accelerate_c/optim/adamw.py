# adamw.py: accelerate_c.optim.Adam / AdamW: torch.optim.Adam / AdamW subclasses (same constructor, param_groups,
# state_dict layout and hooks) whose step() runs the fused C kernel for every group it supports and torch's own
# implementation for the rest (non-CPU, sparse, complex, non-fp32, differentiable or capturable groups).
# Not for: the kernel plumbing (_fused.py) or flat buffers (flat.py).
from __future__ import annotations

from typing import Callable

import torch

from ._fused import group_supported, run_groups


def torch_step(base: type, opt: torch.optim.Optimizer, groups: list[dict]) -> None:
    """Runs torch's own `base.step` on `groups` only (without running step hooks a second time)."""
    if not groups:
        return
    f = base.step
    if getattr(f, "hooked", False):  # torch wraps step() with the hook runner once per class
        f = f.__wrapped__
    saved = opt.param_groups
    opt.param_groups = groups
    try:
        f(opt)
    finally:
        opt.param_groups = saved


def fused_or_torch_step(opt: torch.optim.Optimizer, kind: str, base: type, closure: Callable | None):
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    fast = [g for g in opt.param_groups if group_supported(kind, g)]
    slow = [g for g in opt.param_groups if not any(g is f for f in fast)]
    if fast:
        with torch.no_grad():
            if run_groups(opt, kind, fast) is False:  # a state tensor we cannot use in place
                slow = opt.param_groups
    torch_step(base, opt, slow)
    return loss


class Adam(torch.optim.Adam):
    """torch.optim.Adam with a fused multi-threaded CPU step (same arguments; foreach/fused/capturable/
    differentiable are accepted and only matter for groups that fall back to torch)."""

    def step(self, closure: Callable | None = None):  # type: ignore[override]
        return fused_or_torch_step(self, "adam", torch.optim.Adam, closure)


class AdamW(torch.optim.AdamW):
    """torch.optim.AdamW with a fused multi-threaded CPU step (decoupled weight decay)."""

    def step(self, closure: Callable | None = None):  # type: ignore[override]
        return fused_or_torch_step(self, "adam", torch.optim.AdamW, closure)
