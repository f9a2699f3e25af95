# accelerate_c/precision/cpu_bf16.py: bf16 autocast at fp32 matmul speed on a CPU without native bf16 matmuls
# (no AVX512-BF16 or AMX). There torch computes autocast's bf16 matmuls and convolutions by a fallback tens of times
# slower than fp32 (a 4-layer GPT-2 training step 19x, a conv2d 60x, on an AVX2 host), and its bf16
# scaled_dot_product_attention backward 6-7x fp32's. `install()` replaces the AutocastCPU kernels of those ops
# (KERNELS) with one that rounds each floating input to bf16, runs the op in fp32 (products of bf16 values are exact
# in fp32, and torch's bf16 CPU kernels accumulate in fp32 too) and rounds the output to bf16: torch's rounding
# points, differing from its result only by the order of the fp32 sums (1 bf16 ulp in ~0.01 % of a matmul's
# outputs). Attention keeps its softmax probabilities in fp32 where torch's bf16 kernel rounds them to bf16 before
# multiplying by V: ours is the correctly rounded result there, torch's is not. The tensors the op saves for
# backward are held as bf16 where they are its inputs (exact: they are the rounded inputs; attention's output is
# saved in fp32, as its fp32 kernel saves it), so the live activation bytes stay autocast's; the op's fp32
# temporaries, once freed, can stay in glibc's heap (measured in docs/differences.md). In a graph torch.compile
# builds, the roundings are integer arithmetic (_round_bits), which inductor keeps, so a compiled model of these ops
# gives eager's bits. Other autocast dtypes (fp16 on a CPU) keep torch's autocast rule: eligible inputs (floating,
# not float64) cast to that dtype. Installed once per process by BF16Precision (precision/policy.py), unless
# ACCELERATE_C_CPU_BF16_MATMUL=torch; it then serves every CPU autocast region of the process. Not for: CUDA
# autocast and the ops torch runs fast in bf16.
from __future__ import annotations

import threading
import warnings
from typing import Any, Callable

import torch

from ..base import settings

# (op, overloads): autocast's CPU lower-precision ops whose bf16 kernels fall back to the slow path
KERNELS = (("linear", ("default",)), ("mm", ("default",)), ("addmm", ("default",)), ("bmm", ("default",)),
           ("baddbmm", ("default",)), ("addbmm", ("default",)), ("matmul", ("default",)),
           ("conv1d", ("default", "padding")), ("conv2d", ("default", "padding")), ("conv3d", ("default", "padding")),
           ("conv_transpose1d", ("default",)), ("conv_transpose2d", ("input",)), ("conv_transpose3d", ("input",)),
           ("scaled_dot_product_attention", ("default",)))
_F32, _BF16 = torch.float32, torch.bfloat16
_AUTOCAST = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
_lock = threading.Lock()
_library = None  # the torch.library registration, kept for the life of the process


def _eligible(x: Any) -> bool:
    """autocast's rule for what it casts: a floating tensor that is not float64"""
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64


def _plain(x: Any) -> bool:
    """a tensor with storage of its own: not a fake, functional or other subclass tensor of a tracer"""
    return type(x) in (torch.Tensor, torch.nn.Parameter) and not torch._is_functional_tensor(x)


def _round_bits(t: torch.Tensor) -> torch.Tensor:
    """fp32 `t` rounded to bf16's precision and kept in fp32, in integer arithmetic: torch's cast (round to nearest,
    ties to even; past the largest bf16 to inf), NaN kept. For graphs torch.compile builds, where inductor folds a
    `.to(bfloat16).to(float32)` round trip away (its emulate_precision_casts is off by default) and would run the op
    on unrounded inputs; integer operations it keeps."""
    bits = t.view(torch.int32)
    mag = torch.clamp(bits & 0x7FFFFFFF, max=0x7F800000)  # NaNs clamped (no int32 overflow below), restored last
    rounded = ((mag + 0x7FFF + ((mag >> 16) & 1)) & 0x7FFF0000) | (bits & -0x80000000)
    return torch.where(torch.isnan(t), t, rounded.view(torch.float32))


class _RoundBits(torch.autograd.Function):
    """_round_bits with eager's gradient: the round trip's backward rounds the incoming gradient to bf16 too"""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
        return _round_bits(t)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return _round_bits(grad)


class _Rounded:
    """The op's inputs rounded to bf16 (kept) and widened to fp32 (what the op computes on), and the saved-tensor
    hooks that hold those fp32 inputs as bf16 while backward waits for them (`track`: eager tensors only; under a
    tracer (torch.compile) the rounding alone goes into the graph, in integer arithmetic: `traced`)."""

    def __init__(self, track: bool, traced: bool) -> None:
        self.track = track
        self.traced = traced  # in a graph torch.compile builds: round with _round_bits
        self.any = False  # whether an input was rounded (else autocast leaves the op, and its output, alone)
        self.low: dict = {}  # storage address of a widened input -> (its bf16 tensor, itself)

    def round(self, x: Any) -> Any:
        if not _eligible(x):
            return x
        self.any = True
        if self.traced:
            return _RoundBits.apply(x if x.dtype == _F32 else x.to(_F32))
        low = x if x.dtype == _BF16 else x.to(_BF16)
        wide = low.to(_F32)
        if self.track:
            self.low[wide.untyped_storage().data_ptr()] = (low, wide)
        return wide

    def pack(self, t: torch.Tensor) -> Any:
        hit = self.low.get(t.untyped_storage().data_ptr()) if t.dtype == _F32 else None
        if hit is None:
            return (False, t)
        low, wide = hit
        if t.shape == wide.shape and t.stride() == wide.stride() and t.storage_offset() == wide.storage_offset():
            return (True, low)  # the input itself: its bf16 twin
        return (True, t.to(_BF16))  # a view of an input: bf16 values, exact

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        low, t = packed
        return t.to(_F32) if low else t


def _kernel(overload: Callable) -> Callable:
    def run(*args: Any, **kwargs: Any) -> Any:
        dtype = torch.get_autocast_dtype("cpu")
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST):
            if dtype != _BF16:  # torch's own autocast rule for any other dtype
                args = tuple(a.to(dtype) if _eligible(a) else a for a in args)
                kwargs = {k: v.to(dtype) if _eligible(v) else v for k, v in kwargs.items()}
                return overload(*args, **kwargs)
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            traced = torch.compiler.is_compiling() or not all(map(_plain, tensors))
            r = _Rounded(torch.is_grad_enabled() and not traced, traced)
            args = tuple(r.round(a) for a in args)
            kwargs = {k: r.round(v) for k, v in kwargs.items()}
            if r.track:
                try:
                    with torch.autograd.graph.saved_tensors_hooks(r.pack, r.unpack):
                        out = overload(*args, **kwargs)
                finally:
                    r.low.clear()  # the graph keeps the hooks (so r) alive: not the fp32 inputs
            else:
                out = overload(*args, **kwargs)
            if not (r.any and out.is_floating_point()):
                return out
            # in a compiled graph inductor may fuse this cast into the next op and skip its rounding: round first
            return (_RoundBits.apply(out) if r.traced and out.dtype == _F32 else out).to(_BF16)
    return run


def installed() -> bool:
    return _library is not None


def install() -> bool:
    """Replace the AutocastCPU kernels of KERNELS (once per process); False where the setting keeps torch's."""
    global _library
    if settings.get("CPU_BF16_MATMUL") == "torch":
        return False
    with _lock:
        if _library is None:
            lib = torch.library.Library("aten", "IMPL")
            with warnings.catch_warnings():  # torch says it overrides its kernel: that is the point
                warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
                for name, overloads in KERNELS:
                    packet = getattr(torch.ops.aten, name)
                    for ov in overloads:
                        qual = name if ov == "default" else f"{name}.{ov}"
                        lib.impl(qual, _kernel(getattr(packet, ov)), "AutocastCPU")
            _library = lib
    return True
