# accelerate_c/base/imports.py: HF Accelerate's `is_*_available` probes that scripts import
# (`from accelerate.utils import is_tensorboard_available, is_bf16_available, ...`), one table of optional
# packages plus the device probes, and `is_torch_version` / `compare_versions` / `str_to_bool`.
# A package counts as available when it can be found and has installed metadata (a stray folder of the same
# name does not count). Nothing here imports the optional package itself.
# Not for: choosing code paths inside accelerate_c beyond "is it installed" (the callers decide).
from __future__ import annotations

import importlib.metadata
import importlib.util
import operator
from functools import lru_cache
from typing import Callable, Optional

from packaging.version import Version

from .settings import FALSE_WORDS, TRUE_WORDS

_OPS = {">": operator.gt, ">=": operator.ge, "==": operator.eq, "!=": operator.ne, "<=": operator.le, "<": operator.lt}


@lru_cache(maxsize=None)
def is_package_available(module: str, metadata_name: Optional[str] = None) -> bool:
    """`module` can be imported and its distribution (`metadata_name`, default `module`) is installed."""
    try:
        if importlib.util.find_spec(module) is None:
            return False
    except (ImportError, ValueError):
        return False
    try:
        importlib.metadata.metadata(metadata_name or module)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def str_to_bool(value: str, to_bool: bool = False) -> int | bool:
    """1 for y/yes/t/true/on/1, 0 for n/no/f/false/off/0 (case-insensitive; True / False with `to_bool`);
    anything else is a ValueError."""
    v = str(value).lower()
    if v in TRUE_WORDS:
        return True if to_bool else 1
    if v in FALSE_WORDS:
        return False if to_bool else 0
    raise ValueError(f"invalid truth value {value!r}")


def compare_versions(library_or_version: str | Version, operation: str, requirement_version: str) -> bool:
    """`library_or_version` (an installed distribution's name, or a version) `operation` `requirement_version`."""
    if operation not in _OPS:
        raise ValueError(f"`operation` must be one of {list(_OPS)}, received {operation!r}")
    if isinstance(library_or_version, str):
        try:
            library_or_version = Version(importlib.metadata.version(library_or_version))
        except importlib.metadata.PackageNotFoundError:
            library_or_version = Version(library_or_version)
    return _OPS[operation](library_or_version, Version(requirement_version))


def is_torch_version(operation: str, version: str) -> bool:
    import torch

    return compare_versions(Version(Version(torch.__version__).base_version), operation, version)


# name in `is_<name>_available` -> (module to find, distribution name when it differs)
_PACKAGES: dict[str, tuple[str, Optional[str]]] = {
    "aim": ("aim", None), "bnb": ("bitsandbytes", None), "boto3": ("boto3", None), "clearml": ("clearml", None),
    "comet_ml": ("comet_ml", None), "datasets": ("datasets", None), "deepspeed": ("deepspeed", None),
    "dvclive": ("dvclive", None), "lomo": ("lomo_optim", "lomo-optim"), "matplotlib": ("matplotlib", None),
    "megatron_lm": ("megatron", "megatron-core"), "mlflow": ("mlflow", None), "msamp": ("msamp", None),
    "numpy": ("numpy", None), "pandas": ("pandas", None), "peft": ("peft", None),
    "pynvml": ("pynvml", "nvidia-ml-py"), "pytest": ("pytest", None), "rich": ("rich", None),
    "safetensors": ("safetensors", None), "sagemaker": ("sagemaker", None), "schedulefree": ("schedulefree", None),
    "swanlab": ("swanlab", None), "tensorboard": ("tensorboard", None), "timm": ("timm", None),
    "torchao": ("torchao", None), "torchdata": ("torchdata", None), "torchvision": ("torchvision", None),
    "tqdm": ("tqdm", None), "trackio": ("trackio", None),
    "transformer_engine": ("transformer_engine", "transformer-engine"),
    "transformers": ("transformers", None), "triton": ("triton", None), "wandb": ("wandb", None),
    "import_timer": ("import_timer", None), "amdsmi": ("amdsmi", None),
}


def _package_probe(name: str, module: str, dist: Optional[str]) -> Callable[[], bool]:
    def probe(min_version: Optional[str] = None) -> bool:
        if not is_package_available(module, dist):
            return False
        return min_version is None or compare_versions(dist or module, ">=", min_version)

    probe.__name__ = probe.__qualname__ = f"is_{name}_available"
    probe.__doc__ = f"True when the `{dist or module}` package is installed (at `min_version` or later, if given)."
    return probe


for _name, (_module, _dist) in _PACKAGES.items():
    globals()[f"is_{_name}_available"] = _package_probe(_name, _module, _dist)


def is_tensorboard_available() -> bool:  # noqa: F811 - torch's SummaryWriter is enough, as in HF
    return is_package_available("tensorboard") or is_package_available("tensorboardX")


def is_bitsandbytes_available() -> bool:
    return is_package_available("bitsandbytes")


def is_4bit_bnb_available() -> bool:
    return is_package_available("bitsandbytes") and compare_versions("bitsandbytes", ">=", "0.39.0")


def is_8bit_bnb_available() -> bool:
    return is_package_available("bitsandbytes") and compare_versions("bitsandbytes", ">=", "0.37.2")


def is_bitsandbytes_multi_backend_available() -> bool:
    if not is_package_available("bitsandbytes"):
        return False
    import bitsandbytes

    return "multi_backend" in getattr(bitsandbytes, "features", set())


def is_transformer_engine_mxfp8_available() -> bool:
    if not is_package_available("transformer_engine", "transformer-engine"):
        return False
    from transformer_engine.pytorch.fp8 import check_mxfp8_support

    return bool(check_mxfp8_support()[0])


def is_xccl_available() -> bool:
    """torch's XCCL (Intel GPU) process-group backend is built in."""
    import torch.distributed as dist

    probe = getattr(dist.distributed_c10d, "is_xccl_available", None)
    return bool(probe and probe())


def is_habana_gaudi1() -> bool:
    """A first-generation Gaudi HPU (HF's probe; False without Habana's torch package)."""
    if not is_package_available("habana_frameworks"):
        return False
    import habana_frameworks.torch.utils.experimental as htexp

    return htexp._get_device_type() == htexp.synDeviceType.synDeviceGaudi


def is_torchdata_stateful_dataloader_available() -> bool:
    if not is_package_available("torchdata"):
        return False
    return compare_versions("torchdata", ">=", "0.8.0")


# ---- devices --------------------------------------------------------------------------------------------------
def is_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def is_rocm_available() -> bool:
    """A CUDA device that torch reaches through ROCm (HIP)."""
    import torch

    return torch.version.hip is not None and torch.cuda.is_available()


def _torch_backend(name: str) -> Callable[[], bool]:
    def probe(check_device: bool = False, init_hccl: bool = False) -> bool:  # (init_hccl: HF's hpu keyword)
        import torch

        mod = getattr(torch, name, None)
        try:
            return bool(mod is not None and mod.is_available())
        except Exception:  # a backend stub that cannot answer
            return False

    probe.__name__ = probe.__qualname__ = f"is_{name}_available"
    return probe


is_xpu_available = _torch_backend("xpu")
is_npu_available = _torch_backend("npu")
is_mlu_available = _torch_backend("mlu")
is_musa_available = _torch_backend("musa")
is_sdaa_available = _torch_backend("sdaa")
is_hpu_available = _torch_backend("hpu")
is_neuron_available = _torch_backend("neuron")


def is_mps_available(min_version: str = "1.12") -> bool:
    import torch

    return bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())


def is_torch_xla_available(check_is_tpu: bool = False, check_is_gpu: bool = False) -> bool:
    return is_package_available("torch_xla")


def is_bf16_available(ignore_tpu: bool = False) -> bool:
    """bf16 autocast works here: always on CPU; on CUDA when the device supports it."""
    if is_cuda_available():
        import torch

        return torch.cuda.is_bf16_supported()
    return True


def is_fp16_available() -> bool:
    return True


def is_fp8_available() -> bool:
    """accelerate_c's own fp8 path (accelerate_c/fp8.py) needs no extra package."""
    return True


def is_torch_distributed_available() -> bool:
    import torch.distributed as dist

    return dist.is_available()


def is_pippy_available() -> bool:
    """torch.distributed.pipelining, which prepare_pippy uses (HF's answer: torch >= 2.4)."""
    return is_torch_version(">=", "2.4.0")


def is_weights_only_available() -> bool:
    return is_torch_version(">=", "2.4.0")


__all__ = sorted(n for n in globals() if n.startswith("is_")) + ["compare_versions", "str_to_bool"]
