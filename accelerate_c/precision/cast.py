# accelerate_c/precision/cast.py: casts with scale and fused amax (bf16/fp16/fp8) in one pass, backed by the C
# kernel in csrc/ops/cast.c for CPU tensors and accelerate_c._C_cuda's (optim/cuda.py) for CUDA tensors where it is
# loaded; what fp8 training and mixed-precision masters cast with. Other devices fall back to torch ops.
# Not for: autograd (no backward is defined), the kernels themselves, strided math (non-contiguous inputs are made
# contiguous), or the gradient passes (optim/gradops.py).
#
# `cast` is also a torch custom op in the `accelerate_c` namespace (torch.ops.accelerate_c.cast*) with a fake
# implementation, so torch.compile treats it as opaque. In eager mode the public function calls the
# implementation directly, skipping the dispatcher (~10 us per call).
from __future__ import annotations

from typing import Optional, Union

import torch

from .. import _C
from ..base.dtypes import C_FLOAT_INPUTS
from ..optim import cuda
from ..optim.gradops import scale_tensor as _scale_tensor

__all__ = ["cast", "FP8_MAX"]

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
_IN = C_FLOAT_INPUTS
_OUT = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)
Scale = Union[float, torch.Tensor, None]


def _compiling() -> bool:
    return torch.compiler.is_compiling()


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


def _cuda_ok(x: torch.Tensor, dtype: torch.dtype, scale: Optional[torch.Tensor], out: Optional[torch.Tensor]) -> bool:
    if not x.is_cuda or x.dtype not in _IN or dtype not in _OUT:
        return False
    if scale is not None and (scale.numel() != 1 or not (scale.is_cpu or scale.device == x.device)):
        return False
    if out is not None and not (out.device == x.device and out.dtype == dtype and out.is_contiguous()
                                and out.shape == x.shape):
        return False
    return cuda.kernels() is not None


def _cast_cuda(x: torch.Tensor, dtype: torch.dtype, scale: Optional[torch.Tensor], want_amax: bool,
               out: Optional[torch.Tensor]):
    """One pass on x's device, on torch's current stream; scale and amax stay on the device (no host read)."""
    x = x.contiguous()
    if out is None:
        out = torch.empty(x.shape, dtype=dtype, device=x.device)
    amax = torch.empty((), dtype=torch.float32, device=x.device) if want_amax else None
    cuda.cast(x, out, None if scale is None else scale.float(), amax)
    return (out, amax) if want_amax else out


def _cast_impl(x: torch.Tensor, dtype: torch.dtype, scale: Optional[torch.Tensor], want_amax: bool,
               out: Optional[torch.Tensor] = None):
    if _cuda_ok(x, dtype, scale, out):
        return _cast_cuda(x, dtype, scale, want_amax, out)
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
def _cast_amax_op(x: torch.Tensor, dtype: torch.dtype,
                  scale: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
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
