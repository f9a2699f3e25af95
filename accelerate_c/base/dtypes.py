# accelerate_c/base/dtypes.py: the one dtype table: the names configs and HF arguments give dtypes ("bf16",
# "float16", ...), the dtypes the C kernels take, and the codes dtypes travel under (safetensors headers, the
# shape/dtype exchange of gather/pad across processes). Every module selects from here.
# Not for: precision policy (which dtype a run computes in: precision/), checks of a tensor's other properties.
from __future__ import annotations

from typing import Iterable, Mapping, Optional

import torch

# name -> dtype, every spelling any config or argument of ours accepts
NAMES: Mapping[str, torch.dtype] = {
    "fp64": torch.float64, "float64": torch.float64, "double": torch.float64,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "bfp16": torch.bfloat16,
    "uint8": torch.uint8, "8bit": torch.uint8,
}

# floating dtypes the C kernels read and write (casts, gradient passes, packing, fused optimizer steps)
C_FLOAT_INPUTS: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
# 16-bit floating dtypes (mixed-precision compute, low-precision optimizer states)
LOW_PRECISION: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)
# a run's mixed_precision mode -> the dtype it computes in (fp8 computes the rest of the model in bf16)
COMPUTE_DTYPE_OF_MODE: Mapping[str, torch.dtype] = {"fp8": torch.bfloat16, "fp16": torch.float16,
                                                    "bf16": torch.bfloat16, "fp32": torch.float32}
# dtypes the collectives reduce
REDUCIBLE: tuple[torch.dtype, ...] = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32,
                                      torch.int64)


def select(names: Iterable[str], extra: Optional[Mapping[str, Optional[torch.dtype]]] = None
           ) -> dict[str, Optional[torch.dtype]]:
    """A map of the given names (each must be in NAMES) to their dtypes, plus extra entries (e.g. "no": None)."""
    out: dict[str, Optional[torch.dtype]] = {n: NAMES[n] for n in names}
    out.update(extra or {})
    return out
