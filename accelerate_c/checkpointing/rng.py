# accelerate_c/checkpointing/rng.py: the process's random number generators as a checkpoint stores them (one
# random_states_{rank} file per rank, format.py's encoding): python, numpy, torch and the device generators: once
# CUDA is initialised, every visible CUDA device's ("cuda", a list by device index: HF saves them all too); once MPS
# has been used, its one generator ("mps"). A state saved on a device this process does not have is left alone on
# load (a GPU checkpoint resumes on the CPU with the host generators restored); a device generator with no saved
# state keeps its own.
# Not for: seeding or synchronising generators across ranks (runtime/random.py).
from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)


def rng_state() -> dict:
    states: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                              "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    if _mps_in_use():
        states["mps"] = torch.mps.get_rng_state()
    return states


def _mps_in_use() -> bool:
    """MPS is this process's device (asking torch.mps for a state elsewhere raises or initialises it)."""
    from ..runtime.device import mps_available
    return mps_available() and hasattr(torch, "mps")


def set_rng_state(states: dict) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        cuda = states["cuda"]
        n = torch.cuda.device_count()
        if len(cuda) != n:
            logger.warning("CUDA RNG saved for %d devices, %d visible: restoring the first %d",
                           len(cuda), n, min(n, len(cuda)))
        for i in range(min(n, len(cuda))):
            torch.cuda.set_rng_state(cuda[i], i)
    if "mps" in states and _mps_in_use():
        torch.mps.set_rng_state(states["mps"])
