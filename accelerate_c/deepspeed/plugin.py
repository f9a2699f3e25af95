# accelerate_c/deepspeed/plugin.py: HF Accelerate's DeepSpeedPlugin (HF 1.15 fields, defaults and
# ACCELERATE_DEEPSPEED_* fallbacks; `hf_ds_config` a JSON path, JSON/base64 string or dict; without one the config
# is synthesised from the fields as HF does), DummyOptim and DummyScheduler. DeepSpeed itself is never imported: the
# JSON is validated against what accelerate_c implements (schema.py) and drives its sharded engine.
# Not for: the JSON schema (schema.py), "auto" resolution at prepare (prepare.py), the FSDP plugin
# (base/fsdp_plugin.py).
from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from ..base import settings
from .schema import HfDeepSpeedConfig, validate_config, warn_hints

# plugin field -> dotted JSON key (HF's mapping)
PLUGIN_TO_CONFIG = {"gradient_accumulation_steps": "gradient_accumulation_steps",
                    "gradient_clipping": "gradient_clipping",
                    "zero_stage": "zero_optimization.stage",
                    "offload_optimizer_device": "zero_optimization.offload_optimizer.device",
                    "offload_param_device": "zero_optimization.offload_param.device",
                    "offload_param_nvme_path": "zero_optimization.offload_param.nvme_path",
                    "offload_optimizer_nvme_path": "zero_optimization.offload_optimizer.nvme_path",
                    "zero3_save_16bit_model": "zero_optimization.stage3_gather_16bit_weights_on_model_save"}
# launcher fields that a deepspeed_config_file makes meaningless (HF's _deepspeed_config_checks)
_IGNORED_WITH_FILE = ("gradient_accumulation_steps", "gradient_clipping", "zero_stage", "offload_optimizer_device",
                      "offload_param_device", "offload_param_nvme_path", "offload_optimizer_nvme_path",
                      "zero3_save_16bit_model", "mixed_precision")


def _env_number(name: str, default: str, cast: Callable[[str], Any]) -> Any:
    raw = os.environ.get(name, default)
    if raw == "auto":
        return raw
    try:
        return cast(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r}: expected a number or auto") from None


@dataclass
class DeepSpeedPlugin:
    """DeepSpeed/ZeRO settings (HF 1.15 field names and defaults), run on accelerate_c's sharded engine."""

    hf_ds_config: Any = None
    gradient_accumulation_steps: Any = None
    gradient_clipping: Any = None
    zero_stage: Optional[int] = None
    is_train_batch_min: bool = True
    offload_optimizer_device: Optional[str] = None
    offload_param_device: Optional[str] = None
    offload_optimizer_nvme_path: Optional[str] = None
    offload_param_nvme_path: Optional[str] = None
    zero3_init_flag: Optional[bool] = None
    zero3_save_16bit_model: Optional[bool] = None
    transformer_moe_cls_names: Optional[str] = None
    enable_msamp: Optional[bool] = None
    msamp_opt_level: Optional[str] = None

    def __post_init__(self) -> None:
        if self.gradient_accumulation_steps is None:
            gas = os.environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "auto")
            self.gradient_accumulation_steps = int(gas) if gas.isdigit() else gas
        if self.gradient_clipping is None:
            self.gradient_clipping = _env_number("ACCELERATE_GRADIENT_CLIPPING", "auto", float)
        if self.zero_stage is None:
            self.zero_stage = _env_number("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2", int)
        if self.offload_optimizer_device is None:
            self.offload_optimizer_device = os.environ.get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "none")
        if self.offload_param_device is None:
            self.offload_param_device = os.environ.get("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "none")
        if self.offload_optimizer_nvme_path is None:
            self.offload_optimizer_nvme_path = os.environ.get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH",
                                                              "none")
        if self.offload_param_nvme_path is None:
            self.offload_param_nvme_path = os.environ.get("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH", "none")
        if self.zero3_save_16bit_model is None:
            self.zero3_save_16bit_model = (
                os.environ.get("ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL", "false").lower() == "true")
        if self.enable_msamp is None:
            self.enable_msamp = os.environ.get("ACCELERATE_FP8_BACKEND", None) == "MSAMP"
        if self.msamp_opt_level is None:
            self.msamp_opt_level = os.environ.get("ACCELERATE_FP8_OPT_LEVEL", "O1")
        if self.hf_ds_config is None:
            self.hf_ds_config = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")

        if isinstance(self.hf_ds_config, dict) or hasattr(self.hf_ds_config, "config") or (
                isinstance(self.hf_ds_config, str) and self.hf_ds_config != "none"):
            self._from_config()
        else:
            self._synthesise()
        self.deepspeed_config = self.hf_ds_config.config
        self.deepspeed_config["steps_per_print"] = float("inf")  # as HF: no DeepSpeed-style progress lines
        if self.zero3_init_flag is None:
            self.zero3_init_flag = settings.hf_bool("ACCELERATE_DEEPSPEED_ZERO3_INIT", os.environ.get(
                "ACCELERATE_DEEPSPEED_ZERO3_INIT", str(self.hf_ds_config.is_zero3())))
        if self.zero3_init_flag and not self.hf_ds_config.is_zero3():
            warnings.warn("DeepSpeed Zero3 Init flag is only applicable for ZeRO Stage 3. Setting it to False.")
            self.zero3_init_flag = False
        self._set_selected(False)
        if self.enable_msamp and "msamp" not in self.deepspeed_config:
            raise NotImplementedError("DeepSpeedPlugin(enable_msamp=True) / ACCELERATE_FP8_BACKEND=MSAMP: MS-AMP is "
                                      "not supported by accelerate_c; use mixed_precision='fp8' (its own fp8 path)")
        if self.transformer_moe_cls_names is None:
            self.transformer_moe_cls_names = os.environ.get("ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES")
        if self.transformer_moe_cls_names is not None:
            raise NotImplementedError(f"DeepSpeedPlugin(transformer_moe_cls_names={self.transformer_moe_cls_names!r}):"
                                      " ZeRO-3 MoE leaf modules are not supported by accelerate_c yet")
        warn_hints(validate_config(self.deepspeed_config))

    def _from_config(self) -> None:
        if not isinstance(self.hf_ds_config, HfDeepSpeedConfig):
            self.hf_ds_config = HfDeepSpeedConfig(self.hf_ds_config)
        config = self.hf_ds_config.config
        config.setdefault("gradient_accumulation_steps", 1)
        if "zero_optimization" not in config:
            raise ValueError("Please specify the ZeRO optimization config in the DeepSpeed config.")
        self._deepspeed_config_checks()
        kwargs = {v: getattr(self, k) for k, v in PLUGIN_TO_CONFIG.items() if getattr(self, k) is not None}
        for key in kwargs:
            self.fill_match(key, **kwargs, must_match=False)
        self.hf_ds_config.set_stage_and_offload()
        for key, path in PLUGIN_TO_CONFIG.items():  # the JSON's values win over the plugin's
            value = self.hf_ds_config.get_value(path)
            if value is not None and value != "auto":
                setattr(self, key, value)

    def _synthesise(self) -> None:
        def offload(device: str, path: str) -> dict:
            return {"device": device, "nvme_path": path if device == "nvme" else None}

        config: dict[str, Any] = {
            "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "zero_optimization": {
                "stage": self.zero_stage,
                "offload_optimizer": offload(self.offload_optimizer_device, self.offload_optimizer_nvme_path),
                "offload_param": offload(self.offload_param_device, self.offload_param_nvme_path),
                "stage3_gather_16bit_weights_on_model_save": self.zero3_save_16bit_model}}
        if self.gradient_clipping:
            config["gradient_clipping"] = self.gradient_clipping
        self.hf_ds_config = HfDeepSpeedConfig(config)

    def _deepspeed_config_checks(self) -> None:
        given = os.environ.get("ACCELERATE_CONFIG_DS_FIELDS", "").split(",")
        if any(name in _IGNORED_WITH_FILE for name in given):
            raise ValueError(
                f"When using `deepspeed_config_file`, the following accelerate config variables will be ignored: "
                f"{list(_IGNORED_WITH_FILE)}.\nPlease specify them appropriately in the DeepSpeed config file.\nIf you "
                "are using an accelerate config file, remove others config variables mentioned in the above specified "
                "list.")

    # -- HF's public methods ---------------------------------------------------------------------------------
    def fill_match(self, ds_key_long: str, mismatches: Optional[list] = None, must_match: bool = True,
                   **kwargs: Any) -> None:
        mismatches = [] if mismatches is None else mismatches
        config, ds_key = self.hf_ds_config.find_config_node(ds_key_long)
        if config is None:
            return
        if config.get(ds_key) == "auto":
            if ds_key_long in kwargs:
                config[ds_key] = kwargs[ds_key_long]
                filled = self.__dict__.get("_prepare_fills")
                if filled is not None:  # inside a prepare(): remember it came from "auto" (begin_prepare)
                    filled[ds_key_long] = kwargs[ds_key_long]
                return
            raise ValueError(f"`{ds_key_long}` not found in kwargs. Please specify `{ds_key_long}` without `auto` (set "
                             "to correct value) in the DeepSpeed config file or pass it in kwargs.")
        if not must_match:
            return
        ds_val = config.get(ds_key)
        if ds_val is not None and ds_key_long in kwargs and ds_val != kwargs[ds_key_long]:
            mismatches.append(f"- ds {ds_key_long}={ds_val} vs arg {ds_key_long}={kwargs[ds_key_long]}")

    @contextlib.contextmanager
    def filling_for(self, owner: object) -> Iterator[None]:
        """The "auto" fills of one prepare() call by the Accelerator `owner`. HF keeps the first Accelerator's
        plugin for every later Accelerator, and a value filled from "auto" stays in the JSON: a second Accelerator
        would silently inherit the first one's gradient accumulation steps and batch sizes. Here the values an
        earlier Accelerator's prepare() filled in (and nobody changed since) are "auto" again for a new one; a
        second prepare() of the same Accelerator keeps them, as HF."""
        filled = self.__dict__.setdefault("_auto_filled", {})
        if self.__dict__.get("_fill_owner") is not owner:
            for key, value in filled.items():
                config, ds_key = self.hf_ds_config.find_config_node(key)
                if config is not None and config.get(ds_key) == value:
                    config[ds_key] = "auto"
            filled.clear()
            self.__dict__["_fill_owner"] = owner
        self.__dict__["_prepare_fills"] = filled
        try:
            yield
        finally:
            self.__dict__.pop("_prepare_fills", None)

    def is_auto(self, ds_key_long: str) -> bool:
        val = self.hf_ds_config.get_value(ds_key_long)
        return val is not None and val == "auto"

    def get_value(self, ds_key_long: str, default: Any = None) -> Any:
        return self.hf_ds_config.get_value(ds_key_long, default)

    def deepspeed_config_process(self, prefix: str = "", mismatches: Optional[list] = None,
                                 config: Optional[dict] = None, must_match: bool = True, **kwargs: Any) -> None:
        mismatches = [] if mismatches is None else mismatches
        config = self.deepspeed_config if config is None else config
        for key, value in config.items():
            if isinstance(value, dict):
                self.deepspeed_config_process(prefix=prefix + key + ".", mismatches=mismatches, config=value,
                                              must_match=must_match, **kwargs)
            else:
                self.fill_match(prefix + key, mismatches, must_match=must_match, **kwargs)
        if mismatches and prefix == "":
            raise ValueError("Please correct the following DeepSpeed config values that mismatch kwargs values:\n"
                             + "\n".join(mismatches) + "\nThe easiest method is to set these DeepSpeed config values "
                             "to 'auto'.")

    def set_mixed_precision(self, mixed_precision: str) -> None:
        """HF's rule: fill fp16/bf16 "enabled" from the Accelerator's mixed precision; the other half-precision
        type enabled in the JSON is an error."""
        ds_config = self.deepspeed_config
        kwargs = {"fp16.enabled": mixed_precision == "fp16", "bf16.enabled": mixed_precision in ("bf16", "fp8")}
        if mixed_precision == "fp16" and "fp16" not in ds_config:
            ds_config["fp16"] = {"enabled": True, "auto_cast": True}
        elif mixed_precision in ("bf16", "fp8") and "bf16" not in ds_config:
            ds_config["bf16"] = {"enabled": True}
        if mixed_precision != "no":
            other = "bf16" if mixed_precision == "fp16" else "fp16"
            if str(ds_config.get(other, {}).get("enabled", "False")).lower() == "true":
                raise ValueError(f"`--mixed_precision` arg cannot be set to `{mixed_precision}` when `{other}` is set "
                                 "in the DeepSpeed config file.")
        for dtype in ("fp16", "bf16"):
            ds_config.setdefault(dtype, {"enabled": False})
        self.fill_match("fp16.enabled", must_match=False, **kwargs)
        self.fill_match("bf16.enabled", must_match=False, **kwargs)

    def is_zero3_init_enabled(self) -> bool:
        return self.zero3_init_flag

    @contextlib.contextmanager
    def zero3_init_context_manager(self, enable: bool = False) -> Iterator[None]:
        old = self.zero3_init_flag
        self.zero3_init_flag = enable
        try:
            yield
        finally:
            self.zero3_init_flag = old

    def set_deepspeed_weakref(self) -> None:
        """HF registers the config with transformers so from_pretrained runs under deepspeed.zero.Init; without
        DeepSpeed that would fail, and sharded construction is the engine's (zero3_init_flag): nothing to do."""

    def set_moe_leaf_modules(self, model: Any) -> None:
        """Refused at construction when MoE class names are set (see __post_init__)."""

    def select(self, _from_accelerator_state: bool = False) -> None:
        if not _from_accelerator_state:
            raise ValueError("A `DeepSpeedPlugin` object must be enabled manually by calling "
                             "`AcceleratorState().enable_deepspeed_plugin(plugin_key)`.")
        self._set_selected(True)

    def _unselect(self) -> None:
        self._set_selected(False)

    def _set_selected(self, value: bool) -> None:
        self._selected = value

    @property
    def selected(self) -> bool:
        return self._selected

    @selected.setter
    def selected(self, value: bool) -> None:
        raise NotImplementedError("'enabled' can only be set through calling "
                                  "'AcceleratorState().enable_deepspeed_plugin(key)'.")


class DummyOptim:
    """Stands for the optimizer of the DeepSpeed JSON "optimizer" block (HF's class): prepare() replaces it."""

    def __init__(self, params: Any, lr: float = 0.001, weight_decay: float = 0, **kwargs: Any) -> None:
        self.params = params
        self.lr = lr
        self.weight_decay = weight_decay
        self.kwargs = kwargs


class DummyScheduler:
    """Stands for the scheduler of the DeepSpeed JSON "scheduler" block, or `lr_scheduler_callable(optimizer)`
    (HF's class): prepare() replaces it."""

    def __init__(self, optimizer: Any, total_num_steps: Optional[int] = None, warmup_num_steps: int = 0,
                 lr_scheduler_callable: Optional[Callable] = None, **kwargs: Any) -> None:
        self.optimizer = optimizer
        self.total_num_steps = total_num_steps
        self.warmup_num_steps = warmup_num_steps
        self.lr_scheduler_callable = lr_scheduler_callable
        self.kwargs = kwargs


def get_active_deepspeed_plugin(state: Any) -> Any:
    """The active DeepSpeedPlugin of an AcceleratorState (HF's helper)."""
    from ..base.dataclasses import DistributedType
    if state.distributed_type != DistributedType.DEEPSPEED:
        raise ValueError("Couldn't retrieve the active `DeepSpeedPlugin` as none were enabled. Please make sure that "
                         "either `Accelerator` is configured for `deepspeed` or make sure that the desired "
                         "`DeepSpeedPlugin` has been enabled (`AcceleratorState().select_deepspeed_plugin(name)`) "
                         "before calling this function.")
    return state.deepspeed_plugin
