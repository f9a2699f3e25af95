# hierarchical.py: HierarchicalGroup, collectives for a process group that spans several hosts with several
# ranks on each: reduce inside each host over shared memory (ShmGroup), combine across hosts over
# torch.distributed among one leader per host (gloo / NCCL), then broadcast inside each host. A scatter goes the
# other way: the source's host leader scatters one slab per host over the leaders, each leader scatters its
# slab inside its host.
# Not for: choosing when to use it (group.get_group does) or single-host groups (ShmGroup alone).
#
# Construction is collective over `pg`: every rank calls dist.new_group for every host's sub-group and for
# the leaders' group in the same order (torch requires it), then builds its host's ShmGroup. Ranks of a host
# need not be contiguous in `pg`; "local rank 0" (the smallest pg rank on the host) is the leader.
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from accelerate_c.base.process_local import ProcessLocal
from accelerate_c.comm.shm import ShmGroup, Work, _op_code, check_scatter_input

_TORCH_OPS = [dist.ReduceOp.SUM, dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.SUM]


class HierarchicalGroup(ProcessLocal):
    def __init__(self, pg: Optional[dist.ProcessGroup], hosts: list, *, timeout: Optional[float] = None) -> None:
        self.pg = pg
        self.rank = dist.get_rank(pg)
        self.size = dist.get_world_size(pg)
        order: list = []
        for h in hosts:  # hosts in order of their first pg rank
            if h not in order:
                order.append(h)
        self.host_ranks = [[r for r in range(self.size) if hosts[r] == h] for h in order]  # pg ranks per host
        self.host_of = [order.index(h) for h in hosts]
        self.host = self.host_of[self.rank]
        self.local = self.host_ranks[self.host].index(self.rank)
        glob = (lambda r: dist.get_global_rank(pg, r)) if pg is not None else (lambda r: r)
        local_pg = None
        for ranks in self.host_ranks:  # every rank creates every sub-group, in the same order
            g = dist.new_group([glob(r) for r in ranks])
            if self.rank in ranks:
                local_pg = g
        self.leaders_pg = dist.new_group([glob(ranks[0]) for ranks in self.host_ranks])
        self.is_leader = self.local == 0
        self.shm = ShmGroup(local_pg, timeout=timeout)

    # ---- implementations (no ordering with the async queue; public wrappers add it) -------------------
    def _all_reduce(self, t: torch.Tensor, code: int, src: Optional[torch.Tensor] = None) -> None:
        """t = reduction of every rank's `src` (of t itself when src is None)."""
        inner = 0 if code in (1, 4) else code  # avg / sum_div = sum everywhere, one division at the end
        if src is None:
            self.shm.raw_all_reduce(t, inner)
        else:
            self.shm.raw_all_reduce_into(t, src, inner)
        if self.is_leader:
            dist.all_reduce(t, op=_TORCH_OPS[inner], group=self.leaders_pg)
        self.shm.raw_broadcast(t, 0)
        if code in (1, 4):
            t.div_(self.size)

    def _broadcast(self, t: torch.Tensor, src: int) -> None:
        src_host = self.host_of[src]
        if self.host == src_host:
            self.shm.raw_broadcast(t, self.host_ranks[src_host].index(src))
        if self.is_leader:
            root = self.host_ranks[src_host][0]
            dist.broadcast(t, src=dist.get_global_rank(self.pg, root) if self.pg is not None else root,
                           group=self.leaders_pg)
        if self.host != src_host:
            self.shm.raw_broadcast(t, 0)

    def _all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        n = input.numel()
        width = max(len(r) for r in self.host_ranks)
        grid = torch.empty(len(self.host_ranks), width, n, dtype=input.dtype)  # [host, local, n]
        mine = grid[self.host, :len(self.host_ranks[self.host])]
        self.shm.raw_all_gather(mine.reshape(-1), input.reshape(-1))
        if self.is_leader and n:
            dist.all_gather(list(grid.unbind(0)), grid[self.host].clone(), group=self.leaders_pg)
        self.shm.raw_broadcast(grid.view(-1), 0)
        out = output.view(-1, n) if n else output
        for r in range(self.size):
            if n:
                out[r].copy_(grid[self.host_of[r], self.host_ranks[self.host_of[r]].index(r)])

    def _scatter(self, output: torch.Tensor, input: Optional[torch.Tensor], src: int) -> None:
        """output contiguous. Slab h = the blocks of host h's ranks in local order (padded to the widest host);
        the leaders scatter the slabs, then each host scatters its slab from its leader (local 0)."""
        n, src_host = output.numel(), self.host_of[src]
        if not n:  # the same on every rank
            return
        width = max(len(r) for r in self.host_ranks)
        slabs = None
        root = self.host_ranks[src_host][0]  # the source host's leader
        if self.rank == src or (self.host == src_host and src != root):
            slabs = torch.empty(len(self.host_ranks), width, n, dtype=output.dtype)
            if self.rank == src:
                blocks = input.view(self.size, n)
                for h, ranks in enumerate(self.host_ranks):
                    slabs[h, :len(ranks)] = blocks[ranks]
            if src != root:  # the source is not its host's leader: hand the slabs over
                self.shm.raw_broadcast(slabs.view(-1), self.host_ranks[src_host].index(src))
        mine = None
        if self.is_leader:
            mine = torch.empty(width, n, dtype=output.dtype)
            dist.scatter(mine, list(slabs.unbind(0)) if self.rank == root else None,
                         src=dist.get_global_rank(self.pg, root) if self.pg is not None else root,
                         group=self.leaders_pg)
        here = len(self.host_ranks[self.host])
        self.shm.raw_scatter(output.view(-1), mine[:here].reshape(-1) if self.is_leader else None, 0)

    # ---- CollectiveGroup interface --------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: Any = "sum") -> torch.Tensor:
        code = _op_code(op)
        self.shm.synchronize()
        self._all_reduce(tensor, code)
        return tensor

    def all_reduce_into(self, output: torch.Tensor, input: torch.Tensor, op: Any = "sum") -> torch.Tensor:
        code = _op_code(op)
        self.shm.synchronize()
        self._all_reduce(output, code, input)
        return output

    def all_reduce_async(self, tensor: torch.Tensor, op: Any = "sum") -> Work:
        """Runs the whole three-step all-reduce on the local ShmGroup's worker thread."""
        code = _op_code(op)
        return self.shm.submit(lambda: self._all_reduce(tensor, code))

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: Any = "sum") -> torch.Tensor:
        """Via a full all-reduce of a copy (moves more bytes than a true reduce-scatter across hosts)."""
        tmp = input.detach().contiguous().clone()
        self.all_reduce(tmp, op)
        n = output.numel()
        output.copy_(tmp.view(-1)[self.rank * n:(self.rank + 1) * n].view_as(output))
        return output

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
        self.shm.synchronize()
        self._all_gather(output, input)
        return output

    def reduce_scatter_async(self, output: torch.Tensor, input: torch.Tensor, op: Any = "sum") -> Work:
        """The reduce_scatter above, run on the local ShmGroup's worker thread."""
        code = _op_code(op)
        tmp = input.detach().contiguous().clone()

        def run() -> None:
            self._all_reduce(tmp, code)
            n = output.numel()
            output.copy_(tmp.view(-1)[self.rank * n:(self.rank + 1) * n].view_as(output))
        return self.shm.submit(run)

    def all_gather_async(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        return self.shm.submit(lambda: self._all_gather(output, input))

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        self.shm.synchronize()
        self._broadcast(tensor, src)
        return tensor

    def scatter(self, output: torch.Tensor, input: Optional[torch.Tensor], src: int = 0) -> torch.Tensor:
        """output = block `rank` of src's input (size * output.numel() elements, read on src only)."""
        if not 0 <= src < self.size:
            raise ValueError(f"scatter: src {src} out of range for {self.size} ranks")
        inp = check_scatter_input(output, input, self.size, self.rank).reshape(-1) if self.rank == src else None
        self.shm.synchronize()
        out = output if output.is_contiguous() else output.contiguous()
        self._scatter(out, inp, src)
        if out is not output:
            output.copy_(out)
        return output

    def barrier(self) -> None:
        self.shm.barrier()
        if self.is_leader:
            dist.barrier(group=self.leaders_pg)
        self.shm.barrier()

    def alloc(self, numel: int, dtype: torch.dtype = torch.float32,
              device: Optional[torch.device] = None) -> torch.Tensor:
        return self.shm.alloc(numel, dtype)

    def host_group(self) -> ShmGroup:
        """The shared-memory group of this host's ranks."""
        return self.shm

    def close(self) -> None:
        self.shm.close()
