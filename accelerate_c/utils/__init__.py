# accelerate_c/utils: HF Accelerate's `accelerate.utils` names: dataclasses, kwargs handlers, operations,
# RNG helpers. Submodules are imported lazily by name so `import accelerate_c` stays fast.
# Not for: anything with behaviour of its own beyond re-exporting.
from .dataclasses import (DataLoaderConfiguration, DistributedType, GradientAccumulationPlugin, KwargsHandler,
                          PrecisionType, ProjectConfiguration, RNGType, TorchDynamoPlugin)
from .kwargs_handlers import (AutocastKwargs, DDPCommunicationHookType, DistributedDataParallelKwargs,
                              FP8RecipeKwargs, GradScalerKwargs, InitProcessGroupKwargs, ProfileKwargs,
                              TERecipeKwargs)
