# accelerate_c/deepspeed/schema.py: the DeepSpeed JSON config without DeepSpeed. HfDeepSpeedConfig (HF's
# query object: dotted-key lookups, stage, offload), the schema of the fields accelerate_c implements (any other
# field is an error naming its dotted path), the batch-size consistency rule (train = micro * GA * world), and the
# prepare-time resolution of "auto" values and DummyOptim/DummyScheduler (`prepare_deepspeed_objects`, which the
# sharded strategy calls from Strategy.prepare_objects), with HF 1.15's checks and error conditions.
# Not for: the plugin class (utils/deepspeed_plugin.py), building optimizers/schedulers (deepspeed_builders.py),
# or the engine (it reads the resolved JSON through ShardedConfig.deepspeed_config).
from __future__ import annotations

import base64
import copy
import json
import logging
import math
import os
import warnings
from typing import Any, Optional

import torch

logger = logging.getLogger(__name__)
AUTO = "auto"

# Field -> (kind, "auto" allowed, effect). kind: int | num | bool | stage | device | path | name | false | true |
# dtype (DeepSpeed's communication_data_type: fp32 / fp16 / bf16, any case, or null; "bfp16", older DeepSpeed's
# spelling of bf16, too).
# effect: "" = implemented; "hint" = a DeepSpeed performance knob with no effect on results here (the engine's own
# bucket/prefetch policy applies): accepted, named once in a warning when the user set it.
SCHEMA: dict[str, tuple[str, bool, str]] = {
    "train_batch_size": ("int", True, ""),
    "train_micro_batch_size_per_gpu": ("int", True, ""),
    "gradient_accumulation_steps": ("int", True, ""),
    "gradient_clipping": ("num", True, ""),
    "steps_per_print": ("num", False, "hint"),
    "wall_clock_breakdown": ("false", False, ""),
    "prescale_gradients": ("false", False, ""),
    "communication_data_type": ("dtype", False, ""),
    "zero_allow_untested_optimizer": ("bool", False, ""),
    "zero_force_ds_cpu_optimizer": ("bool", False, ""),
    "fp16.enabled": ("bool", True, ""),
    "fp16.auto_cast": ("bool", True, ""),
    "fp16.loss_scale": ("num", False, ""),
    "fp16.initial_scale_power": ("int", False, ""),
    "fp16.loss_scale_window": ("int", False, ""),
    "fp16.hysteresis": ("int", False, ""),
    "fp16.consecutive_hysteresis": ("bool", False, ""),
    "fp16.min_loss_scale": ("num", False, ""),
    "bf16.enabled": ("bool", True, ""),
    "zero_optimization.stage": ("stage", False, ""),
    "zero_optimization.offload_optimizer.device": ("device", False, ""),
    "zero_optimization.offload_optimizer.nvme_path": ("path", False, ""),
    "zero_optimization.offload_optimizer.pin_memory": ("bool", False, "hint"),
    "zero_optimization.offload_param.device": ("device", False, ""),
    "zero_optimization.offload_param.nvme_path": ("path", False, ""),
    "zero_optimization.offload_param.pin_memory": ("bool", False, "hint"),
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": ("bool", True, ""),
    "zero_optimization.reduce_bucket_size": ("num", True, ""),
    "zero_optimization.allgather_partitions": ("true", False, ""),
    "zero_optimization.reduce_scatter": ("true", False, ""),
    "zero_optimization.overlap_comm": ("bool", False, "hint"),
    "zero_optimization.contiguous_gradients": ("bool", False, "hint"),
    "zero_optimization.allgather_bucket_size": ("num", False, "hint"),
    "zero_optimization.round_robin_gradients": ("bool", False, "hint"),
    "zero_optimization.sub_group_size": ("num", False, "hint"),
    "zero_optimization.stage3_prefetch_bucket_size": ("num", True, "hint"),
    "zero_optimization.stage3_param_persistence_threshold": ("num", True, "hint"),
    "zero_optimization.stage3_max_live_parameters": ("num", False, "hint"),
    "zero_optimization.stage3_max_reuse_distance": ("num", False, "hint"),
    "optimizer.type": ("name", False, ""),
    "scheduler.type": ("name", False, ""),
}
BLOCKS = ("fp16", "bf16", "zero_optimization", "zero_optimization.offload_optimizer", "zero_optimization.offload_param",
          "optimizer", "scheduler")
FREE_BLOCKS = ("optimizer.params", "scheduler.params")  # checked by deepspeed_builders.py against the type
_HF_INSERTED = ("steps_per_print",)  # HF's plugin always writes it: never warned about


COMM_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "bfp16": torch.bfloat16}


def communication_dtype(config: dict) -> Optional[torch.dtype]:
    """communication_data_type as a torch dtype (None: absent or null, the compute dtype is reduced)."""
    value = config.get("communication_data_type")
    if value is None:
        return None
    _check_value("communication_data_type", "dtype", False, value)
    return COMM_DTYPES[value.lower()]


class DeepSpeedConfigError(ValueError):
    """A DeepSpeed JSON field we do not implement or a bad value; the message names the dotted path."""


class HfDeepSpeedConfig:
    """HF's config holder (same methods): a JSON file path, a JSON or base64-JSON string, or a dict (copied)."""

    def __init__(self, config_file_or_dict: Any) -> None:
        if isinstance(getattr(config_file_or_dict, "config", None), dict):  # another library's HfDeepSpeedConfig
            config_file_or_dict = config_file_or_dict.config
        if isinstance(config_file_or_dict, dict):
            config = copy.deepcopy(config_file_or_dict)
        elif isinstance(config_file_or_dict, str) and os.path.exists(config_file_or_dict):
            with open(config_file_or_dict, encoding="utf-8") as f:
                try:
                    config = json.load(f)
                except json.JSONDecodeError as e:
                    raise DeepSpeedConfigError(f"DeepSpeed config {config_file_or_dict}: not valid JSON: {e}") from None
        else:
            try:
                try:
                    config = json.loads(config_file_or_dict)
                except json.JSONDecodeError:
                    config = json.loads(base64.urlsafe_b64decode(config_file_or_dict).decode("utf-8"))
            except (UnicodeDecodeError, AttributeError, ValueError, TypeError):
                raise ValueError("Expected a string path to an existing deepspeed config, or a dictionary, or a base64 "
                                 f"encoded string. Received: {config_file_or_dict}") from None
        if not isinstance(config, dict):
            raise DeepSpeedConfigError(f"DeepSpeed config must be a JSON object, got {type(config).__name__}")
        self.config = config
        self.set_stage_and_offload()

    def set_stage_and_offload(self) -> None:
        self._stage = self.get_value("zero_optimization.stage", -1)
        devices = {self.get_value("zero_optimization.offload_optimizer.device"),
                   self.get_value("zero_optimization.offload_param.device")}
        self._offload = (self.is_zero2() or self.is_zero3()) and bool(devices & {"cpu", "nvme"})

    def find_config_node(self, ds_key_long: str) -> tuple[Optional[dict], str]:
        config: Any = self.config
        nodes = ds_key_long.split(".")
        ds_key = nodes.pop()
        for node in nodes:
            config = config.get(node) if isinstance(config, dict) else None
            if config is None:
                return None, ds_key
        return config, ds_key

    def get_value(self, ds_key_long: str, default: Any = None) -> Any:
        config, ds_key = self.find_config_node(ds_key_long)
        return default if config is None else config.get(ds_key, default)

    def del_config_sub_tree(self, ds_key_long: str, must_exist: bool = False) -> None:
        config, key = self.find_config_node(ds_key_long)
        if config is None or key not in config:
            if must_exist:
                raise ValueError(f"Can't find {ds_key_long} entry in the config: {self.config}")
            return
        config.pop(key)

    def is_true(self, ds_key_long: str) -> bool:
        value = self.get_value(ds_key_long)
        return False if value is None else bool(value)

    def is_false(self, ds_key_long: str) -> bool:
        value = self.get_value(ds_key_long)
        return False if value is None else not bool(value)

    def is_zero2(self) -> bool:
        return self._stage == 2

    def is_zero3(self) -> bool:
        return self._stage == 3

    def is_offload(self) -> bool:
        return self._offload


# -- validation ------------------------------------------------------------------------------------------
def _check_value(path: str, kind: str, auto_ok: bool, value: Any) -> None:
    if value == AUTO:
        if auto_ok:
            return
        raise DeepSpeedConfigError(f"DeepSpeed config `{path}`: \"auto\" is not accepted for this field")
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = {"int": isinstance(value, int) and not isinstance(value, bool) or (isinstance(value, float)
                                                                              and value.is_integer()),
          "num": number, "bool": isinstance(value, bool), "false": value is False, "true": value is True,
          "stage": value in (0, 1, 2, 3) and not isinstance(value, bool),
          "device": value in ("none", "cpu", "nvme", None), "path": value is None or isinstance(value, str),
          "name": isinstance(value, str),
          "dtype": value is None or isinstance(value, str) and value.lower() in COMM_DTYPES}[kind]
    if not ok:
        allowed = {"int": "an integer", "num": "a number", "bool": "true or false", "false": "false (only)",
                   "true": "true (only)", "stage": "0, 1, 2 or 3", "device": "none, cpu or nvme",
                   "path": "a path or null", "name": "a string", "dtype": "fp32, fp16, bf16 or null"}[kind]
        raise DeepSpeedConfigError(f"DeepSpeed config `{path}`: got {value!r}; allowed: {allowed}"
                                   + ("" if not auto_ok else " or \"auto\""))
    if kind == "device" and value == "nvme":
        raise DeepSpeedConfigError(f"DeepSpeed config `{path}`: \"nvme\" offload is not supported by accelerate_c; "
                                   "allowed: none, cpu")


def validate_config(config: dict, _prefix: str = "") -> list[str]:
    """Raises DeepSpeedConfigError for the first field we do not implement (its dotted path) or bad value; returns
    the performance-knob ("hint") fields the user set."""
    hints: list[str] = []
    for key, value in config.items():
        path = f"{_prefix}{key}"
        if path in FREE_BLOCKS:
            if not isinstance(value, dict):
                raise DeepSpeedConfigError(f"DeepSpeed config `{path}`: expected an object, got {value!r}")
            continue
        if path in BLOCKS:
            if not isinstance(value, dict):
                raise DeepSpeedConfigError(f"DeepSpeed config `{path}`: expected an object, got {value!r}")
            hints += validate_config(value, path + ".")
            continue
        spec = SCHEMA.get(path)
        if spec is None:
            raise DeepSpeedConfigError(
                f"DeepSpeed config field `{path}` is not supported by accelerate_c (it would be ignored); remove it. "
                "Supported fields: docs/sharding_config.md")
        kind, auto_ok, effect = spec
        _check_value(path, kind, auto_ok, value)
        if effect == "hint" and path not in _HF_INSERTED:
            hints.append(path)
    for block in ("optimizer", "scheduler"):
        if not _prefix and block in config:
            if "type" not in config[block]:
                raise DeepSpeedConfigError(f"DeepSpeed config `{block}`: the block needs a `type`")
            from .builders import check_block
            check_block(block, config[block])
    return hints


def warn_hints(hints: list[str]) -> None:
    if hints:
        warnings.warn("DeepSpeed config: these tuning fields have no effect in accelerate_c (its sharded engine uses "
                      f"its own bucketing and prefetch): {', '.join(hints)}", UserWarning, stacklevel=3)


def resolve_batch_sizes(config: dict, world: int) -> None:
    """DeepSpeed's rule: derive the missing ones of train_batch_size / train_micro_batch_size_per_gpu /
    gradient_accumulation_steps, then require train = micro * GA * world. Values must not be "auto" any more."""
    train, micro, ga = (config.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                                "gradient_accumulation_steps"))
    for key, v in (("train_batch_size", train), ("train_micro_batch_size_per_gpu", micro),
                   ("gradient_accumulation_steps", ga)):
        if v == AUTO:
            raise DeepSpeedConfigError(f"DeepSpeed config `{key}` is still \"auto\" (nothing to fill it from)")
    if train is not None and micro is not None and ga is None:
        ga = train // micro // world
    elif train is not None and ga is not None and micro is None:
        micro = train // world // ga
    elif micro is not None and ga is not None and train is None:
        train = micro * ga * world
    elif train is not None and micro is None and ga is None:
        ga, micro = 1, train // world
    elif micro is not None and train is None and ga is None:
        ga, train = 1, micro * world
    elif train is None and micro is None:
        raise DeepSpeedConfigError("DeepSpeed config: either train_batch_size or train_micro_batch_size_per_gpu "
                                   "needs to be provided")
    if not (train > 0 and micro > 0 and ga > 0):
        raise DeepSpeedConfigError(f"DeepSpeed config: batch sizes must be > 0: train_batch_size={train}, "
                                   f"train_micro_batch_size_per_gpu={micro}, gradient_accumulation_steps={ga}")
    if train != micro * ga * world:
        raise DeepSpeedConfigError(
            "DeepSpeed config: train_batch_size is not equal to train_micro_batch_size_per_gpu * "
            f"gradient_accumulation_steps * world_size: {train} != {micro} * {ga} * {world}")
    config.update(train_batch_size=int(train), train_micro_batch_size_per_gpu=int(micro),
                  gradient_accumulation_steps=int(ga))


# -- prepare time: "auto" and the Dummy objects ---------------------------------------------------------------
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
    from .plugin import DummyOptim, DummyScheduler
    from .builders import build_optimizer, build_scheduler, is_ds_scheduler

    config = plugin.deepspeed_config
    world = accelerator.num_processes
    loaders = [o for o in objects if isinstance(o, torch.utils.data.DataLoader)]
    micro = None
    if plugin.is_auto("train_micro_batch_size_per_gpu"):
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
        micro = min(sizes) if plugin.is_train_batch_min else max(sizes)
    else:
        micro = plugin.get_value("train_micro_batch_size_per_gpu")

    plugin.fill_match("gradient_accumulation_steps", must_match=False,
                      gradient_accumulation_steps=accelerator.gradient_accumulation_steps)
    ds_ga = plugin.get_value("gradient_accumulation_steps")
    if ds_ga != accelerator.gradient_accumulation_steps:
        logger.warning(f"Gradient accumulation steps mismatch: GradientAccumulationPlugin has "
                       f"{accelerator.gradient_accumulation_steps}, DeepSpeed config has {ds_ga}. Using DeepSpeed's "
                       "value.")
        accelerator.gradient_accumulation_steps = ds_ga

    kwargs: dict[str, Any] = {"gradient_clipping": 1.0,
                              "zero_optimization.stage3_gather_16bit_weights_on_model_save": False}
    if micro is not None:
        kwargs["train_micro_batch_size_per_gpu"] = micro
        kwargs["train_batch_size"] = micro * plugin.get_value("gradient_accumulation_steps") * world

    model = next((o for o in objects if isinstance(o, torch.nn.Module)), None)
    optimizer = next((o for o in objects if isinstance(o, (torch.optim.Optimizer, DummyOptim))), None)
    scheduler = next((o for o in objects if isinstance(o, (torch.optim.lr_scheduler.LRScheduler, DummyScheduler))
                      or is_ds_scheduler(o)), None)
    _check_dummies(config, optimizer, scheduler, DummyOptim, DummyScheduler)
    if isinstance(optimizer, torch.optim.Optimizer):
        config["zero_allow_untested_optimizer"] = True
    if model is None:
        return objects

    for block, obj, dummy in (("optimizer", optimizer, "DummyOptim"), ("scheduler", scheduler, "DummyScheduler")):
        if block in config and obj is None:  # DeepSpeed would build and run it behind the model: so must we
            raise ValueError(f"The DeepSpeed config has a `{block}` block: pass a `{dummy}` to the same prepare() "
                             f"call as the model (accelerate_c builds the {block} there)")
    _fill_hidden_size_keys(plugin, model, kwargs)
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
            kwargs["scheduler.params.total_num_steps"] = (scheduler.total_num_steps if accelerator.split_batches
                                                          else math.ceil(scheduler.total_num_steps / world))
    plugin.deepspeed_config_process(must_match=False, **kwargs)
    resolve_batch_sizes(config, world)
    accelerator.deepspeed_config = config
    _say_offload_is_noop(config, accelerator.device)

    out = list(objects)
    real_opt = None
    for i, obj in enumerate(out):
        if isinstance(obj, DummyOptim):
            real_opt = out[i] = build_optimizer(config["optimizer"], obj.params)
    calls_per_step = 1 if accelerator.split_batches else world  # AcceleratedScheduler's steps per optimizer step
    for i, obj in enumerate(out):
        if isinstance(obj, DummyScheduler):
            target = real_opt if real_opt is not None else obj.optimizer
            if "scheduler" in config:
                out[i] = build_scheduler(config["scheduler"], target, calls_per_step)
            else:
                out[i] = obj.lr_scheduler_callable(target)
    return out


def _check_dummies(config: dict, optimizer: Any, scheduler: Any, DummyOptim: type, DummyScheduler: type) -> None:
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
