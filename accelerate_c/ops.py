# accelerate_c/ops.py: casts with scale and fused amax (bf16/fp16/fp8), and the fused gradient passes a
# mixed-precision training step needs (non-finite check + unscale, global norm, scale by a factor), backed by
# the C kernels in csrc/ops/cast.c and csrc/ops/gradops.c.
# Not for: autograd (no backward is defined), CUDA kernels (non-CPU tensors fall back to torch ops until the
# CUDA variants exist), or strided math (non-contiguous inputs are made contiguous / handed to torch).
#
# Every public op is also a torch custom op in the `accelerate_c` namespace (torch.ops.accelerate_c.*) with a
# fake implementation, so torch.compile treats it as opaque. In eager mode the public functions call the
# implementation directly, skipping the dispatcher (~10 us per call).
from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch

from . import _C

__all__ = ["cast", "non_finite_check_and_unscale_", "global_norm", "scale_", "clip_grad_norm_", "FP8_MAX"]

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
_IN = (torch.float32, torch.bfloat16, torch.float16)
_OUT = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)
Scale = Union[float, torch.Tensor, None]


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def _scale_tensor(scale: Scale) -> Optional[torch.Tensor]:
    if scale is None or isinstance(scale, torch.Tensor):
        return scale
    return torch.tensor(float(scale), dtype=torch.float32)


# ---- cast -------------------------------------------------------------------------------------------------


def _cast_torch(x: torch.Tensor, dtype: torch.dtype, scale: Optional[torch.Tensor]) -> torch.Tensor:
    """The reference sequence (what torch users write); used for tensors the C kernel does not take."""
    if dtype in FP8_MAX:
        y = x.float() if scale is None else x.float() * scale
        return y.clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype)
    return x.to(dtype) if scale is None else (x.float() * scale).to(dtype)


def _amax_torch(x: torch.Tensor) -> torch.Tensor:
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return x.abs().max().float()


def _c_ok(x: torch.Tensor, dtype: torch.dtype, scale: Optional[torch.Tensor]) -> bool:
    if x.device.type != "cpu" or x.dtype not in _IN or dtype not in _OUT:
        return False
    return scale is None or (scale.device.type == "cpu" and scale.numel() == 1)


def _cast_impl(x: torch.Tensor, dtype: torch.dtype, scale: Optional[torch.Tensor], want_amax: bool,
               out: Optional[torch.Tensor] = None):
    if not _c_ok(x, dtype, scale) or (out is not None and not (
            out.device.type == "cpu" and out.dtype == dtype and out.is_contiguous() and out.shape == x.shape)):
        y = _cast_torch(x, dtype, scale)
        if out is not None:
            y = out.copy_(y)
        return (y, _amax_torch(x)) if want_amax else y
    x = x.contiguous()
    if scale is not None and scale.dtype != torch.float32:
        scale = scale.float()
    if out is None:
        out = torch.empty(x.shape, dtype=dtype)
    amax = torch.empty((), dtype=torch.float32) if want_amax else None
    _C.cast(x, out, scale, amax, torch.get_num_threads())
    return (out, amax) if want_amax else out


@torch.library.custom_op("accelerate_c::cast", mutates_args=())
def _cast_op(x: torch.Tensor, dtype: torch.dtype, scale: Optional[torch.Tensor]) -> torch.Tensor:
    return _cast_impl(x, dtype, scale, False)


@_cast_op.register_fake
def _(x, dtype, scale):
    return torch.empty_like(x, dtype=dtype, memory_format=torch.contiguous_format)


@torch.library.custom_op("accelerate_c::cast_amax", mutates_args=())
def _cast_amax_op(x: torch.Tensor, dtype: torch.dtype, scale: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return _cast_impl(x, dtype, scale, True)


@_cast_amax_op.register_fake
def _(x, dtype, scale):
    return (torch.empty_like(x, dtype=dtype, memory_format=torch.contiguous_format),
            x.new_empty((), dtype=torch.float32))


def cast(x: torch.Tensor, dtype: torch.dtype, *, scale: Scale = None, return_amax: bool = False,
         out: Optional[torch.Tensor] = None) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Cast `x` (fp32/bf16/fp16) to `dtype` (fp32/bf16/fp16/float8_e4m3fn/float8_e5m2) after multiplying by
    `scale` (float or 1-element fp32 tensor) in fp32. float8 outputs saturate to +-max (NaN stays NaN).
    Bit-identical to torch's `(x.float()*scale).clamp(-max, max).to(dtype)` (fp8) / `(x.float()*scale).to(dtype)`.
    With return_amax=True also returns max|x| (before scaling) as a 0-d fp32 tensor, from the same pass
    (NaN if x has a NaN; 0 for an empty x, where torch's x.abs().max() raises).
    `out`: a preallocated result (same shape, `dtype`) to write into; reusing it skips the page faults of a
    fresh allocation, which on the CPU cost more than the cast itself for big tensors."""
    s = _scale_tensor(scale)
    if _compiling():
        r = torch.ops.accelerate_c.cast_amax(x, dtype, s) if return_amax else torch.ops.accelerate_c.cast(x, dtype, s)
        if out is None:
            return r
        if return_amax:
            return out.copy_(r[0]), r[1]
        return out.copy_(r)
    return _cast_impl(x, dtype, s, return_amax, out)


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
    if rest:
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
    parts = [_C.multi_norm(ours, float(norm_type), torch.get_num_threads())] if ours else []
    if rest:
        per = torch.stack([torch.linalg.vector_norm(g, norm_type, dtype=torch.float64).to(device) for g in rest])
        if supported:
            parts.append(float(torch.linalg.vector_norm(per, norm_type)))
        else:
            return torch.linalg.vector_norm(per, norm_type).to(torch.float32)
    return torch.tensor(_combine(norm_type, parts), dtype=torch.float32, device=device)


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
    if rest:
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
    f = _scale_tensor(factor)
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
    if float(coef) != 1.0:
        scale_(grads, coef)
    return total
