# accelerate_c/checkpointing/rng.py: the process's random number generators as a checkpoint stores them (one
# random_states_{rank} file per rank, format.py's encoding): python, numpy, torch and, once CUDA is initialised,
# every CUDA device's generator.
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
    return states


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
