# accelerate_c/optim/cuda.py: the CUDA kernels' side of the one dispatch between accelerate_c's kernels and torch's:
# whether accelerate_c._C_cuda serves a set of tensors (built where nvcc was found, imported only once torch sees a
# GPU, ACCELERATE_C_CUDA_KERNELS not 0, every tensor contiguous on one CUDA device), torch's current stream to enqueue
# on, and the device-side counterparts of the CPU entry points the dispatchers call (the optimizer step in _fused.py,
# gradops.py's passes, precision/cast.py, sharding/pack.py). Nothing here reads a device value back to the host.
# Not for: CPU tensors (the C kernels, _C), deciding whether a step uses kernels at all (the strategies), the
# kernels themselves (csrc/cuda/).
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from ..base import settings

_MOD: Any = None
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_LOADED = False


def kernels() -> Any:
    """accelerate_c._C_cuda, or None: not built (no nvcc at install), no GPU torch can see, or
    ACCELERATE_C_CUDA_KERNELS=0. Decided on the first call (the variable too: a launch's hot path reads no
    environment), where the import happens on a machine with a GPU, never on a CPU one."""
    global _MOD, _LOADED
    if not _LOADED:
        _LOADED = True
        if settings.get("CUDA_KERNELS") and torch.cuda.is_available():
            try:
                from .. import _C_cuda
            except ImportError:
                _C_cuda = None
            _MOD = _C_cuda
    return _MOD


def why_not() -> str:
    """Why kernels() is None here, in words (skipped tests and the GPU script say it)."""
    if not settings.get("CUDA_KERNELS"):
        return "ACCELERATE_C_CUDA_KERNELS=0"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    try:
        from .. import _C_cuda  # noqa: F401
    except ImportError as e:
        return f"accelerate_c._C_cuda was not built (no nvcc when the package was installed): {e}"
    return "available"


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # CUDA builds of torch: no Stream object made


def stream(device: torch.device) -> int:
    """torch's current stream on `device` as the int the kernels take (cudaStream_t)."""
    if _RAW_STREAM is not None:
        return _RAW_STREAM(device.index if device.index is not None else torch.cuda.current_device())
    return torch.cuda.current_stream(device).cuda_stream


def serves(tensors: Sequence[Optional[torch.Tensor]]) -> Any:
    """The kernels' module when every tensor given (None entries skipped) is a contiguous CUDA tensor on one device,
    else None."""
    dev = None
    for t in tensors:
        if t is None:
            continue
        if not t.is_cuda or not t.is_contiguous() or (dev is not None and t.device != dev):
            return None
        dev = t.device
    return kernels() if dev is not None else None


def serves_floats(tensors: Sequence[Optional[torch.Tensor]]) -> Any:
    """serves(), with every tensor float32, bfloat16 or float16 (the gradient passes' and copies' dtypes)."""
    if any(t is not None and t.dtype not in _FLOATS for t in tensors):
        return None
    return serves(tensors)


# ---- entry points mirroring the CPU ones (same arguments, a stream for the thread count) ---------------------------

def adam_step(device: torch.device, *args: Any, low: Optional[tuple] = None, found_inf: Any = None) -> None:
    """_C.adam_step's first 16 arguments (params ... grad_scale) and lr_is_f32_tensor, on `device`'s current stream;
    `low`: (exp_avg_absmaxes, exp_avg_sq_absmaxes, offsets, salts) of low-precision state."""
    head, lr_f32 = args[:16], args[16]
    tail = tuple(low) if low is not None else (None, None, None, None)
    kernels().adam_step(*head, stream(device), lr_f32, *tail, found_inf)


def sgd_step(device: torch.device, *args: Any) -> None:
    """_C.sgd_step's first 12 arguments (params ... grad_scale), on `device`'s current stream."""
    kernels().sgd_step(*args, stream(device))


def nonfinite_flag(grads: Sequence[torch.Tensor], scale: float) -> torch.Tensor:
    """A float32 device scalar: 1 when any gradient times `scale` is inf/NaN (computed on the device)."""
    flag = torch.empty((), dtype=torch.float32, device=grads[0].device)
    kernels().nonfinite(list(grads), float(scale), flag, stream(grads[0].device))
    return flag


def cast(x: torch.Tensor, out: torch.Tensor, scale: Optional[torch.Tensor], amax: Optional[torch.Tensor]) -> None:
    """out = x * scale (a 1-element float32 tensor on x's device or the CPU, or None), amax = max|x| (a float32
    scalar on x's device, or None), one pass."""
    s: Any = None
    if scale is not None:
        s = scale.reshape(()) if scale.is_cuda else float(scale)
    kernels().cast(x, out, s, amax, stream(x.device))


def multi_scale_(tensors: Sequence[torch.Tensor], factor: Any, found_inf: Optional[torch.Tensor]) -> None:
    """Every tensor *= factor (a number or a float32 scalar on their device), found_inf set on inf/NaN."""
    if isinstance(factor, torch.Tensor):
        factor = factor.reshape(()).to(tensors[0].device, torch.float32) if factor.is_cuda else float(factor)
    kernels().multi_scale_(list(tensors), factor, found_inf, stream(tensors[0].device))


def multi_norm(tensors: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The global norm (1, 2, inf) of the tensors as a float32 device scalar, fp64 accumulation, no host read."""
    dev = tensors[0].device
    cu = kernels()
    partials = torch.empty(cu.norm_partials([t.numel() for t in tensors]), dtype=torch.float64, device=dev)
    out = torch.empty((), dtype=torch.float32, device=dev)
    cu.multi_norm(list(tensors), float(norm_type), partials, out, stream(dev))
    return out


def multi_copy(srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor]) -> None:
    """dsts[i] = srcs[i] converted, one launch for the lists."""
    kernels().multi_copy(list(srcs), list(dsts), stream(dsts[0].device))
