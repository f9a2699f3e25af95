# accelerate_c/bigmodel/empty.py: building a model without memory for its weights (HF 1.15's
# init_empty_weights / init_on_device): while the context is open, every parameter a module registers is moved to
# the given device ("meta": no memory at all), buffers too with `include_buffers` (default: HF's variable
# ACCELERATE_INIT_INCLUDE_BUFFERS, read through base/settings.env_flag as HF's face reads it).
# Not for: loading weights into such a model (checkpoint.py) or placing it (dispatch.py).
from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Union

import torch
from torch import nn

from ..base import settings

CONSTRUCTORS = ("empty", "zeros", "ones", "full")


@contextlib.contextmanager
def init_on_device(device: Union[str, torch.device], include_buffers: Optional[bool] = None) -> Iterator[None]:
    """Parameters (and, with `include_buffers`, buffers and the tensors torch.empty/zeros/ones/full make) created
    inside the context are on `device`; the class of a parameter and its attributes are kept."""
    if include_buffers is None:
        include_buffers = settings.env_flag("ACCELERATE_INIT_INCLUDE_BUFFERS", False)
    if include_buffers:
        with torch.device(device):
            yield
        return
    original = nn.Module.register_parameter

    def register_parameter(module: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        original(module, name, param)
        if param is None:
            return
        current = module._parameters[name]
        attrs = dict(current.__dict__)
        hf_flag = attrs.pop("_is_hf_initialized", None)
        attrs["requires_grad"] = param.requires_grad
        moved = type(current)(current.to(device), **attrs)
        if hf_flag is not None:
            moved._is_hf_initialized = hf_flag
        module._parameters[name] = moved

    nn.Module.register_parameter = register_parameter
    try:
        yield
    finally:
        nn.Module.register_parameter = original


@contextlib.contextmanager
def init_empty_weights(include_buffers: Optional[bool] = None) -> Iterator[None]:
    """init_on_device("meta"): the model's structure without the memory of its weights."""
    with init_on_device(torch.device("meta"), include_buffers=include_buffers) as ctx:
        yield ctx
