# accelerate_c/bigmodel/tensors.py: putting one named tensor of a module on a device or giving it a value
# (HF's set_module_tensor_to_device, 1.15 signature), the one primitive the hooks and the loaders use: a parameter
# stays an nn.Parameter of the same class and requires_grad, a buffer stays a buffer, "meta" frees the memory,
# tied tensors share one copy per device through `tied_params_map`.
# Not for: deciding when to move (hooks.py) or where (device_map.py).
from __future__ import annotations

from typing import Any, Optional, Union

import torch
from torch import nn


def recursive_getattr(obj: Any, attr: str) -> Any:
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    if "." in name:
        path, name = name.rsplit(".", 1)
        for part in path.split("."):
            child = getattr(module, part, None)
            if child is None:
                raise ValueError(f"{module} has no attribute {part}.")
            module = child
    if name not in module._parameters and name not in module._buffers:
        raise ValueError(f"{module} does not have a parameter or a buffer named {name}.")
    return module, name


def _device(device: Union[int, str, torch.device]) -> torch.device:
    if isinstance(device, int):
        return torch.device("cuda", device)
    return torch.device(device)


def set_module_tensor_to_device(module: nn.Module, tensor_name: str, device: Union[int, str, torch.device],
                                value: Optional[torch.Tensor] = None, dtype: Optional[Union[str, torch.dtype]] = None,
                                fp16_statistics: Optional[torch.Tensor] = None,
                                tied_params_map: Optional[dict] = None, non_blocking: bool = False,
                                clear_cache: bool = True) -> None:
    """Puts `module`'s parameter or buffer `tensor_name` (dotted) on `device`, with `value` when given (cast to
    `dtype`, else to the old tensor's floating dtype). A ValueError names a missing tensor or a value whose shape
    differs. `fp16_statistics` (int8 quantization) is not supported: NotImplementedError."""
    if fp16_statistics is not None:
        raise NotImplementedError("set_module_tensor_to_device: fp16_statistics (bitsandbytes int8) is not supported")
    owner, name = _owner(module, tensor_name)
    is_buffer = name in owner._buffers
    old = owner._buffers[name] if is_buffer else owner._parameters[name]
    dev = _device(device)
    if value is not None:
        if old is not None and tuple(old.shape) != tuple(value.shape):
            raise ValueError(f'Trying to set a tensor of shape {value.shape} in "{name}" (which has shape '
                             f"{old.shape}), this looks incorrect.")
        if dtype is not None:
            value = value.to(dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype.replace("torch.", "")))
        elif old is not None and old.dtype.is_floating_point and value.dtype.is_floating_point:
            value = value.to(old.dtype)
    key = None
    if tied_params_map is not None and value is not None and value.data_ptr() in tied_params_map:
        key = value.data_ptr()
        shared = tied_params_map[key].get(dev)
        if shared is not None:
            _assign(owner, name, shared, is_buffer, old)
            return
    with torch.no_grad():
        source = old if value is None else value
        new = source.to(dev, non_blocking=non_blocking) if source is not None else None
    if key is not None:
        tied_params_map[key][dev] = new
    _assign(owner, name, new, is_buffer, old)


def _assign(owner: nn.Module, name: str, new: Optional[torch.Tensor], is_buffer: bool, old: Any) -> None:
    if is_buffer:
        owner._buffers[name] = new
        return
    if new is None or isinstance(new, nn.Parameter):
        owner._parameters[name] = new
        return
    cls = type(old) if isinstance(old, nn.Parameter) else nn.Parameter
    requires_grad = old.requires_grad if old is not None else new.is_floating_point()
    try:
        owner._parameters[name] = cls(new, requires_grad=requires_grad)
    except TypeError:  # a Parameter subclass with another constructor
        owner._parameters[name] = nn.Parameter(new, requires_grad=requires_grad)


def id_tensor_storage(tensor: torch.Tensor) -> tuple[torch.device, int, int]:
    """HF's: (device, address, bytes) of the storage under `tensor`: equal for tensors sharing one storage while it
    lives (every meta tensor reports address 0)."""
    try:
        storage = tensor.untyped_storage()
        return tensor.device, storage.data_ptr(), storage.nbytes()
    except (NotImplementedError, RuntimeError):
        return tensor.device, 0, tensor.nelement() * tensor.element_size()
