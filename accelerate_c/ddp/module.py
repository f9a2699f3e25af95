# accelerate_c/ddp/module.py: DataParallelModule, the wrapper prepare() puts around a model under data
# parallelism (forward hooks for the gradient sync and the buffer broadcast, no_sync, join), and GradSync, the
# reference gradient sync: one coalesced all-reduce per dtype at the end of each backward pass, summed then
# divided by the world size in a fixed order, so all ranks end with bitwise-identical gradients.
# Not for: the bucketed engine (bucketed.py) or the strategy (strategies/ddp.py).
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from ..base.process_local import ProcessBound
from ..base.weak import weak_hook


class DataParallelModule(torch.nn.Module):
    """Wraps the user's model like torch DDP: `.module` is the user's model, gradients are synchronised at the end
    of each backward unless inside `no_sync()`, and with broadcast_buffers rank 0's buffers are copied to every
    rank at the start of a forward, on torch DDP's rule: when the previous forward ran with grad enabled outside
    no_sync (or this is the first forward). `buffer_sync(buffers)` is the strategy's coalesced broadcast."""

    _accelerate_c_wrapper = True

    def __init__(self, module: torch.nn.Module, sync: Any, buffer_sync: Optional[Callable[[list], None]]) -> None:
        super().__init__()
        self.module = module
        self._grad_sync = sync
        self._buffer_sync = buffer_sync
        self._sync_buffers_next = True  # torch DDP's require_forward_param_sync
        self._join: Optional[Any] = None  # the JoinProtocol while inside join_uneven_inputs

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        src = self._join.notify(self) if self._join is not None else 0  # may switch a lone sync off (ddp_join.py)
        sync = torch.is_grad_enabled() and self._grad_sync.enabled
        self._sync_buffers(src)
        if getattr(self.module, "runs_backward", False) and self.module.training:
            # a pipeline stage runs its micro-batches' backward passes inside this call: they accumulate unsynced,
            # and what the rank then holds is averaged once
            with self.no_sync():
                out = self.module(*args, **kwargs)
            if sync:
                self._grad_sync.sync_held()
        else:
            out = self.module(*args, **kwargs)
        self._sync_buffers_next = sync
        return out

    def _sync_buffers(self, src: int) -> None:
        if self._buffer_sync is None or not self._sync_buffers_next:
            return
        buffers = [b for b in self.module.buffers()]  # again each time: a module may reassign a buffer
        if buffers:
            # in place, under no_grad, without bumping version counters (as torch DDP): a buffer saved for a pending
            # backward (e.g. under no_sync accumulation) must not look modified
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tuple(buffers)):
                self._buffer_sync(buffers, src)

    def _shadow_forward(self, src: int, sync: bool, keep: bool = False) -> None:
        """A rank out of inputs mirrors an active rank's forward (and backward when it syncs): ddp_join.py. keep: its
        gradients take part in that sync (its own was deferred), zeros otherwise."""
        self._sync_buffers(src)
        self._sync_buffers_next = sync
        if sync:
            self._grad_sync.shadow(keep)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        prev = self._grad_sync.enabled
        self._grad_sync.enabled = False
        try:
            yield
        finally:
            self._grad_sync.enabled = prev


class GradSync(ProcessBound):
    """Queues one gradient all-reduce at the end of each backward pass (reference implementation).

    Parameters whose gradient is None on some rank (unused in this step) take part with zeros; a
    per-parameter "had a gradient" count is reduced alongside, and a parameter that no rank used keeps
    grad None, as in the single-process loop."""

    def __init__(self, params: list[torch.nn.Parameter], group: Any, world_size: int,
                 compress: Optional[torch.dtype] = None, owner: Optional[Callable[[], None]] = None) -> None:
        self.params = params
        self.group = group
        self.world_size = world_size
        self.compress = compress  # reduce in this dtype (torch's fp16/bf16 compress hooks)
        self.enabled = True
        self._queued = False
        # owner: instead of a callback of its own, the first gradient of a synced pass calls owner(), whose own
        # end-of-pass callback runs sync_now() (the sharded engine: one fixed order of the pass's collectives)
        self._owner = owner
        self._handles = [p.register_post_accumulate_grad_hook(weak_hook(self._on_grad)) for p in params]

    def _on_grad(self, _p: torch.Tensor) -> None:
        # The first gradient of a synced pass queues the sync at the end of the (outermost, when it fires there)
        # autograd pass, as torch's Reducer does.
        if self.enabled and self._owner is not None:
            self._owner()
        elif self.enabled and not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize)

    def _finalize(self) -> None:
        self._queued = False
        self.sync_now()

    def reset_pass(self) -> None:
        """Before a backward: forget a pass that raised midway (its end-of-pass callback never ran)."""
        self._queued = False

    def sync_held(self) -> None:
        """Averages the gradients the parameters hold now (accumulated outside a synced backward)."""
        self.sync_now()

    def shadow(self, keep: bool = False) -> None:
        """The collectives of a synced backward on a rank out of inputs (ddp_join.py), with zero gradients, or with
        the ones it holds when `keep` (its own sync was deferred); they are dropped after, so count once."""
        if not keep:
            for p in self.params:
                p.grad = None
        self.sync_now()
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def sync_now(self) -> None:
        by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for p in self.params:
            by_dtype.setdefault(p.dtype, []).append(p)
        used = torch.tensor([0.0 if p.grad is None else 1.0 for p in self.params],
                            device=self.params[0].device if self.params else None)  # NCCL reduces no CPU tensor
        dist.all_reduce(used, group=self.group)
        used_map = {id(p): u for p, u in zip(self.params, (used > 0).tolist())}
        for dtype, params in by_dtype.items():
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
            if self.compress is None:
                dist.all_reduce(flat, group=self.group)
                flat.div_(self.world_size)
            else:  # torch's compress hooks: cast, divide, sum in low precision, cast back
                low = flat.to(self.compress).div_(self.world_size)
                dist.all_reduce(low, group=self.group)
                flat.copy_(low)
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
