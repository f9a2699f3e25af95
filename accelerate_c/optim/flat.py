# flat.py: in-place optimizer steps on caller-owned buffers (one flat shard or any contiguous tensors), for
# strategies (ZeRO/FSDP shards, DDP flat buckets) that keep their own state instead of a torch optimizer.
# The caller owns the step counter. Not for: torch optimizer objects (fused_step in _fused.py).
from __future__ import annotations

import torch

from .. import _C


def _nthreads(num_threads: int | None) -> int:
    return num_threads or torch.get_num_threads()


def adamw_flat_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                step: int, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                weight_decay: float = 1e-2, *, decoupled: bool = True, amsgrad: bool = False,
                max_exp_avg_sq: torch.Tensor | None = None, maximize: bool = False, grad_scale: float | None = None,
                skip_if_nonfinite: bool = False, low_precision_out: torch.Tensor | None = None,
                num_threads: int | None = None, exp_avg_absmax: torch.Tensor | None = None,
                exp_avg_sq_absmax: torch.Tensor | None = None, offset: int = 0, salt: int = 0) -> bool:
    """One AdamW (decoupled=True) or Adam (decoupled=False, L2) step in place. `step` is the number of this
    update (1 for the first). param(/max_exp_avg_sq) fp32; grad fp32, bf16 or fp16; all contiguous CPU with
    the same numel. low_precision_out: bf16/fp16 tensor receiving the new param.
    exp_avg/exp_avg_sq: fp32; bf16 (written with stochastic rounding seeded by step and `salt`); or uint8 8-bit
    codes (optim/lowbit.py) with exp_avg_absmax/exp_avg_sq_absmax (fp32, one per 256 elements). A shard of a
    larger logical tensor passes its first element's index as `offset` (8-bit: a multiple of 256, and the
    absmax slices of its blocks), so its result is bitwise that of stepping the whole tensor.
    Returns False (and changes nothing) when skip_if_nonfinite and grad*grad_scale has an inf/NaN, else True."""
    scale = 1.0 if grad_scale is None else float(grad_scale)
    n = _nthreads(num_threads)
    if skip_if_nonfinite and _C.grads_nonfinite([grad], scale, n):
        return False
    extra = () if exp_avg.dtype == torch.float32 else (None, [exp_avg_absmax], [exp_avg_sq_absmax], [int(offset)],
                                                       [int(salt)])
    _C.adam_step([param], [grad], [exp_avg], [exp_avg_sq], [max_exp_avg_sq] if amsgrad else None, float(step),
                 [low_precision_out] if low_precision_out is not None else None, float(lr), float(betas[0]),
                 float(betas[1]), float(eps), float(weight_decay), decoupled, amsgrad, maximize, scale, n, False,
                 *extra)
    return True


def adam_flat_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               step: int, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
               weight_decay: float = 0.0, **kwargs) -> bool:
    """adamw_flat_ with torch.optim.Adam's L2 weight decay (decoupled=False)."""
    return adamw_flat_(param, grad, exp_avg, exp_avg_sq, step, lr, betas, eps, weight_decay, decoupled=False,
                       **kwargs)


def sgd_flat_(param: torch.Tensor, grad: torch.Tensor, momentum_buffer: torch.Tensor | None, lr: float,
              momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False, *,
              first_step: bool = False, maximize: bool = False, grad_scale: float | None = None,
              skip_if_nonfinite: bool = False, low_precision_out: torch.Tensor | None = None,
              num_threads: int | None = None) -> bool:
    """One SGD step in place. With momentum, first_step=True writes the buffer from the gradient (torch's
    first step) instead of reading it. Returns False (nothing changed) when skipped for a non-finite gradient."""
    scale = 1.0 if grad_scale is None else float(grad_scale)
    n = _nthreads(num_threads)
    if skip_if_nonfinite and _C.grads_nonfinite([grad], scale, n):
        return False
    use_mom = momentum != 0
    _C.sgd_step([param], [grad], [momentum_buffer] if use_mom else None, [first_step] if use_mom else None,
                [low_precision_out] if low_precision_out is not None else None, float(lr), float(momentum),
                float(dampening), float(weight_decay), nesterov, maximize, scale, n)
    return True


def grads_nonfinite(grads: list[torch.Tensor], grad_scale: float = 1.0, num_threads: int | None = None) -> bool:
    """True when any gradient element times grad_scale is inf or NaN (one parallel read pass)."""
    return bool(_C.grads_nonfinite(list(grads), float(grad_scale), _nthreads(num_threads)))
