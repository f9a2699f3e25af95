# accelerate_c/strategies/sharded.py: the sharded data-parallel strategy (ZeRO 1/2/3, FSDP), chosen when the
# Accelerator holds a FullyShardedDataParallelPlugin or a DeepSpeedPlugin; both faces fill one ShardedConfig
# (sharding/config.py). Stage 0 (NO_SHARD) is our bucketed DDP, unchanged (this class inherits it). Stages 1-3
# build one ShardEngine per prepared model (sharding/engine.py) and hand the optimizer the engine's shard pieces
# (sharding/optim_shard.py); the step stays the base class's one choice (fused kernels or the optimizer's own
# step) on the shard, preceded by the used-parameter mask and DeepSpeed's gradient_clipping, followed by the
# all-gather of the updated shards (stages 1/2). Parameters kept out of the units (ignored_modules) are averaged
# after each synced backward as DDP's reference path does; frozen ones are left alone. Buffers follow DDP's
# broadcast_buffers rule (the same wrapper). HYBRID_SHARD across hosts shards over a host's ranks and averages each
# shard gradient across hosts (sharding/comm.py hybrid_shard_comm); a ParallelismConfig with dp_replicate_size and
# dp_shard_size > 1 under FSDP is HF's HSDP over the layout's groups (layout_shard_comm). A model on the meta device
# (on any rank) is built shard by shard from rank 0's values at prepare (sharding/construct.py). Stages 1/2 over
# pipeline stages (pp_size > 1): sharded_stages.py. Not for: the engine's buffers and hooks (sharding/), the plugins
# (base/fsdp_plugin.py, deepspeed/plugin.py) or checkpoint files.
from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

from ..ddp.module import DataParallelModule, GradSync
from ..sharding.config import ShardedConfig
from . import register
from .base import compute_dtype
from .ddp_bucketed import BucketedDataParallel


class _SyncSwitch:
    """What the DDP wrapper toggles (`enabled`, under no_sync): the engine's and the replicated parameters' sync."""

    def __init__(self, engine: Any, replicated: Optional[GradSync]) -> None:
        self.engine, self.replicated = engine, replicated

    @property
    def enabled(self) -> bool:
        return self.engine.enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self.engine.enabled = value
        if self.replicated is not None:
            self.replicated.enabled = value

    def sync_held(self) -> None:
        """What the units hold reduced once (a pipeline stage's micro-batches, run under no_sync)."""
        self.engine.sync_held()

    def shadow(self) -> None:
        """The collectives of a synced backward with zero gradients (stages 1/2; sharding/join.py)."""
        from ..sharding.join import shadow_backward
        shadow_backward(self.engine, self.replicated, True)


@register("sharded")
class ShardedDataParallel(BucketedDataParallel):
    priority = 30
    config_class = ShardedConfig
    config: ShardedConfig

    @classmethod
    def applies(cls, state: Any, handlers: dict[str, Any]) -> bool:
        return state.parallel_layout.dp_size > 1 and ("FullyShardedDataParallelPlugin" in handlers
                                            or "DeepSpeedPlugin" in handlers)

    def __init__(self, ctx: Any, config: Optional[ShardedConfig] = None) -> None:
        super().__init__(ctx, config)
        self.engines: list[Any] = []     # one ShardEngine per prepared model
        self.sharded: list[Any] = []     # its ShardedParams
        self._replicated: list[GradSync] = []
        self.comm: Optional[Any] = None
        self._mark = 0
        self.bytes_last_step = 0         # model bytes moved by the collectives of the last step (counted)
        self.step_seconds: dict[str, float] = {}  # the last step: the optimizer on the shard, the all-gather after
        self.last_precision: Optional[Any] = None  # the Accelerator's precision, as last passed (join's shadow)
        self._join_optims: list = []      # prepared optimizers, in order (a join names them by index)
        self._stage_hooks: list = []      # pipeline stages: their pre-call hooks (sharded_stages.attach)
        from .sharded_stages import refuse_unsupported
        refuse_unsupported(self.stage, self.config.face, self.state.parallel_layout)

    @property
    def stage(self) -> int:
        return int(self.config.stage)

    @property
    def frees_whole_units(self) -> bool:
        return self.stage == 3

    def _engine_config(self) -> ShardedConfig:
        """The Accelerator's mixed_precision="bf16" / "fp16" means a bf16 / fp16 compute copy unless param_dtype
        says otherwise (HF: FSDP's set_mixed_precision, DeepSpeed's bf16 / fp16 block); fp32 master shards."""
        dtype = compute_dtype(self.state)  # fp16: DeepSpeed's fp16 block too
        if self.config.param_dtype is None and dtype is not None:
            return dataclasses.replace(self.config, param_dtype=dtype)
        return self.config

    def _comm(self) -> Any:
        if self.comm is None:
            from ..comm.group import group_for_device
            from ..sharding.comm import ShardComm, hybrid_shard_comm, layout_shard_comm
            device = self.state.device
            layout = self.state.parallel_layout
            if self.config.face == "fsdp" and layout.dp_replicate > 1 and layout.dp_shard > 1:
                # HF's HSDP (FSDP2 over the (dp_replicate, dp_shard) mesh): shard over dp_shard, replicate
                self.comm = layout_shard_comm(layout, device)
                return self.comm
            group = group_for_device(device, self.config.transport, self.dp)
            host = group.host_group()
            if self.config.hybrid and host is not None and host.size != group.size:
                self.comm = hybrid_shard_comm(group, host, device)
            else:
                self.comm = ShardComm(group, device)
        return self.comm

    # -- preparation -------------------------------------------------------------------------------------------
    def prepare_model(self, model: torch.nn.Module, device_placement: bool,
                      evaluation_mode: bool = False) -> torch.nn.Module:
        if self.stage == 0 or evaluation_mode:
            from ..sharding.construct import construction_needed, materialize_whole
            if construction_needed(model, self._comm()):  # a meta model, whole on every rank (rank 0's values)
                materialize_whole(model, self.state.device, self.dp.rank == 0)
                if evaluation_mode:  # (DDP's prepare broadcasts for training only)
                    self.broadcast(list(model.parameters()) + list(model.buffers()))
            return super().prepare_model(model, device_placement, evaluation_mode)
        from ..sharding.construct import construction_needed
        from ..sharding.engine import ShardEngine
        from ..sharding.optim_shard import ShardedParams
        # a pipeline stage (pp_size > 1; its call runs the backward): the engine shards the user's pruned model
        stage = model if getattr(model, "runs_backward", False) else None
        inner = stage.module if stage is not None else model
        construct = construction_needed(inner, self._comm())  # collective: some rank's model is on meta
        if device_placement and not construct:
            model = model.to(self.state.device)
        # every rank starts from rank 0's parameters and buffers (sync_module_states), as DDP at construction
        # (sharded construction sends rank 0's unit by unit)
        if not construct:
            self.broadcast(list(model.parameters()) + list(model.buffers()))
        engine = ShardEngine(inner, self._engine_config(), self._comm(), construct=construct)
        self.engines.append(engine)
        self.sharded.append(ShardedParams(engine))
        if stage is not None:
            from .sharded_stages import attach
            self._stage_hooks.append(attach(stage, engine, self.sharded[-1]))
        rep = [p for _, p in engine.replicated if p.requires_grad]
        # replicated parameters are averaged at the end of the engine's own pass, after its units (the order a join's
        # shadow mirrors: sharding/join.py shadow_backward)
        sync = GradSync(rep, None, self.dp.size, owner=lambda: engine.begin_pass()) if rep else None
        if sync is not None:
            self._replicated.append(sync)
            engine.replicated_sync = sync
        broadcast = self.broadcast if self.config.broadcast_buffers else None
        return DataParallelModule(model, _SyncSwitch(engine, sync), broadcast)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if self.stage == 0:
            return super().prepare_optimizer(optimizer)
        for sp in self.sharded:
            if sp.owns(optimizer):
                sp.shard_optimizer(optimizer)
        self._join_optims.append(optimizer)
        return optimizer

    def _sharded_for(self, optimizer: torch.optim.Optimizer) -> list[Any]:
        return [sp for sp in self.sharded if sp.owns(optimizer)]

    # -- the step ----------------------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        for e in self.engines:
            e.reset_pass()
        for sp in self.sharded:  # (a clip or unscale before this backward attached gradients it now changes)
            sp.forget_attached()
        super().backward(loss, **kwargs)

    def _step(self, optimizer: torch.optim.Optimizer, precision: Any, closure: Optional[Callable] = None) -> bool:
        if self.stage == 0:
            return super()._step(optimizer, precision, closure)
        self.last_precision = precision
        mine = self._sharded_for(optimizer)
        try:
            # the pieces get their gradients; under loss scaling unscaled, the overflow decision agreed by every
            # rank (the base step then applies DeepSpeed's gradient_clipping and steps, or skips, on every rank)
            self.unscale_(optimizer, precision)
            if self.config.gradient_clipping:  # DeepSpeed's clipping (in the base step) works on a copy
                for sp in mine:
                    sp.step_on_copy()
            t0 = time.perf_counter()
            skipped = super()._step(optimizer, precision, closure)
            t1 = time.perf_counter()
        finally:
            if self._join is not None:
                self._join.in_step = False  # the step the join announced is over
        for sp in mine:
            sp.after_step()
        self.step_seconds = {"optimizer": t1 - t0, "gather": time.perf_counter() - t1}
        if self.comm is not None:
            total = self.comm.model_bytes()
            self.bytes_last_step, self._mark = total - self._mark, total
        return skipped

    def unscale_(self, optimizer: torch.optim.Optimizer, precision: Any) -> None:
        """Each rank sees only its shard of the gradients: the pieces get their gradients first (the fp32 copy
        under a compute dtype, so fp16 gradients are unscaled in fp32), then the precision unscales them and the
        found-inf flag is all-reduced (max) before anyone decides to skip (collective)."""
        mine = self._sharded_for(optimizer) if self.stage else []
        if not mine:
            return super().unscale_(optimizer, precision)
        self.last_precision = precision
        if self._join is not None and self._join.before_unscale(optimizer, precision):
            return  # join: a deferred sync, unscaled with the others' next step
        for sp in mine:
            sp.before_step()
        comm = mine[0].engine.comm

        mp = self.mp

        def agree(found: torch.Tensor) -> None:  # over the data-parallel ranks, then over one replica's ranks
            found.copy_(comm.all_reduce(found, "max", control=True, world=True))
            if mp.size > 1:
                mp.group.all_reduce(found, "max")
        precision.unscale_(optimizer, agree=agree)

    def low_precision_copies(self, optimizer: torch.optim.Optimizer) -> Optional[dict]:
        """Mixed precision: the compute copy's ranges of this optimizer's pieces (ShardedParams)."""
        if self.stage == 0:
            return super().low_precision_copies(optimizer)
        out = {}
        for sp in self._sharded_for(optimizer):
            out.update(sp.low_precision_copies())
        return out or None

    def kernel_step(self, optimizer: torch.optim.Optimizer, grad_scale: Optional[float],
                    check_nonfinite: bool) -> Optional[bool]:
        r = super().kernel_step(optimizer, grad_scale, check_nonfinite)
        if r is not False and self.stage != 0:  # stepped (or skipped: nothing changed): no cast after it
            for sp in self._sharded_for(optimizer):
                sp.lp_written = sp.lp_offered
        return r

    def _zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool) -> bool:
        if self.stage == 0:
            return super()._zero_grad(optimizer, set_to_none)
        mine = self._sharded_for(optimizer)
        for sp in mine:
            sp.zero_grad(optimizer)
        if not mine:
            return False
        sharded = {id(p) for sp in mine for p in sp.pieces}
        for g in optimizer.param_groups:
            for p in g["params"]:
                if id(p) not in sharded and p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.zero_()
        return True

    def _clip_grad_norm_(self, parameters: Iterable[torch.nn.Parameter], max_norm: float,
                         norm_type: float = 2.0) -> torch.Tensor:
        if self.stage == 0 or not self.sharded:
            return super()._clip_grad_norm_(parameters, max_norm, norm_type)
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if len(self.sharded) > 1:
            raise NotImplementedError("clip_grad_norm_ with several sharded models prepared")
        sp = self.sharded[0]
        known = set(sp.engine.index) | set(sp.of_piece)
        rep = [p for p in params if id(p) not in known]
        # tensor / pipeline parallelism: the parts of one replica summed over its ranks, each part counted once
        return sp.clip_grad_norm_(params, max_norm, norm_type, rep, self.mp.group, self.counts_here)

    @contextlib.contextmanager
    def join(self, joinables: list, enable: bool = True) -> Iterator[None]:
        if self.stage == 0 or not enable:
            with super().join(joinables, enable):
                yield
            return
        from ..sharding.join import sharded_join
        with sharded_join(self, joinables):
            yield

    # -- state -------------------------------------------------------------------------------------------------
    def _engine_of(self, model: torch.nn.Module) -> Optional[Any]:
        from ..runtime.models import extract_model_from_parallel
        inner = extract_model_from_parallel(model)
        return next((e for e in self.engines if e.model is inner), None)

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> Optional[dict[str, torch.Tensor]]:
        """HF 1.15's get_state_dict under its FSDP and DeepSpeed engines (collective: call it on every rank; `unwrap`
        is ignored, as HF ignores it there; CPU copies). FSDP face, any sharding strategy or state_dict_type: the
        full fp32 state dict on rank 0, {} on the others (FSDP2's full_state_dict + cpu_offload, FSDP1's
        rank0_only). DeepSpeed face: the engine's dtype (16-bit when the JSON enables fp16/bf16); ZeRO-3 on rank 0
        only, None on the others (DeepSpeed's _zero3_consolidated_16bit_state_dict), and only with
        stage3_gather_16bit_weights_on_model_save (else HF's ValueError, on every rank before any collective);
        ZeRO 0-2 on every rank (the module's own weights)."""
        everywhere = self.deepspeed.state_dict_everywhere(self.stage)
        if self.state.parallel_layout.pp > 1 and self._engine_of(model) is not None:  # the logical model, every stage's
            from .sharded_stages import full_state_dict
            out = full_state_dict(model, self._engine_of(model), self.state.parallel_layout, self.saved_weights_dtype())
            return out if everywhere or self.state.process_index == 0 else self.deepspeed.state_dict_off_rank0({})
        out = self.gather_state_dict(model, self.saved_weights_dtype(), rank0_only=not everywhere)
        if not everywhere and self.state.process_index != 0:
            return self.deepspeed.state_dict_off_rank0(out)
        return out

    def hooks_get_no_weights(self) -> bool:
        return True  # (HF's FSDP and DeepSpeed engines alike)

    def gather_state_dict(self, model: torch.nn.Module, dtype: Optional[torch.dtype] = None,
                          rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """The model's full state dict (fp32 masters unless `dtype`) as CPU copies, gathered unit by unit
        (sharding/statedict.py; collective): on rank 0 only ({} elsewhere, where at most one gathered unit is held
        at a time) or, rank0_only=False, on every rank."""
        from ..sharding.statedict import full_state_dict
        from ..runtime.models import extract_model_from_parallel
        inner = extract_model_from_parallel(model)
        if self.state.parallel_layout.tp > 1:  # each TP rank's local tensors, then the TP blocks gathered over the
            from ..tensor_parallel.logical import gather_slices, specs_by_name  # TP group (all keep or none)
            keep = not rank0_only or self.dp.rank == 0
            local = full_state_dict(inner, self._engine_of(model), keep, dtype)
            out = gather_slices(local, specs_by_name(inner), self.state.parallel_layout.tp_group, keep) if keep else {}
            return out if not rank0_only or self.state.process_index == 0 else {}
        keep = not rank0_only or self.state.process_index == 0
        return full_state_dict(inner, self._engine_of(model), keep, dtype)

    def model_slices(self, model: torch.nn.Module) -> list:
        """Each unit parameter's piece of this rank's fp32 master shard (under every name it is registered by);
        buffers and replicated parameters whole, one owner each (sharding/checkpoint.py)."""
        engine = self._engine_of(model)
        if engine is None:
            return super().model_slices(model)
        if self.state.parallel_layout.pp > 1:  # this stage's pieces; the other stages' tensors listed empty
            from .sharded_stages import model_slices
            return model_slices(model, engine, self.state.parallel_layout)
        from ..sharding.checkpoint import engine_model_slices
        slices = engine_model_slices(engine, self.state.process_index, self.state.num_processes)
        if self.state.parallel_layout.tp > 1:  # pieces of the TP blocks, as ranges of the logical tensors
            from ..tensor_parallel.logical import logical_slices, specs_by_name
            return logical_slices(slices, specs_by_name(engine.model), owner=self.dp.rank == 0,
                                  tp_first=self.state.parallel_layout.tp_rank == 0, pieces=self._piece_names(engine))
        return slices

    def optimizer_layout(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> list:
        """Each optimizer parameter: a shard piece (start, numel, local 1-D shape) or a whole replicated one."""
        engine = self._engine_of(model)
        if engine is None:
            return super().optimizer_layout(optimizer, model)
        from ..sharding.checkpoint import engine_optimizer_layout
        sp = self.sharded[self.engines.index(engine)]
        if self.state.parallel_layout.pp > 1:
            from .sharded_stages import optimizer_layout
            return optimizer_layout(model, engine, sp, optimizer, self.state.parallel_layout)
        slots = engine_optimizer_layout(engine, sp, optimizer, self.state.process_index, self.state.num_processes)
        if self.state.parallel_layout.tp > 1:
            from ..tensor_parallel.logical import logical_slots, specs_by_name
            return logical_slots(slots, specs_by_name(engine.model), owner=self.dp.rank == 0,
                                 tp_first=self.state.parallel_layout.tp_rank == 0, pieces=self._piece_names(engine))
        return slots

    @staticmethod
    def _piece_names(engine: Any) -> set[str]:
        """Every name of the engine's unit parameters (held as shard pieces)."""
        return {n for n, p in engine.model.named_parameters(remove_duplicate=False) if id(p) in engine.index}

    def optimizer_model(self, optimizer: torch.optim.Optimizer) -> Optional[torch.nn.Module]:
        """The user model whose shard pieces this optimizer steps (its parameters are pieces, not the model's)."""
        return next((sp.engine.model for sp in self.sharded if sp.owns(optimizer)), None)

    def slices_loaded(self, model: torch.nn.Module) -> None:
        """After a checkpoint loader wrote into model_slices: rebuild what derives from the shards (collective;
        stages 1/2 all-gather the full parameters, stage 3 gathers on demand anyway)."""
        engine = self._engine_of(model)
        if engine is not None:
            engine.after_step()
            if engine.mixed is not None:
                engine.mixed.refresh()

    def model_state_bytes(self, optimizers: Iterable[torch.optim.Optimizer] = ()) -> int:
        """Measured bytes of the model state this rank holds: parameters (full and shards), gradients and the
        optimizers' state tensors (distinct storages)."""
        from ..sharding.engine import storage_bytes
        ts = [t for e in self.engines for t in e.state_tensors()]
        for opt in optimizers:
            inner = getattr(opt, "optimizer", opt)
            ts += [v for st in inner.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        return storage_bytes(ts)

    def close(self) -> None:
        for e in self.engines:
            e.remove()
        for s in self._replicated:
            s.remove()
        for h in self._stage_hooks:
            h.remove()
        self._stage_hooks = []
        self.engines, self.sharded, self._replicated = [], [], []
        self.comm = None
        super().close()
