# accelerate_c/utils/modeling.py: HF's `accelerate.utils.modeling` names, re-exported from where they live
# (accelerate_c/bigmodel/: sizes, device maps, tensors, checkpoints, aligned weights; precision/contexts.py;
# runtime/models.py: is_peft_model).
# Not for: behaviour of its own.
from ..bigmodel.aligned import align_module_device, get_state_dict_offloaded_model, has_offloaded_params
from ..bigmodel.checkpoint import load_checkpoint_in_model, load_state_dict, retie_parameters
from ..bigmodel.device_map import check_device_map, check_tied_parameters_on_same_device, infer_auto_device_map
from ..bigmodel.sizes import (calculate_maximum_sizes, clean_device_map, compute_module_sizes,
                              compute_module_total_buffer_size, convert_file_size_to_int, dtype_byte_size,
                              find_tied_parameters, get_balanced_memory, get_max_layer_size, get_max_memory,
                              get_module_leaves, get_non_persistent_buffers, named_module_tensors)
from ..bigmodel.tensors import id_tensor_storage, recursive_getattr, set_module_tensor_to_device
from ..precision.contexts import get_grad_scaler, get_mixed_precision_context_manager
from ..runtime.models import is_peft_model

__all__ = ["align_module_device", "calculate_maximum_sizes", "get_state_dict_offloaded_model", "has_offloaded_params",
           "check_tied_parameters_on_same_device", "id_tensor_storage", "get_grad_scaler",
           "get_mixed_precision_context_manager",
           "check_device_map", "clean_device_map", "compute_module_sizes", "compute_module_total_buffer_size",
           "convert_file_size_to_int", "dtype_byte_size", "find_tied_parameters", "get_balanced_memory",
           "get_max_layer_size", "get_max_memory", "get_module_leaves", "get_non_persistent_buffers",
           "infer_auto_device_map", "is_peft_model", "load_checkpoint_in_model", "load_state_dict",
           "named_module_tensors", "recursive_getattr", "retie_parameters", "set_module_tensor_to_device"]
