# accelerate_c/optim/gradops.py: the fused multi-tensor gradient passes a training step needs (non-finite check +
# unscale, global norm, scale by a factor, clip by norm), backed by the C kernels in csrc/ops/gradops.c for CPU
# tensors and by accelerate_c._C_cuda's (optim/cuda.py) for CUDA tensors of one device where it is loaded; other
# tensors go to torch ops.
# Not for: autograd, the kernels themselves, or casts (precision/cast.py).
#
# Every pass is also a torch custom op in the `accelerate_c` namespace with a fake implementation, so
# torch.compile treats it as opaque; in eager mode the public functions skip the dispatcher.
from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch

from .. import _C
from ..base.dtypes import C_FLOAT_INPUTS as _IN
from . import cuda

__all__ = ["non_finite_check_and_unscale_", "global_norm", "scale_", "clip_grad_norm_"]


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def scale_tensor(scale: Union[float, torch.Tensor, None]) -> Optional[torch.Tensor]:
    """A scale as the 1-element fp32 tensor the kernels take (None and tensors pass through)."""
    if scale is None or isinstance(scale, torch.Tensor):
        return scale
    return torch.tensor(float(scale), dtype=torch.float32)


# ---- multi-tensor gradient passes ---------------------------------------------------------------------------


def _split(grads: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(tensors the C kernels take in place, the rest for torch)."""
    ours, rest = [], []
    for g in grads:
        (ours if g.device.type == "cpu" and g.dtype in _IN and g.is_contiguous() else rest).append(g)
    return ours, rest


def _unscale_impl(grads: Sequence[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    ours, rest = _split(grads)
    if ours and (found_inf.device.type != "cpu" or inv_scale.device.type != "cpu"):
        ours, rest = [], list(grads)
    if ours:
        if found_inf.dtype == torch.float32 and found_inf.is_contiguous():
            _C.multi_scale_(ours, inv_scale.float(), found_inf, torch.get_num_threads())
        else:
            flag = torch.zeros(1, dtype=torch.float32)
            _C.multi_scale_(ours, inv_scale.float(), flag, torch.get_num_threads())
            if flag.item():
                found_inf.fill_(1.0)
    if rest and found_inf.dtype == torch.float32 and cuda.serves_floats(rest + [found_inf, inv_scale.reshape(-1)]):
        cuda.multi_scale_(rest, inv_scale.float(), found_inf)  # on the device, no host read
    elif rest:
        torch._amp_foreach_non_finite_check_and_unscale_(rest, found_inf, inv_scale)


@torch.library.custom_op("accelerate_c::non_finite_check_and_unscale_", mutates_args=("grads", "found_inf"))
def _unscale_op(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    _unscale_impl(grads, found_inf, inv_scale)


@_unscale_op.register_fake
def _(grads, found_inf, inv_scale):
    return None


def non_finite_check_and_unscale_(grads: Sequence[torch.Tensor], found_inf: torch.Tensor,
                                  inv_scale: torch.Tensor) -> None:
    """torch._amp_foreach_non_finite_check_and_unscale_ semantics: every grad *= inv_scale in place (computed
    in fp32, rounded back; nothing written when inv_scale == 1); found_inf (1-element fp32) is set to 1.0 if
    any grad had an inf or NaN before scaling. One fused pass over all grads."""
    if _compiling():
        return torch.ops.accelerate_c.non_finite_check_and_unscale_(list(grads), found_inf, inv_scale)
    _unscale_impl(grads, found_inf, inv_scale)


def _combine(norm_type: float, parts: list[float]) -> float:
    if not parts:
        return 0.0
    if math.isinf(norm_type):
        return math.nan if any(math.isnan(p) for p in parts) else max(parts)
    if norm_type == 1.0:
        return sum(parts)
    return math.sqrt(sum(p * p for p in parts))


def _norm_impl(grads: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
    device = grads[0].device if len(grads) else torch.device("cpu")
    supported = norm_type in (1.0, 2.0) or (math.isinf(norm_type) and norm_type > 0)
    ours, rest = _split(grads) if supported else ([], list(grads))
    part = _C.multi_norm(ours, float(norm_type), torch.get_num_threads()) if ours else None
    if not rest:
        return torch.tensor(_combine(norm_type, [] if part is None else [part]), dtype=torch.float32, device=device)
    if part is None and supported and cuda.serves_floats(rest):
        return cuda.multi_norm(rest, norm_type)  # one device: fp64 accumulation there, a device scalar
    # device tensors: torch's norms in fp64, kept on the device (no host sync: clipping reads the result there)
    per = torch.stack([torch.linalg.vector_norm(g, norm_type, dtype=torch.float64).to(device) for g in rest])
    if part is not None:
        per = torch.cat([per, torch.tensor([part], dtype=torch.float64).to(device)])
    return torch.linalg.vector_norm(per, norm_type).to(torch.float32)


@torch.library.custom_op("accelerate_c::global_norm", mutates_args=())
def _norm_op(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    return _norm_impl(grads, norm_type)


@_norm_op.register_fake
def _(grads, norm_type):
    device = grads[0].device if len(grads) else torch.device("cpu")
    return torch.empty((), dtype=torch.float32, device=device)


def global_norm(grads: Sequence[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The norm of all grads taken together (clip_grad_norm_'s total norm) as a 0-d fp32 tensor. p = 1, 2 and inf
    run in C with fp64 accumulation (more accurate than torch's per-dtype norms: compare with a relative
    tolerance of ~1e-6 for fp32 grads, ~1e-2 for torch's bf16 result); other p use torch in fp64."""
    if _compiling():
        return torch.ops.accelerate_c.global_norm(list(grads), float(norm_type))
    return _norm_impl(grads, float(norm_type))


def _scale_impl(grads: Sequence[torch.Tensor], factor: torch.Tensor) -> None:
    ours, rest = _split(grads)
    if ours and factor.device.type == "cpu":
        _C.multi_scale_(ours, factor.float(), None, torch.get_num_threads())
    else:
        rest = list(grads)
    if rest and cuda.serves_floats(rest) and factor.numel() == 1 and (factor.is_cpu or factor.device == rest[0].device):
        cuda.multi_scale_(rest, factor.float(), None)
    elif rest:
        torch._foreach_mul_(rest, factor.to(rest[0].device))


@torch.library.custom_op("accelerate_c::scale_", mutates_args=("grads",))
def _scale_op(grads: list[torch.Tensor], factor: torch.Tensor) -> None:
    _scale_impl(grads, factor)


@_scale_op.register_fake
def _(grads, factor):
    return None


def scale_(grads: Sequence[torch.Tensor], factor: Union[float, torch.Tensor]) -> None:
    """Multiply every grad in place by `factor` (float or 1-element tensor, used as fp32), like
    torch._foreach_mul_(grads, factor) (bit-identical for fp32/bf16/fp16). factor == 1 writes nothing."""
    f = scale_tensor(factor)
    if _compiling():
        return torch.ops.accelerate_c.scale_(list(grads), f)
    _scale_impl(grads, f)


def clip_grad_norm_(grads: Sequence[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ over gradient tensors (not parameters) with two fused passes: the
    global norm, then one scale by min(1, max_norm / (norm + 1e-6)) computed in fp32 like torch. Returns the
    total norm (0-d fp32)."""
    grads = [g for g in grads if g is not None]
    total = global_norm(grads, norm_type)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients is non-finite, so it cannot be clipped.")
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    if total.device.type != "cpu" or float(coef) != 1.0:  # on a device: no host read, the scaling always runs
        scale_(grads, coef)
    return total
