# accelerate_c/strategies/ddp.py: data parallelism over N processes, the reference path: after backward
# (at the end of the autograd pass, like torch DDP) every gradient is all-reduced in one coalesced
# collective per dtype, summed then divided by the world size, in a fixed order on every rank so all
# ranks end with bitwise-identical gradients and hence parameters. DDPConfig (both data-parallel strategies'
# configuration) is read here, once.
# Not for: the fast bucketed/overlapped path (strategies/ddp_bucketed.py builds on this file's wrapper).
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional

import torch
import torch.distributed as dist

from . import register
from .base import Strategy, StrategyConfig
from ..base import settings


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


BROADCAST_CHUNK_BYTES = 64 << 20  # coalesced broadcasts go in pieces of at most this (bounded extra memory)


@torch.no_grad()
def broadcast_coalesced(tensors: list[torch.Tensor], broadcast: Callable[[torch.Tensor], Any],
                        chunk_bytes: int = BROADCAST_CHUNK_BYTES) -> None:
    """Copies the src rank's `tensors` into every rank's in place, packed as raw bytes into few flat buffers
    (one collective per chunk instead of one per tensor; any dtype). `broadcast(flat_uint8)` is the collective."""
    pending: list[torch.Tensor] = []
    size = 0

    def flush() -> None:
        nonlocal pending, size
        if not pending:
            return
        offsets, off = [], 0
        for t in pending:  # each tensor at a 16-byte aligned offset, so its bytes view back as its dtype
            offsets.append(off)
            off += -(-t.numel() * t.element_size() // 16) * 16
        flat = torch.empty(off, dtype=torch.uint8, device=pending[0].device)
        for t, o in zip(pending, offsets):
            flat[o:o + t.numel() * t.element_size()].copy_(t.contiguous().view(-1).view(torch.uint8))
        broadcast(flat)
        for t, o in zip(pending, offsets):
            t.copy_(flat[o:o + t.numel() * t.element_size()].view(t.dtype).view(t.shape))
        pending, size = [], 0

    for t in tensors:
        if t.numel() == 0:
            continue
        nbytes = t.numel() * t.element_size()
        if pending and (size + nbytes > chunk_bytes or pending[0].device != t.device):
            flush()
        pending.append(t.data)
        size += nbytes
    flush()


class GradSync:
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
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

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
        used = torch.tensor([0.0 if p.grad is None else 1.0 for p in self.params])
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


_COMPRESS = {"no": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def _compress_dtype(kwargs: Any) -> Optional[torch.dtype]:
    """DistributedDataParallelKwargs.comm_hook -> the dtype gradients are reduced in (None: their own)."""
    hook = "no" if kwargs is None else str(getattr(kwargs.comm_hook, "value", kwargs.comm_hook)).lower()
    if hook in _COMPRESS:
        return _COMPRESS[hook]
    if hook in ("power_sgd", "batched_power_sgd"):
        raise NotImplementedError(f"DistributedDataParallelKwargs(comm_hook={hook!r}): PowerSGD is not supported by "
                                  "accelerate_c's gradient sync; use comm_hook='fp16' or 'bf16' (compressed "
                                  "all-reduce) or 'no'")
    raise ValueError(f"DistributedDataParallelKwargs(comm_hook={hook!r}): unknown hook; allowed: no, fp16, bf16")


@dataclass(frozen=True)
class DDPConfig(StrategyConfig):
    """Data parallelism (ddp.py, ddp_bucketed.py): DistributedDataParallelKwargs, then ACCELERATE_C_* variables
    (HF's YAML and launcher have no DDP fields of their own)."""

    grad_sync: str = "bucketed"       # ACCELERATE_C_GRAD_SYNC: bucketed (ddp_bucketed.py) | reference (ddp.py)
    transport: str = "auto"           # ACCELERATE_C_COMM: auto (shared memory for CPU tensors) | torch
    sharded_step: bool = True         # ACCELERATE_C_SHARDED_STEP: split the optimizer step between a host's ranks
    bucket_cap_mb: float = 25.0       # DistributedDataParallelKwargs.bucket_cap_mb
    broadcast_buffers: bool = True    # DistributedDataParallelKwargs.broadcast_buffers
    compress_dtype: Optional[torch.dtype] = None  # DistributedDataParallelKwargs.comm_hook: fp16 / bf16 reduction

    @classmethod
    def _fields(cls, handlers: Mapping[str, Any], env: Optional[Mapping[str, str]]) -> dict[str, Any]:
        fields = super()._fields(handlers, env)
        kw = handlers.get("DistributedDataParallelKwargs")
        fields.update(grad_sync=settings.get("GRAD_SYNC", env), transport=settings.get("COMM", env),
                      sharded_step=settings.get("SHARDED_STEP", env), compress_dtype=_compress_dtype(kw))
        if kw is not None:
            try:
                fields["bucket_cap_mb"] = float(kw.bucket_cap_mb)
            except (TypeError, ValueError):
                raise ValueError(f"DistributedDataParallelKwargs(bucket_cap_mb={kw.bucket_cap_mb!r}): "
                                 "expected a number of megabytes") from None
            fields["broadcast_buffers"] = bool(kw.broadcast_buffers)
        return fields


@register("ddp")
class DataParallel(Strategy):
    priority = 10
    config_class = DDPConfig
    config: DDPConfig

    @classmethod
    def applies(cls, state: Any, handlers: dict[str, Any]) -> bool:
        return state.num_processes > 1

    def __init__(self, ctx: Any, config: Optional[DDPConfig] = None) -> None:
        super().__init__(ctx, config)
        self.group: Optional[Any] = None
        self._syncs: list[GradSync] = []
        self._join: Optional[Any] = None  # the join (ddp_join.py, sharding/join.py) inside join_uneven_inputs

    def make_sync(self, params: list[torch.nn.Parameter]) -> GradSync:
        return GradSync(params, self.group, self.state.num_processes, compress=self.config.compress_dtype)

    def broadcast(self, tensors: list[torch.Tensor], src: int = 0) -> None:
        """Rank `src`'s `tensors` into every rank's, in place (coalesced)."""
        broadcast_coalesced(tensors, lambda flat: dist.broadcast(flat, src=src, group=self.group))

    def all_reduce_sum(self, t: torch.Tensor) -> None:
        dist.all_reduce(t, group=self.group)

    def prepare_model(self, model: torch.nn.Module, device_placement: bool, evaluation_mode: bool = False) -> torch.nn.Module:
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

    def clip_grad_norm_(self, parameters: Iterable[torch.nn.Parameter], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        if self._join is not None and self._join.before_clip(max_norm, norm_type):
            return torch.tensor(float("nan"))  # clipped with the others' next step
        return self._clip_grad_norm_(parameters, max_norm, norm_type)

    def _clip_grad_norm_(self, parameters: Iterable[torch.nn.Parameter], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
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
