# accelerate_c: a drop-in, faster Hugging Face Accelerate. `from accelerate_c import Accelerator` is the
# one-line change; the hot paths are the C extension accelerate_c._C.
# Not for: heavy imports at import time (checkpointing, the CLI and data loading load on first use).
from __future__ import annotations

__version__ = "0.1.0"

from .accelerator import Accelerator
from .state import AcceleratorState, GradientState, PartialState
from .utils.dataclasses import (DataLoaderConfiguration, DistributedType, GradientAccumulationPlugin,
                                ProjectConfiguration)
from .utils.kwargs_handlers import (AutocastKwargs, DDPCommunicationHookType, DistributedDataParallelKwargs,
                                    FP8RecipeKwargs, GradScalerKwargs, InitProcessGroupKwargs, ProfileKwargs)


def __getattr__(name: str):
    # Lazily resolved names (keep `import accelerate_c` as cheap as `import torch`).
    if name in ("skip_first_batches",):
        from .data_loader import skip_first_batches
        return skip_first_batches
    if name in ("synchronize_rng_states",):
        from .utils.random import synchronize_rng_states
        return synchronize_rng_states
    if name == "find_executable_batch_size":
        from .utils.memory import find_executable_batch_size
        return find_executable_batch_size
    if name in ("FullyShardedDataParallelPlugin", "DeepSpeedPlugin"):
        from . import utils
        return getattr(utils, name)
    if name in ("notebook_launcher", "debug_launcher"):
        from . import launchers
        return getattr(launchers, name)
    raise AttributeError(f"module 'accelerate_c' has no attribute {name!r}")


__all__ = ["Accelerator", "AcceleratorState", "AutocastKwargs", "DDPCommunicationHookType", "DataLoaderConfiguration",
           "DeepSpeedPlugin", "FullyShardedDataParallelPlugin",
           "DistributedDataParallelKwargs", "DistributedType", "FP8RecipeKwargs", "GradScalerKwargs",
           "GradientAccumulationPlugin", "GradientState", "InitProcessGroupKwargs", "PartialState",
           "ProfileKwargs", "ProjectConfiguration", "debug_launcher", "find_executable_batch_size",
           "notebook_launcher", "skip_first_batches", "synchronize_rng_states"]
