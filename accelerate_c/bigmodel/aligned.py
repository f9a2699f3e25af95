# accelerate_c/bigmodel/aligned.py: HF's helpers for reaching the real weights of a dispatched model from outside its
# forward (accelerate.utils.modeling: has_offloaded_params, align_module_device, get_state_dict_offloaded_model):
# compression and export tools read an offloaded module's weights through them. align_module_device runs the
# module's AlignDevicesHook as its forward would (the weights brought onto the execution device, or onto the one
# given) and gives them back after.
# Not for: the hooks themselves (hooks.py) or placing a model (dispatch.py).
from __future__ import annotations

import contextlib
import logging
from typing import Iterator, Optional, Union

import torch
from torch import nn

from .hooks import AlignDevicesHook
from .tensors import set_module_tensor_to_device

logger = logging.getLogger(__name__)


def has_offloaded_params(module: nn.Module) -> bool:
    """Whether `module` has an AlignDevicesHook that offloads its weights."""
    hook = getattr(module, "_hf_hook", None)
    return isinstance(hook, AlignDevicesHook) and bool(hook.offload)


@contextlib.contextmanager
def align_module_device(module: nn.Module,
                        execution_device: Optional[Union[int, str, torch.device]] = None) -> Iterator[None]:
    """Inside: `module`'s own weights are real tensors on its execution device (or `execution_device`)."""
    if has_offloaded_params(module):
        hook = module._hf_hook
        saved = hook.execution_device
        if execution_device is not None:
            hook.execution_device = execution_device
        try:
            hook.pre_forward(module)
            yield
        finally:
            hook.post_forward(module, None)
            hook.execution_device = saved
    elif execution_device is not None:
        devices = {name: p.device for name, p in module.named_parameters(recurse=False)}
        try:
            for name in devices:
                set_module_tensor_to_device(module, name, execution_device)
            yield
        finally:
            for name, device in devices.items():
                set_module_tensor_to_device(module, name, device)
    else:
        yield


def get_state_dict_offloaded_model(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole state dict of a dispatched model, on the CPU, each module's weights brought in turn."""
    state: dict[str, torch.Tensor] = {}
    on_meta = set()
    for name, module in model.named_modules():
        if not name:
            continue
        try:
            with align_module_device(module, "cpu"):
                tensors = module.state_dict()
        except MemoryError:
            raise MemoryError("Offloaded module must fit in CPU memory to call save_model!") from None
        for key, t in tensors.items():
            if t.device.type == "meta":
                on_meta.add(f"{name}.{key}")
            else:
                state[f"{name}.{key}"] = t.to("cpu")
    on_meta -= set(state)
    if on_meta:
        logger.warning("The following tensors were not saved because they were still on meta device: %s", on_meta)
    return state
