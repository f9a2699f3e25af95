# accelerate_c/runtime/device.py: the one decision of which device a process computes on (PartialState asks it once):
# CUDA when torch sees a GPU (cuda:LOCAL_RANK for a distributed run, HF's index-less "cuda" for a single process),
# MPS on Apple silicon (one process), the CPU with cpu=True / ACCELERATE_USE_CPU or when there is no accelerator.
# Accelerators accelerate_c does not run on (XLA/TPU, NPU, XPU, HPU, MLU, MUSA, SDAA, Neuron) are a clear
# NotImplementedError instead of HF's backend. Also what follows from the device: the process-group backend when
# none is asked for, and whether a prepared data loader pins its host memory.
# Not for: creating the process group or reading rank variables (state.py), placing models or batches (strategies,
# data/).
from __future__ import annotations

from typing import Optional

import torch

from ..base import imports

# torch backend module -> the name HF gives the accelerator, in HF's order of preference
_UNSUPPORTED = (("npu", "NPU (torch_npu)"), ("mlu", "MLU"), ("sdaa", "SDAA"), ("musa", "MUSA"), ("hpu", "HPU (Gaudi)"),
                ("xpu", "XPU (Intel GPU)"), ("neuron", "Neuron"))
_HINT = "pass cpu=True to Accelerator / PartialState (or set ACCELERATE_USE_CPU=1) to run on the CPU instead"


def mps_available() -> bool:
    """torch's MPS backend is built and has a device (HF's is_mps_available)."""
    mps = getattr(torch.backends, "mps", None)
    try:
        return bool(mps is not None and mps.is_available() and mps.is_built())
    except Exception:  # a stub that cannot answer
        return False


def unsupported_accelerator() -> Optional[str]:
    """The name of an accelerator HF would pick on this machine that accelerate_c does not run on, or None."""
    for attr, name in _UNSUPPORTED:
        if getattr(imports, f"is_{attr}_available")():
            return name
    if imports.is_torch_xla_available():
        return "XLA/TPU (torch_xla)"
    return None


def select_device(cpu: bool, local_index: int, distributed: bool) -> torch.device:
    """The device of this process. `local_index`: its rank on this host (cuda:local_index modulo the visible
    GPUs, so several processes may share one GPU); `distributed`: more than one process. CUDA comes first, then
    MPS; with neither, an accelerator we do not support is an error (HF would run on it: silently falling back
    to the CPU would change what the script does), and the CPU otherwise."""
    if cpu:
        return torch.device("cpu")
    if torch.cuda.is_available():
        if not distributed:
            return torch.device("cuda")
        return torch.device("cuda", local_index % max(1, torch.cuda.device_count()))
    if mps_available():
        if distributed:
            raise NotImplementedError("several processes on MPS are not supported (torch.distributed has no MPS "
                                      f"backend, and neither has HF Accelerate): {_HINT}")
        return torch.device("mps")
    other = unsupported_accelerator()
    if other is not None:
        raise NotImplementedError(f"accelerate_c runs on CUDA GPUs, Apple MPS and the CPU; this machine's "
                                  f"accelerator is {other}, which accelerate_c does not support: {_HINT}")
    return torch.device("cpu")


def default_backend(device: torch.device, requested: Optional[str]) -> str:
    """The process-group backend: the one asked for (InitProcessGroupKwargs), except NCCL where there is no GPU
    (HF's kwargs default to nccl: gloo is what works there); NCCL for CUDA devices, gloo otherwise."""
    if requested not in (None, "nccl"):
        return requested
    return "nccl" if device.type == "cuda" else "gloo"


def pin_for_device(device: Optional[torch.device], non_blocking: bool, pin_memory: bool) -> bool:
    """Whether a prepared data loader pins its batches: as the user asked, and also when its batches are copied to a
    CUDA device with non_blocking=True (a copy from pageable memory is staged and waited for, so non_blocking needs
    pinned memory to overlap anything: HF leaves this to the user, who then gets no overlap)."""
    return bool(pin_memory or (non_blocking and device is not None and torch.device(device).type == "cuda"))
