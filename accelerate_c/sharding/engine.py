# accelerate_c/sharding/engine.py: the flat-shard engine of one prepared model (ZeRO 1/2/3, FSDP). Units
# (units.py) each get a flat buffer padded to a multiple of the world size (flat.py); rank r owns shard r.
#   stage 1: the full parameters live in one flat buffer (shared memory on one host); every parameter's gradient
#            accumulates locally in a view of one full flat gradient buffer. A synced backward reduce-scatters
#            (average) each unit into its own shard of that buffer (in place) as the unit completes; under no_sync
#            nothing is reduced. After that the rest of the buffer holds local gradients already counted: a
#            grad-enabled forward (or a backward) before zero_grad first moves the shard's average aside and zeroes
#            the unit, and the next reduction adds it back (gradviews.py: stash), so synced backwards accumulate.
#            With a reduce dtype of its own the averaged shard is a buffer apart (`gshard`, overwritten from the full
#            buffer at each synced backward). The optimizer steps the shard; the shards are then all-gathered.
#   stage 2: as 1, but no full gradient buffer: under no_sync the gradients accumulate locally in the parameters'
#            own .grad (torch FSDP's no_sync); in a synced backward, as each unit's gradients are complete
#            (post-accumulate-grad hooks, in a fixed unit order on every rank) they are packed into a staging
#            window (a unit larger than one goes in pieces: each window holds the same piece of every rank's shard),
#            reduce-scattered into the unit's shard gradient (accumulating across synced
#            backwards until zero_grad) and the parameters' .grad freed.
#   stage 3: as 2, and the parameters themselves are sharded: zero3.py gathers a unit before its forward and its
#            backward and frees it after.
# Every optimizer parameter that belongs to a unit is replaced by a 1-D Parameter viewing its piece of this rank's
# fp32 master shard, whose .grad views the shard gradient (optim_shard.py), so torch's element-wise optimizers and
# the fused kernels step the shard unchanged. A parameter that no rank used since the last zero_grad gets grad None
# on its piece (not stepped), as in the single-process loop.
# Mixed precision (param_dtype): the full parameters and their gradients use the compute dtype; fp32 master shards
# (`master`, stage 3 `pshard`) are what the optimizer steps, cast into the compute copy after it (or written by the
# fused kernel in the same pass: after_step(cast=False)). reduce_dtype (default: the compute dtype): gradients are
# cast into it on the copy-in (pack.py), reduced in it and the shard gradient `gshard` is kept in it (stage 1's full
# gradient buffer stays in the compute dtype). Modules kept
# in fp32 (BatchNorm by default) and frozen parameters under a compute dtype: mixed.py.
# What user code reads from a unit parameter (its .grad, stage 3's values between uses) is views.py / gradviews.py.
# Not for: the strategy contract (strategies/sharded.py) or the layout arithmetic (flat.py).
from __future__ import annotations

from typing import Any, Iterator, Optional

import torch

from .. import _C
from ..base.process_local import ProcessBound
from ..base.weak import weak_hook
from ..base.dtypes import C_FLOAT_INPUTS
from .comm import ShardComm
from .flat import FlatEntry, FlatUnit
from .placement import place_buffers
from .recompute import checkpoint_units
from .units import build_units
from .views import attach, raw_grad, set_raw_grad


class ShardEngine(ProcessBound):
    def __init__(self, model: torch.nn.Module, config: Any, comm: ShardComm, construct: bool = False) -> None:
        self.model, self.config, self.comm = model, config, comm
        self.construct = construct  # some rank's model is on the meta device: sharded construction (construct.py)
        self.stage = int(config.stage)
        self.rank, self.world = comm.rank, comm.size
        from .mixed import fp32_modules  # mixed precision: BatchNorm (by default) kept out of the units, in fp32
        low = (config.param_dtype or torch.float32) != torch.float32
        keep32 = fp32_modules(model, getattr(config, "fp32_module_classes", None)) if low else []
        specs, self.replicated = build_units(model, config.auto_wrap_policy, config.transformer_layer_cls,
                                             config.min_num_params, tuple(config.ignored_modules) + tuple(keep32),
                                             getattr(config, "auto_wrap_callable", None))
        self.units = [FlatUnit(i, s.name, s.module, s.params, self.world, self.rank) for i, s in enumerate(specs)]
        sbase = fbase = 0
        for u in self.units:
            u.base, u.fbase = sbase, fbase
            sbase, fbase = sbase + u.shard, fbase + u.padded
        self.shard_numel, self.full_numel = sbase, fbase
        self.entries: list[FlatEntry] = [e for u in self.units for e in u.entries]
        self.index = {id(e.param): i for i, e in enumerate(self.entries)}
        self.unit_of = [u for u in self.units for _ in u.entries]
        for e in self.entries:
            if e.param.dtype != torch.float32:
                raise TypeError(f"sharded engine: parameter {e.name} is {e.param.dtype}; the master shards are fp32 "
                                "(build the model in fp32; a low-precision compute copy is param_dtype's job)")
        # mixed precision: parameters and gradients in the compute dtype, reduced in reduce_dtype; fp32 master shards
        pdt = config.param_dtype or torch.float32
        self.pdt, self.low = pdt, pdt != torch.float32
        self.rdt = config.reduce_dtype or pdt
        if self.rdt not in C_FLOAT_INPUTS:
            raise TypeError(f"sharded engine: reduce_dtype={self.rdt}; allowed: float32, bfloat16, float16")
        self.split_reduce = self.rdt != pdt          # gradients change dtype on their way into the reduction
        from .buffers import cast_buffers
        self.buffer_orig = cast_buffers(model, config.buffer_dtype, keep=keep32)  # FSDP1: id -> original dtype
        self.low_grad = self.rdt != torch.float32    # the shard gradient needs an fp32 copy for the step
        self.enabled = True            # False inside no_sync
        # this rank produced a gradient since the last zero_grad (on the device: NCCL reduces no CPU tensor)
        self.used = torch.zeros(len(self.entries), device=comm.device)
        self.gused = [False] * len(self.entries)  # some rank did, as agreed at the end of the last synced backward
        self._fresh = [True] * len(self.units)      # the unit's shard gradient is zero (stages 2/3)
        self._in_pass = False
        self._works: list[tuple[Any, Optional[torch.Tensor], Optional[torch.Tensor]]] = []  # (work, tmp, shard)
        self._inplace: list[FlatUnit] = []  # stage 1: units reduced in place, until wait()
        self.zero3: Optional[Any] = None
        self.replicated_sync: Optional[Any] = None  # the strategy's average of the replicated parameters (end of pass)
        with torch.no_grad():
            place_buffers(self)
        from .gradviews import GradViews
        self.views = GradViews(self)  # what user code reads of the unit parameters
        for i, e in enumerate(self.entries):
            attach(e.param, self.views, i)
        self.mixed: Optional[Any] = None
        if self.low:  # fp32 modules' cast hooks; frozen parameters into the compute dtype (mixed.py)
            from .mixed import MixedEdges
            from .units import _ignored_params
            skip = _ignored_params(model, tuple(config.ignored_modules) + tuple(keep32))
            self.mixed = MixedEdges(model, pdt, keep32, [p for _, p in self.replicated
                                                          if not p.requires_grad and id(p) not in skip])
        nb = len(self.units)
        self.counter = _C.BucketCounter([nb - 1 - u.index for u in self.unit_of], max(nb, 1))
        self._handles = [e.param.register_post_accumulate_grad_hook(weak_hook(self._on_grad)) for e in self.entries]
        self._restore: list[tuple[torch.nn.Module, Any]] = []  # (module, its own forward) under checkpointing
        if self.low:  # FSDP's cast_forward_inputs: floating inputs of the root forward in the compute dtype
            self._handles.append(model.register_forward_pre_hook(self._cast_inputs, with_kwargs=True))
        if self.views.inplace:  # stage 1: before gradients accumulate again after an in-place reduction
            self._handles.append(model.register_forward_pre_hook(lambda m, a: self.views.stash()))
        if config.activation_checkpointing:
            checkpoint_units(self.units, self._restore)
        if self.stage == 3:
            from .zero3 import Zero3Hooks
            self.zero3 = Zero3Hooks(self)

    def _cast_inputs(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple:
        from ..runtime.operations import recursively_apply

        def cast(x: torch.Tensor) -> torch.Tensor:
            return x.to(self.pdt) if x.is_floating_point() and x.dtype != self.pdt else x
        return recursively_apply(cast, args), recursively_apply(cast, kwargs)

    # -- buffers -----------------------------------------------------------------------------------------
    def master_shard(self, u: FlatUnit) -> torch.Tensor:
        """This rank's fp32 master shard of unit u (what the optimizer steps)."""
        if self.stage == 3:
            return self.pshard[u.base:u.base + u.shard]
        if self.low:
            return self.master[u.base:u.base + u.shard]
        return self.flat[u.fbase + u.lo:u.fbase + u.hi]

    def gather_source(self, u: FlatUnit) -> torch.Tensor:
        """Stage 3: what is all-gathered into the unit's full buffer (the compute copy of the shard)."""
        return (self.lshard if self.low else self.pshard)[u.base:u.base + u.shard]

    def compute_shard(self, u: FlatUnit) -> torch.Tensor:
        """Mixed precision: this rank's shard of unit u in the compute copy (what the master shard is cast into)."""
        if self.stage == 3:
            return self.lshard[u.base:u.base + u.shard]
        return self.flat[u.fbase + u.lo:u.fbase + u.hi]

    def grad_shard(self, u: FlatUnit) -> torch.Tensor:
        """This rank's shard of unit u's averaged gradient (what the optimizer's pieces step with)."""
        if self.stage == 1 and not self.split_reduce:
            return self.gfull[u.fbase + u.lo:u.fbase + u.hi]
        return self.gshard[u.base:u.base + u.shard]

    # -- backward ------------------------------------------------------------------------------------------
    def _on_grad(self, p: torch.Tensor) -> None:
        i = self.index[id(p)]
        self.used[i] = 1.0
        if self.stage == 1:
            view, g = self.gviews[i], raw_grad(p)
            if g is not view:  # a fresh gradient tensor (the grad slot was emptied): back into the buffer
                view.copy_(g)
                set_raw_grad(p, view)
        if not self.enabled:  # no_sync: the gradient accumulates locally (gradviews.py)
            self.views.accumulated(i)
            return
        self.begin_pass()
        self._reduce_units(*self.counter.mark(i))

    def begin_pass(self) -> None:
        """Queues the end-of-backward callback once per backward pass (from inside the pass)."""
        if not self._in_pass:
            self._in_pass = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._in_pass = False
        if self.enabled:
            self._reduce_units(*self.counter.mark_all_remaining())
        self.counter.reset()
        self.wait()  # when backward returns, every shard gradient is reduced
        if self.enabled:
            self.agree_used()
            if self.replicated_sync is not None:
                self.replicated_sync.sync_now()
        if self.zero3 is not None:
            self.zero3.end_of_backward()

    @torch.no_grad()
    def sync_held(self) -> None:
        """What the units hold now reduced, as at the end of a synced backward (gradients accumulated outside one: a
        pipeline stage's micro-batches under no_sync): every unit in the hooks' fixed order, the used mask agreed,
        the replicated parameters averaged (collective over the shard group)."""
        self._reduce_units(0, len(self.units))
        self.wait()
        self.agree_used()
        if self.replicated_sync is not None:
            self.replicated_sync.sync_now()

    def reset_pass(self) -> None:
        """Before a backward: forget a pass that raised midway (its end callback never ran); stage 1, the averages of
        an earlier reduction moved aside (as a forward does)."""
        if self._in_pass:
            self._in_pass = False
            self.counter.reset()
            self.wait()
        self.views.stash(force=True)

    @torch.no_grad()
    def wait(self) -> None:
        works, self._works = self._works, []
        for work, tmp, shard in works:
            if work is not None:
                work.wait()
            self.comm.finish_reduce(tmp if tmp is not None else shard)
            if tmp is not None:
                shard.add_(tmp)
        done, self._inplace = self._inplace, []
        for u in done:  # (stage 1: a stashed average added back)
            self.views.inplace_reduced(u)
        if hasattr(self, "staging"):
            self._staging_work = [None] * len(self.staging)

    @torch.no_grad()
    def _reduce_units(self, first: int, end: int) -> None:
        nb = len(self.units)
        for b in range(first, end):
            self._reduce(self.units[nb - 1 - b])

    def _reduce(self, u: FlatUnit) -> None:
        comm = self.comm
        if self.stage == 1 and not self.split_reduce:
            self.views.reduced(u)
            # in place: the averaged shard lands in our own slice of the full gradient buffer
            out = self.grad_shard(u)
            w = comm.reduce_scatter_async(out, self.gfull[u.fbase:u.fbase + u.padded], "avg")
            self._works.append((w, None, out))
            self._inplace.append(u)
            return
        # stage 1: the full gradient buffer (it accumulates): cast into the reduce dtype, overwrite; stages 2/3: each
        # parameter's local gradient
        grads = [self.views.local_grad(self.index[id(e.param)], fold=True) for e in u.entries]
        self.views.reduced(u)
        shard = self.grad_shard(u)
        fresh = self._fresh[u.index] or self.stage == 1
        self._fresh[u.index] = False
        whole = u.shard <= self.window
        flats = None if whole else [g.reshape(-1) if g is not None else None for g in grads]
        for start in range(0, max(u.shard, 1), self.window):  # the unit in windows of its shards, in order
            n = min(self.window, u.shard - start)
            k = self._next_staging
            self._next_staging = (k + 1) % len(self.staging)
            if self._staging_work[k] is not None:  # peers may read this buffer until its reduce-scatter is done
                self._staging_work[k].wait()
            staging = self.staging[k][:n * self.world]
            if whole:
                u.pack(staging, grads)
            else:
                u.pack_window(staging, flats, start, n)
            out = shard[start:start + n]
            if fresh:
                w = comm.reduce_scatter_async(out, staging, "avg")
                self._works.append((w, None, out))
            else:  # accumulation: a second backward before zero_grad
                tmp = torch.empty_like(out)
                w = comm.reduce_scatter_async(tmp, staging, "avg")
                self._works.append((w, tmp, out))
            self._staging_work[k] = w
        del flats, grads
        if self.stage == 1:
            return
        for e in u.entries:
            set_raw_grad(e.param, None)
        if self.zero3 is not None:
            self.zero3.after_reduce(u)

    # -- the step --------------------------------------------------------------------------------------------
    def global_used(self) -> tuple[list[bool], bool]:
        """Which parameters some rank produced a gradient for since the last zero_grad, and whether some rank holds
        a local gradient no synced backward reduced (one collective)."""
        used = torch.cat([self.used, self.used.new_full((1,), float(self.views.pending_local()))])
        self.comm.all_reduce(used, "max", control=True, world=True)
        flags = (used > 0).tolist()
        self.gused = flags[:-1]
        return flags[:-1], flags[-1]

    def agree_used(self) -> None:
        """After a synced backward: which parameters some rank used (a small control all-reduce, as torch DDP's
        unused-parameter bitmap), so that one no rank used shows grad None, as under DDP."""
        used = self.used.clone()
        self.comm.all_reduce(used, "max", control=True, world=True)
        self.gused = (used > 0).tolist()

    @torch.no_grad()
    def after_step(self, cast: bool = True) -> None:
        """The updated fp32 master shards into the compute copy (cast=False: the fused kernel already wrote it in
        the step's pass) and, stages 1/2, every rank's updated shards into every rank's full parameters."""
        if self.stage == 3:
            if self.low and cast:
                self.lshard.copy_(self.pshard)
            self.zero3.after_step()
            return
        if self.low and cast:
            for u in self.units:
                self.flat[u.fbase + u.lo:u.fbase + u.hi].copy_(self.master[u.base:u.base + u.shard])
        self.comm.gather_shards_inplace(self.flat, [(u.fbase, u.shard) for u in self.units])

    @torch.no_grad()
    def zero_grad(self, which: Optional[set[int]] = None) -> None:
        """Zero the gradients of entries `which` (indices; None: all) - an optimizer's own parameters, so that
        two optimizers over one model zero only their own."""
        self.views.zeroed(which)
        if which is None or len(which) == len(self.entries):
            if self.stage == 1:
                self.gfull.zero_()
                for e, v in zip(self.entries, self.gviews):
                    set_raw_grad(e.param, v)
            else:
                self._fresh = [True] * len(self.units)
                for e in self.entries:
                    set_raw_grad(e.param, None)
            if hasattr(self, "gshard"):  # (a PageBuffer gives its pages back until the next backward writes them)
                (self.gshard_pages or self.gshard).zero_()
            self.used.zero_()
            return
        for i in sorted(which):
            e, u = self.entries[i], self.unit_of[i]
            a, b = u.shard_slice(e)
            self.grad_shard(u)[a:b].zero_()
            if self.stage == 1:
                self.gviews[i].zero_()
                set_raw_grad(e.param, self.gviews[i])
            else:
                set_raw_grad(e.param, None)
            self.used[i] = 0.0
        if self.stage != 1:  # a unit is fresh (its reduce-scatter may overwrite) only when wholly zeroed
            for u in self.units:
                if all(self.index[id(e.param)] in which for e in u.entries):
                    self.grad_shard(u).zero_()
                    self._fresh[u.index] = True

    # -- state -----------------------------------------------------------------------------------------------
    def gathered_units(self) -> Iterator[tuple[FlatUnit, list[torch.Tensor]]]:
        """Each unit with its parameters' full fp32 values, one unit at a time (collective under stage 3 and under
        a compute copy: call on every rank, running the generator to its end). The values view one unit-sized
        scratch buffer that the next unit overwrites (copy what you keep), so a rank holds at most one gathered
        unit on top of its shards; stages 1/2 without a compute copy: the full parameters themselves."""
        scratch: Optional[torch.Tensor] = None
        for u in self.units:
            if self.stage in (1, 2) and not self.low:
                yield u, [e.param.detach() for e in u.entries]
                continue
            if scratch is None:
                biggest = max(v.padded for v in self.units)
                scratch = torch.empty(biggest, dtype=torch.float32, device=self.comm.device)
            # from the fp32 master shards (zero-copy all-gather: the shards sit at the same offset on every rank)
            full = scratch[:u.padded]
            with torch.no_grad():
                self.comm.all_gather(full, self.master_shard(u))
            yield u, [v.detach() for v in u.views(full)]

    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor the engine holds for the model: parameters (full and shards), gradients, staging."""
        ts = [e.param for e in self.entries] + [p for _, p in self.replicated]
        ts += [p.grad for _, p in self.replicated if p.grad is not None]
        for name in ("flat", "master", "pshard", "lshard", "gfull", "gshard"):
            if hasattr(self, name):
                ts.append(getattr(self, name))
        ts += getattr(self, "staging", [])
        ts += [raw_grad(e.param) for e in self.entries if raw_grad(e.param) is not None]
        ts += self.views.tensors()
        return ts

    @torch.no_grad()
    def remove(self) -> None:
        """Hooks off; every unit parameter left a plain parameter (its own class) with its full value and, as its
        .grad, what user code read there (collective: end_training calls it on every rank)."""
        grads = self.views.snapshot()
        for h in self._handles:
            h.remove()
        self._handles = []
        for module, forward in self._restore:
            if module.__dict__.get("forward") is not None:
                del module.forward  # back to the class's forward
        self._restore = []
        if self.zero3 is not None:
            self.zero3.remove()  # (every unit's values into parameters of their own first: collective)
        if self.mixed is not None:
            self.mixed.remove()
        self.views.detach(grads)


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (a view counts once with its base)."""
    seen: dict[int, int] = {}
    with torch._C.DisableTorchFunctionSubclass():  # (what is held: a stage-3 stand-in is not gathered to count it)
        for t in tensors:
            s = t.untyped_storage()
            ptr = s.data_ptr()
            if ptr:
                seen[ptr] = max(seen.get(ptr, 0), s.nbytes())
    return sum(seen.values())
