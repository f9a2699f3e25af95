# accelerate_c/ddp/powersgd.py: HF's PowerSGD communication hooks (DistributedDataParallelKwargs(comm_hook=
# POWER_SGD | BATCHED_POWER_SGD, comm_wrapper=NO | FP16 | BF16, comm_state_option={...})) on our bucketed gradient
# sync. The algorithm is torch's own (torch.distributed.algorithms.ddp_comm_hooks: powerSGD_hook,
# batched_powerSGD_hook, the fp16/bf16 wrappers and PowerSGDState, built exactly as HF builds them), so the results
# are what HF's torch DDP gives. Each of our buckets is handed to the hook as torch's GradBucket interface
# (`_HookBucket`: buffer, per-parameter gradient views, index, is_last, parameters, set_buffer) and its reduced
# result copied back into the bucket. The hook's collectives run on the data-parallel torch process group, one
# bucket after the other at the end of backward (no overlap with backward: the hook chains collectives in future
# callbacks, which on gloo would otherwise be issued in a different order on different ranks).
# Not for: the fp16/bf16 compress hooks alone (bucketed.py reduces those itself, on the shared-memory transport).
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

HOOKS = ("power_sgd", "batched_power_sgd")
WRAPPERS = ("no", "fp16", "bf16")


@dataclass(frozen=True)
class PowerSGDSpec:
    """What DistributedDataParallelKwargs asked for: the hook, its wrapper and PowerSGDState's keywords."""

    hook: str                                      # power_sgd | batched_power_sgd
    wrapper: str = "no"                            # no | fp16 | bf16
    options: dict = field(default_factory=dict)    # comm_state_option

    def build(self, process_group: Any) -> tuple[Any, Callable]:
        """(PowerSGDState, hook): HF's DistributedDataParallelKwargs.register_comm_hook, for our buckets."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        hook = powerSGD_hook.powerSGD_hook if self.hook == "power_sgd" else powerSGD_hook.batched_powerSGD_hook
        if self.wrapper == "fp16":
            hook = default_hooks.fp16_compress_wrapper(hook)
        elif self.wrapper == "bf16":
            hook = default_hooks.bf16_compress_wrapper(hook)
        try:
            state = powerSGD_hook.PowerSGDState(process_group, **self.options)
        except TypeError as e:
            raise ValueError(f"DistributedDataParallelKwargs(comm_state_option={self.options!r}): not keywords of "
                             f"torch's PowerSGDState: {e}") from None
        return state, hook


class _HookBucket:
    """One bucket as torch's dist.GradBucket: the flat gradients of `params` (in bucket order) at `offsets`."""

    def __init__(self, index: int, buffer: torch.Tensor, params: list, offsets: list[int], last: bool) -> None:
        self._index, self._buffer, self._params, self._offsets, self._last = index, buffer, params, offsets, last

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def gradients(self) -> list[torch.Tensor]:
        return [self._buffer[o:o + p.numel()].view(p.shape) for p, o in zip(self._params, self._offsets)]

    def parameters(self) -> list:
        return list(self._params)

    def is_last(self) -> bool:
        return self._last


class PowerSGDSync:
    """Runs the hook over a BucketedGradSync's buckets (`reduce`, at the end of a synced backward)."""

    def __init__(self, spec: PowerSGDSpec, process_group: Any) -> None:
        self.state, self.hook = spec.build(process_group)

    def reduce(self, buckets: list[tuple[torch.Tensor, list, list[int]]]) -> None:
        """`buckets`: (flat view, its parameters, their offsets in the view) in issue order; each is replaced by
        the hook's result (the average over the group, PowerSGD-compressed after start_powerSGD_iter)."""
        n = len(buckets)
        for i, (view, params, offsets) in enumerate(buckets):
            # a bucket of its own, as torch's are: the batched hook pads its buffer in place (resize_), which on a
            # view of our flat buffer would write over the next bucket
            out = self.hook(self.state, _HookBucket(i, view.clone(), params, offsets, i == n - 1)).wait()
            view.copy_(out[:view.numel()])
