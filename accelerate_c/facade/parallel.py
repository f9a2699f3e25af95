# accelerate_c/facade/parallel.py: the Accelerator's side of the parallel layout. `parallel_plugins` settles the
# ParallelismConfig / MegatronLMPlugin as HF 1.15 settles them (torch_tp_plugin -> ParallelismConfig(tp_size=...),
# ACCELERATE_USE_PARALLELISM_CONFIG / ACCELERATE_USE_MEGATRON_LM build one from the variables, HF's type check,
# HF's own classes converted to ours); `ModelParallel` is the one seam where prepare hands a model to the
# model-parallel engines before precision and the data-parallel strategy wrap it (DESIGN.md: TP slices the modules,
# PP cuts stages, then data parallelism wraps what each rank holds).
# Not for: the layout (runtime/layout.py, runtime/layout_build.py) or the faces (base/).
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

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


class ModelParallel:
    """The Accelerator's one seam to the model-parallel engines (it always exists; with tp = pp = 1 every method
    passes its argument through). prepare_model: tensor parallelism slices the model in place (tensor_parallel/
    prepare.py: the model's transformers tp_plan or the user's `model.tp_plan`; a meta model is materialised slice
    by slice), then pipeline parallelism cuts it (pipeline/engine.py: the model returned is this rank's
    PipelineEngine, whose call runs the whole schedule, forward and backward, and returns the loss), before
    precision and data parallelism wrap what the rank holds. prepare_optimizer: the parameters pipeline parallelism
    dropped from this rank leave the optimizer. backward_done: whether a loss was already backpropagated by the
    model that returned it (a pipeline's), which makes accelerator.backward a no-op, as under HF's Megatron-LM."""

    def __init__(self, layout: Any, scale_loss: Callable[[torch.Tensor], torch.Tensor],
                 sync_gradients: Callable[[], bool]) -> None:
        self.layout = layout
        self._scale_loss, self._sync_gradients = scale_loss, sync_gradients
        self._dropped: set[int] = set()  # ids of parameters pipeline parallelism removed from this rank

    def prepare_model(self, model: torch.nn.Module, handlers: dict) -> torch.nn.Module:
        if self.layout.tp > 1:
            from ..tensor_parallel.prepare import prepare_tensor_parallel
            model = prepare_tensor_parallel(model, self.layout)
        if self.layout.pp > 1:
            from ..pipeline.prepare import prepare_pipeline
            before = {id(p) for p in model.parameters()}
            model = prepare_pipeline(model, self.layout, self._scale_loss, self._sync_gradients)
            self._dropped |= before - {id(p) for p in model.parameters()}
        return model

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Drops from every param group the parameters this rank no longer holds (kept: the groups, so their
        hyperparameters and order stay the same on every rank)."""
        if self._dropped:
            for g in optimizer.param_groups:
                g["params"] = [p for p in g["params"] if id(p) not in self._dropped]
        return optimizer

    @staticmethod
    def backward_done(loss: Any) -> bool:
        return bool(getattr(loss, "_accelerate_c_backward_done", False))
