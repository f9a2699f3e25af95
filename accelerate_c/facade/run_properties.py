# accelerate_c/facade/run_properties.py: the Accelerator's read-through properties of the run (HF 1.15 names): the
# process state (device, ranks, mixed precision), the gradient-accumulation state, the data-loader and project
# configuration. A mixin of Accelerator; every value lives in the objects the Accelerator built.
# Not for: probes of features a run may not use (probes.py) or anything that acts.
from __future__ import annotations

from typing import Any, Optional

import torch


class RunProperties:
    """Properties of `Accelerator` that read (and for a few, set) the state it holds."""

    @property
    def device(self) -> torch.device:
        return self.state.device

    @property
    def distributed_type(self) -> Any:
        return self.state.distributed_type

    @property
    def num_processes(self) -> int:
        return self._num_processes

    @property
    def process_index(self) -> int:
        return self._process_index

    @property
    def local_process_index(self) -> int:
        return self._local_process_index

    @property
    def mixed_precision(self) -> str:
        return self.state.mixed_precision

    @property
    def use_distributed(self) -> bool:
        return self.state.use_distributed

    @property
    def multi_device(self) -> bool:
        return self.use_distributed and self.device.type != "cpu"

    @property
    def sync_gradients(self) -> bool:
        return bool(self._sync_gradients)

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        self.gradient_state._set_sync_gradients(value)

    @property
    def gradient_accumulation_steps(self) -> int:
        return self._gradient_accumulation_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, value: int) -> None:
        self.gradient_state.plugin_kwargs.update({"num_steps": value})
        self._gradient_accumulation_steps = value

    @property
    def split_batches(self) -> bool:
        return self.dataloader_config.split_batches

    @property
    def dispatch_batches(self) -> Optional[bool]:
        return self.dataloader_config.dispatch_batches

    @property
    def even_batches(self) -> bool:
        return self.dataloader_config.even_batches

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        self.dataloader_config.even_batches = value

    @property
    def use_seedable_sampler(self) -> bool:
        return self.dataloader_config.use_seedable_sampler

    @property
    def non_blocking(self) -> bool:
        return self.dataloader_config.non_blocking

    @property
    def use_stateful_dataloader(self) -> bool:
        return self.dataloader_config.use_stateful_dataloader

    @property
    def project_dir(self) -> Optional[str]:
        return self.project_configuration.project_dir

    @property
    def logging_dir(self) -> Optional[str]:
        return self.project_configuration.logging_dir

    @property
    def save_iteration(self) -> int:
        return self.project_configuration.iteration

    @property
    def optimizer_step_was_skipped(self) -> bool:
        return any(opt.step_was_skipped for opt in self._optimizers)
