# group.py: get_group(pg) -> the collective group the strategies use, picking the transport from where the
# ranks of `pg` live: all on one host -> ShmGroup (shared memory); one rank per host -> TorchGroup (plain
# torch.distributed); several hosts with several ranks each -> HierarchicalGroup (shm inside a host, the
# process group between one leader per host).
# Not for: the transports themselves (shm.py, hierarchical.py).
#
# Common interface (CollectiveGroup): all_reduce(tensor, op="sum") in place; all_reduce_into(output, input, op)
# out of place (input untouched); all_reduce_async(tensor, op)
# -> Work; reduce_scatter(output, input, op); all_gather(output, input) (flat, rank order);
# reduce_scatter_async / all_gather_async (same arguments) -> Work (wait() before touching the tensors);
# broadcast(tensor, src) with src a rank *of the group*; scatter(output, input, src) (src's input,
# size * output.numel() elements, block q -> rank q's output; input is only read on src, None elsewhere); barrier();
# alloc(numel, dtype, device) (shared memory when the transport has it); host_group() (the ShmGroup of this
# host's ranks, or None); close().
# `op` is "sum" | "avg" | "max" | "min" | "sum_div" (the sum, then divided by the group size as torch divides)
# (or a dist.ReduceOp).
# Non-CPU tensors always go to torch.distributed on `pg` (NCCL/gloo; NCCL's native reduce-scatter and all-gather into
# one flat tensor for CUDA tensors). ACCELERATE_C_COMM=torch forces the plain
# torch path. `group_for_device` is the one place that chooses shared memory or the process group for a device, and
# `p2p_for_device` the one place that chooses the point-to-point transport (comm/p2p.py) the same way.
from __future__ import annotations

import socket
from typing import Any, Optional, Protocol

import torch
import torch.distributed as dist

from accelerate_c.base import settings
from accelerate_c.base.process_local import ProcessLocal
from accelerate_c.comm.p2p import ShmP2P, TorchP2P
from accelerate_c.comm.shm import ShmGroup, _op_code, check_scatter_input

# avg and sum_div = sum / n: torch's division of the summed tensor
_TORCH_OPS = [dist.ReduceOp.SUM, dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.SUM]
_CACHE: dict = {}  # id(pg) (None: the default group) -> (the process group object it was built on, group)


def host_id() -> str:
    """This process's host identity: ACCELERATE_C_HOST_ID if set (one per launcher), else the hostname."""
    return settings.get("HOST_ID") or socket.gethostname()


class CollectiveGroup(Protocol):
    rank: int
    size: int

    def all_reduce(self, tensor: torch.Tensor, op: Any = "sum") -> torch.Tensor: ...
    def all_reduce_into(self, output: torch.Tensor, input: torch.Tensor, op: Any = "sum") -> torch.Tensor: ...
    def all_reduce_async(self, tensor: torch.Tensor, op: Any = "sum") -> Any: ...
    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: Any = "sum") -> torch.Tensor: ...
    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> torch.Tensor: ...
    def reduce_scatter_async(self, output: torch.Tensor, input: torch.Tensor, op: Any = "sum") -> Any: ...
    def all_gather_async(self, output: torch.Tensor, input: torch.Tensor) -> Any: ...
    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor: ...
    def scatter(self, output: torch.Tensor, input: Optional[torch.Tensor], src: int = 0) -> torch.Tensor: ...
    def barrier(self) -> None: ...
    def alloc(self, numel: int, dtype: torch.dtype = torch.float32,
              device: Optional[torch.device] = None) -> torch.Tensor: ...
    def host_group(self) -> Any: ...
    def close(self) -> None: ...


class _SumThenDivide:
    """A torch.distributed Work whose wait() also divides the summed tensor by the group size."""

    def __init__(self, work: Any, t: torch.Tensor, n: int) -> None:
        self.work, self.t, self.n = work, t, n

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def wait(self, timeout: Optional[float] = None) -> bool:
        self.work.wait()
        self.t.div_(self.n)
        return True


class _KeepBlock:
    """A Work whose wait() also copies block `rank` of the reduced copy into the reduce-scatter's output."""

    def __init__(self, work: Any, tmp: torch.Tensor, output: torch.Tensor, rank: int) -> None:
        self.work, self.tmp, self.output, self.rank = work, tmp, output, rank

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def wait(self, timeout: Optional[float] = None) -> bool:
        self.work.wait()
        n = self.output.numel()
        self.output.copy_(self.tmp.view(-1)[self.rank * n:(self.rank + 1) * n].view_as(self.output))
        return True


class TorchGroup(ProcessLocal):
    """Plain torch.distributed on `pg` behind the CollectiveGroup interface (also the non-CPU fallback)."""

    def __init__(self, pg: Optional[dist.ProcessGroup] = None) -> None:
        self.pg = pg
        self.rank = dist.get_rank(pg)
        self.size = dist.get_world_size(pg)
        self._backend: Optional[str] = None  # the process group's, read at the first collective

    def _global(self, r: int) -> int:
        return dist.get_global_rank(self.pg, r) if self.pg is not None else r

    def all_reduce(self, tensor: torch.Tensor, op: Any = "sum") -> torch.Tensor:
        code = _op_code(op)
        dist.all_reduce(tensor, op=_TORCH_OPS[code], group=self.pg)
        if code in (1, 4):
            tensor.div_(self.size)
        return tensor

    def all_reduce_into(self, output: torch.Tensor, input: torch.Tensor, op: Any = "sum") -> torch.Tensor:
        return self.all_reduce(output.copy_(input), op)

    def all_reduce_async(self, tensor: torch.Tensor, op: Any = "sum") -> Any:
        code = _op_code(op)
        work = dist.all_reduce(tensor, op=_TORCH_OPS[code], group=self.pg, async_op=True)
        # avg: torch has no reduction that divides; the division runs in wait(), after the sum arrived
        return _SumThenDivide(work, tensor, self.size) if code in (1, 4) else work

    def _nccl(self, t: torch.Tensor) -> bool:
        """NCCL on a CUDA tensor: the native reduce-scatter / all-gather into one flat tensor are there."""
        if not t.is_cuda:
            return False
        if self._backend is None:
            self._backend = str(dist.get_backend(self.pg))
        return self._backend == "nccl"

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: Any = "sum") -> torch.Tensor:
        if self._nccl(output) and output.is_contiguous() and input.is_contiguous():
            self._native_reduce_scatter(output, input, op, False)
            return output
        # gloo has no reduce_scatter on every torch version: all-reduce a copy and keep our slice
        tmp = input.detach().clone()
        self.all_reduce(tmp, op)
        n = output.numel()
        output.copy_(tmp.view(-1)[self.rank * n:(self.rank + 1) * n].view_as(output))
        return output

    def _native_reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: Any, async_op: bool) -> Any:
        code = _op_code(op)
        work = dist.reduce_scatter_tensor(output.view(-1), input.reshape(-1), op=_TORCH_OPS[code], group=self.pg,
                                          async_op=async_op)
        if code in (1, 4):  # the sum, then divided as torch divides (the same bits on every rank)
            if async_op:
                return _SumThenDivide(work, output, self.size)
            output.div_(self.size)
        return work

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
        if self._nccl(output) and output.is_contiguous():
            dist.all_gather_into_tensor(output.view(-1), input.contiguous().view(-1), group=self.pg)
            return output
        parts = list(output.view(-1).chunk(self.size)) if input.numel() else [input.new_empty(0)] * self.size
        dist.all_gather(parts, input.contiguous().view(-1), group=self.pg)
        return output

    def reduce_scatter_async(self, output: torch.Tensor, input: torch.Tensor, op: Any = "sum") -> Any:
        """NCCL's own reduce-scatter, else through an async all-reduce of a copy (see reduce_scatter); wait() copies
        this rank's block out."""
        if self._nccl(output) and output.is_contiguous() and input.is_contiguous():
            return self._native_reduce_scatter(output, input, op, True)
        tmp = input.detach().contiguous().clone()
        return _KeepBlock(self.all_reduce_async(tmp, op), tmp, output, self.rank)

    def all_gather_async(self, output: torch.Tensor, input: torch.Tensor) -> Any:
        if self._nccl(output) and output.is_contiguous():
            return dist.all_gather_into_tensor(output.view(-1), input.contiguous().view(-1), group=self.pg,
                                               async_op=True)
        parts = list(output.view(-1).chunk(self.size)) if input.numel() else [input.new_empty(0)] * self.size
        return dist.all_gather(parts, input.contiguous().view(-1), group=self.pg, async_op=True)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        dist.broadcast(tensor, src=self._global(src), group=self.pg)
        return tensor

    def scatter(self, output: torch.Tensor, input: Optional[torch.Tensor], src: int = 0) -> torch.Tensor:
        n = output.numel()
        parts = None
        if self.rank == src:
            parts = list(check_scatter_input(output, input, self.size, self.rank).reshape(-1).split(n))
        if not n:  # the size is the same on every rank: nobody calls
            return output
        out = output if output.is_contiguous() else torch.empty_like(output, memory_format=torch.contiguous_format)
        dist.scatter(out.view(-1), [p.to(out.device, out.dtype) for p in parts] if parts is not None else None,
                     src=self._global(src), group=self.pg)
        if out is not output:
            output.copy_(out)
        return output

    def barrier(self) -> None:
        dist.barrier(group=self.pg)

    def alloc(self, numel: int, dtype: torch.dtype = torch.float32,
              device: Optional[torch.device] = None) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, device=device)

    def host_group(self) -> None:
        """No shared memory between the ranks of this group."""
        return None

    def close(self) -> None:
        pass


class _CpuOrTorch:
    """Routes non-CPU tensors of an shm-backed group to torch.distributed on the same process group."""

    def __init__(self, inner: Any, pg: Optional[dist.ProcessGroup]) -> None:
        self.inner, self.pg = inner, pg
        self.rank, self.size = inner.rank, inner.size
        self._torch: Optional[TorchGroup] = None

    def _pick(self, a: torch.Tensor, b: Optional[torch.Tensor] = None) -> Any:
        if a.is_cpu and a.is_contiguous() and (b is None or (b.is_cpu and b.is_contiguous())):
            return self.inner
        if self._torch is None:
            self._torch = TorchGroup(self.pg)
        return self._torch

    def all_reduce(self, tensor: torch.Tensor, op: Any = "sum") -> torch.Tensor:
        return self._pick(tensor).all_reduce(tensor, op)

    def all_reduce_into(self, output: torch.Tensor, input: torch.Tensor, op: Any = "sum") -> torch.Tensor:
        return self._pick(output, input).all_reduce_into(output, input, op)

    def all_reduce_async(self, tensor: torch.Tensor, op: Any = "sum") -> Any:
        return self._pick(tensor).all_reduce_async(tensor, op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: Any = "sum") -> torch.Tensor:
        return self._pick(output, input).reduce_scatter(output, input, op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
        return self._pick(output, input).all_gather(output, input)

    def reduce_scatter_async(self, output: torch.Tensor, input: torch.Tensor, op: Any = "sum") -> Any:
        return self._pick(output, input).reduce_scatter_async(output, input, op)

    def all_gather_async(self, output: torch.Tensor, input: torch.Tensor) -> Any:
        return self._pick(output, input).all_gather_async(output, input)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        return self._pick(tensor).broadcast(tensor, src)

    def scatter(self, output: torch.Tensor, input: Optional[torch.Tensor], src: int = 0) -> torch.Tensor:
        # by the output alone: every rank must take the same route, and only src has an input
        if output.is_cpu:
            return self.inner.scatter(output, input, src)
        return self._pick(output).scatter(output, input, src)

    def barrier(self) -> None:
        self.inner.barrier()

    def alloc(self, numel: int, dtype: torch.dtype = torch.float32,
              device: Optional[torch.device] = None) -> torch.Tensor:
        if device is not None and torch.device(device).type != "cpu":
            return torch.zeros(numel, dtype=dtype, device=device)
        return self.inner.alloc(numel, dtype)

    def host_group(self) -> Any:
        return self.inner.host_group()

    def close(self) -> None:
        self.inner.close()


def get_group(pg: Optional[dist.ProcessGroup] = None, *, timeout: Optional[float] = None) -> CollectiveGroup:
    """Collective (every rank of `pg` must call it, in the same order as other collectives). Cached per pg;
    a cached group built on a process group that has since been destroyed (and maybe re-created) is closed
    and built again."""
    key = id(pg) if pg is not None else None
    hit = _CACHE.get(key)
    owner = pg if pg is not None else dist.distributed_c10d.GroupMember.WORLD
    if hit is not None:
        if hit[0] is owner:
            return hit[1]
        del _CACHE[key]
        hit[1].close()
    if not (dist.is_available() and dist.is_initialized()):
        grp: Any = ShmGroup(None, timeout=timeout)
    elif settings.get("COMM") == "torch":
        grp = TorchGroup(pg)
    else:
        n = dist.get_world_size(pg)
        hosts: list = [None] * n
        dist.all_gather_object(hosts, host_id(), group=pg)
        distinct = len(set(hosts))
        if distinct == 1:
            grp = _CpuOrTorch(ShmGroup(pg, timeout=timeout), pg)
        elif distinct == n:
            grp = TorchGroup(pg)
        else:
            from accelerate_c.comm.hierarchical import HierarchicalGroup
            grp = _CpuOrTorch(HierarchicalGroup(pg, hosts, timeout=timeout), pg)
    _CACHE[key] = (owner, grp)
    return grp


def group_for_device(device: torch.device, transport: str = "auto", dim: Any = None) -> CollectiveGroup:
    """The one choice between accelerate_c's groups and the process group: for CPU tensors get_group() (shared
    memory within a host), unless `transport` is "torch"; torch.distributed (NCCL/gloo) for any other device.
    `dim`: one group of the parallel layout (runtime/layout.py DimGroup: .size, .process_group, and .group, its
    cached CollectiveGroup) to build over instead of every rank (a size-1 one gives a SoloGroup).
    Collective when it builds a group (every rank of it calls it with the same arguments)."""
    if dim is not None and dim.size == 1:
        from accelerate_c.comm.solo import SoloGroup
        return SoloGroup()
    if torch.device(device).type == "cpu" and transport != "torch":
        return get_group() if dim is None else dim.group
    return TorchGroup(None if dim is None else dim.process_group)


def p2p_for_device(device: torch.device, pg: Optional[dist.ProcessGroup], channels: Any, transport: str = "auto",
                   **options: Any) -> Any:
    """The one choice of a point-to-point transport (comm/p2p.py) for `channels` ((src, dst) group ranks) between the
    ranks of `pg`: shared-memory rings when the tensors live on the CPU and every rank of `pg` is on this host (its
    group from get_group is a ShmGroup), torch.distributed isend/irecv otherwise or when `transport` is "torch".
    Collective (every rank of `pg` calls it with the same arguments). `options`: the rings' nslots / slot_bytes."""
    if torch.device(device).type == "cpu" and transport != "torch":
        inner = getattr(get_group(pg), "inner", None)
        if isinstance(inner, ShmGroup):
            return ShmP2P(inner, channels, **options)
    return TorchP2P(pg, channels)


def release_groups() -> None:
    """Closes every cached group (call before destroy_process_group)."""
    for _owner, g in list(_CACHE.values()):
        g.close()
    _CACHE.clear()
