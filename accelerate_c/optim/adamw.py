# adamw.py: accelerate_c.optim.Adam / AdamW: torch.optim.Adam / AdamW subclasses (same constructor, param_groups,
# state_dict layout and hooks) whose step() runs the fused C kernel for every group it supports and torch's own
# implementation for the rest (non-CPU, sparse, complex, non-fp32, differentiable or capturable groups).
# state_dtype= keeps exp_avg/exp_avg_sq in bf16 or 8 bits (lowbit.py); such groups run on the kernel only.
# Not for: the kernel plumbing (_fused.py), state layouts (lowbit.py) or flat buffers (flat.py).
from __future__ import annotations

from typing import Any, Callable

import torch

from . import lowbit
from .step import fused_or_torch_step


class _LowPrecisionState:
    """The state_dtype option shared by Adam and AdamW: a group default ("state_dtype", "min_8bit_size"), checked
    once here, and a load_state_dict that accepts any layout and converts it to this optimizer's."""

    def _init_state_dtype(self, state_dtype: Any, min_8bit_size: int) -> None:
        self.defaults["state_dtype"] = lowbit.canonical_state_dtype(state_dtype)
        self.defaults["min_8bit_size"] = int(min_8bit_size)
        for g in self.param_groups:
            self._check_group(g)

    def _check_group(self, group: dict) -> None:
        group["state_dtype"] = lowbit.canonical_state_dtype(group.get("state_dtype", self.defaults["state_dtype"]))
        group.setdefault("min_8bit_size", self.defaults["min_8bit_size"])
        if group["state_dtype"] != "float32" and group.get("amsgrad", False):
            raise ValueError(f"amsgrad=True is not supported with state_dtype={group['state_dtype']!r} "
                             "(use state_dtype=torch.float32)")

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)  # type: ignore[misc]
        if "state_dtype" in self.defaults:  # not yet while torch's __init__ adds the first groups
            self._check_group(self.param_groups[-1])

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load_state_dict, then every param's moments converted to this optimizer's layout: a state
        saved in the same layout comes back bit for bit; an fp32 (torch) state is quantised into an 8-bit
        optimizer and an 8-bit or bf16 one widened into an fp32 optimizer. The groups keep this optimizer's
        state_dtype (the other hyperparameters are loaded, as torch does)."""
        wanted = [(g["state_dtype"], g["min_8bit_size"]) for g in self.param_groups]
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        layouts = {}
        for sid, p in zip(saved_ids, params):
            st = state_dict["state"].get(sid)
            if st:
                layouts[p] = lowbit.layout_of(st)
        super().load_state_dict(state_dict)  # type: ignore[misc]
        for g, (sd, mn) in zip(self.param_groups, wanted):
            g["state_dtype"], g["min_8bit_size"] = sd, mn
            for p in g["params"]:
                st = self.state.get(p)
                if st and layouts.get(p) is not None:
                    lowbit.restore_dtypes(st, layouts[p])
                    lowbit.convert(st, p, lowbit.layout_for(g, p))

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)  # type: ignore[misc]
        self.defaults.setdefault("state_dtype", "float32")
        self.defaults.setdefault("min_8bit_size", lowbit.MIN_8BIT_SIZE)
        for g in self.param_groups:
            g.setdefault("state_dtype", self.defaults["state_dtype"])
            g.setdefault("min_8bit_size", self.defaults["min_8bit_size"])


class Adam(_LowPrecisionState, torch.optim.Adam):
    """torch.optim.Adam with a fused multi-threaded CPU step (same arguments; foreach/fused/capturable/
    differentiable are accepted and only matter for groups that fall back to torch).

    state_dtype: torch.float32 (torch's state), torch.bfloat16 (exp_avg and exp_avg_sq in bf16, written with
    stochastic rounding seeded by the step: 4 B/param) or "8bit" (block-wise dynamic 8-bit codes with one fp32
    scale per 256 elements: ~2.03 B/param; params under min_8bit_size elements keep fp32 state). Per group too."""

    fused_kind = "adam"  # optim/_fused.py: optimizer_kind (this exact class, not a subclass)

    def __init__(self, params: Any, *args: Any, state_dtype: Any = torch.float32, min_8bit_size: int = 4096,
                 **kwargs: Any) -> None:
        super().__init__(params, *args, **kwargs)
        self._init_state_dtype(state_dtype, min_8bit_size)

    def step(self, closure: Callable | None = None):  # type: ignore[override]
        return fused_or_torch_step(self, "adam", torch.optim.Adam, closure)


class AdamW(_LowPrecisionState, torch.optim.AdamW):
    """torch.optim.AdamW with a fused multi-threaded CPU step (decoupled weight decay); state_dtype as for Adam."""

    fused_kind = "adam"  # optim/_fused.py: optimizer_kind (this exact class, not a subclass)

    def __init__(self, params: Any, *args: Any, state_dtype: Any = torch.float32, min_8bit_size: int = 4096,
                 **kwargs: Any) -> None:
        super().__init__(params, *args, **kwargs)
        self._init_state_dtype(state_dtype, min_8bit_size)

    def step(self, closure: Callable | None = None):  # type: ignore[override]
        return fused_or_torch_step(self, "adam", torch.optim.AdamW, closure)
