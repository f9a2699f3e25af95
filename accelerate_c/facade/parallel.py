# accelerate_c/facade/parallel.py: the Accelerator's side of the parallel layout. `parallel_plugins` settles the
# ParallelismConfig / MegatronLMPlugin as HF 1.15 settles them (torch_tp_plugin -> ParallelismConfig(tp_size=...),
# ACCELERATE_USE_PARALLELISM_CONFIG / ACCELERATE_USE_MEGATRON_LM build one from the variables, HF's type check,
# HF's own classes converted to ours); `apply_model_parallelism` is the one seam where prepare hands a model to the
# model-parallel engines before precision and the data-parallel strategy wrap it (DESIGN.md: TP slices the modules,
# PP cuts stages, then data parallelism wraps what each rank holds).
# Not for: the layout (runtime/layout.py, runtime/layout_build.py) or the faces (base/).
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from ..base import settings
from ..base.megatron_plugin import MegatronLMPlugin
from ..base.parallel_handlers import (DeepSpeedSequenceParallelConfig, TorchContextParallelConfig,
                                      TorchTensorParallelConfig)
from ..base.parallelism_config import ParallelismConfig

_HANDLERS = {"tp_handler": TorchTensorParallelConfig, "cp_handler": TorchContextParallelConfig,
             "sp_handler": DeepSpeedSequenceParallelConfig}


def _ours(pc: Any) -> ParallelismConfig:
    """A ParallelismConfig of another class with the same fields (HF's own `accelerate.ParallelismConfig`) as
    ours; ours as it is."""
    if isinstance(pc, ParallelismConfig):
        return pc
    if not hasattr(pc, "tp_size") or not hasattr(pc, "dp_shard_size"):
        raise TypeError(f"`parallelism_config` must be a ParallelismConfig object, got {type(pc).__name__}")
    kw = {f.name: getattr(pc, f.name, None) for f in dataclasses.fields(ParallelismConfig)
          if f.name not in _HANDLERS}
    for name, cls in _HANDLERS.items():
        h = getattr(pc, name, None)
        if h is not None:
            kw[name] = cls(**{f.name: getattr(h, f.name) for f in dataclasses.fields(cls) if hasattr(h, f.name)})
    return ParallelismConfig(**kw)


def _megatron(plugin: Any) -> MegatronLMPlugin:
    if isinstance(plugin, MegatronLMPlugin):
        return plugin
    if type(plugin).__name__ != "MegatronLMPlugin":
        raise TypeError("`megatron_lm_plugin` must be a MegatronLMPlugin object.")
    return MegatronLMPlugin(**{f.name: getattr(plugin, f.name) for f in dataclasses.fields(MegatronLMPlugin)
                               if hasattr(plugin, f.name)})  # HF's own class: the same fields


def parallel_plugins(parallelism_config: Any, torch_tp_plugin: Any,
                     megatron_lm_plugin: Any) -> tuple[Optional[ParallelismConfig], Optional[MegatronLMPlugin]]:
    """The run's ParallelismConfig and MegatronLMPlugin (either may be None; both at once is refused when the
    layout is built), settled as HF settles them."""
    if megatron_lm_plugin is None:
        if settings.env_flag("ACCELERATE_USE_MEGATRON_LM"):
            megatron_lm_plugin = MegatronLMPlugin()
    else:
        megatron_lm_plugin = _megatron(megatron_lm_plugin)
        settings.env_set("ACCELERATE_USE_MEGATRON_LM", "true")  # as HF
    if parallelism_config is None:
        if torch_tp_plugin is not None:  # HF: the deprecated plugin becomes a config of its tp_size
            parallelism_config = ParallelismConfig(tp_size=torch_tp_plugin.tp_size)
        elif settings.env_flag("ACCELERATE_USE_PARALLELISM_CONFIG"):
            parallelism_config = ParallelismConfig()
    else:
        parallelism_config = _ours(parallelism_config)
    return parallelism_config, megatron_lm_plugin


def apply_model_parallelism(model: torch.nn.Module, layout: Any, handlers: dict) -> torch.nn.Module:
    """The model as this rank holds it under the layout's model parallelism, before precision and data parallelism
    wrap it: tensor parallelism slices it in place (tensor_parallel/prepare.py: the model's transformers tp_plan or
    the user's `model.tp_plan`; a meta model is materialised slice by slice). Pipeline parallelism, refused when the
    layout is built, will cut it here."""
    if layout.tp > 1:
        from ..tensor_parallel.prepare import prepare_tensor_parallel
        return prepare_tensor_parallel(model, layout)
    return model
