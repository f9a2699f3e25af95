# accelerate_c/utils/other.py: HF's `save` / `load` (drop-ins for torch.save / torch.load), HF's path for the
# model helpers of runtime/models.py (extract_model_from_parallel, the torch.compile helpers), and HF 1.15's small
# helpers of `accelerate.utils.other` with its semantics: wait_for_everyone, get_pretty_name, merge_dicts,
# is_port_in_use, convert_bytes (base/units.py), check_os_kernel, recursive_getattr, get_module_children_bottom_up.
# Not for: checkpoint formats (checkpointing/ owns safetensors writing and the tied-tensor cleanup it uses).
from __future__ import annotations

import functools
import platform
import re
import socket
from typing import Any, Optional

import torch

from ..base.units import convert_bytes
from ..runtime.logging import get_logger
from ..runtime.models import (compile_model, compile_regions, extract_model_from_parallel, has_compiled_regions,
                              has_repeated_blocks, is_compiled_module, is_repeated_blocks)

__all__ = ["check_os_kernel", "compile_model", "compile_regions", "convert_bytes", "extract_model_from_parallel",
           "get_module_children_bottom_up", "get_pretty_name", "has_compiled_regions", "has_repeated_blocks",
           "is_compiled_module", "is_port_in_use", "is_repeated_blocks", "load", "merge_dicts", "recursive_getattr",
           "save", "wait_for_everyone"]
logger = get_logger(__name__)


def save(obj: Any, f: Any, save_on_each_node: bool = False, safe_serialization: bool = False) -> None:
    """torch.save(obj, f) on the main process only (on each machine's local main process with
    save_on_each_node=True). safe_serialization=True writes a dict of tensors as safetensors instead (tied
    tensors once, non-contiguous/device tensors copied to contiguous CPU ones)."""
    from ..runtime.state import PartialState

    state = PartialState()
    if not (state.is_local_main_process if save_on_each_node else state.is_main_process):
        return
    if not safe_serialization:
        torch.save(obj, f)
        return
    if not isinstance(obj, dict):
        raise TypeError(f"save(..., safe_serialization=True) needs a dict of tensors, got a {type(obj).__name__}; "
                        "use safe_serialization=False for other objects")
    from ..checkpointing.format import write_tensors
    from ..checkpointing.model import clean_state_dict_for_safetensors

    write_tensors(f, clean_state_dict_for_safetensors(obj), metadata={"format": "pt"})


def _numpy_safe_globals() -> list:
    # What torch.load(weights_only=True) must be allowed to rebuild for numpy arrays and RNG states, as HF.
    import codecs

    import numpy as np

    core = getattr(np, "_core", None) or np.core
    allowed = [core.multiarray._reconstruct, np.ndarray, codecs.encode, np.dtype]
    dtypes = getattr(np, "dtypes", None)
    if dtypes is not None and hasattr(dtypes, "UInt32DType"):
        allowed.append(dtypes.UInt32DType)
    return allowed


def load(f: Any, map_location: Optional[Any] = None, **kwargs: Any) -> Any:
    """torch.load with weights_only=True by default (no arbitrary unpickling) and numpy arrays allowed."""
    kwargs.setdefault("weights_only", True)
    previous = torch.serialization.get_safe_globals()
    torch.serialization.add_safe_globals(_numpy_safe_globals())
    try:
        return torch.load(f, map_location=map_location, **kwargs)
    finally:
        torch.serialization.clear_safe_globals()
        if previous:
            torch.serialization.add_safe_globals(previous)


def wait_for_everyone() -> None:
    """Blocks until every process reaches this point (PartialState().wait_for_everyone())."""
    from ..runtime.state import PartialState

    PartialState().wait_for_everyone()


def get_pretty_name(obj: Any) -> str:
    """`obj`'s __qualname__ (or __name__; an instance without either names its class), else str(obj)."""
    if not hasattr(obj, "__qualname__") and not hasattr(obj, "__name__"):
        obj = getattr(obj, "__class__", obj)
    for attr in ("__qualname__", "__name__"):
        if hasattr(obj, attr):
            return getattr(obj, attr)
    return str(obj)


def merge_dicts(source: dict, destination: dict) -> dict:
    """Merges `source` into `destination` in place, nested dicts key by key (source wins); returns destination."""
    for key, value in source.items():
        if isinstance(value, dict):
            merge_dicts(value, destination.setdefault(key, {}))
        else:
            destination[key] = value
    return destination


def is_port_in_use(port: Optional[int] = None) -> bool:
    """Whether something accepts connections on localhost:`port` (default 29500, the launcher's default)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        return s.connect_ex(("localhost", 29500 if port is None else port)) == 0


def check_os_kernel() -> None:
    """Logs a warning (main process) on Linux kernels older than 5.5.0, where HF saw processes hang."""
    info = platform.uname()
    if info.system != "Linux":
        return
    found = re.search(r"(\d+)\.(\d+)\.(\d+)", info.release)
    if found and tuple(map(int, found.groups())) < (5, 5, 0):
        logger.warning(f"Detected kernel version {found.group(0)}, which is below the recommended minimum of 5.5.0; "
                       "this can cause the process to hang. It is recommended to upgrade the kernel to the minimum "
                       "version or higher.", main_process_only=True)


def recursive_getattr(obj: Any, attr: str) -> Any:
    """getattr along a dotted path: recursive_getattr(model, "encoder.layer")."""
    return functools.reduce(getattr, attr.split("."), obj)


def get_module_children_bottom_up(model: torch.nn.Module, return_fqns: bool = False) -> list:
    """Every submodule of `model`, children before their parents and `model` last (HF's order: a depth-first walk
    that visits the last child first, reversed); with return_fqns, (qualified name, module) pairs ("" for model)."""
    stack, order = [("", model)], []
    while stack:
        name, module = stack.pop()
        for child_name, child in module.named_children():
            if isinstance(child, torch.nn.Module):
                stack.append((f"{name}.{child_name}" if name else child_name, child))
        order.append((name, module) if return_fqns else module)
    return order[::-1]
