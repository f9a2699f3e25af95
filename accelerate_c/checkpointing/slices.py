# accelerate_c/checkpointing/slices.py: the contract between strategies and universal checkpoints. A strategy
# describes the model and optimizer state this rank holds as TensorSlices of *logical* tensors (full name, full
# unpadded shape, a contiguous range of the row-major flattened tensor); the checkpoint writer stores the slices
# each rank owns (every rank in parallel), the loader fills each rank's slices from whatever ranges the
# checkpoint holds, whatever strategy and world size wrote it.
# Logical names: a model entry is its state_dict key ("layers.0.weight"); an optimizer state tensor of a
# parameter's size is "<param name>/<state key>" ("layers.0.weight/exp_avg"). The optimizer side is described by
# ParamSlots (where each optimizer parameter lies in the logical model), because optimizer state may not exist
# yet when a checkpoint is loaded: the loader builds the state dict from the slots and calls load_state_dict.
# Not for: the file format (format.py, session.py), which rank writes a tensor held whole (layout.py) or any strategy's
# holdings (strategies/).
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class TensorSlice:
    """Elements [start, start + data.numel()) of the logical tensor `name` of shape `shape`, held by this rank.
    `data` is a 1-D view of the rank's own memory: the writer reads it, the loader copies into it.
    `owner`: True when this rank is the one that writes this slice (a tensor every rank holds whole, such as a
    replicated buffer, is written once; the strategy chooses the owner so ranks share the writing).
    `alias`: another name of the same logical tensor (a weight tied to it, held apart, e.g. on another pipeline
    stage): the slice is stored as, and loaded from, that tensor (None: the memory tells, as for tied names held in
    one module)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    start: int
    data: torch.Tensor
    owner: bool = True
    alias: Optional[str] = None

    @property
    def numel(self) -> int:
        return self.data.numel()


@dataclass
class ParamSlot:
    """Optimizer parameter `index` (flattened param_groups order, the key of its state dict entry) is elements
    [start, start + numel) of the logical parameter `name` of shape `shape`; the optimizer holds it as a tensor of
    shape `local_shape` (the logical shape when whole, 1-D when it is a shard's piece). `owner` as in
    TensorSlice."""

    index: int
    name: str
    shape: tuple[int, ...]
    start: int
    numel: int
    local_shape: tuple[int, ...]
    owner: bool = True
    # several ranges instead of [start, start + numel): ((logical start, count), ...) in the local tensor's order
    # (a tensor-parallel block of a dimension other than 0 is one range per row of the dimensions before it)
    segments: Optional[tuple[tuple[int, int], ...]] = None

    def ranges(self) -> list[tuple[int, int]]:
        """The (start, count) ranges of the logical tensor the slot holds, in the local tensor's order."""
        return list(self.segments) if self.segments is not None else [(self.start, self.numel)]
