# accelerate_c/strategies/base.py: the contract every backend implements, the context it receives and
# its configuration (StrategyConfig, read in one place: from_sources). The Accelerator calls only these
# methods; it never asks which backend it has. Adding a backend means one new file in this folder with a
# @register'ed Strategy subclass (see strategies/__init__.py). The strategy owns the optimizer step
# (`step`): the fused-kernels-or-torch choice is made here, once, for every backend.
# Not for: precision (precision.py) or data loading (data_loader.py), which are backend-independent; the
# kernels themselves (optim/).
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterable, Iterator, Optional

import torch

from ..base.dataclasses import DistributedType
from ..ddp.config import StrategyConfig
from ..deepspeed.face import deepspeed_face


@dataclass
class StrategyContext:
    """What a strategy may know about the run: the process state and the user's kwargs handlers (keyed by
    class name, e.g. "DistributedDataParallelKwargs"). The precision object is not part of it: it is an
    argument of the one call that needs it (`Strategy.step`)."""

    state: Any                      # AcceleratorState
    handlers: dict[str, Any] = field(default_factory=dict)

    def handler(self, name: str) -> Optional[Any]:
        return self.handlers.get(name)


_fused_step: Optional[Callable[..., Any]] = None


def _cuda_serves(grads: list[torch.Tensor]) -> bool:
    """Every gradient a contiguous float tensor on one CUDA device that accelerate_c._C_cuda serves."""
    if grads[0].device.type != "cuda":
        return False
    from ..optim import cuda
    return cuda.serves_floats(grads) is not None


def _kernels() -> Optional[Callable[..., Any]]:
    """accelerate_c.optim.fused_step, imported once (None when the extension lacks the optimizer kernels)."""
    global _fused_step
    if _fused_step is None:
        try:
            from ..optim import fused_step
        except ImportError:
            return None
        _fused_step = fused_step
    return _fused_step


def standalone_state(device: Optional[torch.device] = None) -> Any:
    """What a single-process Strategy reads of the process state, for an AcceleratedOptimizer built by hand outside
    any Accelerator: one process, full precision, on `device` (CPU by default)."""
    import types

    from ..runtime.layout_build import trivial_layout
    device = device or torch.device("cpu")
    return types.SimpleNamespace(parallel_layout=trivial_layout(1, 0, False, device.type), device=device,
                                 distributed_type=DistributedType.NO, process_index=0, num_processes=1,
                                 mixed_precision="no")


class Strategy:
    """Base class: single-process behaviour. Subclasses override what differs."""

    name = "base"
    priority = 0  # higher wins when several strategies apply
    config_class: ClassVar[type[StrategyConfig]] = StrategyConfig

    def __init__(self, ctx: StrategyContext, config: Optional[StrategyConfig] = None) -> None:
        self.ctx = ctx
        self.state = ctx.state
        self.deepspeed = deepspeed_face(ctx.handlers.get("DeepSpeedPlugin"))  # (NO_DEEPSPEED without a plugin)
        self.config = config if config is not None else self.config_class.from_sources(ctx.handlers)

    # -- selection -------------------------------------------------------------------------------------
    @classmethod
    def applies(cls, state: Any, handlers: dict[str, Any]) -> bool:
        return False

    @property
    def distributed_type(self) -> DistributedType:
        return self.state.distributed_type

    @property
    def dp(self) -> Any:
        """The data-parallel group of this rank (runtime/layout.py DimGroup "dp": .size, .rank, .ranks global,
        .process_group, .group): every rank under plain data parallelism, the ranks holding the same model slice
        under tensor / pipeline parallelism. Data-parallel strategies average, broadcast and shard over it."""
        return self.state.parallel_layout.dim("dp")

    @property
    def mp(self) -> Any:
        """The ranks that together hold one replica of the model (pp x cp x tp; DimGroup "model"): their gradients
        differ, so overflow decisions and gradient norms are agreed over them."""
        return self.state.parallel_layout.dim("model")

    @property
    def frees_whole_units(self) -> bool:
        """Whether each step allocates and frees whole units of parameters (stage 3's gathers): CPU runs then keep
        large tensors out of the C heap by default (runtime/memory.py tune_cpu_heap)."""
        return False

    # -- preparation -----------------------------------------------------------------------------------
    def prepare_objects(self, objects: list, accelerator: Any) -> list:
        """Called by Accelerator.prepare with all the objects of one call before any is prepared; returns the list
        to prepare (same length and order). Under a DeepSpeedPlugin (any strategy, one process included): the
        DeepSpeed face's "auto" values and DummyOptim / DummyScheduler placeholders resolved
        (deepspeed/prepare.py); `accelerator` is the calling Accelerator (run settings such as
        gradient_accumulation_steps may be updated), and the config re-reads what they filled ("auto"
        gradient_clipping: 1.0, as HF). Otherwise unchanged."""
        objects = self.deepspeed.prepare_objects(objects, accelerator)
        self.config = self.deepspeed.resolved(self.config)
        return objects

    def prepare_model(self, model: torch.nn.Module, device_placement: bool,
                      evaluation_mode: bool = False) -> torch.nn.Module:
        if device_placement:
            model = model.to(self.state.device)
        return model

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return optimizer

    # -- the step --------------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        loss.backward(**kwargs)

    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module) -> Iterator[None]:
        yield

    @contextlib.contextmanager
    def join(self, joinables: list, enable: bool = True) -> Iterator[None]:
        """Uneven inputs across ranks (Accelerator.join_uneven_inputs): nothing to do on one process."""
        yield

    def step(self, optimizer: torch.optim.Optimizer, precision: Any, closure: Optional[Callable] = None) -> bool:
        """The optimizer step of a synchronising iteration (AcceleratedOptimizer.step delegates here); True when
        it was skipped (a non-finite gradient under loss scaling). The one place that chooses between the fused
        C kernels and the optimizer's own step(): the kernels when the config allows, there is no closure and
        the precision can express its gradient scaling to them (`precision.kernel_scale`); the optimizer's own
        step, through the precision (`precision.torch_step`: GradScaler's step under fp16), otherwise or when
        the kernels do not take this optimizer. DeepSpeed's gradient_clipping is applied first, on the unscaled
        gradients, as DeepSpeed's engine does."""
        clip = self.config.gradient_clipping
        if self.mp.size > 1:  # the overflow decision agreed over the model's ranks before anyone steps or skips
            self.unscale_(optimizer, precision)
        if clip:
            self.unscale_(optimizer, precision)
            self.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], clip)
        if closure is None and self.config.fused_optimizer:
            scale = precision.kernel_scale(optimizer)
            if scale is not None:
                if scale.skip:  # already unscaled (clipping) and non-finite: nothing to step
                    return precision.after_kernel_step(optimizer, skipped=True)
                r = self.kernel_step(optimizer, scale.grad_scale, scale.check_nonfinite)
                if r is not False:
                    return precision.after_kernel_step(optimizer, skipped=r is None)
        self.before_torch_step(optimizer)
        return precision.torch_step(optimizer, closure)

    def unscale_(self, optimizer: torch.optim.Optimizer, precision: Any) -> None:
        """Unscale the optimizer's gradients (loss scaling; Accelerator.unscale_gradients and the step's clipping
        call this). Every data-parallel rank holds the same averaged gradients; the ranks of one model replica (tensor
        parallelism) hold different ones, so their found-inf flags are all-reduced (max) first (collective)."""
        if self.mp.size > 1:
            group = self.mp.group
            precision.unscale_(optimizer, agree=lambda found: group.all_reduce(found, "max"))
        else:
            precision.unscale_(optimizer)

    def kernel_step(self, optimizer: torch.optim.Optimizer, grad_scale: Optional[float],
                    check_nonfinite: bool) -> Optional[bool]:
        """One step on the fused kernels (accelerate_c.optim.fused_step's answer: True stepped, None skipped on
        a non-finite gradient, False not taken: nothing changed)."""
        fused_step = _kernels()
        if fused_step is None:
            return False
        return fused_step(optimizer, grad_scale=grad_scale, skip_if_nonfinite=check_nonfinite,
                          partition=self.step_partition(optimizer),
                          low_precision_copies=self.low_precision_copies(optimizer))

    def low_precision_copies(self, optimizer: torch.optim.Optimizer) -> Optional[dict]:
        """{fp32 parameter: bf16/fp16 tensor} the fused kernels write each updated parameter into in the same pass
        (a compute copy the strategy would otherwise cast after the step); None: none."""
        return None

    def step_partition(self, optimizer: torch.optim.Optimizer) -> Optional[Any]:
        """The kernels' partition for this optimizer when the step is split between processes (each steps its
        slice; optim/_fused.py: run_groups gives the protocol), None to step every parameter here."""
        return None

    def before_torch_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Called right before the optimizer's own step() runs on every parameter (nothing to prepare here)."""

    def zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool) -> bool:
        """Optionally zero the optimizer's gradients itself (e.g. in flat buffers); True if it did."""
        return False

    def clip_grad_norm_(self, parameters: Iterable[torch.nn.Parameter], max_norm: float,
                        norm_type: float = 2.0) -> torch.Tensor:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if self.mp.size > 1:  # the logical model's norm: each replica's parts summed over its ranks, counted once
            return _model_clip(params, max_norm, norm_type, self.mp.group, self.counts_here)
        grads = [p.grad for p in params if p.grad is not None]
        if grads and (all(g.device.type == "cpu" for g in grads) or _cuda_serves(grads)):
            from ..optim.gradops import clip_grad_norm_  # one fused norm pass + one scale pass (C or CUDA C)
            return clip_grad_norm_(grads, max_norm, norm_type=norm_type)
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)

    def counts_here(self, p: torch.Tensor) -> bool:
        """Whether this rank counts parameter p in the model's gradient norm: not when another rank of the replica
        holds the same values (a TP-replicated tensor: TP rank 0 counts it; a weight tied across pipeline stages:
        its first holder, pipeline/engine.py marks the others)."""
        if getattr(p, "_pp_counted_elsewhere", False):
            return False
        return getattr(p, "_tp_slice", None) is not None or self.state.parallel_layout.tp_rank == 0

    def clip_grad_value_(self, parameters: Iterable[torch.nn.Parameter], clip_value: float) -> None:
        torch.nn.utils.clip_grad_value_(list(parameters), clip_value)

    # -- state -----------------------------------------------------------------------------------------
    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The model's state dict. Under a DeepSpeedPlugin (one process: HF still runs DeepSpeed's engine) CPU copies
        in the engine's dtype, under ZeRO-3 only with stage3_gather_16bit_weights_on_model_save (saved_weights_dtype's
        rule); the sharded strategy has its own (strategies/sharded.py)."""
        from ..runtime.models import extract_model_from_parallel
        if self.state.parallel_layout.pp > 1:  # the logical model, every stage's (collective over TP and PP)
            from ..pipeline.holdings import full_state_dict, pipeline_of
            return full_state_dict(pipeline_of(model), self.state.parallel_layout)
        if self.state.parallel_layout.tp > 1:  # the logical tensors, gathered over the TP group (collective)
            from ..tensor_parallel import gather_full_state_dict
            return gather_full_state_dict(extract_model_from_parallel(model))
        if self.deepspeed.runs_engine:
            from ..sharding.statedict import full_state_dict
            return full_state_dict(extract_model_from_parallel(model), None, True, self.saved_weights_dtype())
        return (extract_model_from_parallel(model) if unwrap else model).state_dict()

    def hooks_get_no_weights(self) -> bool:
        """True where HF 1.15 runs its own FSDP / DeepSpeed engine (DeepSpeed: on one process too), which saves the
        models its own way: save_state then hands the save_model_state_pre_hooks an empty weights list."""
        return self.deepspeed.runs_engine

    def saved_weights_dtype(self) -> Optional[torch.dtype]:
        """The dtype `Accelerator.save_model` writes floating tensors in: None = as held (fp32, HF's FSDP and plain
        runs). Under a DeepSpeedPlugin, what HF's DeepSpeed engine hands it (DeepSpeedFace.saved_weights_dtype: the
        fp16/bf16 compute dtype when the JSON enables one; under ZeRO-3 only with
        stage3_gather_16bit_weights_on_model_save, else HF's error, on every rank before any collective)."""
        return self.deepspeed.saved_weights_dtype(compute_dtype(self.state))

    def model_slices(self, model: torch.nn.Module) -> list:
        """The model's logical tensors as this rank holds them (checkpointing/slices.py): here every tensor whole,
        each written by one rank (checkpointing/layout.py whole_model_slices)."""
        from ..checkpointing.layout import whole_model_slices
        if self.state.parallel_layout.pp > 1:  # this stage's tensors; the other stages' listed empty
            from ..pipeline.holdings import model_slices, pipeline_of
            return model_slices(pipeline_of(model), self.state.parallel_layout)
        if self.state.parallel_layout.tp > 1:  # TP slices: one data-parallel replica writes them
            from ..runtime.models import extract_model_from_parallel
            from ..tensor_parallel import checkpoint_slices
            return checkpoint_slices(extract_model_from_parallel(model), self.state.process_index,
                                     self.state.num_processes, owner=self.dp.rank == 0)
        return whole_model_slices(model, self.state.process_index, self.state.num_processes)

    def optimizer_layout(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> list:
        """Where each of the optimizer's parameters (flattened param_groups order: index i of its state dict) lies in
        the logical model (checkpointing/slices.py ParamSlot): here every parameter whole, each written by one rank
        (checkpointing/layout.py whole_optimizer_layout)."""
        from ..checkpointing.layout import whole_optimizer_layout
        if self.state.parallel_layout.pp > 1:
            from ..pipeline.holdings import optimizer_layout, pipeline_of
            return optimizer_layout(pipeline_of(model), self.state.parallel_layout, optimizer)
        if self.state.parallel_layout.tp > 1:
            from ..runtime.models import extract_model_from_parallel
            from ..tensor_parallel.logical import optimizer_layout
            return optimizer_layout(optimizer, extract_model_from_parallel(model), self.state.process_index,
                                    self.state.num_processes, owner=self.dp.rank == 0)
        return whole_optimizer_layout(optimizer, model, self.state.process_index, self.state.num_processes)

    def optimizer_model(self, optimizer: torch.optim.Optimizer) -> Optional[torch.nn.Module]:
        """The model an optimizer was re-pointed to by this strategy (sharded pieces), None when its parameters are
        the model's own (the checkpoint code then finds the model by its parameters)."""
        return None

    def slices_loaded(self, model: torch.nn.Module) -> None:
        """Called (on every rank) after a checkpoint loader wrote into this rank's `model_slices(model)`: rebuild
        whatever derives from them (the sharded strategy re-gathers full parameters; nothing here)."""

    def close(self) -> None:
        """Release communication resources (end_training)."""


def _model_clip(params: list, max_norm: float, norm_type: float, group: Any,
                counts_here: Callable[[torch.Tensor], bool]) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ over a model whose replica is split over `group`'s ranks (tensor / pipeline
    parallelism): this rank's counted gradients' power sum (C kernels, fp64), summed (max for inf) over the group."""
    import math
    from ..optim.gradops import global_norm, scale_
    norm_type = float(norm_type)
    grads = [p.grad for p in params if p.grad is not None]
    mine = [p.grad for p in params if p.grad is not None and counts_here(p)]
    op = "max" if math.isinf(norm_type) else "sum"
    total = global_norm(mine, norm_type).reshape(1).to(torch.float64) ** (1.0 if op == "max" else norm_type)
    group.all_reduce(total, op)
    total = (total[0] if op == "max" else total[0] ** (1.0 / norm_type)).float()
    scale_([g for g in grads if g.numel()], torch.clamp(float(max_norm) / (total + 1e-6), max=1.0))
    return total


def compute_dtype(state: Any) -> Optional[torch.dtype]:
    """The low-precision dtype the run's mixed_precision computes weights in (fp8: bf16 weights, as HF; the
    plugins' own table, MIXED_PRECISION_DTYPES), None for full precision."""
    from ..base.fsdp_plugin import MIXED_PRECISION_DTYPES
    dtype = MIXED_PRECISION_DTYPES.get(str(getattr(state, "mixed_precision", "no")))
    return dtype if dtype is not None and dtype != torch.float32 else None


