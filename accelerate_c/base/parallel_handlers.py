# accelerate_c/base/parallel_handlers.py: HF 1.15's per-dimension handler dataclasses of a ParallelismConfig
# (TorchTensorParallelConfig, TorchContextParallelConfig, DeepSpeedSequenceParallelConfig) and the deprecated
# TorchTensorParallelPlugin (the Accelerator's `torch_tp_plugin`), with HF's fields, PARALLELISM_CONFIG_* variable
# fallbacks and error texts. HF's torch/transformers version checks are left out: accelerate_c's tensor parallelism
# is its own (no DTensor), and context / Ulysses sequence parallelism are refused when the layout is built.
# Not for: the sizes and their validation (parallelism_config.py) or the layout (runtime/layout.py).
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

from . import settings

_ENV = "PARALLELISM_CONFIG_"
SP_ATTN_BUILTIN = ("flash_attention_2", "flash_attention_3", "sdpa")


@dataclass
class TorchTensorParallelConfig:
    """Settings of the tensor-parallel dimension (HF's face; `enable_async_tp` is not supported, as in HF)."""

    enable_async_tp: bool = False

    def __post_init__(self) -> None:
        if self.enable_async_tp:
            warnings.warn("Async tensor parallelism is currently not supported, ignoring this option.")


@dataclass
class TorchContextParallelConfig:
    """Settings of the context-parallel dimension (HF's face; context parallelism itself is not implemented)."""

    cp_comm_strategy: Optional[str] = field(default=None, metadata={"help": "allgather | alltoall"})

    def __post_init__(self) -> None:
        if self.cp_comm_strategy is None:
            self.cp_comm_strategy = settings.env_value(_ENV + "CP_COMM_STRATEGY", "allgather")
        if self.cp_comm_strategy not in ["allgather", "alltoall"]:
            raise ValueError(f"Invalid cp_comm_strategy: {self.cp_comm_strategy}. Must be one of 'allgather' or "
                             "'alltoall'.")


@dataclass
class DeepSpeedSequenceParallelConfig:
    """Settings of HF's DeepSpeed (ALST/Ulysses) sequence-parallel dimension (HF's face; not implemented)."""

    sp_seq_length: Optional[int] = None
    sp_seq_length_is_variable: Optional[bool] = None
    sp_attn_implementation: Optional[str] = None

    def __post_init__(self) -> None:
        if self.sp_seq_length_is_variable is None:
            raw = settings.env_value(_ENV + "SP_SEQ_LENGTH_IS_VARIABLE", "true")
            self.sp_seq_length_is_variable = str(raw).lower() == "true"
        if not self.sp_seq_length_is_variable and self.sp_seq_length is None:
            raw = settings.env_value(_ENV + "SP_SEQ_LENGTH")
            if raw is None:
                raise ValueError("when `sp_seq_length_is_variable` is `False` `sp_seq_length` must be provided either "
                                 "through the constructor or the environment variable PARALLELISM_CONFIG_SP_SEQ_LENGTH")
            self.sp_seq_length = None if raw == "None" else settings.env_int(_ENV + "SP_SEQ_LENGTH")
        if self.sp_attn_implementation is None:
            self.sp_attn_implementation = settings.env_value(_ENV + "SP_ATTN_IMPLEMENTATION")
        impl = self.sp_attn_implementation
        if impl is None:
            return
        if impl in ("eager", "flex_attention"):
            raise ValueError(f"Invalid sp_attn_implementation: {impl}. 'eager' and 'flex_attention' are not supported "
                             "with sequence parallelism.")
        if impl not in SP_ATTN_BUILTIN and ("/" not in impl or "flash-attn" not in impl):
            raise ValueError(f"Invalid sp_attn_implementation: {impl}. Must be one of {list(SP_ATTN_BUILTIN)} or a "
                             "hub-hosted flash attention kernel (e.g. 'kernels-community/flash-attn2').")


@dataclass
class TorchTensorParallelPlugin:
    """HF's deprecated `torch_tp_plugin`: the Accelerator turns it into ParallelismConfig(tp_size=tp_size)."""

    tp_size: int = field(default=1, metadata={"help": "tensor parallel size"})
    torch_device_mesh: Optional[Any] = field(default=None)
