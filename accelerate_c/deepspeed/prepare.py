# accelerate_c/deepspeed/prepare.py: a DeepSpeedPlugin's prepare time (HF 1.15's _prepare_deepspeed without
# DeepSpeed): the "auto" values filled from the Accelerator and the objects of one prepare() call, HF's rules on
# DummyOptim / DummyScheduler checked, the batch sizes resolved, and each Dummy replaced by the real optimizer /
# scheduler the JSON describes (`prepare_deepspeed_objects`, which the strategy's DeepSpeed face calls from
# Strategy.prepare_objects).
# Not for: the JSON schema and its checks (schema.py), the builders of those objects (builders.py), the plugin
# class (plugin.py), or what the strategy re-reads from the filled JSON (face.py).
from __future__ import annotations

import logging
import math
import warnings
from typing import Any, Optional

import torch

from .builders import build_optimizer, build_scheduler, is_ds_scheduler
from .plugin import DummyOptim, DummyScheduler
from .schema import resolve_batch_sizes

logger = logging.getLogger(__name__)
_warned_offload = False


def _say_offload_is_noop(config: dict, device: torch.device) -> None:
    global _warned_offload
    zero = config.get("zero_optimization", {})
    offloaded = [f"zero_optimization.{k}.device=cpu" for k in ("offload_optimizer", "offload_param")
                 if zero.get(k, {}).get("device") == "cpu"]
    if offloaded and device.type == "cpu" and not _warned_offload:
        _warned_offload = True
        warnings.warn(f"DeepSpeed config {', '.join(offloaded)}: this run is on CPU already, so offloading to CPU "
                      "is a no-op", UserWarning, stacklevel=3)


def prepare_deepspeed_objects(plugin: Any, objects: list, accelerator: Any) -> list:
    """HF 1.15's _prepare_deepspeed, minus DeepSpeed: fills the plugin's "auto" values from the Accelerator and the
    objects of this prepare() call (dataloader batch size, GA steps, world size, DummyOptim lr/weight_decay,
    DummyScheduler warmup/total steps, the model's hidden size), checks the optimizer/scheduler rules and the batch
    sizes, and returns the list with each DummyOptim/DummyScheduler replaced by the real optimizer/scheduler the
    JSON describes (same length and order). May set accelerator.gradient_accumulation_steps (DeepSpeed's wins).
    "auto" is resolved per Accelerator (DeepSpeedPlugin.filling_for)."""
    token = accelerator.__dict__.setdefault("_ds_fill_token", object())  # (no reference to the Accelerator kept)
    with plugin.filling_for(token):
        return _prepare_deepspeed_objects(plugin, objects, accelerator)


def _prepare_deepspeed_objects(plugin: Any, objects: list, accelerator: Any) -> list:
    config = plugin.deepspeed_config
    world = accelerator.num_processes
    micro = _micro_batch_size(plugin, objects, accelerator, world)
    _take_accumulation_steps(plugin, accelerator)

    kwargs: dict[str, Any] = {"gradient_clipping": 1.0,
                              "zero_optimization.stage3_gather_16bit_weights_on_model_save": False}
    if micro is not None:
        kwargs["train_micro_batch_size_per_gpu"] = micro
        kwargs["train_batch_size"] = micro * plugin.get_value("gradient_accumulation_steps") * world

    model = next((o for o in objects if isinstance(o, torch.nn.Module)), None)
    optimizer = next((o for o in objects if isinstance(o, (torch.optim.Optimizer, DummyOptim))), None)
    scheduler = next((o for o in objects if isinstance(o, (torch.optim.lr_scheduler.LRScheduler, DummyScheduler))
                      or is_ds_scheduler(o)), None)
    _check_dummies(config, optimizer, scheduler)
    if isinstance(optimizer, torch.optim.Optimizer):
        config["zero_allow_untested_optimizer"] = True
    if model is None:
        return objects

    for block, obj, dummy in (("optimizer", optimizer, "DummyOptim"), ("scheduler", scheduler, "DummyScheduler")):
        if block in config and obj is None:  # DeepSpeed would build and run it behind the model: so must we
            raise ValueError(f"The DeepSpeed config has a `{block}` block: pass a `{dummy}` to the same prepare() "
                             f"call as the model (accelerate_c builds the {block} there)")
    _fill_hidden_size_keys(plugin, model, kwargs)
    _fill_dummy_keys(optimizer, scheduler, accelerator.split_batches, world, kwargs)
    plugin.deepspeed_config_process(must_match=False, **kwargs)
    resolve_batch_sizes(config, world)
    accelerator.deepspeed_config = config
    _say_offload_is_noop(config, accelerator.device)
    return _build_objects(config, objects, accelerator.split_batches, world)


def _micro_batch_size(plugin: Any, objects: list, accelerator: Any, world: int) -> Optional[int]:
    """train_micro_batch_size_per_gpu: the JSON's value, or when "auto" the smallest (is_train_batch_min) or
    largest batch size of this call's dataloaders (per process under split_batches)."""
    if not plugin.is_auto("train_micro_batch_size_per_gpu"):
        return plugin.get_value("train_micro_batch_size_per_gpu")
    loaders = [o for o in objects if isinstance(o, torch.utils.data.DataLoader)]
    if not loaders:
        raise ValueError(
            "When using DeepSpeed, `accelerate.prepare()` requires you to pass at least one of training or "
            "evaluation dataloaders with `batch_size` attribute returning an integer value or alternatively set "
            "an integer value in `train_micro_batch_size_per_gpu` in the deepspeed config file or assign integer "
            "value to `AcceleratorState().deepspeed_plugin.deepspeed_config['train_micro_batch_size_per_gpu']`.")
    sizes = [getattr(o, "batch_size", None) for o in loaders]
    if any(bs is None for bs in sizes):
        raise ValueError("At least one of the dataloaders passed to `accelerate.prepare()` has `None` as batch "
                         "size. Please set an integer value in `train_micro_batch_size_per_gpu` in the deepspeed "
                         "config file or assign integer value to `AcceleratorState().deepspeed_plugin."
                         "deepspeed_config['train_micro_batch_size_per_gpu']`.")
    if accelerator.split_batches:
        sizes = [bs // world for bs in sizes]
    return min(sizes) if plugin.is_train_batch_min else max(sizes)


def _take_accumulation_steps(plugin: Any, accelerator: Any) -> None:
    """gradient_accumulation_steps: "auto" is the Accelerator's; a different JSON value wins (HF's warning)."""
    plugin.fill_match("gradient_accumulation_steps", must_match=False,
                      gradient_accumulation_steps=accelerator.gradient_accumulation_steps)
    ds_ga = plugin.get_value("gradient_accumulation_steps")
    if ds_ga != accelerator.gradient_accumulation_steps:
        logger.warning(f"Gradient accumulation steps mismatch: GradientAccumulationPlugin has "
                       f"{accelerator.gradient_accumulation_steps}, DeepSpeed config has {ds_ga}. Using DeepSpeed's "
                       "value.")
        accelerator.gradient_accumulation_steps = ds_ga


def _check_dummies(config: dict, optimizer: Any, scheduler: Any) -> None:
    """HF's rules: the JSON optimizer block iff a DummyOptim, the JSON scheduler block (or a callable) iff a
    DummyScheduler, a DummyScheduler only with a DummyOptim."""
    if optimizer is not None:
        if "optimizer" in config and not isinstance(optimizer, DummyOptim):
            raise ValueError("You cannot specify an optimizer in the config file and in the code at the same time. "
                             "Please remove the optimizer from the config file or create `accelerate.utils.DummyOptim`"
                             " in the code.")
        if "optimizer" not in config and isinstance(optimizer, DummyOptim):
            raise ValueError("You cannot create a `DummyOptim` without specifying an optimizer in the config file.")
    if scheduler is not None:
        if "scheduler" in config and not isinstance(scheduler, DummyScheduler):
            raise ValueError("You cannot specify a scheduler in the config file and in the code at the same time. "
                             "Please remove the scheduler from the config file or create "
                             "`accelerate.utils.DummyScheduler` in the code.")
        if ("scheduler" not in config and isinstance(scheduler, DummyScheduler)
                and scheduler.lr_scheduler_callable is None):
            raise ValueError("Either specify a scheduler in the config file or pass in the `lr_scheduler_callable` "
                             "parameter when using `accelerate.utils.DummyScheduler`.")
    if optimizer is not None and scheduler is not None:
        if isinstance(optimizer, DummyOptim) and not isinstance(scheduler, DummyScheduler):
            raise ValueError("You can only specify `accelerate.utils.DummyScheduler` in the code when using "
                             "`accelerate.utils.DummyOptim`.")


def _fill_hidden_size_keys(plugin: Any, model: torch.nn.Module, kwargs: dict) -> None:
    keys = ["zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
            "zero_optimization.stage3_param_persistence_threshold"]
    auto = [k for k in keys if plugin.is_auto(k)]
    if not auto:
        return
    reason = ("therefore it's not possible to automatically fill out the following `auto` entries in the DeepSpeed "
              f"config file: {auto}. You can fix that by replacing `auto` values for these keys with an integer value "
              "of your choice.")
    if not hasattr(model, "config"):
        raise ValueError("Can't find `model.config` entry, " + reason)
    if hasattr(model.config, "hidden_size"):
        hidden = model.config.hidden_size
    elif hasattr(model.config, "hidden_sizes"):
        hidden = max(model.config.hidden_sizes)
    else:
        raise ValueError("Can find neither `model.config.hidden_size` nor `model.config.hidden_sizes`, " + reason)
    kwargs.update({keys[0]: hidden * hidden, keys[1]: int(0.9 * hidden * hidden), keys[2]: 10 * hidden})


def _fill_dummy_keys(optimizer: Any, scheduler: Any, split_batches: bool, world: int, kwargs: dict) -> None:
    """The "auto" values a DummyOptim (lr, weight_decay; ours: betas, eps) and a DummyScheduler without a callable
    (warmup from the optimizer's lr, warmup and total steps) fill."""
    if isinstance(optimizer, DummyOptim):
        kwargs.update({"optimizer.params.lr": optimizer.lr, "optimizer.params.weight_decay": optimizer.weight_decay})
        for key in ("betas", "eps"):  # ours: also from DummyOptim(..., betas=, eps=) when given (HF: an error)
            if key in optimizer.kwargs:
                kwargs[f"optimizer.params.{key}"] = optimizer.kwargs[key]
    if isinstance(scheduler, DummyScheduler) and scheduler.lr_scheduler_callable is None:
        opt = scheduler.optimizer
        max_lr = getattr(opt, "lr", None) if getattr(opt, "defaults", None) is None else opt.defaults["lr"]
        kwargs.update({"scheduler.params.warmup_min_lr": 0, "scheduler.params.warmup_max_lr": max_lr,
                       "scheduler.params.warmup_num_steps": max(1, scheduler.warmup_num_steps)})
        if scheduler.total_num_steps is not None:
            kwargs["scheduler.params.total_num_steps"] = (scheduler.total_num_steps if split_batches
                                                          else math.ceil(scheduler.total_num_steps / world))


def _build_objects(config: dict, objects: list, split_batches: bool, world: int) -> list:
    """`objects` with each DummyOptim / DummyScheduler replaced by what the resolved JSON builds (a scheduler
    without a JSON block: the DummyScheduler's callable), over the real optimizer when one was built."""
    out = list(objects)
    real_opt = None
    for i, obj in enumerate(out):
        if isinstance(obj, DummyOptim):
            real_opt = out[i] = build_optimizer(config["optimizer"], obj.params)
    calls_per_step = 1 if split_batches else world  # AcceleratedScheduler's steps per optimizer step
    for i, obj in enumerate(out):
        if isinstance(obj, DummyScheduler):
            target = real_opt if real_opt is not None else obj.optimizer
            if "scheduler" in config:
                out[i] = build_scheduler(config["scheduler"], target, calls_per_step)
            else:
                out[i] = obj.lr_scheduler_callable(target)
    return out
