# accelerate_c/utils/modeling.py: HF's `accelerate.utils.modeling` names, re-exported from where they live
# (accelerate_c/bigmodel/: sizes, device maps, tensors, checkpoints, aligned weights; runtime/models.py: is_peft_model).
# Not for: behaviour of its own.
from ..bigmodel.aligned import align_module_device, get_state_dict_offloaded_model, has_offloaded_params
from ..bigmodel.checkpoint import load_checkpoint_in_model, load_state_dict, retie_parameters
from ..bigmodel.device_map import check_device_map, infer_auto_device_map
from ..bigmodel.sizes import (calculate_maximum_sizes, clean_device_map, compute_module_sizes,
                              compute_module_total_buffer_size, convert_file_size_to_int, dtype_byte_size,
                              find_tied_parameters, get_balanced_memory, get_max_layer_size, get_max_memory,
                              get_module_leaves, get_non_persistent_buffers, named_module_tensors)
from ..bigmodel.tensors import recursive_getattr, set_module_tensor_to_device
from ..runtime.models import is_peft_model

__all__ = ["align_module_device", "calculate_maximum_sizes", "get_state_dict_offloaded_model", "has_offloaded_params",
           "check_device_map", "clean_device_map", "compute_module_sizes", "compute_module_total_buffer_size",
           "convert_file_size_to_int", "dtype_byte_size", "find_tied_parameters", "get_balanced_memory",
           "get_max_layer_size", "get_max_memory", "get_module_leaves", "get_non_persistent_buffers",
           "infer_auto_device_map", "is_peft_model", "load_checkpoint_in_model", "load_state_dict",
           "named_module_tensors", "recursive_getattr", "retie_parameters", "set_module_tensor_to_device"]
