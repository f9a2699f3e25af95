# accelerate_c/tensor_parallel/state.py: what a tensor-parallel model's tensors are in logical terms, for checkpoints
# and gradient clipping. tp_layout: for every sliced tensor of the state dict, the dimension and offset of its block in
# the logical tensor (TPSlice); tensors absent from it are replicated whole on every TP rank. gather_full_state_dict:
# the logical state dict (collective). tensor_slices: the rank's tensors as checkpointing/slices.py TensorSlices
# (contiguous ranges of the row-major logical tensor: one per dimension-0 block, one per row for a dimension-1 block);
# checkpoint_slices adds the replicated tensors whole (checkpointing/layout.py).
# grad_norm / clip_grad_norm_: the global gradient norm over the TP group, counting replicated parameters (whose
# gradients are the same on every TP rank) once and summing the sliced ones' squares over the group. init_rng: the
# random stream of a module holding slices during materialisation (every rank would otherwise draw the same block);
# broadcast_replicated: one TP rank's replicated tensors to the others.
# Not for: data-parallel dimensions (the caller combines this group's norm with its own groups'), the file format.
from __future__ import annotations

import contextlib
import math
import zlib
from typing import Any, Callable, ContextManager, Iterable, Iterator, Optional, Union

import torch
from torch import nn

from ..checkpointing.layout import model_layout, tied_names
from ..checkpointing.slices import TensorSlice
from ..comm.coalesced import broadcast_coalesced
from .apply import TPSlice, tp_state
from .comm import from_blocks


def _named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return model.state_dict(keep_vars=True)


def tp_layout(model: nn.Module) -> dict[str, TPSlice]:
    """{state-dict name: TPSlice} of every tensor this rank holds a block of (tied names listed under each name)."""
    tp_state(model)
    return {k: t._tp_slice for k, t in _named_tensors(model).items() if getattr(t, "_tp_slice", None) is not None}


def gather_full_state_dict(model: nn.Module, group: Optional[Any] = None) -> dict[str, torch.Tensor]:
    """The logical state dict (full shapes), on every rank: each sliced tensor all-gathered over the TP group in state
    dict order (collective: every rank of the group calls it); replicated tensors are returned as they are."""
    comm = tp_state(model).comm
    group = group if group is not None else comm.group
    out: dict[str, torch.Tensor] = {}
    done: dict[int, torch.Tensor] = {}
    for k, t in _named_tensors(model).items():
        spec = getattr(t, "_tp_slice", None)
        if spec is None:
            out[k] = t.detach()
            continue
        if id(t) not in done:
            local = t.detach().contiguous()
            buf = local.new_empty((comm.size, *local.shape))
            group.all_gather(buf.view(-1), local.view(-1))
            done[id(t)] = from_blocks(buf, spec.dim).contiguous()
        out[k] = done[id(t)]
    return out


def tensor_slices(model: nn.Module, owner: bool = True) -> list[TensorSlice]:
    """This rank's blocks of the sliced tensors as TensorSlices of the logical tensors (data: views of the local
    tensor, 1-D). A dimension-0 block is one contiguous range; any other dimension gives one range per row of the
    dimensions before it. `owner`: whether this rank writes them (one rank per TP slice across data-parallel
    replicas). Replicated tensors are not listed: the caller lays them out as whole tensors (layout.py)."""
    out: list[TensorSlice] = []
    for k, t in _named_tensors(model).items():
        spec = getattr(t, "_tp_slice", None)
        if spec is None:
            continue
        local = t.detach()
        if not local.is_contiguous():
            raise ValueError(f"tensor parallelism: {k!r} is not contiguous")
        inner = math.prod(spec.shape[spec.dim + 1:])
        rows = math.prod(spec.shape[:spec.dim])
        width, full_width = spec.length * inner, spec.shape[spec.dim] * inner
        flat = local.reshape(rows, width)
        for r in range(rows):
            out.append(TensorSlice(k, tuple(spec.shape), t.dtype, r * full_width + spec.start * inner, flat[r],
                                   owner=owner))
    return out


def checkpoint_slices(model: nn.Module, rank: int, world: int, owner: bool = True) -> list[TensorSlice]:
    """The model for a universal checkpoint (checkpointing/universal.py model_rank_part, a strategy's model_slices):
    tensor_slices(model, owner) for the TP slices, and the replicated tensors held whole, each written by one of the
    `world` ranks that hold them (`rank` among them; layout.py balances the writers). Tied names are listed, written
    once."""
    sd = _named_tensors(model)
    sliced = {id(t) for t in sd.values() if getattr(t, "_tp_slice", None) is not None}
    whole = {k: t for k, t in sd.items() if id(t) not in sliced}
    return tensor_slices(model, owner) + model_layout(whole, rank, world, unowned=tied_names(whole))


def _grads(parameters: Union[torch.Tensor, Iterable[torch.Tensor]]) -> tuple[list, list]:
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    seen, sliced, whole = set(), [], []
    for p in params:
        if p.grad is None or id(p) in seen:
            continue
        seen.add(id(p))
        (sliced if getattr(p, "_tp_slice", None) is not None else whole).append(p.grad.detach())
    return sliced, whole


def grad_norm(parameters: Union[torch.Tensor, Iterable[torch.Tensor]], group: Any,
              norm_type: float = 2.0) -> torch.Tensor:
    """The norm of the logical model's gradient (collective over the TP `group`: every rank calls it with its own
    parameters in the same order): sliced parameters' contributions are summed (max for inf) over the group,
    replicated parameters counted once. Returns a float32 scalar, the same on every rank."""
    norm_type = float(norm_type)
    sliced, whole = _grads(parameters)
    if norm_type == math.inf:
        part = torch.stack([g.abs().max().float() for g in sliced]).max() if sliced else torch.zeros(())
        part = part.reshape(1).contiguous()
        group.all_reduce(part, "max")
        rest = torch.stack([g.abs().max().float() for g in whole]).max() if whole else torch.zeros(())
        return torch.maximum(part[0], rest)
    def powsum(gs: list) -> torch.Tensor:
        if not gs:
            return torch.zeros((), dtype=torch.float64)
        return torch.stack([torch.linalg.vector_norm(g.float(), norm_type).double() ** norm_type for g in gs]).sum()
    part = powsum(sliced).reshape(1).contiguous()
    group.all_reduce(part, "sum")
    return ((part[0] + powsum(whole)) ** (1.0 / norm_type)).float()


def clip_grad_norm_(parameters: Union[torch.Tensor, Iterable[torch.Tensor]], max_norm: float, group: Any,
                    norm_type: float = 2.0) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ over the logical model (grad_norm above): scales every gradient by
    max_norm / (total + 1e-6) when that is below 1; returns the total norm."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    total = grad_norm(params, group, norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.detach().mul_(coef.to(p.grad.dtype))
    return total


def init_rng(model: nn.Module, seed: Optional[int] = None) -> Callable[[nn.Module], ContextManager]:
    """For sharding.materialize's around_init: a module whose own parameters include TP slices initialises in a random
    stream of its own, seeded from `seed` (default torch.initial_seed(), the same on every rank), this TP rank and the
    module's name, so the ranks draw different blocks (from one shared stream every rank would draw the same block:
    the logical tensor would repeat itself, and the repeated heads or rows would stay equal through training). The
    shared stream is restored afterwards, so replicated tensors initialised elsewhere stay equal across the ranks.
    A module's replicated own parameters (a row-parallel bias) come from that stream too: transformers' init gives
    them constants; otherwise call broadcast_replicated afterwards."""
    rank = tp_state(model).comm.rank
    base = torch.initial_seed() if seed is None else int(seed)
    names = {id(m): n for n, m in model.named_modules()}

    @contextlib.contextmanager
    def around(m: nn.Module) -> Iterator[None]:
        if not any(getattr(p, "_tp_slice", None) is not None for p in m.parameters(recurse=False)):
            yield
            return
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed((base * 1_000_003 + rank * 7919 + zlib.crc32(names.get(id(m), "").encode())) % 2 ** 63)
            yield
    return around


def broadcast_replicated(model: nn.Module, src: int = 0) -> None:
    """Copies TP rank `src`'s replicated parameters and buffers (every tensor that is not a TP slice) into the other
    ranks' (collective over the model's TP group, coalesced)."""
    group = tp_state(model).comm.group
    seen, tensors = set(), []
    for t in _named_tensors(model).values():
        if getattr(t, "_tp_slice", None) is None and id(t) not in seen:
            seen.add(id(t))
            tensors.append(t.detach())
    broadcast_coalesced(tensors, lambda flat: group.broadcast(flat, src))
