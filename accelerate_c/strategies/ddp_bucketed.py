# accelerate_c/strategies/ddp_bucketed.py: the default data-parallel strategy: DataParallel with the bucketed
# gradient engine (ddp/bucketed.py) over the group comm.group_for_device picks (shared memory for CPU tensors).
# Over shared memory the optimizer step itself is split between the host's ranks (ddp/split_step.py): the
# step passes the prepared optimizer's SplitStep to the kernels as their partition; parameters and
# optimizer state move into shared regions at prepare, each rank updates its slice and writes it into its peers'
# copies (DDPConfig.sharded_step, ACCELERATE_C_SHARDED_STEP=0, turns this off).
# Not for: the reference path (ddp.py) or the engine's internals.
from __future__ import annotations

import warnings
from typing import Any, Optional

import torch

from ..comm.coalesced import broadcast_coalesced
from ..comm.group import group_for_device, release_groups
from ..ddp.bucketed import BucketedGradSync
from ..ddp.split_step import SplitStep, SharedParams, state_keys
from . import register
from ..ddp.config import DDPConfig
from .ddp import DataParallel


@register("ddp_bucketed")
class BucketedDataParallel(DataParallel):
    priority = 20

    @classmethod
    def applies(cls, state: Any, handlers: dict[str, Any]) -> bool:
        return state.parallel_layout.dp_size > 1 and DDPConfig.from_sources(handlers).grad_sync == "bucketed"

    def __init__(self, ctx: Any, config: Optional[DDPConfig] = None) -> None:
        super().__init__(ctx, config)
        self.bucket_group: Optional[Any] = None  # the CollectiveGroup of the gradient buckets
        self._shared_params: list[SharedParams] = []
        # id(optimizer) -> (optimizer, its shard): the split step of each prepared optimizer
        self._split_steps: dict[int, tuple[torch.optim.Optimizer, SplitStep]] = {}

    def _host_group(self) -> Optional[Any]:
        """The host's shm group when the optimizer step can be split over it, else None."""
        if self.bucket_group is None or not self.config.fused_optimizer or not self.config.sharded_step:
            return None
        host = self.bucket_group.host_group()
        return host if host is not None and host.size > 1 else None

    def prepare_model(self, model: torch.nn.Module, device_placement: bool,
                      evaluation_mode: bool = False) -> torch.nn.Module:
        wrapped = super().prepare_model(model, device_placement, evaluation_mode)
        host = None if evaluation_mode else self._host_group()
        if host is not None:
            # trainable ones (frozen ones, e.g. a base model under adapters, stay where they are; one unfrozen
            # later is stepped whole on every rank)
            try:
                params = [p for p in wrapped.module.parameters() if p.requires_grad]
                self._shared_params.append(SharedParams(params, host, wrapped._grad_sync))
            except RuntimeError as e:  # e.g. /dev/shm too small: the same on every rank (the error is shared)
                warnings.warn(f"accelerate_c: every rank steps every parameter (no split optimizer step): {e}")
        return wrapped

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        # Split the step over the optimizer's parameters that the first prepared model holding any of them
        # moved into shared memory (the others are stepped whole on every rank). Decided identically on every
        # rank: the region allocation below is collective.
        keys = state_keys(optimizer)
        params = {id(p) for g in optimizer.param_groups for p in g["params"]}
        for shards in self._shared_params:
            if keys is not None and not params.isdisjoint(shards.offset.keys()):
                try:
                    shard = SplitStep(optimizer, shards, keys)
                except RuntimeError as e:
                    warnings.warn(f"accelerate_c: every rank steps every parameter of this optimizer: {e}")
                    break
                self._split_steps[id(optimizer)] = (optimizer, shard)
                break
        return optimizer

    def split_step(self, optimizer: torch.optim.Optimizer) -> Optional[SplitStep]:
        """The split step of a prepared optimizer (the user's torch optimizer), or None when it steps whole."""
        entry = self._split_steps.get(id(optimizer))
        return entry[1] if entry is not None and entry[0] is optimizer else None

    # -- the step ----------------------------------------------------------------------------------------
    def step_partition(self, optimizer: torch.optim.Optimizer) -> Optional[SplitStep]:
        """The kernels step this rank's slice (the shard is their partition) while the split applies; the whole
        optimizer on every rank otherwise (per-rank gradients after no_sync turn it off for good)."""
        shard = self.split_step(optimizer)
        if shard is not None and not shard.usable():
            shard.before_unsharded_step(optimizer)
            return None
        return shard

    def before_torch_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Every rank steps the whole optimizer itself: its state is completed from the peers' slices first."""
        shard = self.split_step(optimizer)
        if shard is not None:
            shard.before_unsharded_step(optimizer)

    def make_sync(self, params: list[torch.nn.Parameter]) -> BucketedGradSync:
        self._bucket_group()
        powersgd = None
        if self.config.powersgd is not None:
            from ..ddp.powersgd import PowerSGDSync
            powersgd = PowerSGDSync(self.config.powersgd, self.dp.process_group)
        return BucketedGradSync(params, self.bucket_group, self.config.bucket_cap_mb,
                                compress=self.config.compress_dtype, powersgd=powersgd)

    def _cached_group(self) -> bool:
        """Whether the buckets' group is get_group()'s (cached, released at close)."""
        return self.state.device.type == "cpu" and self.config.transport != "torch"

    def _bucket_group(self) -> Any:
        if self.bucket_group is None:
            self.bucket_group = group_for_device(self.state.device, self.config.transport, self.dp)
        return self.bucket_group

    def broadcast(self, tensors: list[torch.Tensor], src: int = 0) -> None:
        group = self._bucket_group()
        broadcast_coalesced(tensors, lambda flat: group.broadcast(flat, src))

    def all_reduce_sum(self, t: torch.Tensor) -> None:
        self._bucket_group().all_reduce_async(t, "sum").wait()

    def suspend_split_step(self) -> None:
        for opt, shard in self._split_steps.values():
            shard.suspend(opt)

    def _zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool) -> bool:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        return any(s.zero_grad(params, set_to_none) for s in self._syncs)

    def close(self) -> None:
        for opt, shard in self._split_steps.values():
            shard.refresh(opt)  # every rank's state complete before the regions' group goes away
            shard.remove()
        self._split_steps, self._shared_params = {}, []
        super().close()
        if self.bucket_group is not None and self._cached_group():
            release_groups()
        self.bucket_group = None
