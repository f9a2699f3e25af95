# accelerate_c/bigmodel/dispatch.py: placing a model by a device map (HF 1.15's dispatch_model,
# load_checkpoint_and_dispatch, cpu_offload, cpu_offload_with_hook, disk_offload; same signatures, same hooks and
# `hf_device_map`); HF's import path `accelerate_c.big_modeling` is this module (a face), so it also carries the
# names HF's big_modeling has (init_empty_weights, init_on_device, infer_auto_device_map, ...). Modules on "disk"
# (and on "cpu" when a GPU runs the model) get offloading AlignDevicesHooks over one OffloadedWeightsLoader; when
# some of their weights are on disk a Prefetcher (prefetch.py) reads the next module's weights during the current
# one's forward. The device map is checked first through this module's global
# `check_device_map` (transformers swaps `accelerate.big_modeling.check_device_map` for its skip_device_map_check()).
# Not for: choosing the map (device_map.py) or reading checkpoints (checkpoint.py).
from __future__ import annotations

import functools
import logging
import os
import re
from typing import Any, Optional, Union

import torch
from torch import nn

from .checkpoint import load_checkpoint_in_model, retie_parameters
from .empty import init_empty_weights, init_on_device  # noqa: F401 - HF's big_modeling names
from .device_map import check_device_map, infer_auto_device_map
from .hooks import (AlignDevicesHook, CpuOffload, LayerwiseCastingHook, UserCpuOffloadHook, add_hook_to_module,
                    attach_align_device_hook,
                    attach_align_device_hook_on_blocks)
from .offload import OffloadedWeightsLoader, extract_submodules_state_dict, offload_state_dict
from .prefetch import attach_prefetcher
from .sizes import find_tied_parameters, get_balanced_memory
from .tensors import recursive_getattr

logger = logging.getLogger(__name__)
MOVED = "You shouldn't move a model that is dispatched using accelerate hooks."


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def cpu_offload(model: nn.Module, execution_device: Optional[torch.device] = None, offload_buffers: bool = False,
                state_dict: Optional[dict] = None, preload_module_classes: Optional[list[str]] = None) -> nn.Module:
    """Every weight kept on CPU (a copy of the state dict), brought to `execution_device` for each forward."""
    execution_device = execution_device if execution_device is not None else _default_device()
    if state_dict is None:
        state_dict = {n: p.to("cpu") for n, p in model.state_dict().items()}
    add_hook_to_module(model, AlignDevicesHook(io_same_device=True), append=True)
    attach_align_device_hook(model, execution_device=execution_device, offload=True, offload_buffers=offload_buffers,
                             weights_map=state_dict, preload_module_classes=preload_module_classes)
    return model


def cpu_offload_with_hook(model: nn.Module, execution_device: Optional[Union[int, str, torch.device]] = None,
                          prev_module_hook: Optional[UserCpuOffloadHook] = None
                          ) -> tuple[nn.Module, UserCpuOffloadHook]:
    """The whole model on CPU, moved to `execution_device` at its forward and left there until the next model of
    the chain (given this one's hook as `prev_module_hook`) runs, or `hook.offload()`."""
    hook = CpuOffload(execution_device=execution_device, prev_module_hook=prev_module_hook)
    add_hook_to_module(model, hook, append=True)
    return model, UserCpuOffloadHook(model, hook)


def disk_offload(model: nn.Module, offload_dir: Union[str, os.PathLike],
                 execution_device: Optional[torch.device] = None, offload_buffers: bool = False,
                 preload_module_classes: Optional[list[str]] = None) -> nn.Module:
    """Every weight written to `offload_dir` (safetensors + index.json; kept when already there) and read back for
    each forward, the next module's in the background."""
    if not os.path.isdir(offload_dir) or not os.path.isfile(os.path.join(offload_dir, "index.json")):
        offload_state_dict(offload_dir, model.state_dict())
    execution_device = execution_device if execution_device is not None else _default_device()
    weights_map = OffloadedWeightsLoader(save_folder=offload_dir)
    add_hook_to_module(model, AlignDevicesHook(io_same_device=True), append=True)
    attach_align_device_hook(model, execution_device=execution_device, offload=True, offload_buffers=offload_buffers,
                             weights_map=weights_map, preload_module_classes=preload_module_classes)
    attach_prefetcher(model)
    return model


def _guard_moves(model: nn.Module) -> None:
    """model.to / .cuda warn, and refuse when offloaded weights sit on "meta" (HF's behaviour)."""
    def guarded(fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if fn.__name__ != "to" or torch._C._nn._parse_to(*args, **kwargs)[0] is not None:
                logger.warning(MOVED)
            if any(p.device == torch.device("meta") for p in model.parameters()):
                raise RuntimeError("You can't move a model that has some modules offloaded to cpu or disk.")
            return fn(*args, **kwargs)
        return wrapper
    model.to = guarded(model.to)
    model.cuda = guarded(model.cuda)


def dispatch_model(model: nn.Module, device_map: dict, main_device: Optional[torch.device] = None,
                   state_dict: Optional[dict] = None, offload_dir: Optional[Union[str, os.PathLike]] = None,
                   offload_index: Optional[dict] = None, offload_buffers: bool = False,
                   skip_keys: Optional[Union[str, list[str]]] = None,
                   preload_module_classes: Optional[list[str]] = None, force_hooks: bool = False) -> nn.Module:
    """Places `model` by `device_map` ({module name: GPU index | "cpu" | "disk"}) with hooks; one device and no
    hooks forced: a plain `model.to(device)`. Sets `model.hf_device_map`."""
    check_device_map(model, device_map)  # a global on purpose: transformers swaps it (skip_device_map_check)
    devices = set(device_map.values())
    if len(devices) > 1 or "disk" in devices or force_hooks:
        if main_device is None:
            placed = devices - {"cpu", "disk"}
            main_device = list(placed)[0] if placed else "cpu"
        if main_device != "cpu":
            cpu_modules = [n for n, d in device_map.items() if d == "cpu"]
            if state_dict is None and cpu_modules:
                state_dict = extract_submodules_state_dict(model.state_dict(), cpu_modules)
        disk_modules = [n for n, d in device_map.items() if d == "disk"]
        if offload_dir is None and offload_index is None and disk_modules:
            raise ValueError("We need an `offload_dir` to dispatch this model according to this `device_map`, the "
                             f"following submodules need to be offloaded: {', '.join(disk_modules)}.")
        if disk_modules and offload_index is None and not os.path.isfile(os.path.join(offload_dir, "index.json")):
            offload_state_dict(offload_dir, extract_submodules_state_dict(model.state_dict(), disk_modules))
        execution_device = {n: main_device if d in ("cpu", "disk") else d for n, d in device_map.items()}
        execution_device[""] = main_device
        offloaded = ["disk"] if main_device in ("cpu", "mps") else ["cpu", "disk"]
        offload = {n: d in offloaded for n, d in device_map.items()}
        save_folder = offload_dir if disk_modules else None
        weights_map = None
        if state_dict is not None or save_folder is not None or offload_index is not None:
            weights_map = OffloadedWeightsLoader(state_dict=state_dict, save_folder=save_folder, index=offload_index,
                                                 device=main_device if offload_index is not None else None)
        tied = find_tied_parameters(model)
        tied_map = {recursive_getattr(model, n).data_ptr(): {} for g in tied for n in g
                    if recursive_getattr(model, n).device.type != "meta"}
        attach_align_device_hook_on_blocks(model, execution_device=execution_device, offload=offload,
                                           offload_buffers=offload_buffers, weights_map=weights_map,
                                           skip_keys=skip_keys, preload_module_classes=preload_module_classes,
                                           tied_params_map=tied_map)
        where = " and ".join(d for d in devices if d in ("cpu", "disk"))
        if where:
            logger.warning(f"Some parameters are on the meta device because they were offloaded to the {where}.")
        retie_parameters(model, tied)
        _guard_moves(model)
        attach_prefetcher(model, device_map)
    else:
        model.to(list(devices)[0])
    model.hf_device_map = dict(device_map)
    return model


def load_checkpoint_and_dispatch(model: nn.Module, checkpoint: Union[str, os.PathLike],
                                 device_map: Optional[Union[str, dict]] = None, max_memory: Optional[dict] = None,
                                 no_split_module_classes: Optional[list[str]] = None,
                                 offload_folder: Optional[Union[str, os.PathLike]] = None,
                                 offload_buffers: bool = False, dtype: Optional[Union[str, torch.dtype]] = None,
                                 offload_state_dict: Optional[bool] = None,
                                 skip_keys: Optional[Union[str, list[str]]] = None,
                                 preload_module_classes: Optional[list[str]] = None, force_hooks: bool = False,
                                 strict: bool = False, full_state_dict: bool = True,
                                 broadcast_from_rank0: bool = False) -> nn.Module:
    """load_checkpoint_in_model, then dispatch_model; a string `device_map` ("auto", "balanced", "balanced_low_0",
    "sequential") is computed with infer_auto_device_map (after get_balanced_memory unless "sequential")."""
    if isinstance(device_map, str) and device_map not in ("auto", "balanced", "balanced_low_0", "sequential"):
        raise ValueError("If passing a string for `device_map`, please choose 'auto', 'balanced', 'balanced_low_0' or "
                         "'sequential'.")
    if isinstance(device_map, str):
        if device_map != "sequential":
            max_memory = get_balanced_memory(model, max_memory=max_memory,
                                             no_split_module_classes=no_split_module_classes, dtype=dtype,
                                             low_zero=(device_map == "balanced_low_0"))
        device_map = infer_auto_device_map(model, max_memory=max_memory,
                                           no_split_module_classes=no_split_module_classes, dtype=dtype,
                                           offload_buffers=offload_buffers)
    if device_map is not None:
        check_device_map(model, device_map)  # a global on purpose: transformers swaps it (skip_device_map_check)
    load_checkpoint_in_model(model, checkpoint, device_map=device_map, offload_folder=offload_folder, dtype=dtype,
                             offload_state_dict=bool(offload_state_dict), offload_buffers=offload_buffers,
                             strict=strict, full_state_dict=full_state_dict, broadcast_from_rank0=broadcast_from_rank0)
    if device_map is None:
        return model
    return dispatch_model(model, device_map=device_map, offload_dir=offload_folder, offload_buffers=offload_buffers,
                          skip_keys=skip_keys, preload_module_classes=preload_module_classes, force_hooks=force_hooks)


# the layers attach_layerwise_casting_hooks casts (HF's accelerate.utils.constants name)
SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
                                          nn.ConvTranspose3d, nn.Linear)


def attach_layerwise_casting_hooks(module: nn.Module, storage_dtype: torch.dtype, compute_dtype: torch.dtype,
                                   skip_modules_pattern: Optional[Union[str, tuple[str, ...]]] = None,
                                   skip_modules_classes: Optional[tuple[type, ...]] = None,
                                   non_blocking: bool = False) -> None:
    """HF's: every Linear / convolution inside `module` (or `module` itself when it is one) keeps its weights in
    `storage_dtype` and computes in `compute_dtype`; modules whose dotted name matches a pattern of
    `skip_modules_pattern` (regular expressions; a single string is one pattern) or whose class is in
    `skip_modules_classes` keep theirs, with everything under them."""
    patterns = (skip_modules_pattern,) if isinstance(skip_modules_pattern, str) else tuple(skip_modules_pattern or ())
    classes = tuple(skip_modules_classes or ())

    def visit(m: nn.Module, name: str) -> None:
        if (classes and isinstance(m, classes)) or any(re.search(p, name) for p in patterns):
            return
        if isinstance(m, SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING):
            add_hook_to_module(m, LayerwiseCastingHook(storage_dtype, compute_dtype, non_blocking), append=True)
            return
        for child_name, child in m.named_children():
            visit(child, f"{name}.{child_name}" if name else child_name)
    visit(module, "")
