# accelerate_c/facade/accelerator.py: the Accelerator façade, HF Accelerate 1.15's API on top of the C base type
# (accelerate_c._C.Accelerator holds the per-step counters). It wires the state, the precision object,
# the strategy and the data loaders together and delegates; it never branches on the backend.
# Not for: the read-through properties of the run's configuration (run_properties.py), process-control
# helpers and collectives (process_api.py), checkpoints (checkpoint_api.py),
# trackers and the profiler (tracking_api.py),
# backend logic (strategies/), precision logic (precision.py).
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch

from .. import _C
from .checkpoint_api import CheckpointAPI
from ..optimizer import AcceleratedOptimizer
from ..precision import make_precision
from .parallel import ModelParallel, parallel_plugins
from .plugins import sharding_plugins
from .feature_api import FeatureAPI
from .probes import AcceleratorProbes
from .run_properties import RunProperties
from .process_api import ProcessAPI
from ..scheduler import AcceleratedScheduler
from ..runtime.layout_build import build_layout
from ..runtime.state import AcceleratorState, GradientState
from ..strategies import StrategyContext, select_strategy
from .tracking_api import TrackingAPI
from ..base import settings
from ..base.dataclasses import (DataLoaderConfiguration, GradientAccumulationPlugin, KwargsHandler,
                                ProjectConfiguration, TorchDynamoPlugin)
from ..runtime.memory import give_back_freed_memory, release_memory, tune_cpu_heap
from ..runtime.models import compile_model, extract_model_from_parallel

_UNSET = object()


def _handlers_by_name(kwargs_handlers: Optional[list]) -> dict[str, KwargsHandler]:
    """The user's kwargs handlers keyed by class name (at most one of each)."""
    handlers: dict[str, KwargsHandler] = {}
    for handler in kwargs_handlers or []:
        if not isinstance(handler, KwargsHandler):
            raise ValueError(f"Unsupported kwargs handler passed: {handler!r}; expected KwargsHandler instances")
        key = type(handler).__name__
        if key in handlers:
            raise ValueError(f"You can only pass one {key} in `kwargs_handlers`.")
        handlers[key] = handler
    return handlers


def _accumulation_plugin(plugin: Optional[GradientAccumulationPlugin], steps: int) -> GradientAccumulationPlugin:
    """The GradientAccumulationPlugin of the run: the user's, else one of `steps` (1: HF's
    ACCELERATE_GRADIENT_ACCUMULATION_STEPS, when set)."""
    if plugin is not None:
        if steps != 1:
            raise ValueError("You can only pass one of `gradient_accumulation_steps` and "
                             "`gradient_accumulation_plugin`. Please only pass in the created "
                             "`GradientAccumulationPlugin` object.")
    else:
        if steps == 1:
            steps = settings.env_int("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", default=1)
        plugin = GradientAccumulationPlugin(num_steps=steps)
    if plugin.num_steps is not None and plugin.num_steps < 1:
        raise ValueError(f"gradient_accumulation_steps must be >= 1, got {plugin.num_steps}")
    return plugin


class Accelerator(RunProperties, AcceleratorProbes, ProcessAPI, CheckpointAPI, TrackingAPI, FeatureAPI,
                  _C.Accelerator):
    """Drop-in replacement for `accelerate.Accelerator` (same arguments, same behaviour)."""

    def __init__(self, device_placement: bool = True, split_batches: Any = _UNSET,
                 mixed_precision: Optional[str] = None, gradient_accumulation_steps: int = 1, cpu: bool = False,
                 dataloader_config: Optional[DataLoaderConfiguration] = None, deepspeed_plugin: Any = None,
                 fsdp_plugin: Any = None, torch_tp_plugin: Any = None, megatron_lm_plugin: Any = None,
                 rng_types: Optional[list] = None, log_with: Any = None, project_dir: Optional[str] = None,
                 project_config: Optional[ProjectConfiguration] = None,
                 gradient_accumulation_plugin: Optional[GradientAccumulationPlugin] = None,
                 step_scheduler_with_optimizer: bool = True, kwargs_handlers: Optional[list] = None,
                 dynamo_backend: Any = None, dynamo_plugin: Any = None, parallelism_config: Any = None,
                 deepspeed_plugins: Any = None) -> None:
        parallelism_config, megatron_lm_plugin = parallel_plugins(parallelism_config, torch_tp_plugin,
                                                                  megatron_lm_plugin)
        if deepspeed_plugins is not None and deepspeed_plugin is not None:
            raise ValueError("You cannot pass in both `deepspeed_plugins` and `deepspeed_plugin`.")
        fsdp_plugin, deepspeed_plugin = sharding_plugins(fsdp_plugin, deepspeed_plugin or deepspeed_plugins)
        if project_config is not None:
            if project_dir is not None:
                project_config.set_directories(project_dir)
            self.project_configuration = project_config
        else:
            self.project_configuration = ProjectConfiguration(project_dir=project_dir)

        self._init_handlers(kwargs_handlers)

        if dynamo_plugin is not None and dynamo_backend is not None:
            raise ValueError("You cannot pass in both `dynamo_plugin` and `dynamo_backend`, please only pass in one.")
        if dynamo_backend is not None:
            dynamo_plugin = TorchDynamoPlugin(backend=dynamo_backend)
        init_kwargs = self.init_handler.to_dict() if self.init_handler is not None else {}
        fresh_state = "_mixed_precision" not in AcceleratorState._shared_state  # HF: the first Accelerator's config
        self.state = AcceleratorState(mixed_precision=mixed_precision, cpu=cpu, init_kwargs=init_kwargs,
                                      dynamo_plugin=dynamo_plugin, deepspeed_plugin=deepspeed_plugin,
                                      fsdp_plugin=fsdp_plugin)
        # the sharding plugins are read like kwargs handlers (one config source for the strategies)
        active_ds = self.state.deepspeed_plugin
        self.handlers.update({type(p).__name__: p for p in (fsdp_plugin, active_ds or deepspeed_plugin)
                              if p is not None and not isinstance(p, dict)})
        if fresh_state:
            self._init_layout(parallelism_config, megatron_lm_plugin)
        if self.state.megatron_lm_plugin is not None:  # its gradient_clipping is read like DeepSpeed's
            self.handlers["MegatronLMPlugin"] = self.state.megatron_lm_plugin

        self._init_gradient_accumulation(gradient_accumulation_plugin, gradient_accumulation_steps)

        self.device_placement = device_placement
        self.dataloader_config = dataloader_config if dataloader_config is not None else DataLoaderConfiguration()
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.rng_types = list(rng_types) if rng_types is not None else ["generator"]
        from ..tracking import filter_trackers  # unknown / uninstalled trackers fail here, before training
        self.log_with = filter_trackers(log_with, self.logging_dir)
        self.trackers: list = []

        self._num_processes = self.state.num_processes
        self._process_index = self.state.process_index
        self._local_process_index = self.state.local_process_index
        self.strategy = select_strategy(StrategyContext(self.state, self.handlers))
        if self.state.device.type == "cpu":  # before the model is built, where scripts build it after Accelerator()
            tune_cpu_heap(self.strategy.frees_whole_units)
        # the precision's C kernels (fp16 unscale) follow the same switch as the strategy's optimizer step
        self.precision = make_precision(self.state.mixed_precision, self.device, self.handlers,
                                        fused_kernels=self.strategy.config.fused_optimizer)
        self.scaler = self.precision.scaler
        self.native_amp = self.state.mixed_precision in ("fp16", "bf16")
        # a pipelined model runs its backward inside its call: it scales each micro-batch's loss as backward() would
        self.model_parallel = ModelParallel(self.state.parallel_layout, self._loss_for_backward,
                                            self._is_sync_step)

        self.flag_tensor: Optional[torch.Tensor] = None
        self._models: list = []
        self._optimizers: list = []
        self._schedulers: list = []
        self._dataloaders: list = []
        self._custom_objects: list = []
        self._save_model_state_pre_hook: dict = {}
        self._load_model_state_pre_hook: dict = {}

    def _init_layout(self, parallelism_config: Any, megatron_lm_plugin: Any) -> None:
        """The state's parallel layout, decided once from the config or plugin and the world (collective when it
        asks for more than data parallelism); the trivial one the state made stays when neither is given."""
        st = self.state
        st.parallelism_config, st.megatron_lm_plugin = parallelism_config, megatron_lm_plugin
        if parallelism_config is not None or megatron_lm_plugin is not None:
            st.parallel_layout = build_layout(parallelism_config, megatron_lm_plugin, num_processes=st.num_processes,
                                              process_index=st.process_index,
                                              distributed_type=str(st.distributed_type.value),
                                              device_type=st.device.type, is_main_process=st.is_main_process)

    def _init_handlers(self, kwargs_handlers: Optional[list]) -> None:
        """The user's kwargs handlers, one per class, keyed by class name (the strategies' and the precision's
        config source; the sharding plugins join them once the state is built), and HF's handler attributes."""
        self.handlers: dict[str, KwargsHandler] = _handlers_by_name(kwargs_handlers)
        self.ddp_handler = self.handlers.get("DistributedDataParallelKwargs")
        self.scaler_handler = self.handlers.get("GradScalerKwargs")
        self.init_handler = self.handlers.get("InitProcessGroupKwargs")
        self.autocast_handler = self.handlers.get("AutocastKwargs")
        self.fp8_recipe_handler = self.handlers.get("FP8RecipeKwargs")
        self.profile_handler = self.handlers.get("ProfileKwargs")

    def _init_gradient_accumulation(self, plugin: Optional[GradientAccumulationPlugin], steps: int) -> None:
        """The GradientAccumulationPlugin (or `gradient_accumulation_steps`, else
        ACCELERATE_GRADIENT_ACCUMULATION_STEPS), the GradientState attached to this Accelerator, and the per-step
        settings the C base type reads."""
        plugin = _accumulation_plugin(plugin, steps)
        self.gradient_state = GradientState(gradient_accumulation_plugin=plugin)
        self.gradient_state._attach(self)
        self._gradient_accumulation_steps = self.gradient_state.num_steps
        self._sync_each_batch = bool(plugin.sync_each_batch)
        self._sync_with_dataloader = bool(plugin.sync_with_dataloader)

    def __setstate__(self, state: tuple) -> None:
        """pickle (the C type's __getstate__/__setstate__ carry the per-step fields): a copy unpickled where the
        process's Accelerator is gone (another process) becomes the one GradientState follows."""
        super().__setstate__(state)
        if self.gradient_state._owner() is None:
            self.gradient_state._attach(self)

    # -- prepare ---------------------------------------------------------------------------------------
    def prepare(self, *args: Any, device_placement: Optional[list] = None) -> Any:
        if device_placement is None:
            device_placement = [None] * len(args)
        elif len(device_placement) != len(args):
            raise ValueError(f"`device_placement` should be a list with {len(args)} elements "
                             "(the number of objects passed).")
        # Models and loaders first, then optimizers (which may be rebuilt on the prepared parameters),
        # then schedulers (which need the prepared optimizers), as HF does in two passes.
        # the strategy may first replace objects (DeepSpeed's DummyOptim / DummyScheduler, "auto" values)
        result = self.strategy.prepare_objects(list(args), self)
        for kind in ("first", "optimizer", "scheduler"):
            for i, obj in enumerate(result):
                result[i] = self._prepare_one(obj, kind, device_placement[i])
        give_back_freed_memory()  # what sharding or moving into shared buffers replaced
        return result[0] if len(result) == 1 else tuple(result)

    def _prepare_one(self, obj: Any, kind: str, device_placement: Optional[bool]) -> Any:
        if getattr(obj, "_is_accelerate_prepared", False):
            return obj
        if kind == "first":
            if isinstance(obj, torch.utils.data.DataLoader):
                return self.prepare_data_loader(obj, device_placement=device_placement)
            if isinstance(obj, torch.nn.Module):
                return self.prepare_model(obj, device_placement=device_placement)
        elif kind == "optimizer" and isinstance(obj, torch.optim.Optimizer):
            return self.prepare_optimizer(obj, device_placement=device_placement)
        elif kind == "scheduler" and isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
            return self.prepare_scheduler(obj)
        return obj

    def prepare_model(self, model: torch.nn.Module, device_placement: Optional[bool] = None,
                      evaluation_mode: bool = False) -> torch.nn.Module:
        device_placement = self._places(model, self.device_placement if device_placement is None else device_placement)
        self._models.append(model)
        model = self.model_parallel.prepare_model(model, self.handlers)
        model = self.precision.prepare_model(model)
        model = self.strategy.prepare_model(model, device_placement, evaluation_mode)
        model = compile_model(model, self.state.dynamo_plugin)  # last, as HF: it compiles the wrapper
        self._models[-1] = model
        model._is_accelerate_prepared = True
        return model

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer,
                          device_placement: Optional[bool] = None) -> AcceleratedOptimizer:
        if isinstance(optimizer, AcceleratedOptimizer):
            return optimizer
        if device_placement is None:
            device_placement = self.device_placement
        inner = self.strategy.prepare_optimizer(self.model_parallel.prepare_optimizer(optimizer))
        wrapped = AcceleratedOptimizer(inner, precision=self.precision, strategy=self.strategy,
                                       device_placement=device_placement, device=self.device)
        wrapped._is_accelerate_prepared = True
        self._optimizers.append(wrapped)
        return wrapped

    def prepare_scheduler(self, scheduler: Any) -> AcceleratedScheduler:
        optimizer = self._optimizers
        for opt in self._optimizers:
            if getattr(scheduler, "optimizer", None) is opt.optimizer:
                optimizer = opt
                break
        wrapped = AcceleratedScheduler(scheduler, optimizer, step_with_optimizer=self.step_scheduler_with_optimizer,
                                       split_batches=self.split_batches)
        wrapped._is_accelerate_prepared = True
        self._schedulers.append(wrapped)
        return wrapped

    def prepare_data_loader(self, data_loader: Any, device_placement: Optional[bool] = None,
                            slice_fn_for_dispatch: Any = None) -> Any:
        from ..data_loader import prepare_data_loader
        if device_placement is None:
            device_placement = self.device_placement
        cfg = self.dataloader_config
        layout = self.state.parallel_layout  # data is sharded over the data-parallel ranks only
        prepared = prepare_data_loader(
            data_loader, self.device, num_processes=layout.dp_size, process_index=layout.dp_rank,
            split_batches=cfg.split_batches, put_on_device=device_placement, rng_types=list(self.rng_types),
            dispatch_batches=cfg.dispatch_batches, even_batches=cfg.even_batches,
            slice_fn_for_dispatch=slice_fn_for_dispatch, use_seedable_sampler=cfg.use_seedable_sampler,
            data_seed=cfg.data_seed, non_blocking=cfg.non_blocking,
            use_stateful_dataloader=cfg.use_stateful_dataloader)
        prepared._is_accelerate_prepared = True
        self._dataloaders.append(prepared)
        return prepared

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        from ..data_loader import skip_first_batches
        return skip_first_batches(dataloader, num_batches=num_batches)

    # -- the training step -----------------------------------------------------------------------------
    def _is_sync_step(self) -> bool:
        return bool(self.sync_gradients)

    def _loss_for_backward(self, loss: torch.Tensor) -> torch.Tensor:
        """What backward() backpropagates for `loss`: divided by the accumulation steps, then the precision's
        scaling (fp16's loss scale)."""
        if self._gradient_accumulation_steps != 1:  # x / 1 == x bit for bit: skip the extra kernel
            loss = loss / self._gradient_accumulation_steps
        return self.precision.scale_loss(loss)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        if self.model_parallel.backward_done(loss):  # a pipeline's loss: its call ran the backward already
            return
        self.strategy.backward(self._loss_for_backward(loss), **kwargs)

    @contextlib.contextmanager
    def accumulate(self, *models: torch.nn.Module) -> Iterator[None]:
        self._do_sync(self.gradient_state.end_of_dataloader)
        allow_sync = self._sync_gradients or (self.use_distributed and self._sync_each_batch)
        with contextlib.ExitStack() as stack:
            if not allow_sync:
                for m in models:
                    stack.enter_context(self.no_sync(m))
            yield

    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module) -> Iterator[None]:
        with self.strategy.no_sync(getattr(model, "_orig_mod", model)):  # a compiled model: its wrapper
            yield

    @staticmethod
    @contextlib.contextmanager
    def trigger_sync_in_backward(model: torch.nn.Module) -> Iterator[None]:
        """Kept for API compatibility: our gradient sync runs at the end of every backward outside
        no_sync, so there is nothing to trigger."""
        yield

    @contextlib.contextmanager
    def join_uneven_inputs(self, joinables: list, even_batches: Optional[bool] = None) -> Iterator[None]:
        """Ranks may run out of batches at different times (HF's semantics, on CPU processes too): with
        even_batches False (or overridden to False here, for map-style loaders), a rank out of inputs mirrors the
        others' collectives until all are done (the strategy's join)."""
        saved = []
        if even_batches is not None:
            from ..data_loader import DataLoaderDispatcher
            if any(isinstance(dl, DataLoaderDispatcher) for dl in self._dataloaders):
                import warnings
                warnings.warn("Overriding even_batches is only supported for map-style datasets, yet some "
                              "dataloaders given were iterable", UserWarning, stacklevel=3)
            for dl in self._dataloaders:
                sampler = getattr(dl, "batch_sampler", None)
                if not isinstance(dl, DataLoaderDispatcher) and hasattr(sampler, "even_batches"):
                    saved.append((sampler, sampler.even_batches))
                    sampler.even_batches = even_batches
        else:
            even_batches = self.even_batches
        try:
            with self.strategy.join(joinables, enable=not even_batches):
                yield
        finally:
            for sampler, value in saved:
                sampler.even_batches = value

    @contextlib.contextmanager
    def autocast(self, autocast_handler: Any = None) -> Iterator[None]:
        with self.precision.autocast(autocast_handler):
            yield

    def _inner_optimizers(self, optimizer: Any = None) -> list:
        if optimizer is None:
            opts = self._optimizers
        else:
            opts = optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]
        return [getattr(o, "optimizer", o) for o in opts]

    def unscale_gradients(self, optimizer: Any = None) -> None:
        for opt in self._inner_optimizers(optimizer):
            self.strategy.unscale_(opt, self.precision)

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> torch.Tensor:
        self.unscale_gradients()
        return self.strategy.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        self.unscale_gradients()
        self.strategy.clip_grad_value_(parameters, clip_value)

    # -- models ----------------------------------------------------------------------------------------
    def unwrap_model(self, model: torch.nn.Module, keep_fp32_wrapper: bool = True,
                     keep_torch_compile: bool = True) -> torch.nn.Module:
        return extract_model_from_parallel(model, keep_fp32_wrapper, keep_torch_compile)

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> Optional[dict]:
        return self.strategy.get_state_dict(getattr(model, "_orig_mod", model), unwrap=unwrap)

    def end_training(self) -> None:
        for tracker in self.trackers:
            tracker.finish()
        self.strategy.close()
        self.state.destroy_process_group()

    def free_memory(self, *objects: Any) -> list:
        self._models, self._optimizers, self._schedulers, self._dataloaders = [], [], [], []
        self.step = 0
        return release_memory(*objects)  # after dropping our references, so the collection can free them

    clear = free_memory

    def __deepcopy__(self, memo: dict) -> "Accelerator":
        return self

    def __repr__(self) -> str:
        return f"Accelerator(\n{self.state!r})"
