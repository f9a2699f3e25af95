# lowbit.py: the layouts of Adam's state in low precision and the conversions between them. A param's state is
# in one of three layouts, told apart by the dtype of state["exp_avg"]:
#   "float32"   torch's own: exp_avg, exp_avg_sq fp32 tensors shaped like the param;
#   "bfloat16"  the same keys in bf16 (the kernel writes them with stochastic rounding);
#   "8bit"      exp_avg / exp_avg_sq uint8 codes shaped like the param (signed / unsigned dynamic map, see
#               csrc/optim/qmap.h) plus exp_avg_absmax / exp_avg_sq_absmax, fp32, one per 256-element block.
# A group's "state_dtype" picks the layout; "8bit" keeps params under "min_8bit_size" elements in fp32.
# A device's (CUDA) state has the same layout on the device (the CUDA kernels keep the CPU's formats, so a checkpoint
# moves between devices); conversions between layouts run on the CPU.
# Not for: the optimizer classes (adamw.py) or the kernel call (_fused.py).
from __future__ import annotations

from typing import Any

import torch

from .. import _C
from ..base.pages import huge_zeros

QBLOCK = 256
MIN_8BIT_SIZE = 4096
LAYOUTS = ("float32", "bfloat16", "8bit")
_ALIASES = {"float32": "float32", "fp32": "float32", "float": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
            "8bit": "8bit", "int8": "8bit", "uint8": "8bit"}
_KEYS_8BIT = ("exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax")


def canonical_state_dtype(value: Any) -> str:
    """torch.float32 / torch.bfloat16 / "8bit" (and their spellings) -> "float32" / "bfloat16" / "8bit"."""
    if value is None:
        return "float32"
    if isinstance(value, torch.dtype):
        value = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.uint8: "8bit"}.get(value, str(value))
    name = _ALIASES.get(str(value).lower())
    if name is None:
        raise ValueError(f"state_dtype={value!r} is not supported; choose torch.float32, torch.bfloat16 or '8bit'")
    return name


def layout_for(group: dict, p: torch.Tensor) -> str:
    """The layout this group keeps p's state in."""
    sd = group.get("state_dtype", "float32")
    if sd == "8bit" and p.numel() < group.get("min_8bit_size", MIN_8BIT_SIZE):
        return "float32"
    return sd


def layout_of(state: dict) -> str | None:
    """The layout a state dict entry is in (None: no exp_avg yet)."""
    t = state.get("exp_avg")
    if not isinstance(t, torch.Tensor):
        return None
    if t.dtype == torch.uint8:
        return "8bit"
    return "bfloat16" if t.dtype == torch.bfloat16 else "float32"


def nblocks(n: int) -> int:
    return (n + QBLOCK - 1) // QBLOCK


def quantize(x: torch.Tensor, signed: bool, num_threads: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise 8-bit codes (shaped like x) and fp32 absmax (one per 256 elements) of a float tensor."""
    flat = x.detach().to(torch.float32).contiguous().view(-1).cpu()  # (a device's state converts on the CPU)
    codes = torch.empty(x.shape, dtype=torch.uint8)
    absmax = torch.empty(nblocks(flat.numel()), dtype=torch.float32)
    _C.quantize_blockwise(flat, codes.view(-1), absmax, bool(signed), num_threads or torch.get_num_threads())
    return codes.to(x.device), absmax.to(x.device)


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, signed: bool, num_threads: int | None = None) -> torch.Tensor:
    """fp32 values (shaped like codes) of block-wise 8-bit codes."""
    out = torch.empty(codes.shape, dtype=torch.float32)
    _C.dequantize_blockwise(codes.contiguous().view(-1).cpu(), absmax.to(torch.float32).contiguous().cpu(),
                            out.view(-1), bool(signed), num_threads or torch.get_num_threads())
    return out.to(codes.device)


def _keys(p: torch.Tensor, layout: str) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    if layout == "float32":  # torch's own state: the parameter's dtype
        return [("exp_avg", tuple(p.shape), p.dtype), ("exp_avg_sq", tuple(p.shape), p.dtype)]
    if layout == "bfloat16":
        return [("exp_avg", tuple(p.shape), torch.bfloat16), ("exp_avg_sq", tuple(p.shape), torch.bfloat16)]
    nb = nblocks(p.numel())
    return [("exp_avg", tuple(p.shape), torch.uint8), ("exp_avg_sq", tuple(p.shape), torch.uint8),
            ("exp_avg_absmax", (nb,), torch.float32), ("exp_avg_sq_absmax", (nb,), torch.float32)]


def new_states(items: list[tuple[torch.Tensor, str]]) -> list[dict]:
    """Zero exp_avg / exp_avg_sq (and block scales) for each (p, layout), the step counter being the caller's.
    The states of one call's contiguous CPU parameters share one huge-page mapping (base/pages.huge_zeros): the
    kernel streams them every step, where each small page would cost a TLB miss per 4 KiB, and a mapping of its own
    keeps this long-lived state out of the C heap, whose freed step temporaries can then go back to the system
    (fp32 state from torch.zeros_like would land between them and pin them). A strided parameter's fp32 state is
    zeros_like's (the parameter's memory format), a device's state torch.zeros on it."""
    mapped = [(i, _keys(p, layout)) for i, (p, layout) in enumerate(items) if p.is_cpu and
              (layout != "float32" or p.is_contiguous())]
    tensors = iter(huge_zeros([(shape, dt) for _, keys in mapped for _, shape, dt in keys]))
    out: list = [None] * len(items)
    for i, keys in mapped:
        out[i] = {k: next(tensors) for k, _, _ in keys}
    for i, (p, layout) in enumerate(items):  # a device's (CUDA) state, or a strided fp32 parameter's: torch's way
        if out[i] is None and layout != "float32":
            out[i] = {k: torch.zeros(shape, dtype=dt, device=p.device) for k, shape, dt in _keys(p, layout)}
        elif out[i] is None:
            out[i] = {"exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                      "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
    return out


def new_state(p: torch.Tensor, layout: str) -> dict:
    """Zero exp_avg / exp_avg_sq for p in `layout` (the step counter is the caller's)."""
    return new_states([(p, layout)])[0]


def _fp32_moments(state: dict, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    if layout == "8bit":
        return (dequantize(state["exp_avg"], state["exp_avg_absmax"], True),
                dequantize(state["exp_avg_sq"], state["exp_avg_sq_absmax"], False))
    return state["exp_avg"].to(torch.float32), state["exp_avg_sq"].to(torch.float32)


def convert(state: dict, p: torch.Tensor, layout: str) -> None:
    """Rewrites state's moments in place into `layout` (fp32 -> 8-bit quantises, 8-bit -> fp32 dequantises,
    bf16 <-> fp32 casts with round-to-nearest). A state already in `layout` is left untouched (bitwise)."""
    have = layout_of(state)
    if have is None or have == layout:
        return
    m, v = _fp32_moments(state, have)
    for k in _KEYS_8BIT[2:]:
        state.pop(k, None)
    if layout == "8bit":
        state["exp_avg"], state["exp_avg_absmax"] = quantize(m, True)
        state["exp_avg_sq"], state["exp_avg_sq_absmax"] = quantize(v, False)
    elif layout == "bfloat16":
        state["exp_avg"], state["exp_avg_sq"] = m.to(torch.bfloat16), v.to(torch.bfloat16)
    else:
        state["exp_avg"], state["exp_avg_sq"] = m.to(p.dtype).view_as(p), v.to(p.dtype).view_as(p)


def restore_dtypes(state: dict, layout: str) -> None:
    """Undoes torch's load_state_dict cast of every floating state tensor to the param's dtype (lossless for
    uint8 codes and bf16 values): puts `layout`'s dtypes back."""
    if layout == "8bit":
        for k in ("exp_avg", "exp_avg_sq"):
            if state[k].dtype != torch.uint8:
                state[k] = state[k].to(torch.uint8)
        for k in _KEYS_8BIT[2:]:
            state[k] = state[k].to(torch.float32)
    elif layout == "bfloat16":
        for k in ("exp_avg", "exp_avg_sq"):
            state[k] = state[k].to(torch.bfloat16)


def check_state(state: dict, p: torch.Tensor, layout: str) -> str | None:
    """None when state (in `layout`) can go to the kernel as is, else what is wrong with it."""
    for k in ("exp_avg", "exp_avg_sq"):
        t = state.get(k)
        if (not isinstance(t, torch.Tensor) or t.device != p.device or not t.is_contiguous()
                or t.numel() != p.numel()):
            return f"state[{k!r}] must be a contiguous tensor on {p.device} with {p.numel()} elements"
    if layout == "8bit":
        for k in _KEYS_8BIT[2:]:
            t = state.get(k)
            if (not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or not t.is_contiguous()
                    or t.numel() != nblocks(p.numel()) or t.device != p.device):
                return (f"state[{k!r}] must be a contiguous fp32 tensor on {p.device} of {nblocks(p.numel())} block "
                        "scales")
    return None


def state_dict_to_fp32(state_dict: dict) -> dict:
    """A copy of an optimizer state_dict with every param's moments in torch's fp32 layout (what torch.optim.Adam/
    AdamW load): 8-bit codes dequantised, bf16 widened; the groups' state_dtype entries dropped."""
    out_state = {}
    for k, st in state_dict["state"].items():
        st = dict(st)
        layout = layout_of(st)
        if layout not in (None, "float32"):
            m, v = _fp32_moments(st, layout)
            for key in _KEYS_8BIT[2:]:
                st.pop(key, None)
            st["exp_avg"], st["exp_avg_sq"] = m, v
        out_state[k] = st
    groups = [{k: v for k, v in g.items() if k not in ("state_dtype", "min_8bit_size")}
              for g in state_dict["param_groups"]]
    return {"state": out_state, "param_groups": groups}


def state_nbytes(optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """(bytes of the moment tensors held, including block scales; number of params with state)."""
    total, n = 0, 0
    for g in optimizer.param_groups:
        for p in g["params"]:
            st = optimizer.state.get(p)
            if not st:
                continue
            n += p.numel()
            total += sum(t.numel() * t.element_size() for k, t in st.items()
                         if k != "step" and isinstance(t, torch.Tensor))
    return total, n
