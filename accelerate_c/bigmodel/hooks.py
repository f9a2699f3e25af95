# accelerate_c/bigmodel/hooks.py: HF 1.15's forward hooks (the names `accelerate.hooks` exports, same
# signatures and attributes: `_hf_hook`, `_old_forward`): ModelHook / SequentialHook, add_hook_to_module /
# remove_hook_from_module / remove_hook_from_submodules, AlignDevicesHook (inputs and weights on the execution device
# for the forward, offloaded weights brought in from their weights map and dropped to "meta" after), CpuOffload and
# UserCpuOffloadHook (cpu_offload_with_hook's chaining), and the attach_* functions that hook a whole model
# (attach_execution_device_hook, attach_align_device_hook, attach_align_device_hook_on_blocks: per block of a device
# map, placed blocks move once, offloaded ones are brought in at each forward). An AlignDevicesHook with a
# `prefetcher` (prefetch.py) takes weights the prefetcher read in the background and lets it start on the next one.
# Not for: where modules go (device_map.py) or reading offloaded weights ahead (prefetch.py).
from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from ..runtime.operations import find_device, send_to_device
from .offload import PrefixedDataset
from .sizes import get_non_persistent_buffers, named_module_tensors
from .tensors import recursive_getattr, set_module_tensor_to_device

Keys = Optional[Union[str, list[str]]]
# attributes dispatch_model sets on modules (removed with the hooks)
ADDED_ATTRIBUTES = ("to", "cuda", "npu", "xpu", "mlu", "sdaa", "musa")


class ModelHook:
    """Called around a module's forward: init_hook when attached, pre_forward (may change the inputs),
    post_forward (may change the output), detach_hook when removed. `no_grad` runs the forward without grad."""
    no_grad = False

    def init_hook(self, module: nn.Module) -> nn.Module:
        return module

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        return module


def _compiler_disabled(fn: Callable) -> Callable:
    """torch.compiler.disable(fn), built at the first call: applied at import it would import torch._dynamo (seconds,
    and its cache folder) for everyone who imports the hooks."""
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if call.disabled is None:
            call.disabled = torch.compiler.disable(fn)
        return call.disabled(*args, **kwargs)
    call.disabled = None
    return call


class LayerwiseCastingHook(ModelHook):
    """HF's: the module's weights are stored in `storage_dtype` and cast to `compute_dtype` for its forward only
    (attach_layerwise_casting_hooks puts one on each Linear / convolution)."""

    _is_stateful = False

    def __init__(self, storage_dtype: torch.dtype, compute_dtype: torch.dtype, non_blocking: bool) -> None:
        self.storage_dtype, self.compute_dtype, self.non_blocking = storage_dtype, compute_dtype, non_blocking

    def init_hook(self, module: nn.Module) -> nn.Module:
        return module.to(dtype=self.storage_dtype, non_blocking=self.non_blocking)

    @_compiler_disabled
    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        module.to(dtype=self.compute_dtype, non_blocking=self.non_blocking)
        return args, kwargs

    @_compiler_disabled
    def post_forward(self, module: nn.Module, output: Any) -> Any:
        module.to(dtype=self.storage_dtype, non_blocking=self.non_blocking)
        return output


class SequentialHook(ModelHook):
    """Several hooks in order (post_forward in the same order, as HF)."""

    def __init__(self, *hooks: ModelHook) -> None:
        self.hooks = hooks

    def init_hook(self, module: nn.Module) -> nn.Module:
        for hook in self.hooks:
            module = hook.init_hook(module)
        return module

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        for hook in self.hooks:
            args, kwargs = hook.pre_forward(module, *args, **kwargs)
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        for hook in self.hooks:
            output = hook.post_forward(module, output)
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        for hook in self.hooks:
            module = hook.detach_hook(module)
        return module


def _hooked_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    hook = module._hf_hook
    args, kwargs = hook.pre_forward(module, *args, **kwargs)
    if hook.no_grad:
        with torch.no_grad():
            output = module._old_forward(*args, **kwargs)
    else:
        output = module._old_forward(*args, **kwargs)
    return hook.post_forward(module, output)


def _set_forward(module: nn.Module, forward: Any) -> None:
    if "GraphModuleImpl" in str(type(module)):  # an instance forward would freeze a GraphModule's graph
        module.__class__.forward = forward
    else:
        module.forward = forward


def add_hook_to_module(module: nn.Module, hook: ModelHook, append: bool = False) -> nn.Module:
    """Wraps `module.forward` with `hook` (replacing an earlier hook, or chained after it with `append`)."""
    if append and getattr(module, "_hf_hook", None) is not None:
        old = module._hf_hook
        remove_hook_from_module(module)
        hook = SequentialHook(old, hook)
    if hasattr(module, "_hf_hook") and hasattr(module, "_old_forward"):
        old_forward = module._old_forward
    else:
        old_forward = module.forward
        module._old_forward = old_forward
    module = hook.init_hook(module)
    module._hf_hook = hook
    _set_forward(module, functools.update_wrapper(functools.partial(_hooked_forward, module), old_forward))
    return module


def remove_hook_from_module(module: nn.Module, recurse: bool = False) -> nn.Module:
    """Detaches the hook and restores the original forward (and, with `recurse`, the children's)."""
    if hasattr(module, "_hf_hook"):
        module._hf_hook.detach_hook(module)
        delattr(module, "_hf_hook")
    if hasattr(module, "_old_forward"):
        _set_forward(module, module._old_forward)
        delattr(module, "_old_forward")
    for attr in ADDED_ATTRIBUTES:
        module.__dict__.pop(attr, None)
    if recurse:
        for child in module.children():
            remove_hook_from_module(child, recurse)
    return module


def remove_hook_from_submodules(module: nn.Module) -> None:
    remove_hook_from_module(module)
    for child in module.children():
        remove_hook_from_submodules(child)


class AlignDevicesHook(ModelHook):
    """Inputs (and, unless offloaded, weights) on `execution_device` for the forward; with `offload`, the weights
    live in `weights_map` (a CPU dict, a disk loader, a PrefixedDataset) and sit on "meta" between forwards;
    `io_same_device` moves the output back to where the input was."""

    def __init__(self, execution_device: Optional[Union[int, str, torch.device]] = None, offload: bool = False,
                 io_same_device: bool = False, weights_map: Optional[Mapping] = None, offload_buffers: bool = False,
                 place_submodules: bool = False, skip_keys: Optional[Union[str, list[str]]] = None,
                 tied_params_map: Optional[dict] = None) -> None:
        self.execution_device = execution_device
        self.offload = offload
        self.io_same_device = io_same_device
        self.weights_map = weights_map
        self.offload_buffers = offload_buffers
        self.place_submodules = place_submodules
        self.skip_keys = skip_keys
        self.input_device = None
        self.param_original_devices: dict = {}
        self.buffer_original_devices: dict = {}
        self.tied_params_names: set = set()
        self.tied_params_map = tied_params_map
        self.tied_pointers_to_remove: set = set()
        self.prefetcher: Any = None  # set by dispatch (prefetch.Prefetcher) for offloaded modules

    def __repr__(self) -> str:
        return (f"AlignDevicesHook(execution_device={self.execution_device}, offload={self.offload}, "
                f"io_same_device={self.io_same_device}, offload_buffers={self.offload_buffers}, "
                f"place_submodules={self.place_submodules}, skip_keys={repr(self.skip_keys)})")

    def offloaded_names(self, module: nn.Module) -> list[str]:
        return [n for n, _ in named_module_tensors(module, include_buffers=self.offload_buffers,
                                                   recurse=self.place_submodules, remove_non_persistent=True)]

    def init_hook(self, module: nn.Module) -> nn.Module:
        if self.execution_device in ("meta", torch.device("meta")):
            self.tied_params_map = None
        if not self.offload and self.execution_device is not None:
            for name, _ in named_module_tensors(module, recurse=self.place_submodules):
                set_module_tensor_to_device(module, name, self.execution_device, tied_params_map=self.tied_params_map)
        elif self.offload:
            self.original_devices = {n: t.device
                                     for n, t in named_module_tensors(module, recurse=self.place_submodules)}
            if self.weights_map is None:
                self.weights_map = {n: t.to("cpu") for n, t in named_module_tensors(
                    module, include_buffers=self.offload_buffers, recurse=self.place_submodules)}
            for name in self.offloaded_names(module):
                ptr = recursive_getattr(module, name).data_ptr()
                if self.tied_params_map is not None and ptr in self.tied_params_map:
                    self.tied_params_names.add(name)
                set_module_tensor_to_device(module, name, "meta")
            if self.execution_device is not None:
                names = ([n for n, _ in module.named_buffers(recurse=self.place_submodules)] if not self.offload_buffers
                         else get_non_persistent_buffers(module, recurse=self.place_submodules))
                for name in names:
                    set_module_tensor_to_device(module, name, self.execution_device,
                                                tied_params_map=self.tied_params_map)
        return module

    def _weights(self, module: nn.Module) -> dict:
        ready = self.prefetcher.take(self) if self.prefetcher is not None else None
        return ready if ready is not None else {n: self.weights_map[n] for n in self.offloaded_names(module)}

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        if self.io_same_device:
            self.input_device = find_device([args, kwargs])
        if self.offload:
            self.tied_pointers_to_remove = set()
            for name, value in self._weights(module).items():
                ptr = value.data_ptr()
                if name in self.tied_params_names and ptr not in self.tied_params_map:
                    self.tied_params_map[ptr] = {}
                if (self.tied_params_map is not None and ptr in self.tied_params_map
                        and self.execution_device not in self.tied_params_map[ptr]):
                    self.tied_pointers_to_remove.add((ptr, self.execution_device))
                set_module_tensor_to_device(module, name, self.execution_device, value=value,
                                            tied_params_map=self.tied_params_map)
            if self.prefetcher is not None:
                self.prefetcher.started(self, module)  # the next module's weights are read during this forward
        return (send_to_device(args, self.execution_device),
                send_to_device(kwargs, self.execution_device, skip_keys=self.skip_keys))

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        if self.offload:
            for name in self.offloaded_names(module):
                set_module_tensor_to_device(module, name, "meta")
            for ptr, device in self.tied_pointers_to_remove:
                self.tied_params_map[ptr].pop(device, None)
            self.tied_pointers_to_remove = set()
        if self.io_same_device and self.input_device is not None:
            output = send_to_device(output, self.input_device, skip_keys=self.skip_keys)
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        if self.offload:
            for name, device in self.original_devices.items():
                if device != torch.device("meta"):
                    set_module_tensor_to_device(module, name, device, value=self.weights_map.get(name, None))
        return module


class CpuOffload(ModelHook):
    """The whole module on CPU between calls, moved to `execution_device` for its forward (and the previous model
    of a cpu_offload_with_hook chain moved back first)."""

    def __init__(self, execution_device: Optional[Union[str, int, torch.device]] = None,
                 prev_module_hook: Optional["UserCpuOffloadHook"] = None) -> None:
        self.prev_module_hook = prev_module_hook
        if execution_device is None:
            execution_device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.execution_device = execution_device

    def init_hook(self, module: nn.Module) -> nn.Module:
        return module.to("cpu")

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        if isinstance(self.prev_module_hook, UserCpuOffloadHook):
            prev = next(self.prev_module_hook.model.parameters(), None)
            if prev is not None and prev.device != torch.device("cpu"):
                self.prev_module_hook.offload()
        first = next(module.parameters(), None)
        if first is not None and first.device == torch.device(self.execution_device):
            return args, kwargs
        module.to(self.execution_device)
        return send_to_device(args, self.execution_device), send_to_device(kwargs, self.execution_device)


class UserCpuOffloadHook:
    """What cpu_offload_with_hook returns: `offload()` puts the model back on CPU, `remove()` drops the hook."""

    def __init__(self, model: nn.Module, hook: CpuOffload) -> None:
        self.model = model
        self.hook = hook

    def offload(self) -> None:
        self.hook.init_hook(self.model)

    def remove(self) -> None:
        remove_hook_from_module(self.model)



def attach_execution_device_hook(module: nn.Module, execution_device: Union[int, str, torch.device],
                                 skip_keys: Keys = None, preload_module_classes: Optional[list[str]] = None,
                                 tied_params_map: Optional[dict] = None) -> None:
    if not hasattr(module, "_hf_hook") and len(module.state_dict()) > 0:
        add_hook_to_module(module, AlignDevicesHook(execution_device, skip_keys=skip_keys,
                                                    tied_params_map=tied_params_map))
    if preload_module_classes is not None and module.__class__.__name__ in preload_module_classes:
        return
    for child in module.children():
        attach_execution_device_hook(child, execution_device, skip_keys=skip_keys,
                                     preload_module_classes=preload_module_classes, tied_params_map=tied_params_map)


def attach_align_device_hook(module: nn.Module, execution_device: Optional[torch.device] = None,
                             offload: bool = False, weights_map: Optional[Mapping] = None,
                             offload_buffers: bool = False, module_name: str = "", skip_keys: Keys = None,
                             preload_module_classes: Optional[list[str]] = None,
                             tied_params_map: Optional[dict] = None) -> None:
    full = offload and preload_module_classes is not None and module.__class__.__name__ in preload_module_classes
    if any(True for _ in named_module_tensors(module)) or full:
        prefix = f"{module_name}." if module_name else ""
        prefixed = None if weights_map is None else PrefixedDataset(weights_map, prefix)
        hook = AlignDevicesHook(execution_device=execution_device, offload=offload, weights_map=prefixed,
                                offload_buffers=offload_buffers, place_submodules=full, skip_keys=skip_keys,
                                tied_params_map=tied_params_map)
        add_hook_to_module(module, hook, append=True)
    if full:
        return
    for name, child in module.named_children():
        attach_align_device_hook(child, execution_device=execution_device, offload=offload, weights_map=weights_map,
                                 offload_buffers=offload_buffers,
                                 module_name=f"{module_name}.{name}" if module_name else name,
                                 preload_module_classes=preload_module_classes, skip_keys=skip_keys,
                                 tied_params_map=tied_params_map)


def _placed_block(module: nn.Module, device: Any, name: str, offload_buffers: bool, skip_keys: Keys,
                  tied: Optional[dict]) -> None:
    add_hook_to_module(module, AlignDevicesHook(execution_device=device, offload_buffers=offload_buffers,
                                                io_same_device=(name == ""), place_submodules=True,
                                                skip_keys=skip_keys, tied_params_map=tied))
    attach_execution_device_hook(module, device, skip_keys=skip_keys, tied_params_map=tied)


def attach_align_device_hook_on_blocks(module: nn.Module, execution_device: Any = None,
                                       offload: Union[bool, dict] = False, weights_map: Optional[Mapping] = None,
                                       offload_buffers: bool = False, module_name: str = "", skip_keys: Keys = None,
                                       preload_module_classes: Optional[list[str]] = None,
                                       tied_params_map: Optional[dict] = None) -> None:
    """`execution_device` / `offload`: one value for the whole module, or {block name: value} (a device map's)."""
    if not isinstance(execution_device, Mapping) and not isinstance(offload, dict):
        if not offload:
            add_hook_to_module(module, AlignDevicesHook(execution_device=execution_device, io_same_device=True,
                                                        skip_keys=skip_keys, place_submodules=True,
                                                        tied_params_map=tied_params_map))
        else:
            attach_align_device_hook(module, execution_device=execution_device, offload=True, weights_map=weights_map,
                                     offload_buffers=offload_buffers, module_name=module_name, skip_keys=skip_keys,
                                     tied_params_map=tied_params_map)
        return
    if not isinstance(execution_device, Mapping):
        execution_device = {key: execution_device for key in offload}
    if not isinstance(offload, Mapping):
        offload = {key: offload for key in execution_device}
    if module_name in execution_device and module_name in offload and not offload[module_name]:
        _placed_block(module, execution_device[module_name], module_name, offload_buffers, skip_keys, tied_params_map)
    elif module_name in execution_device and module_name in offload:
        attach_align_device_hook(module, execution_device=execution_device[module_name], offload=True,
                                 weights_map=weights_map, offload_buffers=offload_buffers, module_name=module_name,
                                 skip_keys=skip_keys, preload_module_classes=preload_module_classes,
                                 tied_params_map=tied_params_map)
        if not hasattr(module, "_hf_hook"):
            add_hook_to_module(module, AlignDevicesHook(execution_device=execution_device[module_name],
                                                        io_same_device=(module_name == ""), skip_keys=skip_keys,
                                                        tied_params_map=tied_params_map))
        attach_execution_device_hook(module, execution_device[module_name],
                                     preload_module_classes=preload_module_classes, skip_keys=skip_keys,
                                     tied_params_map=tied_params_map)
    elif module_name == "":
        add_hook_to_module(module, AlignDevicesHook(execution_device=execution_device.get(""), io_same_device=True,
                                                    skip_keys=skip_keys, tied_params_map=tied_params_map))
    for name, child in module.named_children():
        attach_align_device_hook_on_blocks(child, execution_device=execution_device, offload=offload,
                                           weights_map=weights_map, offload_buffers=offload_buffers,
                                           module_name=f"{module_name}.{name}" if module_name else name,
                                           preload_module_classes=preload_module_classes, skip_keys=skip_keys,
                                           tied_params_map=tied_params_map)
