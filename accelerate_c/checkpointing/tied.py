# accelerate_c/checkpointing/tied.py: tied weights (one tensor registered under several names: the same memory,
# shape and strides) in checkpoints and model files: stored once, under their first name (`dedupe_tied`), and
# refilled from the module's own aliasing on load (`fill_tied`). Distinct views into one flat buffer (accelerate_c's
# memory model) are distinct tensors and all kept.
# Not for: the files themselves (model.py, universal.py).
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Optional

import torch

logger = logging.getLogger(__name__)


def _alias_key(t: torch.Tensor) -> Optional[tuple]:
    """Identity of the exact memory a tensor shows: equal keys = the same (tied) tensor. Distinct views into
    one flat buffer (accelerate_c's memory model) have distinct keys and are all kept."""
    if t.numel() == 0 or t.device.type == "meta":
        return None
    return (t.device.type, t.device.index, t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)


def dedupe_tied(state_dict: dict) -> "OrderedDict[str, torch.Tensor]":
    """Drops later names of tied tensors (same memory, shape and strides); no copies."""
    seen: dict[tuple, str] = {}
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    dropped = []
    for name, t in state_dict.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"model state dict entry {name!r} is a {type(t).__name__}, not a tensor")
        key = _alias_key(t)
        if key is not None and key in seen:
            dropped.append(f"{name} (= {seen[key]})")
            continue
        if key is not None:
            seen[key] = name
        out[name] = t.detach()
    if dropped:
        logger.info("Tied tensors stored once: %s", ", ".join(dropped))
    return out


def fill_tied(module: torch.nn.Module, state_dict: dict) -> dict:
    """Adds names missing from state_dict that alias (share storage with) a present name in `module`."""
    groups: dict[tuple, list[str]] = {}
    for name, t in module.state_dict(keep_vars=True).items():
        key = _alias_key(t) if isinstance(t, torch.Tensor) else None
        if key is not None:
            groups.setdefault(key, []).append(name)
    for names in groups.values():
        present = [n for n in names if n in state_dict]
        if present:
            for n in names:
                if n not in state_dict:
                    state_dict[n] = state_dict[present[0]]
    return state_dict
