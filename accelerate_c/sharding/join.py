# accelerate_c/sharding/join.py: join_uneven_inputs under the sharded engine (ZeRO 1/2/3, FSDP). Ranks whose loop
# has ended keep taking part in every collective of the ranks still training, in the same order, until all are done:
# under sharding a rank out of inputs still owns a shard of the parameters, gradients and optimizer state, so it
# must keep reducing (contributing zeros), stepping its shard with the others' averaged gradients (as torch's
# ZeroRedundancyOptimizer join hook does) and serving its shard to their all-gathers.
# The protocol: inside the context, each event of a training rank that issues collectives is announced first by one
# small all-reduce (max) over every rank of a float64 vector [one-hot "I am training" per rank, kind, fields...]:
#   FWD  (each forward of the model: grad mode, whether it syncs; buffers then follow DDP's broadcast rule)
#   BWD  (the first reduction hook of each backward pass, from inside it: whether it syncs)
#   UNSC (the strategy's unscale_ outside a step: accelerator.unscale_gradients / clip_grad_norm_ attach the shard
#         gradients and agree on overflow, both collective: which optimizer)
#   CLIP (accelerator.clip_grad_norm_: max_norm, norm_type)
#   STEP (the optimizer step: which optimizer, its param groups' numeric hyperparameters, so a scheduler's lr holds)
#   ZERO (zero_grad: which optimizer, set_to_none)
# A rank out of inputs loops in `shadow()`: it contributes zeros and mirrors each announced event with the engine's
# own code: stage 1/2 backward reduce-scatters every unit in the engine's fixed order (stage 1: the full gradient
# buffer as it stands, i.e. micro-batches this rank accumulated before it ran out are counted; stage 2: zeros);
# stage 3 replays this rank's last forward and a backward of zeros (leaf gradients forced to zero), so the hooks issue
# the unit all-gathers, prefetches, frees and reduce-scatters exactly as the training ranks do; STEP / CLIP / ZERO
# call the strategy's own step / clip_grad_norm_ / zero_grad, UNSC its unscale_. Inside an announced step nothing
# more is announced (the mirrored step issues the same unscale and DeepSpeed clipping itself). When no rank is
# training, every rank leaves together and takes the buffers (and replicated parameters) of the highest rank
# among the last to finish; the sharded parameters are the same on every rank already. Averages divide by the
# initial world size (torch DDP's divide_by_initial_world_size default, what our DDP join does).
# Whether a forward syncs is agreed as at stage 0 (ddp/join.py SyncAgreement, the one owner of the rule:
# a rank that alone wants to sync, as HF's accumulate at its own last batch, runs the iteration as accumulation).
# Not for: the engine's buffers and hooks (engine.py, zero3.py) or stage 0 (ddp/join.py).
from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator, Optional

import torch

from ..ddp.join import NFIELDS as NAGREE, SyncAgreement
from .zero3 import _tensors

FWD, BWD, CLIP, STEP, ZERO, LAST, UNSC = 1, 2, 3, 4, 5, 6, 7
NFIELDS = 4  # fields after the kind, before the hyperparameters


def _hyper_keys(optimizer: torch.optim.Optimizer) -> list[tuple[int, str, int]]:
    """(group, key, element) of every numeric hyperparameter (floats, ints, tuples of them) of the param groups, in
    a fixed order: what a scheduler may change between steps."""
    out = []
    for g, group in enumerate(optimizer.param_groups):
        for key in sorted(group):
            v = group[key]
            if isinstance(v, bool) or key == "params":
                continue
            if isinstance(v, (int, float)):
                out.append((g, key, -1))
            elif isinstance(v, (tuple, list)) and v and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                            for x in v):
                out += [(g, key, k) for k in range(len(v))]
    return out


def shadow_backward(engine: Any, replicated: Optional[Any], enabled: bool) -> None:
    """Stages 1/2: the collectives of one backward pass without a backward: every unit reduce-scattered in the order
    the engine's hooks issue them (stage 1 the full gradient buffer as it stands, stage 2 zeros: this rank's
    parameters hold no gradient), then the replicated parameters' all-reduce when the pass syncs: of their
    gradients as they stand (what this rank accumulated before it ran out of inputs counts, as the units' do;
    None: zeros), not DDP's join shadow, which drops them."""
    if engine.stage == 3:
        raise NotImplementedError("stage 3 mirrors a backward by replaying a forward (sharding/join.py ShardedJoin)")
    engine.views.stash(force=True)  # (a training rank's forward did it there)
    with torch.no_grad():
        engine._reduce_units(0, len(engine.units))
        engine.wait()
        engine.agree_used()  # (what the training ranks' end of backward agrees on)
    if enabled and replicated is not None:
        replicated.sync_now()


class ShardedJoin:
    """One join_uneven_inputs context over the one prepared model `model` (a DataParallelModule) of `strategy`."""

    def __init__(self, strategy: Any, model: Any) -> None:
        self.strategy, self.model = strategy, model
        self.engine = strategy._engine_of(model)
        self.switch = model._grad_sync            # the strategy's _SyncSwitch
        self.comm = self.engine.comm
        self.world, self.rank = strategy.dp.size, strategy.dp.rank  # the data-parallel ranks join
        self.optimizers = list(strategy._join_optims)   # the prepared optimizers; a STEP names one by index
        self.hkeys = [_hyper_keys(o) for o in self.optimizers]
        self.size = self.world + 1 + NFIELDS + max([len(k) for k in self.hkeys] + [0])
        self.shadowing = False
        self.buf_next = bool(model._sync_buffers_next)  # DDP's buffer rule on the agreed sync of the last forward
        self.agreement = SyncAgreement()
        self.precision: Optional[Any] = None
        self.last_input: Optional[tuple] = None
        self.pending: list[torch.Tensor] = []    # stage 3 shadow: outputs of replayed forwards awaiting a backward
        self.in_step = False   # a training rank inside its announced step (the strategy clears it)
        self._handles = [model.register_forward_pre_hook(self._record, with_kwargs=True)]
        self._begin_pass = self.engine.begin_pass
        self.engine.begin_pass = self._announce_backward   # instance attribute: the engine's hooks call it

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self.engine.__dict__.pop("begin_pass", None)
        self.agreement.end()
        self.model._sync_buffers_next = self.buf_next

    # -- messages --------------------------------------------------------------------------------------------------
    def _exchange(self, kind: int, fields: list[float] = ()) -> torch.Tensor:
        """Training ranks: their one-hot and the event (identical on each); ranks out of inputs: zeros and -inf."""
        v = torch.full((self.size,), -math.inf, dtype=torch.float64)
        v[:self.world] = 0.0
        if kind:
            v[self.rank] = 1.0
            v[self.world] = kind
            for k, x in enumerate(fields):
                v[self.world + 1 + k] = float(x)
        v = v.to(self.comm.device)  # NCCL reduces no CPU tensor
        self.comm.all_reduce(v, "max", control=True, world=True)
        return v.cpu()

    def _active(self, v: torch.Tensor) -> list[int]:
        return [r for r in range(self.world) if v[r] > 0]

    def _field(self, v: torch.Tensor, k: int) -> float:
        return float(v[self.world + 1 + k])

    # -- the training ranks' side ------------------------------------------------------------------------------
    def _record(self, module: Any, args: tuple, kwargs: dict) -> None:
        if not self.shadowing:
            self.last_input = (args, kwargs)

    def notify(self, model: Any) -> int:
        """A training rank's forward (DataParallelModule.forward): announce it, agree on whether it syncs; returns
        the rank buffers come from (the highest training rank, as DDP's join)."""
        sync = self.agreement.wish(self.switch)
        v = self._exchange(FWD, SyncAgreement.fields(sync))
        agreed = self._agree(v)
        self.agreement.settle(self.switch, sync, agreed)
        model._sync_buffers_next = self.buf_next
        self.buf_next = agreed
        return max(self._active(v))

    def _agree(self, v: torch.Tensor) -> bool:
        return SyncAgreement.agreed(v[self.world + 1:self.world + 1 + NAGREE])

    def _announce_backward(self) -> None:
        if not self.engine._in_pass and not self.shadowing:
            self._exchange(BWD, [self.engine.enabled])
        self._begin_pass()

    def before_clip(self, max_norm: float, norm_type: float) -> bool:
        """True: skip (a deferred sync: the gradients are clipped with the others' next step)."""
        if self.shadowing:
            return False
        if self.agreement.skip_clip():
            return True
        if self.in_step:  # DeepSpeed's gradient_clipping inside a step: the STEP announced it
            return False
        self._exchange(CLIP, [max_norm, norm_type])
        return False

    def before_step(self, optimizer: torch.optim.Optimizer, precision: Any) -> bool:
        """True: skip this rank's step (its sync was deferred: its gradients wait for the others' next step)."""
        self.precision = precision
        if self.shadowing:
            return False
        if self.agreement.skip_step():
            return True
        i = self._index(optimizer)
        self._exchange(STEP, [i, 0, 0, 0] + self._hyper(i))
        self.in_step = True
        return False

    def before_unscale(self, optimizer: torch.optim.Optimizer, precision: Any) -> bool:
        """True: skip (a deferred sync: the gradients are unscaled with the others' next step)."""
        self.precision = precision
        if self.shadowing or self.in_step:
            return False
        if self.agreement.skip_clip():  # deferred, as its clipping: with the others' next step
            return True
        self._exchange(UNSC, [self._index(optimizer)])
        return False

    def before_zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool) -> bool:
        """True: skip (the step of this iteration was deferred, so are its gradients)."""
        if self.shadowing:
            return False
        if self.agreement.skip_zero_grad():
            return True
        self._exchange(ZERO, [self._index(optimizer), set_to_none])
        return False

    def _index(self, optimizer: torch.optim.Optimizer) -> int:
        for i, o in enumerate(self.optimizers):
            if o is optimizer:
                return i
        raise ValueError("join_uneven_inputs: an optimizer that was not prepared by this Accelerator stepped inside "
                         "the context")

    def _hyper(self, i: int) -> list[float]:
        groups = self.optimizers[i].param_groups
        return [float(groups[g][key] if k < 0 else groups[g][key][k]) for g, key, k in self.hkeys[i]]

    # -- a rank out of inputs ------------------------------------------------------------------------------------
    def shadow(self) -> bool:
        """Mirror the training ranks' collectives until none is left. True when no rank was training at this rank's
        first check (it is one of the last to finish)."""
        self.agreement.end()
        self.shadowing = True
        last = True
        try:
            while True:
                v = self._exchange(0)
                active = self._active(v)
                if not active:
                    return last
                last = False
                kind = int(v[self.world])
                if kind == FWD:
                    self._shadow_forward(v, max(active))
                elif kind == BWD:
                    self._shadow_backward(self._field(v, 0) > 0)
                elif kind == CLIP:
                    params = list(self.engine.model.parameters())
                    self.strategy.clip_grad_norm_(params, self._field(v, 0), self._field(v, 1))
                elif kind == STEP:
                    self._shadow_step(v)
                elif kind == UNSC:
                    self.strategy.unscale_(self.optimizers[int(self._field(v, 0))], self._precision())
                elif kind == ZERO:
                    self.strategy.zero_grad(self.optimizers[int(self._field(v, 0))], self._field(v, 1) > 0)
                else:
                    raise RuntimeError(f"join_uneven_inputs: rank {self.rank} got an unknown event {kind}")
        finally:
            self.shadowing = False
            self.pending = []

    def _shadow_forward(self, v: torch.Tensor, src: int) -> None:
        agreed = self._agree(v)
        grad = self._field(v, 0) > 0
        self.model._sync_buffers_next = self.buf_next
        self.model._sync_buffers(src)
        self.buf_next = agreed
        if self.engine.stage != 3:
            return  # stages 1/2: a forward issues no collective
        if self.last_input is None:
            raise RuntimeError(f"join_uneven_inputs under ZeRO-3 / FULL_SHARD: rank {self.rank} ran out of inputs "
                               "before running any forward of the model inside the context; it replays its last "
                               "batch to serve its parameter shard to the others' all-gathers")
        args, kwargs = self.last_input
        module = self.model.module
        buffers = list(module.buffers())
        saved = [b.detach().clone() for b in buffers]
        with torch.random.fork_rng(devices=[]), torch.set_grad_enabled(grad):
            out = module(*args, **kwargs)
        # the replay must not move this rank's buffers (BatchNorm statistics) or its random state
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tuple(buffers)):
            for b, s in zip(buffers, saved):
                b.copy_(s)
        if grad:
            self.pending += [t for t in _tensors(out) if t.requires_grad]

    def _shadow_backward(self, enabled: bool) -> None:
        engine = self.engine
        if engine.stage != 3:
            shadow_backward(engine, self.switch.replicated, enabled)
            return
        outs, self.pending = self.pending, []
        if not outs:
            raise RuntimeError(f"join_uneven_inputs: rank {self.rank} has no replayed forward to mirror the training "
                               "ranks' backward with (every backward must follow a forward of the joined model)")
        used = engine.used.clone()
        params = [e.param for e in engine.entries] + [p for _, p in engine.replicated if p.requires_grad]
        hooks = [p.register_hook(torch.zeros_like) for p in params]  # this rank contributes zeros
        prev = self.switch.enabled
        self.switch.enabled = enabled
        try:
            torch.autograd.backward(outs, [torch.zeros_like(t) for t in outs])
        finally:
            self.switch.enabled = prev
            for h in hooks:
                h.remove()
            engine.used.copy_(used)

    def _shadow_step(self, v: torch.Tensor) -> None:
        i = int(self._field(v, 0))
        opt = self.optimizers[i]
        groups = opt.param_groups
        for k, (g, key, e) in enumerate(self.hkeys[i]):
            x = self._field(v, NFIELDS + k)
            if e < 0:
                groups[g][key] = type(groups[g][key])(x)
            else:
                seq = list(groups[g][key])
                seq[e] = type(seq[e])(x)
                groups[g][key] = type(groups[g][key])(seq)
        self.strategy.step(opt, self._precision())

    def _precision(self) -> Any:
        """The Accelerator's precision object (loss scaling must agree): the last one this rank's strategy saw."""
        if self.precision is None:
            self.precision = self.strategy.last_precision
        if self.precision is None:  # this rank never stepped nor unscaled: full precision
            from ..precision.policy import Precision
            self.precision = Precision(self.comm.device, {})
        return self.precision

    def finish(self, last: bool) -> None:
        """Every rank is out: all take the buffers and replicated parameters of the highest rank among the last to
        finish (the sharded parameters agree already)."""
        v = self._exchange(LAST if last else 0)
        src = max(self._active(v))
        module = self.model.module
        tensors = list(module.buffers()) + [p for _, p in self.engine.replicated]
        if tensors:
            with torch.no_grad():
                self.strategy.broadcast(tensors, src=src)


@contextlib.contextmanager
def sharded_join(strategy: Any, joinables: list) -> Iterator[None]:
    """The strategy's join under stages 1-3: one prepared model among `joinables` (optimizers may be listed too)."""
    from ..ddp.module import DataParallelModule
    models = [j for j in joinables if isinstance(j, DataParallelModule)]
    if len(models) != 1 or len(strategy.engines) != 1:
        raise NotImplementedError("join_uneven_inputs under the sharded engine (stages 1-3) takes exactly one prepared "
                                  f"model; got {len(models)} among the joinables and {len(strategy.engines)} prepared")
    model = models[0]
    if strategy._engine_of(model) is None:
        raise ValueError("join_uneven_inputs: the model is not one the sharded strategy prepared")
    join = ShardedJoin(strategy, model)
    strategy._join, model._join = join, join
    try:
        yield
        model._join = None  # this rank is out of inputs: its forwards no longer announce themselves
        join.finish(join.shadow())
    finally:
        strategy._join, model._join = None, None
        join.close()
