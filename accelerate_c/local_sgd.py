# accelerate_c/local_sgd.py: HF's `accelerate.local_sgd.LocalSGD`: each process takes `local_sgd_steps` optimizer
# steps on its own (its gradients are not synchronised: the prepared model runs under no_sync), then every process's
# parameters are replaced by their average over the data-parallel ranks; once more when the context ends. Buffers
# (BatchNorm statistics) are not averaged, as in HF. Refused, with HF's error, where HF refuses it: sharded runs
# (FSDP / DeepSpeed faces) and Megatron-LM.
# Not for: the gradient synchronisation it switches off (ddp/, strategies/).
from __future__ import annotations

from typing import Any, Optional

import torch

from .base.dataclasses import DistributedType
from .runtime.models import extract_model_from_parallel


class LocalSGD:
    """`with LocalSGD(accelerator, model, local_sgd_steps=k) as local_sgd:` ... `local_sgd.step()` after each
    optimizer step (HF 1.15's class)."""

    def __init__(self, accelerator: Any, model: torch.nn.Module, local_sgd_steps: int, enabled: bool = True) -> None:
        if accelerator.distributed_type not in (DistributedType.NO, DistributedType.MULTI_CPU,
                                                DistributedType.MULTI_GPU):
            raise NotImplementedError("LocalSGD is supported only for CPUs and GPUs (no DeepSpeed or MegatronLM)")
        self.enabled = enabled and accelerator.distributed_type != DistributedType.NO
        self.num_steps = 0
        self._sync: Optional[Any] = None
        if self.enabled:
            if int(local_sgd_steps) < 1:
                raise ValueError(f"LocalSGD: local_sgd_steps must be >= 1, got {local_sgd_steps!r}")
            self.accelerator, self.model, self.local_sgd_steps = accelerator, model, int(local_sgd_steps)

    def __enter__(self) -> "LocalSGD":
        if self.enabled:
            self._sync = self.accelerator.no_sync(self.model)
            self._sync.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.enabled:
            try:
                self._sync_and_avg_model_params()
            finally:
                self._sync.__exit__(*exc)

    def step(self) -> None:
        """Counts an optimizer step; every `local_sgd_steps`-th one averages the parameters."""
        self.num_steps += 1
        if self.enabled and self.num_steps % self.local_sgd_steps == 0:
            self._sync_and_avg_model_params()

    @torch.no_grad()
    def _sync_and_avg_model_params(self) -> None:
        self.accelerator.wait_for_everyone()
        for p in extract_model_from_parallel(self.model).parameters():
            # in place: a parameter's storage may be a shared buffer the data-parallel engine relies on
            p.copy_(self.accelerator.reduce(p.detach().clone(), reduction="mean"))
