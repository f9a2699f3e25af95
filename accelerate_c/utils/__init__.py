# accelerate_c/utils: HF Accelerate's `accelerate.utils` names: dataclasses, kwargs handlers, operations,
# RNG helpers. Submodules are imported lazily by name so `import accelerate_c` stays fast.
# Not for: anything with behaviour of its own beyond re-exporting.
from .dataclasses import (DataLoaderConfiguration, DistributedType, GradientAccumulationPlugin, KwargsHandler,
                          PrecisionType, ProjectConfiguration, RNGType, TorchDynamoPlugin)
from .kwargs_handlers import (AutocastKwargs, DDPCommunicationHookType, DistributedDataParallelKwargs,
                              FP8RecipeKwargs, GradScalerKwargs, InitProcessGroupKwargs, ProfileKwargs,
                              TERecipeKwargs)
from .operations import (DistributedOperationException, TensorInformation, broadcast, broadcast_object_list,
                         concatenate, convert_to_fp32, copy_tensor_to_devices, find_batch_size, find_device, gather,
                         gather_object, get_data_structure, honor_type, ignorant_find_batch_size,
                         initialize_tensors, is_namedtuple, is_tensor_information, is_torch_tensor, listify,
                         pad_across_processes, recursively_apply, reduce, send_to_device, slice_tensors)
from .random import set_seed, synchronize_rng_state, synchronize_rng_states
