# accelerate_c/base/megatron_plugin.py: HF 1.15's MegatronLMPlugin face (`accelerate.utils.MegatronLMPlugin`): HF's
# fields, defaults and MEGATRON_LM_* variable fallbacks (the launcher's --megatron_lm_* flags and the
# `megatron_lm_config:` block), without Megatron-LM: the plugin drives accelerate_c's own layout and engines.
# Implemented: tp_degree (the tp dimension), pp_degree (the pp dimension: our pipeline, 1F1B), num_micro_batches
# (the pipeline's micro-batches per batch), sequence_parallelism (Megatron-SP under tp > 1) and
# gradient_clipping (the global-norm clip applied at every optimizer step; 0 = off). Every other field left at a
# value other than HF's default is a NotImplementedError naming it (`unsupported_fields`).
# Not for: the layout built from it (runtime/layout_build.py).
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Callable, Optional

from . import settings

_ENV = "MEGATRON_LM_"
IMPLEMENTED = ("tp_degree", "pp_degree", "num_micro_batches", "sequence_parallelism", "gradient_clipping")
# HF's __post_init__ fallbacks when neither the field nor its MEGATRON_LM_* variable is set: (kind, default)
ENV_DEFAULTS: dict[str, tuple[str, Any]] = {
    "tp_degree": ("int", 1), "pp_degree": ("int", 1), "use_custom_fsdp": ("bool", False),
    "no_load_optim": ("bool", False), "eod_mask_loss": ("bool", False), "no_save_optim": ("bool", False),
    "optimizer_cpu_offload": ("bool", False), "overlap_cpu_optimizer_d2h_h2d": ("bool", False),
    "use_precision_aware_optimizer": ("bool", False), "decoder_last_pipeline_num_layers": ("int", None),
    "num_micro_batches": ("int", 1), "gradient_clipping": ("float", 1.0), "recompute_activations": ("bool", False),
    "use_distributed_optimizer": ("bool", False), "sequence_parallelism": ("bool", False),
    "recompute_granularity": ("str", "full"), "recompute_method": ("str", "uniform"),
    "recompute_num_layers": ("int", 1), "attention_backend": ("bool", True), "expert_model_parallel_size": ("int", 1),
    "context_parallel_size": ("int", 2), "attention_dropout": ("float", 0.0), "hidden_dropout": ("float", 0.0),
    "attention_softmax_in_fp32": ("bool", True), "expert_tensor_parallel_size": ("int", 1),
    "calculate_per_token_loss": ("bool", True), "use_rotary_position_embeddings": ("bool", True),
}
# values besides HF's default that mean "this feature is off", so they are accepted too
_ALSO_OFF: dict[str, tuple] = {"context_parallel_size": (1,)}


def _from_env(name: str, kind: str, default: Any) -> Any:
    var = _ENV + name.upper()
    raw = settings.env_value(var)
    if raw is None:
        return default
    if kind == "bool":
        return settings.hf_bool(var, raw)
    if kind == "int":
        return settings.env_int(var, default=default)
    if kind == "float":
        try:
            return float(raw)
        except ValueError:
            raise settings.SettingError(f"environment variable {var}={raw!r}: allowed: a number") from None
    return raw


@dataclass
class MegatronLMPlugin:
    """HF's Megatron-LM plugin, run on accelerate_c's own engines (no Megatron-LM needed); see the module header
    for what is implemented."""

    tp_degree: int = None  # type: ignore[assignment]
    pp_degree: int = None  # type: ignore[assignment]
    use_custom_fsdp: bool = None  # type: ignore[assignment]
    overlap_cpu_optimizer_d2h_h2d: bool = None  # type: ignore[assignment]
    no_load_optim: bool = None  # type: ignore[assignment]
    eod_mask_loss: bool = None  # type: ignore[assignment]
    no_save_optim: bool = None  # type: ignore[assignment]
    optimizer_cpu_offload: bool = None  # type: ignore[assignment]
    use_precision_aware_optimizer: bool = None  # type: ignore[assignment]
    decoder_last_pipeline_num_layers: int = None  # type: ignore[assignment]
    recompute_granularity: str = None  # type: ignore[assignment]
    recompute_method: str = None  # type: ignore[assignment]
    recompute_num_layers: int = None  # type: ignore[assignment]
    attention_backend: bool = None  # type: ignore[assignment]
    expert_model_parallel_size: int = None  # type: ignore[assignment]
    context_parallel_size: int = None  # type: ignore[assignment]
    attention_dropout: float = None  # type: ignore[assignment]
    hidden_dropout: float = None  # type: ignore[assignment]
    attention_softmax_in_fp32: bool = None  # type: ignore[assignment]
    expert_tensor_parallel_size: int = None  # type: ignore[assignment]
    calculate_per_token_loss: bool = None  # type: ignore[assignment]
    use_rotary_position_embeddings: bool = None  # type: ignore[assignment]
    num_micro_batches: int = None  # type: ignore[assignment]
    gradient_clipping: float = None  # type: ignore[assignment]
    sequence_parallelism: bool = None  # type: ignore[assignment]
    recompute_activations: bool = None  # type: ignore[assignment]
    use_distributed_optimizer: bool = None  # type: ignore[assignment]
    pipeline_model_parallel_split_rank: int = None  # type: ignore[assignment]
    num_layers_per_virtual_pipeline_stage: int = None  # type: ignore[assignment]
    is_train_batch_min: str = True  # type: ignore[assignment]
    train_iters: int = None  # type: ignore[assignment]
    train_samples: int = None  # type: ignore[assignment]
    weight_decay_incr_style: str = "constant"
    start_weight_decay: float = None  # type: ignore[assignment]
    end_weight_decay: float = None  # type: ignore[assignment]
    lr_decay_style: str = "linear"
    lr_decay_iters: int = None  # type: ignore[assignment]
    lr_decay_samples: int = None  # type: ignore[assignment]
    lr_warmup_iters: int = None  # type: ignore[assignment]
    lr_warmup_samples: int = None  # type: ignore[assignment]
    lr_warmup_fraction: float = None  # type: ignore[assignment]
    min_lr: float = 0
    consumed_samples: list[int] = None  # type: ignore[assignment]
    no_wd_decay_cond: Optional[Callable] = None
    scale_lr_cond: Optional[Callable] = None
    lr_mult: float = 1.0
    megatron_dataset_flag: bool = False
    seq_length: int = None  # type: ignore[assignment]
    encoder_seq_length: int = None  # type: ignore[assignment]
    decoder_seq_length: int = None  # type: ignore[assignment]
    tensorboard_dir: str = None  # type: ignore[assignment]
    set_all_logging_options: bool = False
    eval_iters: int = 100
    eval_interval: int = 1000
    return_logits: bool = False
    custom_train_step_class: Optional[Any] = None
    custom_train_step_kwargs: Optional[dict[str, Any]] = None
    custom_model_provider_function: Optional[Callable] = None
    custom_prepare_model_function: Optional[Callable] = None
    custom_megatron_datasets_provider_function: Optional[Callable] = None
    custom_get_batch_function: Optional[Callable] = None
    custom_loss_function: Optional[Callable] = None
    other_megatron_args: Optional[dict[str, Any]] = None

    def __post_init__(self) -> None:
        for name, (kind, default) in ENV_DEFAULTS.items():
            if getattr(self, name) is None:
                setattr(self, name, _from_env(name, kind, default))
        for name in ("tp_degree", "pp_degree", "num_micro_batches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MegatronLMPlugin.{name} must be an integer >= 1, got {value!r}")
        clip = self.gradient_clipping
        if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not math.isfinite(clip) or clip < 0:
            raise ValueError(f"MegatronLMPlugin.gradient_clipping must be a finite number >= 0 (0: no clipping), "
                             f"got {clip!r}")
        self.sequence_parallelism = bool(self.sequence_parallelism)
        bad = self.unsupported_fields()
        if bad:
            lines = [f"MegatronLMPlugin.{name} is not supported by accelerate_c (got {value!r}; leave it at "
                     f"{_default(name)!r})" for name, value in bad]
            raise NotImplementedError("\n".join(lines) + f"\n(accelerate_c implements: {', '.join(IMPLEMENTED)})")

    def unsupported_fields(self) -> list[tuple[str, Any]]:
        """(name, value) of every field outside IMPLEMENTED whose value is not HF's default."""
        out = []
        for f in fields(self):
            if f.name in IMPLEMENTED:
                continue
            value, default = getattr(self, f.name), _default(f.name)
            if value != default and value not in _ALSO_OFF.get(f.name, ()):
                out.append((f.name, value))
        return out

    @property
    def clip_norm(self) -> Optional[float]:
        """The gradient-norm clip to apply at each step (None when gradient_clipping is 0)."""
        return float(self.gradient_clipping) if self.gradient_clipping else None


def _default(name: str) -> Any:
    if name in ENV_DEFAULTS:
        return ENV_DEFAULTS[name][1]
    return next(f.default for f in fields(MegatronLMPlugin) if f.name == name)
