# accelerate_c/deepspeed/schema.py: the DeepSpeed JSON config without DeepSpeed, at the bottom of the package (it
# imports nothing else of it). HfDeepSpeedConfig (HF's query object: dotted-key lookups, stage, offload), the schema
# of the fields accelerate_c implements (any other field is an error naming its dotted path, DeepSpeedConfigError),
# the types and parameter names of the "optimizer" / "scheduler" blocks it builds, the batch-size consistency rule
# (train = micro * GA * world), and the readers of resolved values (gradient_clipping, communication_dtype).
# Not for: the plugin class (plugin.py), filling "auto" values at prepare (prepare.py), building the optimizer and
# scheduler objects (builders.py), or the engine (it reads the resolved JSON through ShardedConfig.deepspeed_config).
from __future__ import annotations

import base64
import copy
import json
import os
import warnings
from typing import Any, Mapping, Optional

import torch

from ..base.dtypes import select

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
FREE_BLOCKS = ("optimizer.params", "scheduler.params")  # checked against the type (check_block)
_HF_INSERTED = ("steps_per_print",)  # HF's plugin always writes it: never warned about

# the "optimizer" / "scheduler" blocks accelerate_c builds (builders.py): type (DeepSpeed lower-cases its own
# optimizer names) -> accepted params with DeepSpeed's defaults (None: required)
_ADAM_PARAMS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "adam_w_mode": True,
                "torch_adam": False, "bias_correction": True, "amsgrad": False}
OPTIMIZERS = {"adam": _ADAM_PARAMS, "adamw": _ADAM_PARAMS,
              "sgd": {"lr": None, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False}}
SCHEDULERS = {"WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 1000,
                           "warmup_type": "log", "last_batch_iteration": -1},
              "WarmupDecayLR": {"total_num_steps": None, "warmup_min_lr": 0.0, "warmup_max_lr": 0.001,
                                "warmup_num_steps": 1000, "warmup_type": "log", "last_batch_iteration": -1},
              "WarmupCosineLR": {"total_num_steps": None, "warmup_min_ratio": 0.0, "warmup_num_steps": 1000,
                                 "cos_min_ratio": 0.0001, "warmup_type": "log", "last_batch_iteration": -1}}


COMM_DTYPES = select(("fp32", "fp16", "bf16", "bfp16"))  # communication_data_type values (DeepSpeed's spellings)


def communication_dtype(config: dict) -> Optional[torch.dtype]:
    """communication_data_type as a torch dtype (None: absent or null, the compute dtype is reduced)."""
    value = config.get("communication_data_type")
    if value is None:
        return None
    _check_value("communication_data_type", "dtype", False, value)
    return COMM_DTYPES[value.lower()]


def gradient_clipping(config: Mapping[str, Any]) -> Optional[float]:
    """DeepSpeed's gradient_clipping from its JSON: a positive number clips; absent, 0 or still "auto": none."""
    clip = config.get("gradient_clipping")
    if isinstance(clip, (int, float)) and not isinstance(clip, bool) and clip > 0:
        return float(clip)
    return None


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
            check_block(block, config[block])
    return hints


def optimizer_kind(block: dict) -> str:
    """The "optimizer" block's type as a key of OPTIMIZERS ("SGD" kept as spelled); any other type is an error."""
    name = str(block["type"])
    kind = name.lower() if name.lower() in ("adam", "adamw") else name
    if kind not in ("adam", "adamw", "SGD"):
        raise DeepSpeedConfigError(f"DeepSpeed config `optimizer.type`: {name!r} is not supported by accelerate_c; "
                                   "supported: Adam, AdamW (DeepSpeed's names, any case), SGD")
    return kind


def check_block(kind: str, block: dict) -> None:
    """At plugin construction: the type and parameter names of the "optimizer" / "scheduler" block are ones we
    build (values may still be "auto"; they are checked when built at prepare)."""
    if kind == "optimizer":
        accepted = OPTIMIZERS[optimizer_kind(block).lower()]
    elif str(block["type"]) in SCHEDULERS:
        accepted = SCHEDULERS[str(block["type"])]
    else:
        raise DeepSpeedConfigError(f"DeepSpeed config `scheduler.type`: {block['type']!r} is not supported by "
                                   f"accelerate_c; supported: {', '.join(SCHEDULERS)}")
    unknown = sorted(set(block.get("params") or {}) - set(accepted))
    if unknown:
        raise DeepSpeedConfigError(f"DeepSpeed config `{kind}.params.{unknown[0]}` is not supported by accelerate_c "
                                   f"for {kind} type {block['type']!r}; supported: {', '.join(accepted)}")


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
