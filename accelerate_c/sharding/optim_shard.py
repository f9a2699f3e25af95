# accelerate_c/sharding/optim_shard.py: the optimizer's view of the sharded engine. Each optimizer parameter that
# belongs to a unit is replaced, in its own param group (so per-group hyperparameters hold, and a unit may span
# several groups), by a 1-D Parameter viewing its piece of this rank's fp32 master shard (possibly empty); the
# piece's .grad views the same range of the shard gradient. Any element-wise optimizer (torch's, ours, the fused
# kernels) then steps the shard unchanged. Before each step the pieces of parameters that no rank used since the
# last zero_grad get grad None (skipped, as in the single-process loop), and empty pieces always do.
# Also here: the global gradient norm over the shards (clipping).
# Not for: moving buffers (engine.py) or choosing how to step (strategies/base.py Strategy.step).
from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Optional

import torch

from .engine import ShardEngine


class ShardedParams:
    """The pieces of one engine: piece(p) for an original parameter, and the bookkeeping around the step."""

    def __init__(self, engine: ShardEngine) -> None:
        self.engine = engine
        self.pieces: list[torch.nn.Parameter] = []
        self.grads: list[torch.Tensor] = []
        self.of_piece: dict[int, int] = {}  # id(piece) -> entry index
        self._g32: Optional[torch.Tensor] = None  # mixed precision: the fp32 shard gradient, during the step only
        self._ready = False  # before_step ran for the coming step (its gradients are attached)
        self.lp_offered = False  # low_precision_copies() handed the compute copy to this step's kernel
        self.lp_written = False  # the fused kernel wrote the compute copy in this step's pass (no cast after it)
        for i, e in enumerate(engine.entries):
            u = engine.unit_of[i]
            a, b = u.shard_slice(e)
            piece = torch.nn.Parameter(engine.master_shard(u)[a:b], requires_grad=True)
            grad = engine.grad_shard(u)[a:b]  # in the reduce dtype: cast to fp32 at the step when it is not fp32
            if not engine.low_grad:
                piece.grad = grad
            self.pieces.append(piece)
            self.grads.append(grad)
            self.of_piece[id(piece)] = i

    def owns(self, optimizer: torch.optim.Optimizer) -> bool:
        return any(id(p) in self.engine.index or id(p) in self.of_piece
                   for g in optimizer.param_groups for p in g["params"])

    def shard_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Replaces the unit parameters in the optimizer's groups by their pieces (state sliced along)."""
        index = self.engine.index
        for group in optimizer.param_groups:
            new = []
            for p in group["params"]:
                i = index.get(id(p))
                if i is None:
                    new.append(p)
                    continue
                piece = self.pieces[i]
                st = optimizer.state.pop(p, None)
                if st:
                    e = self.engine.entries[i]
                    optimizer.state[piece] = {k: (v.reshape(-1)[e.lo:e.hi].clone()
                                                  if isinstance(v, torch.Tensor) and v.numel() == e.numel else v)
                                              for k, v in st.items()}
                new.append(piece)
            group["params"] = new

    def before_step(self) -> None:
        """Attach each piece's gradient, or None when empty or unused by every rank (collective). Once per step:
        unscaling (Strategy.unscale_) and clipping may come first and work on these gradients."""
        if self._ready:
            return
        self._ready = True
        engine = self.engine
        used, pending = engine.global_used()
        # user code's writes to .grad and stage-3 values; a step after no_sync
        engine.views.settle(agreed_pending=pending)
        grads = self.grads
        if engine.low_grad:  # the optimizer's gradients are fp32 like its parameters: cast the shard for the step
            grads = self._fp32_copy()
        for i, piece in enumerate(self.pieces):
            piece.grad = grads[i] if used[i] and piece.numel() else None

    def _fp32_copy(self) -> list[torch.Tensor]:
        """The shard gradients copied into one fp32 buffer (freed after the step); each piece's range of it."""
        engine = self.engine
        self._g32 = g32 = torch.empty(engine.shard_numel, dtype=torch.float32, device=engine.comm.device)
        for u in engine.units:
            g32[u.base:u.base + u.shard].copy_(engine.grad_shard(u))
        out = []
        for i, e in enumerate(engine.entries):
            u = engine.unit_of[i]
            a, b = u.shard_slice(e)
            out.append(g32[u.base + a:u.base + b])
        return out

    def step_on_copy(self) -> None:
        """After before_step: the step works on a copy of the shard gradients (DeepSpeed's gradient_clipping is part
        of its step, and the gradients user code reads stay as the backward and user code left them)."""
        if self._g32 is not None:
            return
        copies = self._fp32_copy()
        for i, piece in enumerate(self.pieces):
            if piece.grad is not None:
                piece.grad = copies[i]

    def low_precision_copies(self) -> dict:
        """Mixed precision: {piece: its range of the compute copy}, for the fused kernel to write the updated
        master into in the same pass (bitwise what after_step's cast writes); {} in fp32 or with
        ACCELERATE_C_SHARD_KERNELS=0 (the separate cast is then the only path)."""
        from .pack import kernels_enabled
        engine = self.engine
        self.lp_offered = engine.low and kernels_enabled()
        if not self.lp_offered:
            return {}
        out = {}
        for i, e in enumerate(engine.entries):
            u = engine.unit_of[i]
            a, b = u.shard_slice(e)
            out[self.pieces[i]] = engine.compute_shard(u)[a:b]
        return out

    def after_step(self) -> None:
        """The updated shards into the parameters (engine.after_step: the cast skipped when the fused kernel wrote
        the compute copy; a piece it did not step kept its master, so its copy is still the master's cast); the
        step's fp32 gradient copy freed."""
        self._ready = False
        if self._g32 is not None:
            for piece in self.pieces:
                piece.grad = None
            self._g32 = None
        written, self.lp_written, self.lp_offered = self.lp_written, False, False
        self.engine.after_step(cast=not written)

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """Zero the shard gradients of this optimizer's parameters (only theirs)."""
        which = {self.of_piece[id(p)] for g in optimizer.param_groups for p in g["params"] if id(p) in self.of_piece}
        self.engine.zero_grad(which)
        self.forget_attached()
        if not self.engine.low_grad:
            for i in which:
                self.pieces[i].grad = self.grads[i]

    def forget_attached(self) -> None:
        """Gradients attached by before_step for a step that has not come (zero_grad, or another backward adds to
        the shard): attach them afresh next time."""
        if self._ready:
            self._ready = False
            if self._g32 is not None:  # the fp32 copy is stale
                for piece in self.pieces:
                    piece.grad = None
                self._g32 = None

    @torch.no_grad()
    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float,
                        replicated: list[torch.Tensor], model_group: Any = None,
                        counted: Callable[[torch.Tensor], bool] = lambda p: True) -> torch.Tensor:
        """The norm over every rank's shard gradients of `parameters` (unit parameters by their pieces; a
        `replicated` parameter outside the units, its gradient identical on every rank, counted once), one control
        all-reduce; every gradient is then scaled by min(1, max_norm / (norm + 1e-6)), as
        torch.nn.utils.clip_grad_norm_. `model_group`: the ranks that hold the other parts of one model replica
        (tensor / pipeline parallelism; collective over it too): a parameter counts on this rank when `counted`
        holds for it (the original parameter, not its piece; e.g. a TP-replicated norm weight on one TP rank only),
        and the parts are summed over the group."""
        engine = self.engine
        if not self._ready:
            engine.views.settle()  # gradients user code materialized (and maybe scaled) back into the shards
        norm_type = float(norm_type)
        mine: list[tuple[torch.Tensor, bool]] = []
        for p in parameters:
            i = engine.index.get(id(p), self.of_piece.get(id(p)))
            # once before_step attached them (after unscaling), the pieces' gradients are the ones to step
            g = (self.pieces[i].grad if self._ready else self.grads[i]) if i is not None else None
            if g is not None and g.numel():
                mine.append((g, counted(engine.entries[i].param)))
        rep = [(p.grad, counted(p)) for p in replicated if p.grad is not None and p.grad.numel()]
        grads = [g for g, c in mine + (rep if engine.rank == 0 else []) if c]
        # this rank's part with the C kernels of accelerate_c.optim.gradops (fp64 accumulation), then all-reduces
        from ..optim.gradops import global_norm, scale_
        op = "max" if math.isinf(norm_type) else "sum"
        local = global_norm(grads, norm_type).reshape(1).to(torch.float64) ** (1.0 if op == "max" else norm_type)
        total = engine.comm.all_reduce(local, op, control=True).clone()
        if model_group is not None and model_group.size > 1:
            model_group.all_reduce(total, op)
        total = (total[0] if op == "max" else total[0] ** (1.0 / norm_type)).float()
        coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        scale_([g for g, _ in mine + rep], coef)
        return total

    def slot(self, piece: torch.Tensor) -> Optional[tuple[Any, int]]:
        """(entry, index) of a piece, None for a parameter the engine does not shard."""
        i = self.of_piece.get(id(piece))
        return None if i is None else (self.engine.entries[i], i)
