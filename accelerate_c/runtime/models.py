# accelerate_c/runtime/models.py: the one owner of unwrapping a model, `extract_model_from_parallel` (accelerate_c's
# DataParallelModule, torch DDP/DataParallel/FSDP, DeepSpeed engines, torch.compile and the mixed-precision
# forward patch), and the torch.compile helpers (`compile_regions`, `compile_model` for a TorchDynamoPlugin).
# HF's path for them is accelerate_c.utils.other.
# Not for: saving or loading (utils/other.py: save/load; checkpointing/ for formats).
from __future__ import annotations

import sys
from types import MethodType
from typing import Any

import torch


def is_compiled_module(module: Any) -> bool:
    """True for a torch.compile'd module (an OptimizedModule)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # not imported yet: nothing can be compiled
    return eval_frame is not None and isinstance(module, eval_frame.OptimizedModule)


def has_compiled_regions(module: torch.nn.Module) -> bool:
    """True when some submodule is a torch.compile'd module (regional compilation)."""
    return bool(module._modules) and any(is_compiled_module(m) for m in module.modules())


def is_repeated_blocks(module: torch.nn.Module) -> bool:
    """A non-empty ModuleList whose children all have the class of the first one."""
    return (isinstance(module, torch.nn.ModuleList) and len(module) > 0
            and all(isinstance(m, module[0].__class__) for m in module))


def has_repeated_blocks(module: torch.nn.Module) -> bool:
    return bool(module._modules) and any(is_repeated_blocks(m) for m in module.modules())


def compile_regions(module: torch.nn.Module, **compile_kwargs: Any) -> torch.nn.Module:
    """Regional compilation (HF's): each block of a repeated ModuleList is compiled on its own (they hit the
    compiler's cache, so cold start is one block's compile), every other leaf branch is compiled whole. Modules on
    the way down are shallow copies holding the compiled children; the original model is untouched and kept as
    `__dict__["_orig_mod"]` of the result, so unwrapping with keep_torch_compile=False gives it back."""
    def regions(m: torch.nn.Module) -> torch.nn.Module:
        if is_repeated_blocks(m):
            return torch.nn.ModuleList(torch.compile(block, **compile_kwargs) for block in m)
        if not has_repeated_blocks(m):
            return torch.compile(m, **compile_kwargs)
        copy = m.__class__.__new__(m.__class__)
        copy.__dict__.update(m.__dict__)
        for name, value in list(copy.__dict__.items()):  # methods bound to the original (e.g. a patched forward)
            if hasattr(value, "__func__") and getattr(value, "__self__", None) is m:
                copy.__dict__[name] = MethodType(value.__func__, copy)
        copy._modules = {}
        for name, child in m.named_children():
            copy.add_module(name, regions(child))
        return copy

    compiled = regions(module)
    if "_orig_mod" not in compiled.__dict__:
        compiled.__dict__["_orig_mod"] = module
    return compiled


def compile_model(model: torch.nn.Module, plugin: Any) -> torch.nn.Module:
    """Applies a TorchDynamoPlugin as HF's prepare_model does: nothing for backend NO or an already compiled
    model, regional compilation when asked, else torch.compile with the plugin's non-default options."""
    from ..base.dataclasses import DynamoBackend

    if plugin is None or plugin.backend == DynamoBackend.NO or is_compiled_module(model):
        return model
    if plugin.use_regional_compilation:
        return compile_regions(model, **plugin.to_kwargs())
    return torch.compile(model, **plugin.to_kwargs())


def _wrapper_types() -> tuple:
    """Container classes whose `.module` is the user's model. Optional ones count only once their module is
    imported (an object of a class never imported cannot exist), so this imports nothing."""
    types: list = [torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel]
    for mod, name in (("torch.distributed.fsdp.fully_sharded_data_parallel", "FullyShardedDataParallel"),
                      ("deepspeed", "DeepSpeedEngine")):
        cls = getattr(sys.modules.get(mod), name, None)
        if isinstance(cls, type):
            types.append(cls)
    return tuple(types)


def _is_wrapper(model: Any, types: tuple) -> bool:
    return isinstance(model, types) or bool(getattr(model, "_accelerate_c_wrapper", False))


def extract_model_from_parallel(model: torch.nn.Module, keep_fp32_wrapper: bool = True,
                                keep_torch_compile: bool = True, recursive: bool = False) -> torch.nn.Module:
    """The user's model out of its containers (HF 1.15 semantics).

    - torch.compile: with keep_torch_compile=True the compiled module is returned, its `_orig_mod` replaced
      by the unwrapped model (as HF does); with False the unwrapped original module.
    - distributed wrappers (accelerate_c's DataParallelModule, DDP, DataParallel, FSDP, DeepSpeed) are peeled
      off through `.module`; recursive=True also replaces wrapped children inside the model.
    - keep_fp32_wrapper=False removes the mixed-precision forward patch (the model's forward is restored)."""
    types = _wrapper_types()
    compiled = None
    if is_compiled_module(model):
        compiled, model = model, model._orig_mod
    elif "_orig_mod" in model.__dict__ and has_compiled_regions(model):
        compiled, model = model, model.__dict__["_orig_mod"]
    while _is_wrapper(model, types):
        model = model.module
    if recursive:
        def unwrap(m: torch.nn.Module) -> torch.nn.Module:
            inner = unwrap(m.module) if hasattr(m, "module") else m
            for name, child in inner.named_children():
                setattr(inner, name, unwrap(child))
            return inner
        model = unwrap(model)
    if not keep_fp32_wrapper:
        _remove_autocast_forward(model)
    if keep_torch_compile and compiled is not None:
        if is_compiled_module(compiled):
            compiled._orig_mod = model
        else:
            compiled.__dict__["_orig_mod"] = model
        model = compiled
    return model


def _remove_autocast_forward(model: torch.nn.Module) -> None:
    """Undoes the forward patch of a mixed-precision prepare (accelerate_c's precision.Precision, or HF's
    when a model comes from HF): the forward stored as `_original_forward` comes back."""
    original = model.__dict__.pop("_original_forward", None)
    if original is None:
        return
    if getattr(original, "__self__", None) is model and getattr(original, "__func__", None) is type(model).forward:
        model.__dict__.pop("forward", None)  # the class's own forward: drop the instance override
    else:
        model.forward = original
    if "_accelerate_c_autocast" in model.__dict__:
        model._accelerate_c_autocast = False


def is_peft_model(model: Any) -> bool:
    """True for a PEFT PeftModel (PEFT installed and the model one of its wrappers), as HF's is_peft_model."""
    from ..base.imports import is_peft_available

    if not is_peft_available():
        return False
    from peft import PeftModel

    return isinstance(model, PeftModel)


def model_has_dtensor(model: torch.nn.Module) -> bool:
    """HF's: whether any parameter of `model` is a torch DTensor."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())
