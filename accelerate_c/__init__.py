# accelerate_c: a drop-in, faster Hugging Face Accelerate. `from accelerate_c import Accelerator` is the
# one-line change; the hot paths are the C extension accelerate_c._C.
# Not for: heavy imports at import time (every public name, torch included, loads on first use).
from __future__ import annotations

__version__ = "0.1.0"

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

# Every public name is resolved on first use (PEP 562), so `import accelerate_c` and the CLI
# (`python -m accelerate_c launch ...`, which never needs torch itself) do not import torch up front.
_LAZY = {
    "Accelerator": ".accelerator",
    "AcceleratorState": ".state", "GradientState": ".state", "PartialState": ".state",
    "DataLoaderConfiguration": ".utils.dataclasses", "DistributedType": ".utils.dataclasses",
    "GradientAccumulationPlugin": ".utils.dataclasses", "ProjectConfiguration": ".utils.dataclasses",
    "AutocastKwargs": ".utils.kwargs_handlers", "DDPCommunicationHookType": ".utils.kwargs_handlers",
    "DistributedDataParallelKwargs": ".utils.kwargs_handlers", "FP8RecipeKwargs": ".utils.kwargs_handlers",
    "GradScalerKwargs": ".utils.kwargs_handlers", "InitProcessGroupKwargs": ".utils.kwargs_handlers",
    "ProfileKwargs": ".utils.kwargs_handlers",
    "skip_first_batches": ".data_loader",
    "synchronize_rng_states": ".utils.random",
    "find_executable_batch_size": ".utils.memory",
    "FullyShardedDataParallelPlugin": ".utils", "DeepSpeedPlugin": ".utils",
    "ParallelismConfig": ".parallelism_config",
    "notebook_launcher": ".launchers", "debug_launcher": ".launchers",
    "install_as_accelerate": ".as_accelerate",
    "init_empty_weights": ".big_modeling", "init_on_device": ".big_modeling", "cpu_offload": ".big_modeling",
    "cpu_offload_with_hook": ".big_modeling", "disk_offload": ".big_modeling", "dispatch_model": ".big_modeling",
    "load_checkpoint_and_dispatch": ".big_modeling", "infer_auto_device_map": ".utils.modeling",
    "load_checkpoint_in_model": ".utils.modeling",
    "prepare_pippy": ".inference", "is_rich_available": ".utils",
}

if TYPE_CHECKING:  # the static view of the same names
    from .facade.accelerator import Accelerator
    from .runtime.state import AcceleratorState, GradientState, PartialState


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module, __name__), name)
    elif not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f"{__name__}.{name}")  # a subpackage (`accelerate_c.utils.X`, as HF's)
    else:
        raise AttributeError(f"module 'accelerate_c' has no attribute {name!r}")
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(_LAZY))


__all__ = ["Accelerator", "AcceleratorState", "AutocastKwargs", "DDPCommunicationHookType", "DataLoaderConfiguration",
           "DeepSpeedPlugin", "FullyShardedDataParallelPlugin",
           "DistributedDataParallelKwargs", "DistributedType", "FP8RecipeKwargs", "GradScalerKwargs",
           "GradientAccumulationPlugin", "GradientState", "InitProcessGroupKwargs", "ParallelismConfig", "PartialState",
           "ProfileKwargs", "ProjectConfiguration", "debug_launcher", "find_executable_batch_size",
           "notebook_launcher", "skip_first_batches", "synchronize_rng_states", "cpu_offload", "cpu_offload_with_hook",
           "disk_offload", "dispatch_model", "infer_auto_device_map", "init_empty_weights", "init_on_device",
           "load_checkpoint_and_dispatch", "load_checkpoint_in_model", "prepare_pippy", "is_rich_available"]
