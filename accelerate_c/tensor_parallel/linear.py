# accelerate_c/tensor_parallel/linear.py: column- and row-parallel nn.Linear. Column-parallel modules that share an
# input (q/k/v under an attention module, gate/up under an MLP: "siblings", the colwise modules of one parent) share
# ONE f: SharedInput is applied once to their common input tensor (found at run time by tensor identity; a sibling
# called with another tensor gets its own), and it takes the siblings' weights as extra inputs. Each sibling's
# ColumnLinear returns its input gradient but no weight gradient: it stashes its output gradient in the shared
# context; SharedInput's backward, which autograd runs after every sibling's, starts the async all-reduce of the summed
# input gradient (sequence parallel: the re-gather of the input shard, then the async reduce-scatter), computes the
# stashed weight gradients meanwhile (the overlap), waits, and returns the weight gradients through autograd, so
# .grad accumulation and post-accumulate-grad hooks fire as usual. RowLinear reduces its partial product: all-reduce,
# or a reduce-scatter along the sequence under sequence parallelism (bias added once, after the reduction).
# Under sequence parallelism the shared all-gather happens at the parent's entry (a forward pre-hook): a module such
# as transformers' attention reads its input's shape to split heads, so it must see the full sequence.
# Not for: slicing the weights (apply.py), the vocabulary layers (vocab.py).
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .comm import GatherLast, SplitLast, TPComm, from_blocks


class Share:
    """One application of the shared f: the siblings' stashed output gradients and, under sequence parallelism,
    the input shard and its backward re-gather."""

    __slots__ = ("comm", "sp", "stash", "inputs", "shard", "regather")

    def __init__(self, comm: TPComm, sp: bool) -> None:
        self.comm, self.sp = comm, sp
        self.stash: dict[int, torch.Tensor] = {}
        self.inputs: dict[int, torch.Tensor] = {}  # a sibling's own matmul input when it is not the shared one (fp8)
        self.shard: Optional[torch.Tensor] = None
        self.regather: Optional[tuple[torch.Tensor, Any]] = None

    def start_regather(self) -> None:
        """Starts the all-gather of the saved input shard (the weight gradients need the full input)."""
        if self.regather is None and self.shard is not None:
            self.regather = self.comm.gather_start(self.shard)

    def weight_grads(self, x: torch.Tensor, n: int, needed: tuple) -> list:
        x2 = x.reshape(-1, x.shape[-1])
        out: list = [None] * n
        for i, g in self.stash.items():
            if needed[i]:
                own = self.inputs.pop(i, None)  # an fp8 sibling's matmul saw its quantised input
                xi = x2 if own is None else own.reshape(-1, own.shape[-1])
                out[i] = g.reshape(-1, g.shape[-1]).t().matmul(xi)
        self.stash.clear()
        self.inputs.clear()
        return out


class SharedInput(torch.autograd.Function):
    """f of a sibling group: identity forward (sequence parallel: all-gather along the sequence), all-reduce backward
    (sequence parallel: reduce-scatter), with the siblings' weight gradients computed while it runs."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, share: Share, *weights: torch.Tensor) -> torch.Tensor:
        ctx.share, ctx.nw = share, len(weights)
        if share.sp:
            share.shard = x.detach()
            return share.comm.gather(x, share.comm.seq_dim)
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        share, comm = ctx.share, ctx.share.comm
        work, grad_x = None, None
        if share.sp:
            share.start_regather()
            buf, gathering = share.regather
            if ctx.needs_input_grad[0]:
                grad_x, work = comm.reduce_scatter_start(grad, comm.seq_dim)   # queued behind the re-gather
            gathering.wait()
            x = from_blocks(buf, comm.seq_dim)
            share.shard, share.regather = None, None
        else:
            (x,) = ctx.saved_tensors
            if ctx.needs_input_grad[0]:
                grad_x = grad.contiguous()
                if grad_x is grad:
                    grad_x = grad.clone()
                work = comm.group.all_reduce_async(grad_x)
        wgrads = share.weight_grads(x, ctx.nw, ctx.needs_input_grad[2:])   # overlaps the collective
        if work is not None:
            work.wait()
        return (grad_x, None, *wgrads)


class ColumnLinear(torch.autograd.Function):
    """A sibling's matmul: y = x W^T + b; backward returns the input and bias gradients and stashes the output
    gradient for SharedInput's backward (no weight gradient here)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], share: Share,
                idx: int, own_input: bool = False) -> torch.Tensor:
        ctx.share, ctx.idx, ctx.has_b = share, idx, b is not None
        ctx.save_for_backward(w)
        if own_input:
            share.inputs[idx] = x.detach()
        return F.linear(x, w, b)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (w,) = ctx.saved_tensors
        share = ctx.share
        if ctx.needs_input_grad[1]:
            share.stash[ctx.idx] = grad
        if share.sp:
            share.start_regather()        # overlaps this and the other siblings' input-gradient matmuls
        gx = grad.matmul(w) if ctx.needs_input_grad[0] else None
        gb = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_b and ctx.needs_input_grad[2] else None
        return gx, None, gb, None, None, None


class RowLinear(torch.autograd.Function):
    """y = reduce(x W^T) + b: all-reduce, or under sequence parallelism a reduce-scatter along the sequence; backward
    (sequence parallel: after all-gathering the output gradient) is rank-local."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], comm: TPComm,
                g_state: Any = None) -> torch.Tensor:
        ctx.comm, ctx.has_b, ctx.g_state = comm, b is not None, g_state
        ctx.save_for_backward(x, w)
        y = F.linear(x, w)
        if comm.sp:
            y = comm.reduce_scatter(y, comm.seq_dim)
        else:
            comm.all_reduce(y)
        if b is not None:
            y += b
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, w = ctx.saved_tensors
        comm = ctx.comm
        g = comm.gather(grad, comm.seq_dim) if comm.sp else grad
        gb = g.reshape(-1, g.shape[-1]).sum(0) if ctx.has_b and ctx.needs_input_grad[2] else None
        if ctx.g_state is not None:  # fp8: the matmuls' output gradient cast (the bias's is not, as FP8Linear)
            q, s = ctx.g_state.quantize(g.contiguous())
            g = q.to(torch.float32).mul_(1.0 / s).to(g.dtype)
        g2 = g.reshape(-1, g.shape[-1])
        gx = g.matmul(w) if ctx.needs_input_grad[0] else None
        gw = g2.t().matmul(x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
        return gx, gw, gb, None, None


def first_input(args: tuple, kwargs: dict, name: Optional[str]) -> tuple[Any, Optional[str]]:
    """A module call's first argument and where it is (None: args[0]; a name: that keyword)."""
    if args:
        return args[0], None
    if name is not None and name in kwargs:
        return kwargs[name], name
    return None, None


def replace_first(args: tuple, kwargs: dict, where: Optional[str], value: Any) -> tuple[tuple, dict]:
    if where is None:
        return (value, *args[1:]), kwargs
    return args, {**kwargs, where: value}


class SiblingGroup:
    """The colwise modules of one parent and the one f they share per input tensor."""

    def __init__(self, comm: TPComm, members: list[nn.Module], first_arg: Optional[str] = None) -> None:
        self.comm, self.members, self.first_arg = comm, members, first_arg
        self.clear()

    def clear(self) -> None:
        self.input: Optional[torch.Tensor] = None
        self.alias: Optional[torch.Tensor] = None
        self.share: Optional[Share] = None
        self.used = 0

    def _apply(self, x: torch.Tensor, sp: bool) -> None:
        share = Share(self.comm, sp)
        weights = [m.weight for m in self.members]
        self.input, self.alias, self.share, self.used = x, SharedInput.apply(x, share, *weights), share, 0

    def is_seq_shard(self, x: Any) -> bool:
        c = self.comm
        return (c.sp and isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() > c.seq_dim
                and c.seq_full is not None and x.shape[c.seq_dim] == c.seq_shard)

    def input_for(self, x: torch.Tensor) -> tuple[torch.Tensor, Optional[Share]]:
        """(the tensor a member computes on, the Share its ColumnLinear joins; None: compute plainly)."""
        if self.input is not x:
            if self.comm.sp and not self.is_seq_shard(x):
                return x, None          # a full-sequence tensor computed from the parent's gathered input
            self._apply(x, self.comm.sp)
        alias, share = self.alias, self.share
        self.used += 1
        if self.used >= len(self.members):
            self.clear()
        return alias, share

    def parent_pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple]:
        """Sequence parallel: the parent's input shard is all-gathered here, once for every sibling."""
        x, where = first_input(args, kwargs, self.first_arg)
        if not self.is_seq_shard(x):
            return None
        self._apply(x, True)
        self.input = self.alias
        return replace_first(args, kwargs, where, self.alias)

    def parent_post_hook(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        self.clear()


def _fp8_active(m: nn.Module) -> bool:
    """Whether the scaling states precision/fp8.py attach_fp8 gave `m` (mixed_precision="fp8") quantise this
    forward: their own rule (ScaleState.quantises)."""
    return hasattr(m, "g_state") and m.x_state.quantises(m.training)


def _amax_max(group: Any, amax: float) -> float:
    t = torch.tensor([amax], dtype=torch.float32)
    group.all_reduce(t, "max")
    return float(t[0])


class ColwiseLinear(nn.Linear):
    """nn.Linear whose weight (and bias) hold this rank's rows of the output features. `_tp_gather` (colwise_rep):
    the output is all-gathered to the full width. Under mixed_precision="fp8" it is given FP8Linear's scaling states
    (precision/fp8.py attach_fp8; fp8_attachable) and quantises its input, weight and output gradient."""

    _tp_group: SiblingGroup
    _tp_index: int
    _tp_gather: bool = False
    fp8_attachable = True

    def amax_reduce(self, amax: float) -> float:
        return _amax_max(self._tp_group.comm.group, amax)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = column_forward(self, x)
        return GatherLast.apply(y, self._tp_group.comm) if self._tp_gather else y


def column_forward(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    alias, share = m._tp_group.input_for(x)
    fp8 = _fp8_active(m)
    if not fp8:
        if share is None or not torch.is_grad_enabled():
            return F.linear(alias, m.weight, m.bias)
        return ColumnLinear.apply(alias, m.weight, m.bias, share, m._tp_index)
    # fp8 (FP8Linear's numerics): the matmul on the quantised input and weight, its output gradient quantised; the
    # bias added after, so its gradient is not
    xq, wq = m.x_state.fake_quant(alias), m.w_state.fake_quant(m.weight)
    if share is None or not torch.is_grad_enabled():
        y = F.linear(xq, wq)
    else:
        y = ColumnLinear.apply(xq, wq, None, share, m._tp_index, True)
    y = m.g_state.grad_quant(y)
    return y if m.bias is None else y + m.bias


class RowwiseLinear(nn.Linear):
    """nn.Linear whose weight holds this rank's columns of the input features; the bias is whole, added once after
    the reduction. `_tp_split_input` (rowwise_split_input / rowwise_rep): the input arrives replicated and this rank
    takes its slice of the last dimension."""

    _tp_comm: TPComm
    _tp_split_input: bool = False
    fp8_attachable = True

    def amax_reduce(self, amax: float) -> float:
        return _amax_max(self._tp_comm.group, amax)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._tp_split_input:
            x = SplitLast.apply(x, self._tp_comm)
        if _fp8_active(self):  # fp8 (precision/fp8.py attach_fp8)
            return RowLinear.apply(self.x_state.fake_quant(x), self.w_state.fake_quant(self.weight), self.bias,
                                   self._tp_comm, self.g_state)
        return RowLinear.apply(x, self.weight, self.bias, self._tp_comm)
