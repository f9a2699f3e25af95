# accelerate_c/base/dataclasses.py: the configuration dataclasses and enums of the public API, under
# HF Accelerate's names and with its fields and defaults (so scripts written for HF run unchanged).
# HF's MegatronLMPlugin and the parallel handlers live in megatron_plugin.py / parallel_handlers.py and are named
# here too (HF's `accelerate.utils.dataclasses` path).
# Not for: kwargs handlers (utils/kwargs_handlers.py) or behaviour; these are plain data.
from __future__ import annotations

import copy
import enum
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from .megatron_plugin import MegatronLMPlugin  # noqa: F401  (HF's import path: accelerate.utils.dataclasses)
from .parallel_handlers import (DeepSpeedSequenceParallelConfig, TorchContextParallelConfig,  # noqa: F401
                                TorchTensorParallelConfig, TorchTensorParallelPlugin)
from .settings import hf_bool


class _Contains(enum.EnumMeta):
    """`"tensorboard" in LoggerType` works on values, as in HF."""

    def __contains__(cls, item: Any) -> bool:
        try:
            cls(item)
        except ValueError:
            return False
        return True


class BaseEnum(enum.Enum, metaclass=_Contains):
    """str(member) is its value; list() gives every value (HF's BaseEnum)."""

    def __str__(self) -> str:
        return str(self.value)

    @classmethod
    def list(cls) -> list[str]:
        return [str(m) for m in cls]


class DistributedType(str, enum.Enum):
    """The kind of distributed environment (HF's values; str so it serialises as JSON)."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_XPU = "MULTI_XPU"
    DEEPSPEED = "DEEPSPEED"
    FSDP = "FSDP"
    XLA = "XLA"
    MEGATRON_LM = "MEGATRON_LM"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"


class PrecisionType(str, enum.Enum):
    NO = "no"
    FP8 = "fp8"
    FP16 = "fp16"
    BF16 = "bf16"

    @classmethod
    def list(cls) -> list[str]:
        return [m.value for m in cls]


class RNGType(str, enum.Enum):
    TORCH = "torch"
    CUDA = "cuda"
    MLU = "mlu"
    SDAA = "sdaa"
    MUSA = "musa"
    NPU = "npu"
    XLA = "xla"
    XPU = "xpu"
    HPU = "hpu"
    GENERATOR = "generator"


class LoggerType(BaseEnum):
    """Experiment trackers `log_with` accepts (HF's values); "all" means every installed one."""

    ALL = "all"
    AIM = "aim"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    TRACKIO = "trackio"
    COMETML = "comet_ml"
    MLFLOW = "mlflow"
    CLEARML = "clearml"
    DVCLIVE = "dvclive"
    SWANLAB = "swanlab"
    JSONL = "jsonl"  # accelerate_c: a JSON-lines file per run, needs no package


class DynamoBackend(str, BaseEnum):
    """torch.compile backends under HF's names (the lower-cased value is what torch.compile takes)."""

    NO = "NO"
    EAGER = "EAGER"
    AOT_EAGER = "AOT_EAGER"
    INDUCTOR = "INDUCTOR"
    AOT_TS_NVFUSER = "AOT_TS_NVFUSER"
    NVPRIMS_NVFUSER = "NVPRIMS_NVFUSER"
    CUDAGRAPHS = "CUDAGRAPHS"
    OFI = "OFI"
    FX2TRT = "FX2TRT"
    ONNXRT = "ONNXRT"
    TENSORRT = "TENSORRT"
    AOT_TORCHXLA_TRACE_ONCE = "AOT_TORCHXLA_TRACE_ONCE"
    TORCHXLA_TRACE_ONCE = "TORCHXLA_TRACE_ONCE"
    TVM = "TVM"
    HPU_BACKEND = "HPU_BACKEND"
    NEURON = "NEURON"


class FP8BackendType(str, enum.Enum):
    """Which fp8 implementation HF would use (`Accelerator.fp8_backend`). accelerate_c's own fp8 path is
    none of TE/MSAMP/AO: it reports the backend named in FP8RecipeKwargs or ACCELERATE_FP8_BACKEND, else NO."""

    NO = "NO"
    TE = "TE"
    MSAMP = "MSAMP"
    AO = "AO"


class SaveMode(str, enum.Enum):  # kept for callers that compare against it
    DEFAULT = "default"


class KwargsHandler:
    """Mixin giving a dataclass `to_dict()` and `to_kwargs()` (the fields that differ from the defaults)."""

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self.__dict__)

    def to_kwargs(self) -> dict[str, Any]:
        default = self.__class__().to_dict()
        return {k: v for k, v in self.to_dict().items() if default.get(k) != v}


@dataclass
class DataLoaderConfiguration:
    """How prepared dataloaders shard, dispatch and pad batches (HF's fields and defaults)."""

    split_batches: bool = False
    dispatch_batches: Optional[bool] = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: Optional[int] = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False


@dataclass
class ProjectConfiguration:
    """Where logs and checkpoints go, and the automatic checkpoint naming policy."""

    project_dir: Optional[str] = None
    logging_dir: Optional[str] = None
    automatic_checkpoint_naming: bool = False
    total_limit: Optional[int] = None
    iteration: int = 0
    save_on_each_node: bool = False

    def set_directories(self, project_dir: Optional[str] = None) -> None:
        self.project_dir = project_dir
        if self.logging_dir is None:
            self.logging_dir = project_dir

    def __post_init__(self) -> None:
        self.set_directories(self.project_dir)


@dataclass
class GradientAccumulationPlugin(KwargsHandler):
    """Gradient accumulation options (exclusive with Accelerator(gradient_accumulation_steps=...))."""

    num_steps: Optional[int] = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False


@dataclass
class TorchDynamoPlugin(KwargsHandler):
    """torch.compile options for prepared models. Fields left as None are read from HF's environment variables
    (ACCELERATE_DYNAMO_BACKEND | MODE | USE_FULLGRAPH | USE_DYNAMIC | USE_REGIONAL_COMPILATION), then default to
    backend "no" (no compilation), mode "default", fullgraph False, dynamic None, regional compilation off."""

    backend: Any = None
    mode: Optional[str] = None
    fullgraph: Optional[bool] = None
    dynamic: Optional[bool] = None
    options: Any = None
    disable: bool = False
    use_regional_compilation: Optional[bool] = None

    def __post_init__(self) -> None:
        env = os.environ.get
        backend = self.backend if self.backend is not None else env("ACCELERATE_DYNAMO_BACKEND", "no")
        try:
            self.backend = DynamoBackend(str(backend.value if isinstance(backend, enum.Enum) else backend).upper())
        except ValueError:
            raise ValueError(f"TorchDynamoPlugin: unknown dynamo backend {backend!r}; allowed (any case): "
                             f"{', '.join(b.value.lower() for b in DynamoBackend)}") from None
        if self.mode is None:
            self.mode = env("ACCELERATE_DYNAMO_MODE", "default")
        if self.fullgraph is None:
            self.fullgraph = hf_bool("ACCELERATE_DYNAMO_USE_FULLGRAPH", env("ACCELERATE_DYNAMO_USE_FULLGRAPH", "False"))
        if self.use_regional_compilation is None:
            self.use_regional_compilation = hf_bool("ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION",
                                                    env("ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION", "False"))
        if self.dynamic is None and env("ACCELERATE_DYNAMO_USE_DYNAMIC") is not None:
            self.dynamic = hf_bool("ACCELERATE_DYNAMO_USE_DYNAMIC", env("ACCELERATE_DYNAMO_USE_DYNAMIC"))

    def to_dict(self) -> dict[str, Any]:
        d = copy.deepcopy(self.__dict__)
        d["backend"] = d["backend"].value.lower()
        return d

    def to_kwargs(self) -> dict[str, Any]:
        """torch.compile keyword arguments: the fields that differ from the defaults an empty environment
        gives (HF compares against a plugin built under `clear_environment()`; same result, no env juggling)."""
        defaults = {"backend": "no", "mode": "default", "fullgraph": False, "dynamic": None, "options": None,
                    "disable": False}
        return {k: v for k, v in self.to_dict().items() if k in defaults and defaults[k] != v}


def get_module_class_from_name(module: Any, name: str) -> Any:
    """The class named `name` of `module` or of its first descendant (depth first) that has it; None if none."""
    if module.__class__.__name__ == name:
        return module.__class__
    for child in module.children():
        found = get_module_class_from_name(child, name)
        if found is not None:
            return found
    return None
