# accelerate_c/tensor_parallel/comm.py: the tensor-parallel engine's communication: TPComm (the group it was given,
# the sequence-parallel switch and the per-forward facts the hooks share) and the autograd Functions over the group:
# Megatron's g (its f is linear.py's ColumnLinear input), the gradient sum of a replicated parameter, the
# sequence-parallel all-gather / reduce-scatter pair and its mirror, and the last-dimension gather/split of
# colwise_rep / rowwise_split_input. Collectives along a dimension d of a tensor are
# flat collectives over a [tp, ...] layout: a tensor is moved to or from that layout with one copy when d is not the
# leading dimension (none when every dimension before d has size 1).
# Not for: the layers (linear.py, vocab.py) or choosing the group (the caller passes it, see apply.py).
from __future__ import annotations

from typing import Any, Optional

import torch


class TPComm:
    """The TP group of one model and the facts its hooks share during a forward. Every collective goes through the
    group's public CollectiveGroup methods (all_reduce, all_reduce_async, all_gather(_async), reduce_scatter(_async)),
    so a wrapper around the group sees every one."""

    def __init__(self, group: Any, sequence_parallel: bool = False, seq_dim: int = 1) -> None:
        self.group = group
        self.rank, self.size = int(group.rank), int(group.size)
        self.sp = bool(sequence_parallel)
        self.seq_dim = seq_dim
        self.seq_full: Optional[int] = None    # the model input's sequence length in this forward (SP)
        self.vocab_loss = False                 # this forward's head returns its vocab shard for the parallel loss
        self.entry: Optional[tuple] = None      # (tensor, its sequence shard): the SP entry of this forward

    @property
    def seq_shard(self) -> Optional[int]:
        return None if self.seq_full is None else self.seq_full // self.size

    def set_sequence(self, length: int) -> None:
        if length % self.size:
            raise ValueError(f"sequence parallelism: the sequence length {length} is not divisible by the tensor-"
                             f"parallel size {self.size} (pad the batch to a multiple of {self.size})")
        self.seq_full = length

    # ---- collectives along a dimension -----------------------------------------------------------------------
    def gather_start(self, shard: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Starts the all-gather of `shard` (any shape) into a [tp, *shard.shape] buffer; (buffer, work)."""
        shard = shard.contiguous()
        buf = shard.new_empty((self.size, *shard.shape))
        work = self.group.all_gather_async(buf.view(-1), shard.view(-1))
        return buf, work

    def gather(self, shard: torch.Tensor, dim: int) -> torch.Tensor:
        shard = shard.contiguous()
        buf = shard.new_empty((self.size, *shard.shape))
        self.group.all_gather(buf.view(-1), shard.view(-1))
        return from_blocks(buf, dim)

    def reduce_scatter_start(self, full: torch.Tensor, dim: int) -> tuple[torch.Tensor, Any]:
        """Starts the reduce-scatter (sum) of `full` along `dim`; (this rank's block, work)."""
        blocks = to_blocks(full, dim, self.size)
        out = blocks.new_empty(blocks.shape[1:])
        work = self.group.reduce_scatter_async(out.view(-1), blocks.view(-1))
        return out, work

    def reduce_scatter(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        blocks = to_blocks(full, dim, self.size)
        out = blocks.new_empty(blocks.shape[1:])
        self.group.reduce_scatter(out.view(-1), blocks.view(-1))
        return out

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In place on a contiguous tensor (returns it)."""
        return self.group.all_reduce(t, op)

    def local_block(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        n = full.shape[dim] // self.size
        return full.narrow(dim, self.rank * n, n)


def to_blocks(full: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """`full` as a contiguous [size, *block shape] tensor, block q = slice q along `dim` (a copy unless free)."""
    dim = dim % full.dim()
    shape = list(full.shape)
    n = shape[dim] // size
    split = full.reshape(*shape[:dim], size, n, *shape[dim + 1:])
    return split.movedim(dim, 0).contiguous()


def from_blocks(blocks: torch.Tensor, dim: int) -> torch.Tensor:
    """The inverse of to_blocks: [size, *block] -> the tensor concatenated along `dim` (a copy unless free)."""
    size, block = blocks.shape[0], list(blocks.shape[1:])
    dim = dim % len(block)
    moved = blocks.movedim(0, dim)
    return moved.reshape(*block[:dim], size * block[dim], *block[dim + 1:])


# ---- autograd Functions -----------------------------------------------------------------------------------------
class ReduceForward(torch.autograd.Function):
    """g: all-reduce (sum) forward, identity backward. The input is a fresh partial result, reduced in place."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: TPComm) -> torch.Tensor:
        x = x.contiguous()
        comm.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad, None


class ReduceScatterSeq(torch.autograd.Function):
    """Partial sums -> this rank's reduced block along `dim` (forward); backward all-gathers the block gradients
    (the sequence-parallel entry from a vocab-parallel embedding, and the row-parallel exit)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: TPComm, dim: int) -> torch.Tensor:
        ctx.comm, ctx.dim = comm, dim
        return comm.reduce_scatter(x, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return ctx.comm.gather(grad, ctx.dim), None, None


class SplitSeq(torch.autograd.Function):
    """A replicated tensor -> this rank's block along `dim` (no communication); backward all-gathers."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: TPComm, dim: int) -> torch.Tensor:
        ctx.comm, ctx.dim = comm, dim
        return comm.local_block(x, dim).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return ctx.comm.gather(grad, ctx.dim), None, None


class GatherLast(torch.autograd.Function):
    """Column shards -> the full last dimension (all-gather forward); backward keeps this rank's slice: the
    gradient of a replicated output is the same on every rank, so no communication (colwise_rep)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: TPComm) -> torch.Tensor:
        ctx.comm = comm
        return comm.gather(x, -1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return ctx.comm.local_block(grad, -1).contiguous(), None


class SplitLast(torch.autograd.Function):
    """A replicated input -> this rank's slice of the last dimension; backward all-gathers the slices' gradients
    (rowwise_split_input / rowwise_rep)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: TPComm) -> torch.Tensor:
        ctx.comm = comm
        return comm.local_block(x, -1).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return ctx.comm.gather(grad.contiguous(), -1), None


class GradAllReduce(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the group. Wraps a replicated parameter whose uses see
    only this rank's part of the data (a norm on sequence shards): each rank's gradient is a partial sum."""

    @staticmethod
    def forward(ctx: Any, p: torch.Tensor, comm: TPComm) -> torch.Tensor:
        ctx.comm = comm
        return p.view_as(p)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        grad = grad.contiguous().clone()
        ctx.comm.all_reduce(grad)
        return grad, None
