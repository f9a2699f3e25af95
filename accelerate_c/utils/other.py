# accelerate_c/utils/other.py: HF's `save` / `load` (drop-ins for torch.save / torch.load), and HF's path for the
# model helpers of runtime/models.py (extract_model_from_parallel, the torch.compile helpers).
# Not for: checkpoint formats (checkpointing/ owns safetensors writing and the tied-tensor cleanup it uses).
from __future__ import annotations

from typing import Any, Optional

import torch

from ..runtime.models import (compile_model, compile_regions, extract_model_from_parallel, has_compiled_regions,
                              has_repeated_blocks, is_compiled_module, is_repeated_blocks)

__all__ = ["compile_model", "compile_regions", "extract_model_from_parallel", "has_compiled_regions",
           "has_repeated_blocks", "is_compiled_module", "is_repeated_blocks", "load", "save"]


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
