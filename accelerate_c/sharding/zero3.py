# accelerate_c/sharding/zero3.py: stage 3's parameter life cycle. Each unit's full parameters live in one flat
# buffer `u.full` whose storage is freed (resized to 0 bytes) while the unit is not in use and refilled in place
# (all-gather of the fp32 shards) when it is: the parameters stay views of that same storage, so autograd's saved
# tensors remain valid across a free/refill and no version counter moves: the shared-memory collective writes raw
# memory; a torch collective (ACCELERATE_C_COMM=torch, NCCL) is an in-place op that bumps the counter, which
# parameters made from views of u.full by sharded construction share, so the refill keeps it (_refill).
#   before a unit's forward: gather (a forward pre-hook);
#   after it: free, when reshard_after_forward (or under no_grad), and hook the outputs so that the unit is
#             gathered again before its backward runs (a hook on each output's gradient);
#   after its backward: once its gradients are reduce-scattered (engine.py), free.
# From the second forward on, the next unit (in the order the first forward ran them; reversed for backward) is
# prefetched: its all-gather runs on the shared-memory group's worker thread while the current unit computes.
# At the end of backward every unit still gathered is freed. Units are gathered one at a time in forward order;
# a unit nested in another (the root holds every layer) stays gathered around its children.
# What user code sees between uses: each parameter is a stand-in (views.py: its shape over one element, never a
# shape larger than its storage) whose first op gathers the unit for user code (materialize, collective) into fresh
# storage of its own, so tensors taken from it (state_dict(), .detach(), .cpu()) stay valid after the engine moves
# on; values user code writes there (load_state_dict, in-place ops) are written back into this rank's shard before
# the unit is next gathered or stepped. The optimizer step and engine.remove() end such a materialization; remove()
# leaves every parameter holding its full value (collective).
# Not for: gradient reduction (engine.py) or the optimizer side (optim_shard.py).
from __future__ import annotations

from typing import Any

import torch

from .flat import FlatUnit
from .views import set_standin, standin_data


def _refill(full: torch.Tensor) -> Any:
    """A context in which writing u.full's refill leaves its version counter (and its views') where it was: the
    values are the same parameters, not a modification autograd must see (FSDP2 does the same on its copy-out)."""
    return torch.autograd._unsafe_preserve_version_counter(full)


def _tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors inside a module's output (tensor, tuple/list, dict or ModelOutput, dataclass-like)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


class Zero3Hooks:
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.comm = engine.comm
        self.reshard_after_forward = bool(engine.config.reshard_after_forward)
        self._handles = []
        self._pending: dict[int, Any] = {}   # unit index -> the Work of its prefetch (all-gather in flight)
        self._order: list[int] = []          # units in the order the first forward ran them
        self._order_done = False
        for u in engine.units:
            # the parameters' views of the unit's full buffer while gathered (the storage is refilled in place); as
            # placed (sharded construction has already emptied the storage, where new views cannot be cut)
            u.pviews = [e.param.data for e in u.entries]
            u.standin, u.mat = False, None  # (materialize: the fresh buffer and each parameter's version)
            self._handles.append(u.module.register_forward_pre_hook(self._pre_forward(u)))
            self._handles.append(u.module.register_forward_hook(self._post_forward(u)))
            u.gathered = True  # (construction leaves the storage empty: free() sets the stand-ins either way)
            self.free(u)

    # -- gather / free ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def gather(self, u: FlatUnit) -> None:
        work = self._pending.pop(u.index, None)
        if work is not None:
            work.wait()
        if not u.gathered:
            self._end_materialized(u, write_back=True)
            u.full.untyped_storage().resize_(u.padded * u.full.element_size())
            with _refill(u.full):
                self.comm.all_gather(u.full, self.engine.gather_source(u))
            u.gathered = True
        self._bind(u)

    def _bind(self, u: FlatUnit) -> None:
        """The parameters view the gathered unit (the class first: a stand-in's ops would gather)."""
        if u.standin or u.mat is not None:
            u.mat = None
            for e, v in zip(u.entries, u.pviews):
                set_standin(e.param, False)
                e.param.data = v
            u.standin = False

    def _standins(self, u: FlatUnit) -> None:
        if not u.standin:
            for e in u.entries:
                e.param.data = standin_data(e.shape, self.engine.pdt, self.comm.device)
                set_standin(e.param, True)
            u.standin, u.mat = True, None

    # -- user code's reads between uses ----------------------------------------------------------------------------
    @torch.no_grad()
    def materialize(self, u: FlatUnit) -> None:
        """A stand-in of unit u was used by user code: gather the unit into fresh storage the parameters then hold
        (collective; a prefetch in flight is simply waited for)."""
        if not u.standin:
            return
        if u.gathered or u.index in self._pending:
            self.gather(u)
            return
        buf = torch.empty(u.padded, dtype=self.engine.pdt, device=self.comm.device)
        self.comm.all_gather(buf, self.engine.gather_source(u))
        for e, v in zip(u.entries, u.views(buf)):
            set_standin(e.param, False)
            e.param.data = v
        u.standin = False
        u.mat = (buf, [e.param._version for e in u.entries])

    @torch.no_grad()
    def _write_back(self, u: FlatUnit) -> None:
        """Values user code wrote into a materialized unit: this rank's shard of them into the shards."""
        buf, versions = u.mat
        if all(e.param._version == v for e, v in zip(u.entries, versions)):
            return
        eng = self.engine
        mine = buf[u.lo:u.hi]
        eng.pshard[u.base:u.base + u.shard].copy_(mine)
        if eng.low:
            eng.lshard[u.base:u.base + u.shard].copy_(mine)
        u.mat = (buf, [e.param._version for e in u.entries])

    def _end_materialized(self, u: FlatUnit, write_back: bool) -> None:
        if u.mat is not None:
            if write_back:
                self._write_back(u)
            self._standins(u)

    def write_back_all(self) -> None:
        for u in self.engine.units:
            if u.mat is not None:
                self._write_back(u)

    def after_step(self) -> None:
        """The shards changed: every unit user code gathered, or left gathered, goes back to its stand-ins."""
        for u in self.engine.units:
            self._end_materialized(u, write_back=False)
            self.free(u)

    @torch.no_grad()
    def prefetch(self, u: FlatUnit) -> None:
        """Starts u's all-gather on the shared-memory group's worker thread (synchronously without one), so it
        runs while the current unit computes; gather(u) waits for it."""
        if u.gathered:
            return
        self._end_materialized(u, write_back=True)
        u.full.untyped_storage().resize_(u.padded * u.full.element_size())
        with _refill(u.full):  # (a torch op bumps the counter when issued, not when waited on)
            work = self.comm.all_gather_async(u.full, self.engine.gather_source(u))
        if work is not None:
            self._pending[u.index] = work
        u.gathered = True

    def _next(self, u: FlatUnit, step: int) -> None:
        """Prefetch the unit after u in the recorded forward order (step 1) or backward order (step -1)."""
        if not self._order_done:
            return
        pos = self._pos.get(u.index)
        if pos is None:
            return
        nxt = pos + step
        if step < 0 and pos == 0:  # the root (around everything) starts backward: the last unit is next
            nxt = len(self._order) - 1 if self.engine.units[self._order[0]].name == "" else -1
        if 0 < nxt < len(self._order) or (step > 0 and nxt == 0):
            self.prefetch(self.engine.units[self._order[nxt]])

    def free(self, u: FlatUnit) -> None:
        if u.gathered:
            work = self._pending.pop(u.index, None)
            if work is not None:
                work.wait()
            self._standins(u)
            u.full.untyped_storage().resize_(0)
            u.gathered = False

    # -- hooks -----------------------------------------------------------------------------------------------
    def _pre_forward(self, u: FlatUnit) -> Any:
        def hook(module: torch.nn.Module, args: Any) -> None:
            if not self._order_done:
                if self._order and u.index == self._order[0]:  # the first forward is over: the order is known
                    self._order_done = True
                    self._pos = {i: k for k, i in enumerate(self._order)}
                elif u.index not in self._order:
                    self._order.append(u.index)
            self.gather(u)
            self._next(u, 1)
        return hook

    def _post_forward(self, u: FlatUnit) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            grad = torch.is_grad_enabled()
            if grad:
                for t in _tensors(output):
                    if t.requires_grad:
                        t.register_hook(self._pre_backward(u))
            if self.reshard_after_forward or not grad:
                self.free(u)
        return hook

    def _pre_backward(self, u: FlatUnit) -> Any:
        def hook(grad: torch.Tensor) -> None:
            self.engine.begin_pass()
            self.gather(u)
            self._next(u, -1)
        return hook

    def after_reduce(self, u: FlatUnit) -> None:
        """The unit's gradients are reduced: its parameters are not needed again in this backward."""
        self.free(u)

    def end_of_backward(self) -> None:
        for u in self.engine.units:
            self.free(u)

    @torch.no_grad()
    def remove(self) -> None:
        """The hooks removed; every parameter left holding its full value in storage of its own (collective)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        for u in self.engine.units:
            if u.gathered:
                self.gather(u)  # (a prefetch in flight)
                vals = [v.clone() for v in u.pviews]
                self.free(u)
                for e, v in zip(u.entries, vals):
                    set_standin(e.param, False)
                    e.param.data = v
                u.standin = False
            else:
                self.materialize(u)  # (nothing to do when user code already did: the storage is its own)
            u.mat = None
