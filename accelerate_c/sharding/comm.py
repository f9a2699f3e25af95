# accelerate_c/sharding/comm.py: the sharded engine's collectives, on an accelerate_c.comm group, each counting
# the bytes it moves (ShardComm.bytes, per kind). Accounting: a reduce-scatter counts its input (the unit's
# padded full buffer), an all-gather its output (the same), an all-reduce its tensor; "control" all-reduces (the
# used-parameter mask, the clipping norm) are counted apart from the model's. So per step, with Ψ the padded
# number of trainable elements times their size, ZeRO-1/2 move 2Ψ (reduce-scatter + all-gather), ZeRO-3 3Ψ
# (all-gather for forward, again for backward, reduce-scatter).
# The stage 1/2 all-gather happens in place in shared memory when every rank is on this host: each rank reads its
# peers' updated shards straight from their parts of the region (no staging copy), between two barriers.
# On a GPU (no shared memory) the async reduce-scatter / all-gather return the process group's Work: NCCL's stream is
# the side stream the prefetch and the reductions run on (ordered after the compute stream's queued work, waited for
# by the compute stream only at Work.wait()).
# HYBRID_SHARD across hosts: hybrid_shard_comm builds the host group's ShardComm with its cross-host groups;
# HSDP over a parallel layout (dp_replicate x dp_shard): layout_shard_comm, from the layout's groups.
# Not for: the transports themselves (accelerate_c/comm) or which buffers move when (engine.py).
from __future__ import annotations

from typing import Any, Optional

import torch

KINDS = ("reduce_scatter", "all_gather", "all_reduce", "control")


class ShardComm:
    """`group`: the ranks a unit is sharded over. HYBRID_SHARD: `group` is this host's ranks, `cross` the torch
    process group of the ranks holding the same shard on the other hosts (`replicas` of them, this one `replica`),
    over which each reduced shard gradient is averaged again (`cross_root`: the global rank of its member on rank 0's
    host, replica 0); `world` the group of every rank (the used mask)."""

    def __init__(self, group: Any, device: torch.device, cross: Optional[Any] = None, replicas: int = 1,
                 replica: int = 0, world: Optional[Any] = None, cross_root: int = 0) -> None:
        self.group = group
        self.device = device
        self.rank, self.size = group.rank, group.size
        self.cross, self.replicas, self.replica = cross, replicas, replica
        self.cross_root = cross_root
        self.world = world if world is not None else group
        host = group.host_group() if device.type == "cpu" else None
        # the shared-memory group of all our ranks (None across hosts or with the torch transport)
        whole = host is not None and host.size == group.size and hasattr(host, "parts")
        self.shm: Optional[Any] = host if whole else None
        self.bytes = {k: 0 for k in KINDS}
        self.calls = {k: 0 for k in KINDS}

    def _count(self, kind: str, t: torch.Tensor) -> None:
        self.bytes[kind] += t.numel() * t.element_size()
        self.calls[kind] += 1

    def model_bytes(self) -> int:
        """Bytes moved so far by the collectives on model tensors (everything but control)."""
        return self.bytes["reduce_scatter"] + self.bytes["all_gather"] + self.bytes["all_reduce"]

    def alloc(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A zeroed 1-D buffer: in the shared segment when the transport has one (collectives on it are
        zero-copy), else ordinary memory on the device."""
        if self.shm is not None:
            return self.group.alloc(numel, dtype)
        return torch.zeros(numel, dtype=dtype, device=self.device)

    def alloc_pages(self, numel: int, dtype: torch.dtype = torch.float32) -> Any:
        """A zeroed CPU buffer whose pages its zero_() gives back (base/pages.py); None on a device or where the
        platform has no anonymous private mappings with MADV_DONTNEED (then alloc() is used)."""
        from ..base.pages import PageBuffer, available
        if self.device.type != "cpu" or not available():
            return None
        return PageBuffer(numel, dtype)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str = "avg") -> None:
        self._count("reduce_scatter", inp)
        self.group.reduce_scatter(out, inp, op)

    def reduce_scatter_async(self, out: torch.Tensor, inp: torch.Tensor, op: str = "avg") -> Optional[Any]:
        """Starts the reduce-scatter on the shared-memory group's worker thread (the C call drops the GIL, so
        backward goes on meanwhile) and returns its Work; None when it already ran synchronously (no shm).
        Neither tensor may be touched before wait(); later collectives on the group queue behind it."""
        self._count("reduce_scatter", inp)
        if self.shm is None:
            if self._on_device(out):
                return self.group.reduce_scatter_async(out, inp, op)
            self.group.reduce_scatter(out, inp, op)
            return None
        shm = self.shm
        return shm.submit(lambda: shm.raw_reduce_scatter(out, inp, op))

    def all_gather_async(self, out: torch.Tensor, inp: torch.Tensor) -> Optional[Any]:
        """As reduce_scatter_async, for an all-gather."""
        self._count("all_gather", out)
        if self.shm is None:
            if self._on_device(out):
                return self.group.all_gather_async(out, inp)
            self.group.all_gather(out, inp)
            return None
        shm = self.shm
        return shm.submit(lambda: shm.raw_all_gather(out, inp))

    @staticmethod
    def _on_device(t: torch.Tensor) -> bool:
        """A device tensor's collective is issued asynchronously on the process group (NCCL runs it on its own
        stream after the work the current stream has queued; Work.wait() makes the current stream wait for it, the
        host does not): the prefetch and the reduction overlap the compute stream with no device-wide sync."""
        return t.device.type != "cpu"

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        self._count("all_gather", out)
        self.group.all_gather(out, inp)

    def all_reduce(self, t: torch.Tensor, op: str = "sum", control: bool = False, world: bool = False) -> torch.Tensor:
        """Over the shard group (world=True: over every rank, e.g. across HYBRID_SHARD's replicas)."""
        self._count("control" if control else "all_reduce", t)
        return (self.world if world else self.group).all_reduce(t, op)

    def finish_reduce(self, shard: torch.Tensor) -> None:
        """HYBRID_SHARD: a shard gradient averaged within the host is averaged over the replicas too."""
        if self.cross is None or not shard.numel():
            return
        import torch.distributed as dist
        self._count("all_reduce", shard)
        dist.all_reduce(shard, group=self.cross)
        shard.div_(self.replicas)

    @torch.no_grad()
    def gather_shards_inplace(self, full: torch.Tensor, ranges: list[tuple[int, int]]) -> None:
        """`full` holds, at each (start, shard) of `ranges`, a unit of size * shard elements of which this rank
        updated its own shard [start + rank * shard, +shard): afterwards every rank's `full` holds every shard."""
        for start, shard in ranges:
            self._count("all_gather", full[start:start + shard * self.size])
        if self.shm is not None:
            parts = self.shm.parts(full)
            self.shm.barrier()  # every rank has written its shard
            for start, shard in ranges:
                for q in range(self.size):
                    if q != self.rank and shard:
                        a = start + q * shard
                        full[a:a + shard].copy_(parts[q][a:a + shard])
            self.shm.barrier()  # nobody writes its shard again while a peer still reads it
            return
        for start, shard in ranges:
            if shard:
                own = full[start + self.rank * shard:start + (self.rank + 1) * shard].clone()
                self.group.all_gather(full[start:start + shard * self.size], own)

    def barrier(self) -> None:
        self.group.barrier()


def hybrid_shard_comm(world: Any, host: Any, device: torch.device) -> ShardComm:
    """HYBRID_SHARD across hosts (the sharded strategy's comm): shard over this host's ranks (shared memory),
    replicate across hosts: the ranks with the same local index on every host form a torch process group
    (collective: every rank creates every such group, in the same order)."""
    import torch.distributed as dist
    from ..comm import host_id
    hosts: list = [None] * world.size
    dist.all_gather_object(hosts, host_id())
    order = list(dict.fromkeys(hosts))
    members = {h: [r for r, x in enumerate(hosts) if x == h] for h in order}
    sizes = {len(m) for m in members.values()}
    if len(sizes) != 1:
        raise ValueError(f"HYBRID_SHARD needs the same number of processes on every host; got "
                         f"{ {h: len(m) for h, m in members.items()} }")
    local = sizes.pop()
    cross = None
    mine = members[hosts[world.rank]].index(world.rank)
    for i in range(local):
        g = dist.new_group([members[h][i] for h in order])
        if i == mine:
            cross = g
    return ShardComm(host, device, cross=cross, replicas=len(order), replica=order.index(hosts[world.rank]),
                     world=world, cross_root=members[order[0]][mine])


def layout_shard_comm(layout: Any, device: torch.device) -> ShardComm:
    """HSDP over a parallel layout (runtime/layout.py): shard over this rank's dp_shard group, average each shard
    gradient over its dp_replicate group (the torch process group of the ranks holding the same shard; replica 0
    is the one with dp_replicate coordinate 0), agree (used mask, norms) over the whole data-parallel group."""
    rep = layout.dim("dp_replicate")
    return ShardComm(layout.dp_shard_group, device, cross=rep.process_group, replicas=rep.size, replica=rep.rank,
                     world=layout.dp_group, cross_root=rep.ranks[0])
