# accelerate_c/runtime/random.py: seeding and cross-process RNG synchronisation (HF's set_seed,
# synchronize_rng_state(s)). Synchronising means: every process adopts process 0's RNG state.
# Not for: checkpointing RNG states (the Accelerator's save/load_state does that).
from __future__ import annotations

import random
from typing import Optional, Union

import numpy as np
import torch

from ..base.dataclasses import DistributedType, RNGType
from .operations import _broadcast_, _distributed, _state


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed `random`, `numpy` and `torch` (CPU and every CUDA device); `device_specific` adds the process index."""
    if device_specific:
        from .state import AcceleratorState

        seed += AcceleratorState().process_index
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)  # a no-op without CUDA
    if deterministic:
        torch.use_deterministic_algorithms(True)


def _get(rng_type: RNGType, generator: Optional[torch.Generator]) -> torch.Tensor:
    if rng_type == RNGType.TORCH:
        return torch.get_rng_state()
    if rng_type == RNGType.CUDA:
        return torch.cuda.get_rng_state()
    if rng_type == RNGType.GENERATOR:
        assert generator is not None, "Need a generator to synchronize its seed."
        return generator.get_state()
    raise NotImplementedError(f"RNG type {rng_type.value!r} is not supported by accelerate_c")


def _set(rng_type: RNGType, state: torch.Tensor, generator: Optional[torch.Generator]) -> None:
    if rng_type == RNGType.TORCH:
        torch.set_rng_state(state)
    elif rng_type == RNGType.CUDA:
        torch.cuda.set_rng_state(state)
    else:
        generator.set_state(state)


def synchronize_rng_state(rng_type: Optional[Union[str, RNGType]] = None,
                          generator: Optional[torch.Generator] = None) -> None:
    """Make this process's `rng_type` RNG state equal to process 0's."""
    rng_type = RNGType(rng_type)
    state = _get(rng_type, generator)
    st = _state()
    if st.distributed_type == DistributedType.NO or not _distributed():
        _set(rng_type, state, generator)
        return
    if st.distributed_type == DistributedType.MULTI_CPU or st.device.type == "cpu":
        state = _broadcast_(state.clone(), 0)
    else:  # NCCL and friends only move device tensors
        state = _broadcast_(state.to(st.device), 0).cpu()
    _set(rng_type, state, generator)


def synchronize_rng_states(rng_types: list, generator: Optional[torch.Generator] = None) -> None:
    for rng_type in rng_types:
        synchronize_rng_state(RNGType(rng_type), generator=generator)
