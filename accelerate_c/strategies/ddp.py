# accelerate_c/strategies/ddp.py: data parallelism over N processes, the reference path: after backward
# (at the end of the autograd pass, like torch DDP) every gradient is all-reduced in one coalesced
# collective per dtype, summed then divided by the world size, in a fixed order on every rank so all
# ranks end with bitwise-identical gradients and hence parameters.
# Not for: the fast bucketed/overlapped path (strategies/ddp_bucketed.py builds on this file's wrapper).
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from . import register
from .base import Strategy


class DataParallelModule(torch.nn.Module):
    """Wraps the user's model like torch DDP: `.module` is the user's model, forward broadcasts buffers
    from rank 0 when asked to, and gradients are synchronised at the end of each backward unless inside
    `no_sync()`."""

    _accelerate_c_wrapper = True

    def __init__(self, module: torch.nn.Module, sync: "GradSync", broadcast_buffers: bool) -> None:
        super().__init__()
        self.module = module
        self._grad_sync = sync
        self._broadcast_buffers = broadcast_buffers and any(True for _ in module.buffers())

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._broadcast_buffers and torch.is_grad_enabled() and self.training:
            _broadcast_tensors([b for b in self.module.buffers()], self._grad_sync.group)
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        prev = self._grad_sync.enabled
        self._grad_sync.enabled = False
        try:
            yield
        finally:
            self._grad_sync.enabled = prev


def _broadcast_tensors(tensors: list[torch.Tensor], group: Any, src: int = 0) -> None:
    with torch.no_grad():
        for t in tensors:
            dist.broadcast(t.data, src=src, group=group)


class GradSync:
    """Queues one gradient all-reduce at the end of each backward pass (reference implementation).

    Parameters whose gradient is None on some rank (unused in this step) take part with zeros; a
    per-parameter "had a gradient" count is reduced alongside, and a parameter that no rank used keeps
    grad None, as in the single-process loop."""

    def __init__(self, params: list[torch.nn.Parameter], group: Any, world_size: int) -> None:
        self.params = params
        self.group = group
        self.world_size = world_size
        self.enabled = True
        self._queued = False
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    def _on_grad(self, _p: torch.Tensor) -> None:
        if self.enabled and not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize)

    def _finalize(self) -> None:
        self._queued = False
        self.sync_now()

    @torch.no_grad()
    def sync_now(self) -> None:
        by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for p in self.params:
            by_dtype.setdefault(p.dtype, []).append(p)
        used = torch.tensor([0.0 if p.grad is None else 1.0 for p in self.params])
        dist.all_reduce(used, group=self.group)
        used_map = {id(p): u for p, u in zip(self.params, (used > 0).tolist())}
        for dtype, params in by_dtype.items():
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
            dist.all_reduce(flat, group=self.group)
            flat.div_(self.world_size)
            offset = 0
            for p in params:
                n = p.numel()
                if used_map[id(p)]:
                    view = flat[offset:offset + n].view_as(p)
                    if p.grad is None:
                        p.grad = view.clone()
                    else:
                        p.grad.copy_(view)
                offset += n

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


@register("ddp")
class DataParallel(Strategy):
    priority = 10

    @classmethod
    def applies(cls, state: Any, handlers: dict[str, Any]) -> bool:
        return state.num_processes > 1

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self.kwargs = ctx.handler("DistributedDataParallelKwargs")
        self.group: Optional[Any] = None
        self._syncs: list[GradSync] = []

    def make_sync(self, params: list[torch.nn.Parameter]) -> GradSync:
        return GradSync(params, self.group, self.state.num_processes)

    def prepare_model(self, model: torch.nn.Module, device_placement: bool, evaluation_mode: bool = False) -> torch.nn.Module:
        model = super().prepare_model(model, device_placement)
        if evaluation_mode:
            return model
        # Every rank starts from rank 0's parameters and buffers, as torch DDP does at construction.
        _broadcast_tensors(list(model.parameters()) + list(model.buffers()), self.group)
        params = [p for p in model.parameters() if p.requires_grad]
        sync = self.make_sync(params)
        self._syncs.append(sync)
        broadcast_buffers = True if self.kwargs is None else bool(self.kwargs.broadcast_buffers)
        return DataParallelModule(model, sync, broadcast_buffers)

    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module) -> Iterator[None]:
        ctx = model.no_sync() if isinstance(model, DataParallelModule) else contextlib.nullcontext()
        with ctx:
            yield

    def close(self) -> None:
        for s in self._syncs:
            s.remove()
        self._syncs = []
