# accelerate_c/sharding/gradviews.py: what user code reads of a sharded model's unit parameters (views.py routes
# a unit parameter's `.grad`, and a stage-3 stand-in's ops, to the engine's GradViews): the gradient with torch
# DDP's meaning, after a backward under no_sync the local gradient accumulated since zero_grad, after a synced
# backward the average over the ranks. Where each lives, per entry i:
#   local[i]: an unreduced local gradient: stage 1 in the full gradient buffer's view, stages 2/3 in the C grad slot
#             (autograd accumulates there under no_sync; with a reduce dtype other than the compute dtype it is moved
#             into acc32[i], kept in the reduce dtype as FSDP2's unsharded_accumulated_grad); a synced backward
#             reduces it (engine.py) and frees it;
#   avg[i]:   the shard gradient S (engine.grad_shard) holds its average, reduced by the last synced backward (None
#             is shown when no rank used the parameter: engine.gused);
#   V[i]:     a materialized average: the unit's shards all-gathered (collective) the first time user code reads a
#             PendingGrad of it. Stages 2/3 move the shard into V (S zeroed, so a later backward's reduction adds to
#             a fresh shard); stage 1 with a reduce dtype of its own copies it (its S is overwritten from the full
#             buffer at each synced backward, which then drops V). Writes into V (torch.nn.utils.clip_grad_norm_,
#             `p.grad.mul_`) are folded back into this rank's shard before the shard is used (settle: the step,
#             clipping, unscaling).
# Stage 1 reducing in place (no reduce dtype of its own: its shard is its own slice of the full buffer) has no S
# apart: after a synced backward the unit is `mixed` (its own slice averaged, the rest local gradients already
# counted); a PendingGrad there all-gathers the averaged slices into the full buffer in place (then it holds the
# average everywhere, as under DDP; settle marks it mixed again, since unscaling, clipping and the step change only
# the slices); before gradients accumulate into a mixed unit again (a grad-enabled forward, a backward) its average
# is moved aside (`stash`: side[u]) and the unit zeroed, and the next in-place reduction adds it back
# (inplace_reduced), so synced backwards without a zero_grad between them accumulate exactly.
# `p.grad = None` (Module.zero_grad) zeroes the entry everywhere; `p.grad = T` makes T its local gradient.
# Not for: the reductions themselves (engine.py) or the parameter classes (views.py).
from __future__ import annotations

from typing import Any, Optional

import torch

from .views import PendingGrad, detach_view, raw_grad, set_raw_grad


class GradViews:
    def __init__(self, engine: Any) -> None:
        self.e = engine
        n = len(engine.entries)
        self.local = [False] * n
        self.avg = [False] * n
        self.V: dict[int, torch.Tensor] = {}
        self.acc32: dict[int, torch.Tensor] = {}
        self.inplace = engine.stage == 1 and not engine.split_reduce
        self.mixed = [False] * len(engine.units)
        self.side: dict[int, torch.Tensor] = {}  # unit index -> its own slice's stashed average

    # -- what views.py asks --------------------------------------------------------------------------------------
    def visible_grad(self, i: int) -> Optional[torch.Tensor]:
        e = self.e
        if e._in_pass:  # autograd's own accumulation, hooks inside backward
            return self.local_grad(i)
        avg = self.avg[i] and e.gused[i]  # (a parameter no rank used: None, as under DDP)
        if self.inplace:
            u = e.unit_of[i]
            if i in self.V:
                return self.V[i]
            if u.index in self.side or (avg and self.mixed[u.index]):
                return self._pending(i)
            return self.local_grad(i) if self.local[i] or avg else None
        if e.stage == 1:
            if i in self.V:
                return self.V[i]
            if avg:
                return self._pending(i)
            return self.local_grad(i) if self.local[i] else None
        raw = self.local_grad(i) if self.local[i] else None
        if avg:
            return self._pending(i)
        v = self.V.get(i)
        if v is None:
            return raw
        return v if raw is None else v + raw.to(v.dtype)  # (a snapshot: writes to it change nothing)

    def set_visible_grad(self, i: int, value: Optional[torch.Tensor]) -> None:
        e = self.e
        e.zero_grad({i})
        if value is None:
            return
        ent = e.entries[i]
        if isinstance(value, PendingGrad):
            value = value.materialize()
        if tuple(value.shape) != tuple(ent.shape):
            raise RuntimeError(f"assigned grad of size {list(value.shape)} to parameter {ent.name} of size "
                               f"{list(ent.shape)}")
        if e.stage == 1:
            e.gviews[i].copy_(value)
        elif e.split_reduce:  # (local gradients under no_sync are kept in the reduce dtype)
            self.acc32[i] = value.detach().to(e.rdt, copy=True)
        else:
            set_raw_grad(ent.param, value.detach().to(ent.param.dtype))
        e.used[i] = 1.0
        self.local[i] = True

    def materialize_param(self, i: int) -> None:
        """Stage 3: entry i's unit gathered for user code (collective; zero3.py)."""
        self.e.zero3.materialize(self.e.unit_of[i])

    def _pending(self, i: int) -> PendingGrad:
        e = self.e

        def resolve() -> torch.Tensor:
            self.materialize(e.unit_of[i])
            return self.visible_grad(i)
        return PendingGrad(e.entries[i].shape, e.rdt, e.comm.device, resolve)

    # -- what the engine tells us --------------------------------------------------------------------------------
    def local_grad(self, i: int, fold: bool = False) -> Optional[torch.Tensor]:
        """Entry i's unreduced local gradient (stage 1: its view of the full buffer; stages 2/3: its .grad plus what
        no_sync accumulated in the reduce dtype; fold: add the one into the other rather than into a new tensor)."""
        e = self.e
        if e.stage == 1:
            return e.gviews[i]
        g, acc = raw_grad(e.entries[i].param), self.acc32.get(i)
        if acc is None or g is None:
            return g if acc is None else acc
        return acc.add_(g) if fold else acc + g

    def accumulated(self, i: int) -> None:
        """A backward under no_sync gave entry i a local gradient (not reduced)."""
        e = self.e
        self.local[i] = True
        if e.stage == 1:  # the full buffer now holds more than the shard's average
            self.avg[i] = False
            self.V.pop(i, None)
        elif e.split_reduce:  # accumulate in the reduce dtype
            p = e.entries[i].param
            g = raw_grad(p)
            set_raw_grad(p, None)
            acc = self.acc32.get(i)
            if acc is None:
                self.acc32[i] = g.to(e.rdt)
            else:
                acc.add_(g)

    def reduced(self, u: Any) -> None:
        """Unit u's local gradients were packed for a synced backward's reduction (averaged into its shard)."""
        e = self.e
        for ent in u.entries:
            i = e.index[id(ent.param)]
            self.local[i] = False
            self.avg[i] = True
            self.acc32.pop(i, None)
            if e.stage == 1:
                self.V.pop(i, None)  # superseded: the shard is the average of the whole full buffer again

    def zeroed(self, which: Optional[set]) -> None:
        e = self.e
        for i in range(len(self.local)) if which is None else which:
            self.local[i] = self.avg[i] = False
            self.V.pop(i, None)
            self.acc32.pop(i, None)
            u = e.unit_of[i]
            if u.index in self.side:
                a, b = u.shard_slice(e.entries[i])
                self.side[u.index][a:b].zero_()
        for u in e.units:  # a unit wholly zeroed is no longer mixed
            if which is None or all(e.index[id(x.param)] in which for x in u.entries):
                self.mixed[u.index] = False
                self.side.pop(u.index, None)

    # -- stage 1 in place ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def stash(self, force: bool = False) -> None:
        """Before gradients accumulate again (a grad-enabled forward; force: a backward) into mixed units: their
        own slice's average moved aside, the unit zeroed (what the rest held is already counted). Local only."""
        if not self.inplace or not any(self.mixed) or not (force or torch.is_grad_enabled()):
            return
        e = self.e
        for u in e.units:
            if self.mixed[u.index]:
                self.side[u.index] = e.grad_shard(u).clone()
                e.gfull[u.fbase:u.fbase + u.padded].zero_()
                self.mixed[u.index] = False

    @torch.no_grad()
    def inplace_reduced(self, u: Any) -> None:
        """Stage 1: unit u's in-place reduction is complete: a stashed average added back."""
        side = self.side.pop(u.index, None)
        if side is not None:
            self.e.grad_shard(u).add_(side)
        self.mixed[u.index] = True

    @torch.no_grad()
    def _unstash(self) -> None:
        """Before the shards are used with units still stashed and nothing accumulated into them since (a forward
        without a backward): the average back in place."""
        e = self.e
        for k in list(self.side):
            u = e.units[k]
            if not any(self.local[e.index[id(x.param)]] for x in u.entries):
                e.grad_shard(u).add_(self.side.pop(k))
                self.mixed[k] = True

    def pending_local(self) -> bool:
        return any(self.local)

    def tensors(self) -> list[torch.Tensor]:
        return list(self.V.values()) + list(self.acc32.values())

    # -- gathering and folding back ----------------------------------------------------------------------------
    @torch.no_grad()
    def materialize(self, u: Any) -> None:
        """Unit u's averaged shard gradients all-gathered into V (collective over the shard group); stage 1 in
        place: into the full buffer itself (a stashed unit: its stash plus the local gradients, into V)."""
        e = self.e
        if self.inplace and u.index not in self.side:
            e.comm.gather_shards_inplace(e.gfull, [(u.fbase, u.shard)])
            self.mixed[u.index] = False
            return
        full = torch.empty(u.padded, dtype=e.rdt, device=e.comm.device)
        if self.inplace:
            e.comm.all_gather(full, self.side[u.index])
            full += e.gfull[u.fbase:u.fbase + u.padded]
            for ent, v in zip(u.entries, u.views(full)):
                self.V[e.index[id(ent.param)]] = v  # (a snapshot: writes to it change nothing)
            return
        e.comm.all_gather(full, e.grad_shard(u))
        for ent, v in zip(u.entries, u.views(full)):
            i = e.index[id(ent.param)]
            if not (self.avg[i] and e.gused[i]):  # (no rank used it: its shard holds zeros, it shows None)
                continue
            if e.stage == 1:
                self.V[i] = v
                continue
            old = self.V.get(i)
            self.V[i] = v if old is None else old.add_(v)
            self.avg[i] = False
        if e.stage != 1:  # moved: the shard starts afresh
            e.grad_shard(u).zero_()
            e._fresh[u.index] = True

    @torch.no_grad()
    def settle(self, agreed_pending: bool = False) -> None:
        """Before the shard gradients are used (the step, clipping, unscaling): V folded back into this rank's shards
        (stage 1: replacing the shard's average, stages 2/3: adding to it); stage 3, parameter values user code
        changed written back into the shards; with `agreed_pending` (every rank agreed that a local gradient no
        synced backward reduced is waiting: a step after no_sync) the units reduced now, as a synced backward
        would have."""
        e = self.e
        if self.inplace:
            self.V.clear()  # (only stashed snapshots)
        for i, v in self.V.items():
            u, ent = e.unit_of[i], e.entries[i]
            a, b = u.shard_slice(ent)
            if b > a:
                piece = e.grad_shard(u)[a:b]
                src = v.reshape(-1)[ent.lo:ent.hi].to(piece.dtype)
                if e.stage == 1:
                    piece.copy_(src)
                else:
                    piece.add_(src)
            if e.stage != 1:
                e._fresh[u.index] = False
            self.avg[i] = True
        self.V.clear()
        if e.zero3 is not None:
            e.zero3.write_back_all()
        if agreed_pending:
            e._reduce_units(0, len(e.units))
            e.wait()
        self._unstash()
        if self.inplace:  # what comes next (unscaling, clipping, the step) changes the shard slices only: the rest
            for u in e.units:  # of a unit gathered for user code is stale, to be gathered again when read
                if u.index not in self.side and any(self.avg[e.index[id(x.param)]] for x in u.entries):
                    self.mixed[u.index] = True

    # -- the engine removed ------------------------------------------------------------------------------------
    def snapshot(self) -> list[Optional[torch.Tensor]]:
        """Every entry's visible gradient as a tensor of its own (collective: pending ones are gathered)."""
        out = []
        for i in range(len(self.e.entries)):
            g = self.visible_grad(i)
            if isinstance(g, PendingGrad):
                g = g.materialize()
            out.append(None if g is None else g.detach().clone())
        return out

    def detach(self, grads: list[Optional[torch.Tensor]]) -> None:
        """Every unit parameter back to its own class, holding `grads` (snapshot()) as its .grad."""
        for ent, g in zip(self.e.entries, grads):
            detach_view(ent.param)
            set_raw_grad(ent.param, None if g is None else g.to(ent.param.dtype))
