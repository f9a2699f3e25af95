# accelerate_c/optim/step.py: the step() body of accelerate_c's optimizer classes: the fused C kernel for every
# param group it supports (_fused.py), torch's own implementation of the base class for the rest.
# Not for: the kernel plumbing (_fused.py) or the classes (adamw.py, sgd.py).
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
    for i, g in enumerate(opt.param_groups):
        if g.get("state_dtype", "float32") != "float32" and any(g is s for s in slow):
            raise ValueError(f"param group {i}: state_dtype={g['state_dtype']!r} needs contiguous float32 CPU params "
                             "with dense float32/bfloat16/float16 gradients of the same shape and no "
                             "differentiable/capturable option (the low-precision state has no torch fallback)")
    if fast:
        with torch.no_grad():
            if run_groups(opt, kind, fast) is False:  # a state tensor we cannot use in place
                slow = opt.param_groups
    torch_step(base, opt, slow)
    return loss
