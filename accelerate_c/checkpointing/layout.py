# accelerate_c/checkpointing/layout.py: the checkpoint layout of one rank (slices.py's TensorSlices and ParamSlots)
# from what its strategy holds. The strategy supplies the facts: its model's tensors (held whole, or as pieces it
# cut itself: a TensorSlice / ParamSlot) and its optimizer's parameters; this module gives every tensor held whole
# one writing rank (balanced_owners: ranks take turns by size, so they write in parallel) and builds the slices.
# The whole-tensor layout (every rank holds every tensor whole: one process, DDP, DeepSpeed stage 0) is
# whole_model_slices / whole_optimizer_layout; `strategy_of` gives an accelerator without a strategy (HF's
# Accelerator, a test double) that layout for its rank and world size (WholeTensors).
# Not for: what a strategy holds (strategies/), the files (universal.py, pieces.py).
from __future__ import annotations

from typing import Any, Collection, Mapping, Optional, Sequence, Union

import torch

from ..runtime.models import extract_model_from_parallel
from .slices import ParamSlot, TensorSlice


def balanced_owners(sizes: Mapping[str, int], world: int) -> dict[str, int]:
    """Assigns each named tensor to one rank, largest first to the least loaded rank (ties: lowest rank), so
    that ranks write about the same number of bytes. Deterministic: every rank computes the same answer."""
    load = [0] * max(world, 1)
    owner: dict[str, int] = {}
    for name in sorted(sizes, key=lambda k: (-sizes[k], k)):
        r = min(range(len(load)), key=lambda i: (load[i], i))
        owner[name] = r
        load[r] += sizes[name]
    return owner


def tied_names(state_dict: Mapping[str, torch.Tensor]) -> set[str]:
    """The later names of tied tensors (the same memory, shape, strides and dtype under a second name)."""
    first: dict[tuple, str] = {}
    tied = set()
    for k, t in state_dict.items():
        key = (t.device, t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype) if t.numel() else None
        if key is not None and key in first:
            tied.add(k)
        elif key is not None:
            first[key] = k
    return tied


def model_layout(held: Mapping[str, Union[torch.Tensor, TensorSlice]], rank: int, world: int,
                 unowned: Collection[str] = ()) -> list[TensorSlice]:
    """The model's logical tensors in `held`'s order: a TensorSlice the strategy cut is kept as it is; a tensor held
    whole becomes a whole slice written by one rank (balanced over the whole tensors but `unowned`, which are
    listed and written by none). Buffers held whole are rank 0's: replicas' buffers (BatchNorm statistics) drift
    apart between ranks, and rank 0's are the ones DDP broadcasts before the next forward and HF saves. A
    non-contiguous tensor is flattened into a copy: written correctly, loaded via load_state_dict."""
    whole = {k: t for k, t in held.items() if not isinstance(t, TensorSlice)}
    buffers = {k for k, t in whole.items() if not isinstance(t, torch.nn.Parameter)}
    owners = balanced_owners({k: t.numel() * t.element_size() for k, t in whole.items()
                              if k not in unowned and k not in buffers}, world)
    owners.update({k: 0 for k in buffers if k not in unowned})
    return [t if isinstance(t, TensorSlice) else
            TensorSlice(k, tuple(t.shape), t.dtype, 0, t.detach().reshape(-1), owner=owners.get(k) == rank)
            for k, t in held.items()]


def optimizer_slots(params: Sequence[torch.Tensor], held: Sequence[Union[str, ParamSlot]], rank: int,
                    world: int) -> list[ParamSlot]:
    """The optimizer's parameters (flattened param_groups order) as ParamSlots: held[i] is the slot the strategy
    cut for params[i] (a piece), or the logical name of a parameter held whole, which gets a whole slot written by
    one rank (balanced over the whole ones)."""
    owners = balanced_owners({h: p.numel() * p.element_size() for p, h in zip(params, held) if isinstance(h, str)},
                             world)
    return [h if isinstance(h, ParamSlot) else
            ParamSlot(i, h, tuple(p.shape), 0, p.numel(), tuple(p.shape), owner=owners[h] == rank)
            for i, (p, h) in enumerate(zip(params, held))]


def whole_model_slices(model: torch.nn.Module, rank: int, world: int) -> list[TensorSlice]:
    """Every tensor of the model whole, written by one rank each. Tied names (the same memory under a second name)
    are listed but owned by no rank: the checkpoint stores them once."""
    sd = extract_model_from_parallel(model).state_dict(keep_vars=True)
    return model_layout(sd, rank, world, unowned=tied_names(sd))


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters of a (possibly wrapped) optimizer in flattened param_groups order: a ParamSlot's index."""
    inner = getattr(optimizer, "optimizer", optimizer)
    return [p for g in inner.param_groups for p in g["params"]]


def whole_param_slots(optimizer: torch.optim.Optimizer, module: torch.nn.Module, rank: int, world: int,
                      where: str = "the model being checkpointed") -> list[ParamSlot]:
    """The optimizer's parameters, each held whole, as ParamSlots named by `module`'s parameter names (a tied
    parameter by its first name) and written by one of the `world` ranks each. A parameter `module` does not hold
    is a ValueError naming its positions and `where`."""
    names: dict[int, str] = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), n)
    params = optimizer_params(optimizer)
    missing = [i for i, p in enumerate(params) if id(p) not in names]
    if missing:
        raise ValueError(f"optimizer parameter(s) {missing} are not parameters of {where}")
    return optimizer_slots(params, [names[id(p)] for p in params], rank, world)


def whole_optimizer_layout(optimizer: torch.optim.Optimizer, model: torch.nn.Module, rank: int,
                           world: int) -> list[ParamSlot]:
    """Every optimizer parameter whole, written by one rank each; a tied parameter is named by its first name, as
    in whole_model_slices."""
    return whole_param_slots(optimizer, extract_model_from_parallel(model), rank, world)


class WholeTensors:
    """The layout of an accelerator without a strategy: every tensor whole (the base Strategy's answers with no
    kwargs handlers)."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world

    def model_slices(self, model: torch.nn.Module) -> list[TensorSlice]:
        return whole_model_slices(model, self.rank, self.world)

    def optimizer_layout(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> list[ParamSlot]:
        return whole_optimizer_layout(optimizer, model, self.rank, self.world)

    def optimizer_model(self, optimizer: torch.optim.Optimizer) -> Optional[torch.nn.Module]:
        return None

    def slices_loaded(self, model: torch.nn.Module) -> None:
        """Nothing derives from whole tensors."""

    def saved_weights_dtype(self) -> Optional[torch.dtype]:
        return None

    def hooks_get_no_weights(self) -> bool:
        return False


def strategy_of(accelerator: Any) -> Any:
    """The accelerator's strategy (the owner of model_slices / optimizer_layout); an object without one gets the
    whole-tensor layout for its rank and world size."""
    strategy = getattr(accelerator, "strategy", None)
    if strategy is not None and hasattr(strategy, "model_slices"):
        return strategy
    return WholeTensors(int(accelerator.process_index), int(accelerator.num_processes))
