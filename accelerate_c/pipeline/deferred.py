# accelerate_c/pipeline/deferred.py: the B/W split of zero-bubble schedules. The stage's nn.Linear layers (exactly
# that type: their weight gradients are the bulk of a transformer's weight-gradient work) run through an autograd
# function whose backward computes the input gradient at once and, while the stage's WeightGrads store is armed
# (during a schedule's B), queues (input, output gradient) instead of computing the weight and bias gradients; the
# schedule's W runs the queue: weight.grad += gy^T x, bias.grad += sum(gy), the same sums autograd would add. Every
# other parameter (norms, embeddings) gets its gradient in B. Under autocast the function casts its operands as
# autocast does for a linear and keeps the cast copies, so B and W compute in the same precision as autograd.
# Not for: choosing when B and W run (schedules.py, runtime.py).
from __future__ import annotations

import types
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn


class WeightGrads:
    """The queue of deferred linear weight gradients; `target` is the list of the micro-batch whose B is running
    (None: compute weight gradients in place, as plain autograd)."""

    def __init__(self) -> None:
        self.target: Optional[list] = None

    @staticmethod
    def run(queue: list) -> None:
        """W: adds each queued linear's weight (and bias) gradient, in queue order."""
        with torch.no_grad():
            for weight, bias, x, gy in queue:
                g2 = gy.reshape(-1, gy.shape[-1])
                gw = (g2.t() @ x.reshape(-1, x.shape[-1])).to(weight.dtype)
                weight.grad = gw if weight.grad is None else weight.grad.add_(gw)
                if bias is not None and bias.requires_grad:
                    gb = g2.sum(0).to(bias.dtype)
                    bias.grad = gb if bias.grad is None else bias.grad.add_(gb)
        queue.clear()


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                store: WeightGrads) -> torch.Tensor:
        ctx.store, ctx.params = store, (weight, bias)
        dtype = torch.get_autocast_dtype("cpu") if x.device.type == "cpu" else torch.get_autocast_dtype(x.device.type)
        if torch.is_autocast_enabled(x.device.type):
            x, weight = x.to(dtype), weight.to(dtype)
            bias = bias.to(dtype) if bias is not None else None
        ctx.save_for_backward(x, weight)
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple:
        x, w = ctx.saved_tensors
        weight, bias = ctx.params
        gy = gy.to(w.dtype)
        gx = gy @ w if ctx.needs_input_grad[0] else None
        need_w = ctx.needs_input_grad[1] or (bias is not None and ctx.needs_input_grad[2])
        if ctx.store.target is not None and need_w:
            ctx.store.target.append((weight, bias, x, gy))
            return gx, None, None, None
        g2 = gy.reshape(-1, gy.shape[-1])
        gw = (g2.t() @ x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
        gb = g2.sum(0) if bias is not None and ctx.needs_input_grad[2] else None
        return gx, gw, gb, None


def _forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return _Linear.apply(x, self.weight, self.bias, self._pp_weight_grads)


def split_linears(root: nn.Module, store: WeightGrads) -> int:
    """Routes every nn.Linear under `root` through the deferring function (in place); returns how many."""
    n = 0
    for m in root.modules():
        if type(m) is nn.Linear:
            m._pp_weight_grads = store
            m.forward = types.MethodType(_forward, m)
            n += 1
    return n
