# accelerate_c/pipeline/engine.py: PipelineEngine, the pipeline-parallel engine of one rank, built from explicit
# inputs (the model, this rank's pipeline rank and size, the pipeline dimension's torch ProcessGroup, the schedule
# and its sizes); it reads no environment variable and no global group. It cuts the model into p·v stages
# (stages.py, from the family's plan in adapters.py), prunes the model in place to this rank's stages (logical names
# kept: `engine.module.state_dict()` is this rank's share of the model's logical tensors), opens the point-to-point
# channels its schedule needs (comm's p2p_for_device) and runs a batch:
#   training mode: `engine(**batch)` splits the batch into m micro-batches, runs forward and backward over the
#     schedule (runtime.py), accumulates into this stage's parameters' .grad exactly what one process's backward on
#     the whole batch gives, and returns PipelineOutput(loss=<the batch's loss>) on every rank of the pipeline;
#     `scale_loss` (a function applied to each micro-batch's loss share before its backward: 1/k gradient
#     accumulation, fp16 loss scaling) and `sync_grads` (sum the tied weights' gradients across their stages at the
#     end of this call; False on accumulation iterations) are attributes the caller sets;
#   eval mode: a forward pipeline; PipelineOutput(loss, logits) (logits of the whole batch, in order) on every rank
#     (eval_outputs="all") or on the last stage's rank only ("last"; the others get None).
# Every rank of the pipeline must be given the same batch. Tied weights (an embedding and the LM head on different
# stages) start from the first holder's values and their gradients are summed across holders, so per-stage
# optimizers keep them equal.
# Not for: schedules (schedules.py), executing them (runtime.py), the optimizer step (the caller steps
# `engine.parameters()`; clip_grad_norm_ here gives the norm over every stage).
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from ..comm.group import p2p_for_device
from ..sharding.materialize import materialize_model
from . import stages as st
from .adapters import adapter_for
from .deferred import WeightGrads, split_linears
from .runtime import DTYPES, Runner
from .schedules import build_schedule, check_sizes, forward_only
from .simulator import simulate


class PipelineOutput(dict):
    """The pipeline's result with attribute access, as transformers' ModelOutput: .loss, .logits."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _full_sequence(mb: dict, hidden: torch.Tensor) -> torch.Tensor:
    """What the stage's masks and positions are built from: the hidden states, or under sequence parallelism (where a
    later stage receives its slice of the sequence) a view of them at the micro-batch's full length (no copy)."""
    ref = mb.get("input_ids")
    ref = ref if isinstance(ref, torch.Tensor) else mb.get("inputs_embeds")
    if not isinstance(ref, torch.Tensor) or ref.dim() < 2 or hidden.dim() < 3 or hidden.shape[1] == ref.shape[1]:
        return hidden
    return hidden[:, :1].expand(hidden.shape[0], ref.shape[1], *hidden.shape[2:])


class PipelineEngine(nn.Module):
    runs_backward = True  # its training call runs the backward itself (a data-parallel wrapper syncs after it)
    _accelerate_c_wrapper = True  # unwrap_model gives the user's (pruned) model

    """See the header. `split`: split points (layer indices or module names, see stages.py); `layers`/`first`/`last`/
    `loss_fn`/`input_key`: a chain model's plan (adapters.py); `activation_checkpointing`: True (every stage) or the
    stages whose layers recompute their activations in backward; `autocast_dtype`: torch.autocast around each F."""

    def __init__(self, model: nn.Module, *, rank: int, size: int, group: Any = None, schedule: str = "1f1b",
                 num_micro_batches: Optional[int] = None, virtual_stages: int = 1, split: st.Split = None,
                 layers: Optional[str] = None, first: Sequence[str] = (), last: Sequence[str] = (),
                 loss_fn: Optional[Callable] = None, input_key: str = "input",
                 activation_checkpointing: Union[bool, Sequence[int]] = False,
                 autocast_dtype: Optional[torch.dtype] = None, device: Optional[torch.device] = None,
                 transport: str = "auto", eval_outputs: str = "all", track_memory: bool = False,
                 p2p_options: Optional[dict] = None) -> None:
        super().__init__()
        if not 0 <= rank < size:
            raise ValueError(f"pipeline rank {rank} is not in 0..{size - 1} (pp_size={size})")
        if eval_outputs not in ("all", "last"):
            raise ValueError(f"eval_outputs={eval_outputs!r}: choose 'all' or 'last'")
        m = num_micro_batches if num_micro_batches is not None else size
        check_sizes(schedule, size, m, virtual_stages)
        self.rank, self.p, self.v, self.m, self.num_stages = rank, size, virtual_stages, m, size * virtual_stages
        self.schedule_name, self.eval_outputs = schedule, eval_outputs
        ckpt = activation_checkpointing
        self.checkpointing = set(range(self.num_stages)) if ckpt is True else set(ckpt or ())
        self.scale_loss: Optional[Callable] = None
        self.sync_grads: Union[bool, Callable[[], bool]] = True  # or a callable asked at the end of each call
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.adapter = adapter_for(model, layers=layers, first=tuple(first), last=tuple(last), loss_fn=loss_fn,
                                   input_key=input_key)
        self._cut(model, split)
        self.module = model
        self.schedule = build_schedule(schedule, size, m, virtual_stages)
        simulate(self.schedule, {"F": 1.0, "B": 1.0, "W": 1.0})  # validates the programs (raises ScheduleError)
        self._eval_schedule = forward_only(size, m, virtual_stages)
        chans = self.schedule.channels()
        self.transport = None
        if size > 1:
            self.transport = p2p_for_device(self.device, group, [(s, d) for s, d, _, _ in chans], transport,
                                            **(p2p_options or {}))
        self.store = WeightGrads()
        if self.schedule.split_backward():
            split_linears(model, self.store)
        self.runner = Runner(rank, self.num_stages, self._stage_fn, self.transport,
                             {(k, s): i for i, (_, _, k, s) in enumerate(chans)}, store=self.store,
                             param_ptrs={p.untyped_storage().data_ptr() for p in model.parameters()},
                             autocast=autocast_dtype, track_memory=track_memory, device=self.device)
        self._sync_tied(values=True)
        for _, p, ranks in self._tied_here():  # a tied weight's gradient norm is counted by its first holder only
            if p is not None and self.rank != ranks[0]:
                p._pp_counted_elsewhere = True

    # ---- stages ----------------------------------------------------------------------------------------------
    def _cut(self, model: nn.Module, split: st.Split) -> None:
        a, S = self.adapter, self.num_stages
        layer_list = st.get_module(model, a.layer_path)
        if not isinstance(layer_list, (nn.ModuleList, nn.Sequential)):
            raise ValueError(f"pipeline: {a.layer_path or 'the model'} is a {type(layer_list).__name__}, not a "
                             "ModuleList or Sequential of layers")
        n = len(layer_list)
        weights = [st.param_count(layer) for layer in layer_list]
        first = sum(st.param_count(st.get_module(model, f)) for f in a.first)
        last = sum(p.numel() for f in a.last for _, p in
                   (st.get_module(model, f).named_parameters(remove_duplicate=False) if st.get_module(model, f)
                    is not None else ()))
        self.stage_layers = st.plan_stages(n, S, split=split, weights=weights, first_extra=first, last_extra=last,
                                           equal=self.schedule_name == "interleaved_1f1b", layer_path=a.layer_path,
                                           pp_size=self.p, virtual=self.v)
        self.my_stages = [self.rank + k * self.p for k in range(self.v)]
        self._layer_stage = {i: s for s, idx in enumerate(self.stage_layers) for i in idx}
        self.logical = st.sizes_of(model)
        self.tied = st.tied_groups(model)
        keep = {i for s in self.my_stages for i in self.stage_layers[s]}
        drop = [f for f in a.first if 0 not in self.my_stages] + [f for f in a.last if S - 1 not in self.my_stages]
        st.prune(model, a.layer_path, keep, drop)
        self._layers = st.kept_layers(model, a.layer_path)
        if st.meta_tensors(model):
            materialize_model(model, self.device)
        model.to(self.device)

    def stage_of(self, name: str) -> list:
        """The stages that hold logical tensor `name` (every stage for tensors outside the plan, e.g. rotary
        buffers)."""
        a = self.adapter
        prefix = a.layer_path + "." if a.layer_path else ""
        if name.startswith(prefix):
            head = name[len(prefix):].split(".", 1)[0]
            if head.isdigit() and int(head) in self._layer_stage:
                return [self._layer_stage[int(head)]]
        for f in a.first:
            if name.startswith(f + "."):
                return [0]
        for f in a.last:
            if name.startswith(f + "."):
                return [self.num_stages - 1]
        return list(range(self.num_stages))

    def checkpoint_owner(self, name: str) -> int:
        """The pipeline rank that writes logical tensor `name` to a checkpoint: the holder of its first stage (a tied
        weight: its first holder, which may hold it under another of its names; rank 0 for a tensor every stage
        holds). Every rank computes the same answer."""
        for names in self.tied:
            if name in names:
                return min(s % self.p for n in names for s in self.stage_of(n))
        return min(s % self.p for s in self.stage_of(name))

    def _stage_fn(self, s: int, mb: dict, x: Optional[torch.Tensor]) -> Any:
        a, model = self.adapter, self.module
        h = a.embed(model, mb) if s == 0 else x
        full = _full_sequence(mb, h)
        tp = getattr(model, "_tp_state", None)  # tensor parallelism's state (its root hook never runs here)
        if tp is not None and tp.comm.sp and full.dim() > tp.comm.seq_dim:
            tp.comm.set_sequence(full.shape[tp.comm.seq_dim])  # this micro-batch's length: SP gathers to it
        ctx = a.context(model, mb, full)
        for i in self.stage_layers[s]:
            if s in self.checkpointing and torch.is_grad_enabled():
                h = torch.utils.checkpoint.checkpoint(a.layer, model, i, self._layers[i], h, ctx, use_reentrant=False)
            else:
                h = a.layer(model, i, self._layers[i], h, ctx)
        return a.head(model, h, mb, self._info) if s == self.num_stages - 1 else h

    # ---- a batch ---------------------------------------------------------------------------------------------
    def _split(self, batch: Mapping) -> tuple:
        rows = next((v.shape[0] for k, v in batch.items() if torch.is_tensor(v) and v.dim() > 0), None)
        if rows is None:
            raise ValueError(f"pipeline: the batch has no tensor to split into micro-batches (keys {list(batch)})")
        if rows % self.m:
            raise ValueError(f"pipeline: batch size {rows} is not divisible by num_micro_batches={self.m}")
        per = rows // self.m
        mbs: list = [{} for _ in range(self.m)]
        for k, v in batch.items():
            for i in range(self.m):
                split = torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == rows
                mbs[i][k] = v[i * per:(i + 1) * per].to(self.device) if split else v
        sig = tuple(sorted((k, tuple(v.shape), str(v.dtype)) for k, v in mbs[0].items() if torch.is_tensor(v)))
        return mbs, sig

    def forward(self, *args: Any, **batch: Any) -> PipelineOutput:
        if args:
            if len(args) != 1 or not isinstance(args[0], Mapping):
                raise TypeError("the pipeline takes the batch as keyword arguments (model(**batch)) or one mapping")
            batch = {**args[0], **batch}
        return self.run(batch)

    def run(self, batch: Mapping) -> PipelineOutput:
        """One batch through the pipeline (see the header)."""
        train = self.training
        mbs, sig = self._split(batch)
        self._info = self.adapter.batch_info(dict(batch))
        sched = self.schedule if train else self._eval_schedule
        scale = self.scale_loss or (lambda x: x)
        results = self.runner.execute(sched, mbs, sig, train, scale)
        last = self.p - 1
        if train:
            loss = torch.zeros((), dtype=torch.float32, device=self.device)
            if self.rank == last:
                loss = sum((results[i][0].float() for i in range(self.m)), loss)
            if self.transport is not None:
                self.transport.broadcast(loss, last)
            if self.sync_grads() if callable(self.sync_grads) else self.sync_grads:
                self.sync_tied_grads()
            loss._accelerate_c_backward_done = True  # accelerator.backward(loss) is then a no-op
            return PipelineOutput(loss=loss)
        return self._eval_result(results)

    def _eval_result(self, results: dict) -> PipelineOutput:
        last = self.p - 1
        loss = logits = None
        if self.rank == last:
            logits = torch.cat([results[i][1] for i in range(self.m)])
            if results[0][0] is not None:
                loss = sum(results[i][0].float() for i in range(self.m))
        if self.transport is None or self.eval_outputs == "last":
            return PipelineOutput(loss=loss, logits=logits)
        head = torch.zeros(12, dtype=torch.int64, device=self.device)
        if self.rank == last:
            head = torch.tensor([int(loss is not None), DTYPES.index(logits.dtype), logits.dim(), *logits.shape] +
                                [0] * (9 - logits.dim()), dtype=torch.int64, device=self.device)
        self.transport.broadcast(head, last)
        has_loss, code, ndim, *dims = head.tolist()
        if self.rank != last:
            logits = torch.empty(dims[:ndim], dtype=DTYPES[code], device=self.device)
            loss = torch.zeros((), dtype=torch.float32, device=self.device) if has_loss else None
        self.transport.broadcast(logits.contiguous(), last)
        if loss is not None:
            self.transport.broadcast(loss, last)
        return PipelineOutput(loss=loss, logits=logits)

    # ---- gradients across stages -------------------------------------------------------------------------------
    def _tied_here(self) -> list:
        """[(group names, this rank's Parameter or None, ranks holding it)] of tied groups held on several ranks."""
        params = dict(self.module.named_parameters(remove_duplicate=False))
        out = []
        for names in self.tied:
            ranks = sorted({s % self.p for n in names for s in self.stage_of(n)})
            if len(ranks) > 1:
                out.append((names, next((params[n] for n in names if n in params), None), ranks))
        return out

    def _sync_tied(self, values: bool) -> None:
        groups = self._tied_here()
        if not groups or self.transport is None:
            return
        parts = []
        for names, p, ranks in groups:
            shape, dtype = self.logical[names[0]]
            src = p if values else (p.grad if p is not None else None)
            mine = src is not None and (not values or self.rank == ranks[0])
            parts.append(src.detach().float().reshape(-1) if mine else torch.zeros(
                int(torch.Size(shape).numel()), dtype=torch.float32, device=self.device))
        flat = torch.cat(parts)
        self.transport.all_reduce(flat)
        off = 0
        with torch.no_grad():
            for (names, p, _), part in zip(groups, parts):
                n = part.numel()
                if p is not None:
                    if values:
                        p.copy_(flat[off:off + n].view_as(p))
                    elif p.grad is not None:
                        p.grad.copy_(flat[off:off + n].view_as(p))
                    else:
                        p.grad = flat[off:off + n].view_as(p).to(p.dtype).clone()
                off += n

    def sync_tied_grads(self) -> None:
        """Sums the gradients of weights tied across stages (every holder ends with the total). Collective over the
        pipeline; run once per optimizer step, after the last accumulation iteration (the engine does it at the end
        of each training call while sync_grads is True)."""
        self._sync_tied(values=False)

    def local_grad_norm_sq(self, norm_type: float = 2.0) -> torch.Tensor:
        """This rank's share of sum(|g|^norm_type) over the pipeline's parameters, a tied weight counted on its first
        holder only (for combining with other parallel dimensions)."""
        skip = {id(p) for _, p, ranks in self._tied_here() if p is not None and self.rank != ranks[0]}
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in self.module.parameters():
            if p.grad is not None and id(p) not in skip:
                total += p.grad.detach().double().abs().pow(norm_type).sum()
        return total

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over the whole pipeline's parameters: the total norm over every stage
        (collective), each stage's gradients scaled by max_norm / (norm + 1e-6) when that is below 1."""
        total = self.local_grad_norm_sq(norm_type)
        if self.transport is not None:
            self.transport.all_reduce(total)
        norm = total.pow(1.0 / norm_type).float()
        coef = float(max_norm) / (float(norm) + 1e-6)
        if coef < 1.0:
            for p in self.module.parameters():
                if p.grad is not None:
                    p.grad.detach().mul_(coef)
        return norm

    def parameters_moved(self) -> None:
        """The stage's parameters now live elsewhere (a sharded engine's flat buffers): the runtime's record of
        parameter storage (activation memory accounting) renewed."""
        self.runner.param_ptrs = {p.untyped_storage().data_ptr() for p in self.module.parameters()}

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None
