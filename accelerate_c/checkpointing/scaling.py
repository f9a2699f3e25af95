# accelerate_c/checkpointing/scaling.py: the fp8 scaling state (FP8Linear amax histories, fp8.scaling_state) in
# save_state / load_state, so a run resumed under delayed scaling quantises exactly as the uninterrupted one.
# One state file per rank, `fp8_states_{rank}.json` (a list: one {layer name: {"x", "w", "g": [amax, ...]}} per
# prepared model), written beside random_states_{rank} and published with the rest of the checkpoint. Not in the
# model's state dict (Transformer Engine's `_extra_state`): model.safetensors stays a plain tensor file that
# transformers and safetensors load, the universal index holds logical tensors only, and the histories are per
# rank (each rank's own inputs and gradients), not one logical tensor.
# Loading under another world size: rank r reads saved rank r % saved_world. A checkpoint without fp8 state
# (older, or from a run without fp8): every history is emptied (the first casts use current scaling, as a fresh
# fp8 run's do) and, under delayed scaling, the main process warns.
# Not for: the histories themselves (fp8.py) or the other per-rank state (session.py).
from __future__ import annotations

import logging
import os
from typing import Any, Optional

from ..precision.fp8 import load_scaling_state, scaling_state, uses_delayed_scaling
from .format import CheckpointError, read_state, write_state

logger = logging.getLogger(__name__)

META_KEY = "fp8_states"   # checkpoint.json: True when every rank wrote fp8_states_{rank}


def _modules(accelerator: Any) -> list:
    return [accelerator.unwrap_model(m, keep_torch_compile=False) for m in accelerator._models]


def save_scaling(accelerator: Any, directory: str, rank: int) -> bool:
    """Writes this rank's fp8 scaling state into directory; False (nothing written) when no model holds FP8Linear.
    Every rank decides alike: the prepared models are the same on every rank."""
    states = [scaling_state(m) for m in _modules(accelerator)]
    if not any(states):
        return False
    write_state(directory, f"fp8_states_{rank}", states, kind="fp8")
    return True


def read_scaling(accelerator: Any, input_dir: str, meta: dict, sizes: Optional[dict] = None) -> Optional[list]:
    """This rank's saved fp8 scaling states (a list, one per model), [] when the checkpoint has none for models that
    have FP8Linear, None when no model here has one (nothing to restore). Reads only: apply_scaling restores."""
    models = _modules(accelerator)
    if not any(scaling_state(m) for m in models):
        return None  # no FP8Linear here: a checkpoint's fp8 state, if any, has nothing to go to
    if not meta.get(META_KEY):
        return []
    saved_world = int(meta.get("world_size") or 1)
    rank = int(accelerator.process_index)
    name = f"fp8_states_{rank % saved_world}"
    if not os.path.isfile(os.path.join(input_dir, name + ".json")):
        raise CheckpointError(f"checkpoint {input_dir} says it holds fp8 scaling state but {name}.json is missing "
                              f"(rank {rank})")
    states = read_state(input_dir, name, kind="fp8", sizes=sizes)
    if not isinstance(states, list) or len(states) < len(models):
        raise CheckpointError(f"checkpoint file {os.path.join(input_dir, name)}.json holds fp8 scaling state for "
                              f"{len(states) if isinstance(states, list) else 'no list of'} model(s), "
                              f"{len(models)} to load")
    return [(name, st) for st in states]


def apply_scaling(accelerator: Any, states: Optional[list], input_dir: str, strict: bool = True) -> None:
    """Restores what read_scaling returned (see the header for other world sizes and older checkpoints)."""
    if states is None:
        return
    models = _modules(accelerator)
    if not states:
        for m in models:
            load_scaling_state(m, None)
        if accelerator.is_main_process and any(uses_delayed_scaling(m) for m in models):
            logger.warning("Checkpoint %s holds no fp8 scaling state (saved without fp8, or by an older "
                           "accelerate_c): the delayed-scaling amax histories start empty, so the first steps "
                           "quantise with current scaling and the run does not resume bit-exactly", input_dir)
        return
    for i, (m, (name, st)) in enumerate(zip(models, states)):
        try:
            missing = load_scaling_state(m, st, strict=strict)
        except ValueError as e:
            raise CheckpointError(f"checkpoint file {os.path.join(input_dir, name)}.json, model {i}: {e}") from None
        if missing and accelerator.is_main_process:
            logger.warning("fp8 scaling state of model %d in %s has no entry for %s (strict=False): their amax "
                           "histories start empty", i, input_dir, missing)
