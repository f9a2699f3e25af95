# accelerate_c/utils: HF Accelerate's `accelerate.utils` names: dataclasses, kwargs handlers, operations,
# RNG helpers, memory helpers, model unwrapping/compiling, save/load, environment context managers, tqdm.
# Submodules that import torch are imported lazily by name so `import accelerate_c.utils` stays fast.
# Not for: anything with behaviour of its own beyond re-exporting.
from ..base.dataclasses import (BaseEnum, DataLoaderConfiguration, DistributedType, DynamoBackend, FP8BackendType,
                                GradientAccumulationPlugin, KwargsHandler, LoggerType, PrecisionType,
                                ProjectConfiguration, RNGType, TorchDynamoPlugin)
from ..base.megatron_plugin import MegatronLMPlugin
from ..base.parallel_handlers import (DeepSpeedSequenceParallelConfig, TorchContextParallelConfig,
                                      TorchTensorParallelConfig, TorchTensorParallelPlugin)
from ..base.parallelism_config import ParallelismConfig
from ..base.environment import (are_libraries_initialized, clear_environment, get_int_from_env, parse_choice_from_env,
                                parse_flag_from_env, patch_environment, purge_accelerate_environment)
from ..base.imports import *  # noqa: F401,F403 - the is_*_available probes (cheap: nothing optional is imported)
from ..base.imports import compare_versions, is_torch_version, str_to_bool
from ..base.kwargs_handlers import (AutocastKwargs, DDPCommunicationHookType, DistributedDataParallelKwargs,
                                    FP8RecipeKwargs, GradScalerKwargs, InitProcessGroupKwargs, ProfileKwargs,
                                    TERecipeKwargs)
# eager (cheap: tqdm itself loads on first call) so the name is the function, not the module
from ..runtime.progress import tqdm

# operations / random import torch: resolved on first use (PEP 562) so `import accelerate_c.utils` stays light.
_LAZY = {
    "operations": ("DistributedOperationException", "TensorInformation", "broadcast", "broadcast_object_list",
                   "concatenate", "convert_to_fp32", "copy_tensor_to_devices", "find_batch_size", "find_device",
                   "gather", "gather_object", "get_data_structure", "honor_type", "ignorant_find_batch_size",
                   "initialize_tensors", "is_namedtuple", "is_tensor_information", "is_torch_tensor", "listify",
                   "pad_across_processes", "recursively_apply", "reduce", "send_to_device", "slice_tensors",
                   "ConvertOutputsToFp32", "convert_outputs_to_fp32", "pad_input_tensors"),
    "random": ("set_seed", "synchronize_rng_state", "synchronize_rng_states"),
    "memory": ("clear_device_cache", "find_executable_batch_size", "release_memory", "should_reduce_batch_size"),
    "other": ("compile_regions", "extract_model_from_parallel", "has_compiled_regions", "has_repeated_blocks",
              "is_compiled_module", "is_repeated_blocks", "load", "save", "wait_for_everyone", "get_pretty_name",
              "merge_dicts", "is_port_in_use", "convert_bytes", "check_os_kernel", "recursive_getattr",
              "get_module_children_bottom_up"),
    "constants": ("MODEL_NAME", "OPTIMIZER_NAME", "RNG_STATE_NAME", "SAFE_MODEL_NAME", "SAFE_WEIGHTS_INDEX_NAME",
                  "SAFE_WEIGHTS_NAME", "SAFE_WEIGHTS_PATTERN_NAME", "SAMPLER_NAME", "SCALER_NAME", "SCHEDULER_NAME",
                  "WEIGHTS_INDEX_NAME", "WEIGHTS_NAME", "WEIGHTS_PATTERN_NAME", "PROFILE_PATTERN_NAME"),
    "accelerate_c.checkpointing.model": ("clean_state_dict_for_safetensors",),
    "accelerate_c.commands.config": ("write_basic_config",),
    "accelerate_c.commands.merge_weights": ("merge_fsdp_weights",),
    "sharding_plugins": ("FullyShardedDataParallelPlugin",),
    "deepspeed_plugin": ("DeepSpeedPlugin", "DummyOptim", "DummyScheduler", "get_active_deepspeed_plugin"),
    "accelerate_c.deepspeed.schema": ("HfDeepSpeedConfig",),
    "accelerate_c.precision.contexts": ("get_grad_scaler", "get_mixed_precision_context_manager"),
    "accelerate_c.runtime.models": ("model_has_dtensor",),
    "modeling": ("align_module_device", "calculate_maximum_sizes", "get_state_dict_offloaded_model",
                 "check_tied_parameters_on_same_device", "id_tensor_storage",
                 "has_offloaded_params", "check_device_map", "clean_device_map", "compute_module_sizes",
                 "convert_file_size_to_int",
                 "dtype_byte_size", "find_tied_parameters", "get_balanced_memory", "get_max_layer_size",
                 "get_max_memory", "infer_auto_device_map", "is_peft_model", "load_checkpoint_in_model",
                 "load_state_dict", "named_module_tensors", "retie_parameters", "set_module_tensor_to_device"),
    "fsdp_utils": ("get_parameters_from_modules", "load_fsdp_model", "load_fsdp_optimizer", "save_fsdp_model",
                   "save_fsdp_optimizer"),
    "accelerate_c.scheduler": ("DeepSpeedSchedulerWrapper",),
    "accelerate_c.optimizer": ("DeepSpeedOptimizerWrapper",),
    "accelerate_c.base.dataclasses": ("get_module_class_from_name",),
    "offload": ("OffloadedWeightsLoader", "PrefixedDataset", "extract_submodules_state_dict", "load_offloaded_weight",
                "offload_state_dict", "offload_weight", "save_offload_index"),
}
_LAZY_NAMES = {name: mod for mod, names in _LAZY.items() for name in names}


def __getattr__(name: str):
    import importlib
    import importlib.util

    mod = _LAZY_NAMES.get(name)
    if mod is None:
        if name.startswith("_") or importlib.util.find_spec(f"{__name__}.{name}") is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = importlib.import_module(f"{__name__}.{name}")  # a submodule: `accelerate.utils.modeling.X`, as HF
        globals()[name] = value
        return value
    value = getattr(importlib.import_module(mod if "." in mod else f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + list(_LAZY_NAMES))
