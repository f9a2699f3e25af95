# accelerate_c/pipeline/prepare.py: what Accelerator.prepare does to a model under pp_size > 1 (through the façade's
# one seam, facade/parallel.py ModelParallel): this rank's PipelineEngine over the layout's pipeline group, with the
# layout's schedule, micro-batches and virtual stages, the user's split points when the model names them
# (`model.pp_split`: layer indices or module names), and the Accelerator's loss scaling (accumulation steps, fp16
# scale) and sync flag, so `model(**batch)` is the whole training step's forward and backward.
# Not for: the engine (engine.py), data parallelism over each stage (the strategies).
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from .engine import PipelineEngine
from .holdings import link, logical_state


def prepare_pipeline(model: nn.Module, layout: Any, scale_loss: Callable[[torch.Tensor], torch.Tensor],
                     sync_gradients: Callable[[], bool]) -> PipelineEngine:
    """The rank's engine (collective over the pipeline group: every stage calls it on the same logical model)."""
    if isinstance(model, PipelineEngine):
        return model
    full = logical_state(model)  # the names and full shapes, before the engine prunes the model
    engine = PipelineEngine(model, rank=layout.pp_rank, size=layout.pp, group=layout.dim("pp").process_group,
                            schedule=layout.pp_schedule, num_micro_batches=layout.num_micro_batches,
                            virtual_stages=layout.pp_virtual_stages, split=getattr(model, "pp_split", None))
    link(engine, model, full)
    engine.scale_loss, engine.sync_grads = scale_loss, sync_gradients
    return engine
