# accelerate_c/comm/collectives.py: the collectives under runtime/operations.py (HF's gather, reduce, broadcast,
# gather_object, broadcast_object_list): ONE function per collective, each picking accelerate_c.comm's group
# (C shared memory within a host) for CPU tensors and torch.distributed otherwise (non-CPU tensors, or
# ACCELERATE_C_COMM=torch, under which get_group() is a TorchGroup). They are everyday calls (a metric per
# step), so the fast path is a handful of attribute reads and one C call.
# Not for: HF's semantics around them (nested structures, debug checks: operations.py) or the groups
# themselves (group.py, shm.py).
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from accelerate_c.base.dtypes import REDUCIBLE
from accelerate_c.comm import outbuf
from accelerate_c.comm.group import TorchGroup, get_group

_REDUCE_DTYPES = REDUCIBLE


def group_for(tensor: torch.Tensor) -> Optional[Any]:
    """The comm group for a CPU tensor (comm.group_for_device's choice), or None: torch.distributed as HF."""
    if not tensor.is_cpu:  # the fast path of an everyday call: no device object built
        return None
    group = get_group()
    return None if type(group) is TorchGroup else group


def all_gather_into(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate the (contiguous, same-shaped, at least 1-d) `tensor` of every rank along dim 0, rank order."""
    group = group_for(tensor)
    if group is not None:
        shape = tensor.shape
        return group.all_gather(outbuf.empty((group.size * shape[0], *shape[1:]), tensor.dtype), tensor)
    world = dist.get_world_size()
    if dist.get_backend() != "gloo":
        out = torch.empty(world * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
        dist.all_gather_into_tensor(out, tensor)
        return out.view(-1, *tensor.shape[1:])
    parts = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(parts, tensor)
    return torch.cat(parts, dim=0)


def all_reduce_into(tensor: torch.Tensor, reduction: str) -> torch.Tensor:
    """A new tensor holding the reduction of every rank's `tensor` (untouched), computed as HF does: a clone,
    all_reduce MAX ("max") or SUM (anything else), then `/= world size` for "mean". For contiguous CPU
    tensors of the C dtypes (not requiring grad) the shm transport reads `tensor` and writes the new tensor
    directly, the mean's division fused in (same rounding: sum rounded to the dtype, then divided); outputs
    of 1 MiB and more come from outbuf's page-resident blocks."""
    op = "max" if reduction == "max" else "sum"
    group = group_for(tensor) if tensor.dtype in _REDUCE_DTYPES else None
    if group is not None and tensor.is_contiguous() and not tensor.requires_grad:
        if reduction != "mean":
            return group.all_reduce_into(outbuf.empty_like(tensor), tensor, op)
        if tensor.is_floating_point():
            return group.all_reduce_into(outbuf.empty_like(tensor), tensor, "sum_div")
    out = tensor.clone()  # everything else: literally HF's steps (integer "mean" raises in `/=` as in HF)
    if group is not None:
        group.all_reduce(out.detach(), op)
    else:
        dist.all_reduce(out, dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    if reduction == "mean":
        out /= dist.get_world_size()
    return out


def broadcast_(tensor: torch.Tensor, src: int) -> torch.Tensor:
    """In-place broadcast of rank `src`'s tensor."""
    group = group_for(tensor)
    if group is not None:
        return group.broadcast(tensor, src=src)
    dist.broadcast(tensor, src=src)
    return tensor


def all_gather_objects(obj: Any) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_objects_(object_list: list, src: int) -> list:
    dist.broadcast_object_list(object_list, src=src)
    return object_list
