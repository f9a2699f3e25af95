# accelerate_c/strategies/ddp.py: data parallelism over N processes, the reference path: after backward
# (at the end of the autograd pass, like torch DDP) every gradient is all-reduced in one coalesced
# collective per dtype, summed then divided by the world size, in a fixed order on every rank so all
# ranks end with bitwise-identical gradients and hence parameters. Its configuration is DDPConfig
# (ddp/config.py), read once.
# Not for: the fast bucketed/overlapped path (strategies/ddp_bucketed.py builds on this file's wrapper).
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist

from ..comm.coalesced import broadcast_coalesced
from ..ddp.config import DDPConfig
from ..ddp.module import DataParallelModule, GradSync
from . import register
from .base import Strategy


@register("ddp_reference")
class DataParallel(Strategy):
    priority = 10
    config_class = DDPConfig
    config: DDPConfig

    @classmethod
    def applies(cls, state: Any, handlers: dict[str, Any]) -> bool:
        return state.parallel_layout.dp_size > 1

    def __init__(self, ctx: Any, config: Optional[DDPConfig] = None) -> None:
        super().__init__(ctx, config)
        self.group: Optional[Any] = None
        self._syncs: list[GradSync] = []
        self._join: Optional[Any] = None  # the join (ddp_join.py, sharding/join.py) inside join_uneven_inputs

    def make_sync(self, params: list[torch.nn.Parameter]) -> GradSync:
        self.group = self.dp.process_group  # the data-parallel ranks (torch's WORLD under plain data parallelism)
        if self.config.powersgd is not None:
            raise NotImplementedError("DistributedDataParallelKwargs(comm_hook=power_sgd / batched_power_sgd) runs on "
                                      "the bucketed gradient sync (ACCELERATE_C_GRAD_SYNC=bucketed, the default), not "
                                      "on the reference one")
        return GradSync(params, self.group, self.dp.size, compress=self.config.compress_dtype)

    def broadcast(self, tensors: list[torch.Tensor], src: int = 0) -> None:
        """Data-parallel rank `src`'s `tensors` into every data-parallel rank's, in place (coalesced)."""
        dp = self.dp
        broadcast_coalesced(tensors, lambda flat: dist.broadcast(flat, src=dp.ranks[src], group=dp.process_group))

    def all_reduce_sum(self, t: torch.Tensor) -> None:
        dist.all_reduce(t, group=self.dp.process_group)

    def prepare_model(self, model: torch.nn.Module, device_placement: bool,
                      evaluation_mode: bool = False) -> torch.nn.Module:
        model = super().prepare_model(model, device_placement)
        if evaluation_mode:
            return model
        # Every rank starts from rank 0's parameters and buffers, as torch DDP does at construction.
        self.broadcast(list(model.parameters()) + list(model.buffers()))
        params = [p for p in model.parameters() if p.requires_grad]
        sync = self.make_sync(params)
        self._syncs.append(sync)
        return DataParallelModule(model, sync, self.broadcast if self.config.broadcast_buffers else None)

    # The join asks first (a rank whose lone sync was deferred skips them: ddp_join.py SyncAgreement); subclasses
    # override the underscored methods.
    def step(self, optimizer: torch.optim.Optimizer, precision: Any, closure: Optional[Callable] = None) -> bool:
        if self._join is not None and self._join.before_step(optimizer, precision):
            return True  # skipped: the scheduler holds, as for an overflowed step
        return self._step(optimizer, precision, closure)

    def _step(self, optimizer: torch.optim.Optimizer, precision: Any, closure: Optional[Callable] = None) -> bool:
        return super().step(optimizer, precision, closure)

    def zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool) -> bool:
        if self._join is not None and self._join.before_zero_grad(optimizer, set_to_none):
            return True  # the deferred gradients stay
        return self._zero_grad(optimizer, set_to_none)

    def _zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool) -> bool:
        return super().zero_grad(optimizer, set_to_none)

    def clip_grad_norm_(self, parameters: Iterable[torch.nn.Parameter], max_norm: float,
                        norm_type: float = 2.0) -> torch.Tensor:
        if self._join is not None and self._join.before_clip(max_norm, norm_type):
            return torch.tensor(float("nan"))  # clipped with the others' next step
        return self._clip_grad_norm_(parameters, max_norm, norm_type)

    def _clip_grad_norm_(self, parameters: Iterable[torch.nn.Parameter], max_norm: float,
                         norm_type: float = 2.0) -> torch.Tensor:
        return super().clip_grad_norm_(parameters, max_norm, norm_type)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        for s in self._syncs:
            s.reset_pass()
        loss.backward(**kwargs)

    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module) -> Iterator[None]:
        ctx = model.no_sync() if isinstance(model, DataParallelModule) else contextlib.nullcontext()
        with ctx:
            yield

    @contextlib.contextmanager
    def join(self, joinables: list, enable: bool = True) -> Iterator[None]:
        """Uneven inputs (ddp_join.py): the prepared models among `joinables` take part; other objects (the prepared
        optimizers) have no collectives of their own to mirror."""
        models = [j for j in joinables if isinstance(j, DataParallelModule)]
        if not enable:
            yield
            return
        if not models:
            raise ValueError("join_uneven_inputs: no model prepared for data parallelism among the joinables "
                             f"({[type(j).__name__ for j in joinables]}); pass the model(s) prepare() returned")
        from ..ddp.join import JoinProtocol
        join = JoinProtocol(self, models)
        self.suspend_split_step()
        self._join = join
        for m in models:
            m._join = join
        try:
            yield
            for m in models:  # this rank is out of inputs: its forwards no longer announce themselves
                m._join = None
            join.finish(join.shadow())
        finally:
            self._join = None
            for m in models:
                m._join = None
            join.close()

    def suspend_split_step(self) -> None:
        """Optimizer steps stop depending on every rank stepping together (none here; the bucketed strategy's
        host-split step is turned off)."""

    def close(self) -> None:
        for s in self._syncs:
            s.remove()
        self._syncs = []
