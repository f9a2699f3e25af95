# accelerate_c/runtime/operations.py: HF Accelerate's tensor/collective helpers under its names and semantics
# (gather, gather_object, broadcast, broadcast_object_list, reduce, pad_across_processes, ...), and HF's path for
# the structure helpers of runtime/structures.py (send_to_device, recursively_apply, ..., re-exported).
# Every collective goes through ONE private function per op (_all_gather_into, _all_reduce_into, _broadcast_,
# _all_gather_objects, _broadcast_objects_), implemented in accelerate_c.comm.collectives, which picks C shared
# memory for CPU tensors and torch.distributed otherwise. gather/reduce of a bare tensor skip the structure
# walk: they are everyday calls (a metric per step) whose Python overhead is the cost.
# Not for: process-group setup (state.py) or RNG helpers (utils/random.py).
from __future__ import annotations

import warnings
from functools import wraps
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ..base.dataclasses import DistributedType
# the structure helpers, re-exported here: HF's path for them is accelerate.utils.operations
from .structures import (ConvertOutputsToFp32, TensorInformation, concatenate, convert_outputs_to_fp32,  # noqa: F401
                         convert_to_fp32, find_batch_size, find_device, get_data_structure, get_shape, honor_type,
                         ignorant_find_batch_size, initialize_tensors, is_namedtuple, is_tensor_information,
                         is_torch_tensor, listify, pad_input_tensors, recursively_apply, send_to_device,
                         slice_tensors)


class DistributedOperationException(Exception):
    """Raised (in debug mode) when a collective is called with inputs that differ across processes."""


class CannotPadNestedTensorWarning(UserWarning):
    pass


_PS: Any = None  # the PartialState class, imported on first use (state.py imports utils)


def _shared() -> dict:
    """PartialState's shared attribute dict, creating the state first when it is empty (as PartialState()
    does in HF's helpers). A dict read, so the everyday collectives pay no object construction."""
    global _PS
    if _PS is None:
        from .state import PartialState
        _PS = PartialState
    d = _PS._shared_state
    if not d:
        _PS()
    return d


def _state() -> Any:
    _shared()
    return _PS()


def _distributed() -> bool:
    """True when collectives must really talk to the other processes."""
    return _shared()["distributed_type"] not in (DistributedType.NO, DistributedType.XLA) and dist.is_initialized()


# ---- the transport: one function per collective (accelerate_c.comm.collectives; loaded on first use, so that
# `import accelerate_c.runtime.operations` does not load the comm package)
_transport: Any = None


def _t() -> Any:
    global _transport
    if _transport is None:
        from ..comm import collectives as transport
        _transport = transport
    return _transport


def _all_gather_into(tensor: torch.Tensor) -> torch.Tensor:
    return _t().all_gather_into(tensor)


def _all_reduce_into(tensor: torch.Tensor, reduction: str) -> torch.Tensor:
    return _t().all_reduce_into(tensor, reduction)


def _broadcast_(tensor: torch.Tensor, src: int) -> torch.Tensor:
    return _t().broadcast_(tensor, src)


def _all_gather_objects(obj: Any) -> list:
    return _t().all_gather_objects(obj)


def _broadcast_objects_(object_list: list, src: int) -> list:
    return _t().broadcast_objects_(object_list, src)


# ---- debug-mode verification ------------------------------------------------------------------------------
def verify_operation(function: Callable) -> Callable:
    """With ACCELERATE_DEBUG_MODE, check the input shapes match on every process before the collective."""

    @wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        d = _shared()
        if not d.get("debug") or d["distributed_type"] == DistributedType.NO:
            return function(*args, **kwargs)
        st = _state()
        operation = f"{function.__module__}.{function.__name__}"
        tensor = kwargs["tensor"] if "tensor" in kwargs else args[0]
        found = find_device(tensor)
        if found is not None and st.device.type != found.type:
            raise DistributedOperationException(
                f"One or more of the tensors passed to {operation} were not on the {found.type} while the "
                f"`Accelerator` is configured for {st.device.type}. Please move it to the {st.device.type} "
                f"before calling {operation}.")
        shapes = gather_object([get_shape(tensor)])
        if shapes[0] is not None and shapes.count(shapes[0]) != len(shapes):
            per_rank = "\n  - ".join(f"Process {i}: {s}" for i, s in enumerate(shapes))
            raise DistributedOperationException(
                "Cannot apply desired operation due to shape mismatches. All shapes across devices must be valid."
                f"\n\nOperation: `{operation}`\nInput shapes:\n  - {per_rank}")
        return function(*args, **kwargs)

    return wrapper


def chained_operation(function: Callable) -> Callable:
    """Re-raise a DistributedOperationException from a nested collective naming this operation."""

    @wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except DistributedOperationException as e:
            operation = f"{function.__module__}.{function.__name__}"
            raise DistributedOperationException(
                f"Error found while calling `{operation}`. Please see the earlier error for more details.") from e

    return wrapper


# ---- collectives ------------------------------------------------------------------------------------------
def _gather_one(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.ndim == 0:
        tensor = tensor.clone()[None]
    return _all_gather_into(tensor.contiguous())


@verify_operation
def gather(tensor: Any) -> Any:
    """Gather (cat on dim 0, rank order) every tensor of a nested structure from all processes."""
    if not _distributed():
        return tensor
    if isinstance(tensor, torch.Tensor):  # the everyday case: what recursively_apply would do, minus its walk
        return _gather_one(tensor)
    return recursively_apply(_gather_one, tensor, error_on_other_type=True)


def gather_object(object: Any) -> Any:
    """Gather picklable objects (each rank passes a list) into one flat list in rank order."""
    st = _state()
    if st.distributed_type == DistributedType.XLA:
        raise NotImplementedError("gather objects in TPU is not supported")
    if not _distributed():
        return object
    return [x for per_rank in _all_gather_objects(object) for x in per_rank]


@verify_operation
def broadcast(tensor: Any, from_process: int = 0) -> Any:
    """Broadcast (in place) every tensor of a nested structure from `from_process`."""
    if not _distributed():
        return tensor
    return recursively_apply(_broadcast_, tensor, error_on_other_type=True, src=from_process)


def broadcast_object_list(object_list: list, from_process: int = 0) -> list:
    """Replace (in place) the items of `object_list` by those of `from_process`."""
    if _distributed():
        _broadcast_objects_(object_list, from_process)
    return object_list


@chained_operation
def pad_across_processes(tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
    """Pad every tensor along `dim` to the largest size across processes (with `pad_index`)."""

    def _pad(t: torch.Tensor, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> torch.Tensor:
        if getattr(t, "is_nested", False):
            warnings.warn("Cannot pad nested tensors without more information. Leaving unprocessed.",
                          CannotPadNestedTensorWarning)
            return t
        if dim >= t.ndim or dim < -t.ndim:
            return t
        dim = dim % t.ndim
        sizes = gather(torch.tensor(t.shape, device=t.device)[None]).cpu()
        max_size = int(max(s[dim] for s in sizes))
        if max_size == t.shape[dim]:
            return t
        new_shape = list(t.shape)
        new_shape[dim] = max_size
        out = t.new_zeros(tuple(new_shape)) + pad_index
        start = max_size - t.shape[dim] if pad_first else 0
        index = tuple(slice(start, start + t.shape[dim]) if i == dim else slice(None) for i in range(t.ndim))
        out[index] = t
        return out

    return recursively_apply(_pad, tensor, error_on_other_type=True, dim=dim, pad_index=pad_index,
                             pad_first=pad_first)


def _reduce_one(t: torch.Tensor, reduction: str = "mean", scale: float = 1.0) -> torch.Tensor:
    if _shared()["distributed_type"] == DistributedType.NO:
        return t.clone()
    if _distributed():
        return _all_reduce_into(t, reduction)
    out = t.clone()
    if reduction == "mean":
        out /= _shared()["num_processes"]
    return out


@verify_operation
def reduce(tensor: Any, reduction: str = "mean", scale: float = 1.0) -> Any:
    """All-reduce (sum/mean/max) copies of every tensor of a nested structure. `scale` is accepted for
    compatibility; as in HF it only affects XLA."""
    if isinstance(tensor, torch.Tensor):  # the everyday case: what recursively_apply would do, minus its walk
        return _reduce_one(tensor, reduction)
    return recursively_apply(_reduce_one, tensor, error_on_other_type=True, reduction=reduction, scale=scale)


_DTYPE_CODES = {torch.float: 1, torch.double: 2, torch.half: 3, torch.bfloat16: 4, torch.uint8: 5, torch.int8: 6,
                torch.int16: 7, torch.int32: 8, torch.int64: 9, torch.bool: 10}
_CODE_DTYPES = {v: k for k, v in _DTYPE_CODES.items()}


def copy_tensor_to_devices(tensor: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Copy the tensor that exactly one process holds (others pass None) to every process (sum-reduce)."""
    st = _state()
    info = [None if tensor is None else (list(tensor.shape), _DTYPE_CODES[tensor.dtype])]
    known = [i for i in gather_object(info) if i is not None]
    shape, code = known[0]
    if tensor is None:
        tensor = torch.zeros(shape, dtype=_CODE_DTYPES[code], device=st.device)
    return reduce(tensor, reduction="sum")
