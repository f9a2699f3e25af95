# accelerate_c/runtime/structures.py: HF Accelerate's helpers over nested structures of tensors (lists, tuples,
# named tuples, mappings), under its names and semantics: recursively_apply, send_to_device, find_batch_size,
# slice_tensors, concatenate, convert_to_fp32 / convert_outputs_to_fp32, pad_input_tensors, ... No collectives and
# no process state: runtime/operations.py builds its collectives on these and re-exports them (HF's path
# `accelerate.utils.operations`).
# Not for: anything that talks to other processes (operations.py).
from __future__ import annotations

import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from functools import update_wrapper
from typing import Any, Callable, Optional

import torch

from ..base.dtypes import LOW_PRECISION


@dataclass
class TensorInformation:
    shape: torch.Size
    dtype: torch.dtype


def is_torch_tensor(tensor: Any) -> bool:
    return isinstance(tensor, torch.Tensor)


def is_tensor_information(tensor_info: Any) -> bool:
    return isinstance(tensor_info, TensorInformation)


def is_namedtuple(data: Any) -> bool:
    return isinstance(data, tuple) and hasattr(data, "_asdict") and hasattr(data, "_fields")


def honor_type(obj: Any, generator: Any) -> Any:
    """Rebuild a list/tuple/namedtuple of the same type as `obj` from `generator`."""
    if is_namedtuple(obj):
        return type(obj)(*list(generator))
    return type(obj)(generator)


def recursively_apply(func: Callable, data: Any, *args: Any, test_type: Callable = is_torch_tensor,
                      error_on_other_type: bool = False, **kwargs: Any) -> Any:
    """Apply `func` to every leaf of nested lists/tuples/mappings that passes `test_type`."""
    if isinstance(data, (tuple, list)):
        return honor_type(data, (recursively_apply(func, o, *args, test_type=test_type,
                                                   error_on_other_type=error_on_other_type, **kwargs) for o in data))
    if isinstance(data, Mapping):
        return type(data)({k: recursively_apply(func, v, *args, test_type=test_type,
                                                error_on_other_type=error_on_other_type, **kwargs)
                           for k, v in data.items()})
    if test_type(data):
        return func(data, *args, **kwargs)
    if error_on_other_type:
        raise TypeError(f"Unsupported types ({type(data)}) passed to `{func.__name__}`. Only nested list/tuple/dicts "
                        f"of objects that are valid for `{test_type.__name__}` should be passed.")
    return data


def send_to_device(tensor: Any, device: Any, non_blocking: bool = False, skip_keys: Any = None) -> Any:
    """Move every object with `.to` in a nested structure to `device` (mapping keys in `skip_keys` untouched)."""
    if is_torch_tensor(tensor) or hasattr(tensor, "to"):
        try:
            return tensor.to(device, non_blocking=non_blocking)
        except TypeError:  # a custom .to() without non_blocking
            return tensor.to(device)
    if isinstance(tensor, (tuple, list)):
        return honor_type(tensor, (send_to_device(t, device, non_blocking=non_blocking, skip_keys=skip_keys)
                                   for t in tensor))
    if isinstance(tensor, Mapping):
        skip = [skip_keys] if isinstance(skip_keys, str) else (skip_keys or [])
        return type(tensor)({k: t if k in skip else send_to_device(t, device, non_blocking=non_blocking,
                                                                    skip_keys=skip_keys)
                             for k, t in tensor.items()})
    return tensor


def get_data_structure(data: Any) -> Any:
    return recursively_apply(lambda t: TensorInformation(shape=t.shape, dtype=t.dtype), data)


def get_shape(data: Any) -> Any:
    return recursively_apply(lambda t: list(t.shape), data)


def initialize_tensors(data_structure: Any) -> Any:
    return recursively_apply(lambda info: torch.empty(*info.shape, dtype=info.dtype), data_structure,
                             test_type=is_tensor_information)


def find_batch_size(data: Any) -> int:
    """Size of dim 0 of the first tensor found (depth-first) in `data`."""
    if isinstance(data, (tuple, list, Mapping)) and len(data) == 0:
        raise ValueError(f"Cannot find the batch size from empty {type(data)}.")
    if isinstance(data, (tuple, list)):
        return find_batch_size(data[0])
    if isinstance(data, Mapping):
        return find_batch_size(data[next(iter(data.keys()))])
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"Can only find the batch size of tensors but got {type(data)}.")
    return data.shape[0]


def ignorant_find_batch_size(data: Any) -> Optional[int]:
    try:
        return find_batch_size(data)
    except (ValueError, TypeError):
        return None


def listify(data: Any) -> Any:
    def _to_list(t: torch.Tensor) -> Any:
        t = t.detach().cpu()
        return (t.float() if t.dtype == torch.bfloat16 else t).tolist()

    return recursively_apply(_to_list, data)


def find_device(data: Any) -> Optional[torch.device]:
    if isinstance(data, Mapping):
        data = list(data.values())
    if isinstance(data, (tuple, list)):
        for obj in data:
            device = find_device(obj)
            if device is not None:
                return device
        return None
    if isinstance(data, torch.Tensor):
        return data.device
    return None


def slice_tensors(data: Any, tensor_slice: Any, process_index: Optional[int] = None,
                  num_processes: Optional[int] = None) -> Any:
    return recursively_apply(lambda t, s: t[s], data, tensor_slice)


def concatenate(data: list, dim: int = 0) -> Any:
    """Concatenate a list of identically nested structures of tensors along `dim`."""
    first = data[0]
    if isinstance(first, (tuple, list)):
        return honor_type(first, (concatenate([d[i] for d in data], dim=dim) for i in range(len(first))))
    if isinstance(first, Mapping):
        return type(first)({k: concatenate([d[k] for d in data], dim=dim) for k in first.keys()})
    if isinstance(first, torch.Tensor):
        return torch.cat(data, dim=dim)
    if isinstance(data, (tuple, list)) and len(data) == 1:
        return first
    raise TypeError(f"Can only concatenate tensors but got {type(first)}")


def convert_to_fp32(tensor: Any) -> Any:
    def _is_half(t: Any) -> bool:
        return (is_torch_tensor(t) or hasattr(t, "dtype")) and t.dtype in LOW_PRECISION

    return recursively_apply(lambda t: t.float(), tensor, test_type=_is_half)


class ConvertOutputsToFp32:
    """A forward whose outputs come back in fp32 (convert_to_fp32 on them); refuses pickling, as HF's."""

    def __init__(self, model_forward: Callable) -> None:
        self.model_forward = model_forward
        update_wrapper(self, model_forward)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return convert_to_fp32(self.model_forward(*args, **kwargs))

    def __getstate__(self) -> None:
        raise pickle.PicklingError("Cannot pickle a prepared model with automatic mixed precision, please unwrap the "
                                   "model with `Accelerator.unwrap_model(model)` before pickling it.")


def convert_outputs_to_fp32(model_forward: Callable) -> Callable:
    """`model_forward` with its fp16/bf16 outputs converted to fp32; `__wrapped__` names the converter, so
    extract_model_from_parallel can strip it."""
    converter = ConvertOutputsToFp32(model_forward)

    def forward(*args: Any, **kwargs: Any) -> Any:
        return converter(*args, **kwargs)

    forward.__wrapped__ = converter
    return forward


def pad_input_tensors(tensor: Any, batch_size: int, num_processes: int, dim: int = 0) -> Any:
    """Each tensor of a nested structure zero-padded along dim 0 to a size `num_processes` can split (HF 1.15's
    arithmetic, kept exactly, including its choice of padding for batches smaller than `num_processes`); the
    original rows are copied in along `dim`. Any leaf that is not a tensor is a TypeError."""
    def _pad(t: torch.Tensor, batch_size: int, num_processes: int, dim: int = 0) -> torch.Tensor:
        per_process = batch_size // num_processes
        last_inputs = batch_size - per_process * num_processes
        to_pad = num_processes - batch_size if per_process == 0 else num_processes - per_process
        if to_pad < 1 and last_inputs > to_pad:  # HF's `last_inputs > to_pad & to_pad < 1`, as Python parses it
            to_pad = last_inputs - to_pad
        size = list(t.shape)
        size[0] = batch_size + to_pad
        out = t.new_zeros(tuple(size))
        out[tuple(slice(0, t.shape[dim]) if i == dim else slice(None) for i in range(len(size)))] = t
        return out

    return recursively_apply(_pad, tensor, error_on_other_type=True, batch_size=batch_size,
                             num_processes=num_processes, dim=dim)
