# accelerate_c/tensor_parallel/vocab.py: the vocabulary-parallel layers. VocabEmbedding holds this rank's rows of the
# vocabulary: ids outside them are masked, the partial lookups are all-reduced (sequence parallel: left partial and
# marked, reduce-scattered along the sequence where the residual stream begins, see apply.py). VocabHead is a
# column-parallel LM head: with labels in a training forward it returns this rank's vocabulary shard of the logits
# (marked), and the model's loss hook (CausalLMLoss) computes the cross-entropy vocab-parallel, never gathering the
# full-vocabulary logits: the row max, the sum of exps and the target logit are reduced over the group (2 small
# all-reduces). Otherwise (no labels, no grad) the head all-gathers the full logits.
# Not for: column/row linears (linear.py), slicing (apply.py).
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .comm import GatherLast, ReduceForward, TPComm
from .linear import ColwiseLinear, column_forward

PARTIAL = "_tp_partial"   # attribute of an embedding output holding partial sums (sequence parallel)
VOCAB = "_tp_vocab"       # attribute of logits holding a vocabulary shard: (first id, logical vocabulary size)


class VocabEmbedding(nn.Embedding):
    """nn.Embedding whose weight holds rows [_tp_start, _tp_start + num_embeddings) of the vocabulary."""

    _tp_comm: TPComm
    _tp_start: int

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self._tp_start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight, self.padding_idx, self.max_norm,
                          self.norm_type, self.scale_grad_by_freq, self.sparse)
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        comm = self._tp_comm
        if comm.sp:
            if ids.dim() > comm.seq_dim:   # (also when the forward starts below the root: the base model alone)
                comm.set_sequence(ids.shape[comm.seq_dim])
            setattr(out, PARTIAL, True)
            return out
        return ReduceForward.apply(out, comm)


class VocabHead(ColwiseLinear):
    """The column-parallel LM head (rows [_tp_start, +out_features) of the vocabulary)."""

    _tp_start: int
    _tp_vocab: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = column_forward(self, x)
        comm = self._tp_group.comm
        if comm.vocab_loss:
            setattr(y, VOCAB, (self._tp_start, self._tp_vocab))
            return y
        return GatherLast.apply(y, comm)


class VocabCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of vocabulary-sharded logits [N, V/tp] (fp32) against global targets [N]. Tokens whose
    target is in no rank's shard (ignore_index) get a meaningless loss and a zero gradient when the caller weighs
    them 0. Backward: softmax - one-hot, local to the shard."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, start: int, comm: TPComm) -> torch.Tensor:
        n = logits.shape[-1]
        m = logits.detach().amax(dim=-1).contiguous()
        comm.all_reduce(m, "max")
        z = logits.detach() - m.unsqueeze(-1)
        t = target - start
        inside = (t >= 0) & (t < n)
        t = t.clamp(0, n - 1)
        pred = z.gather(-1, t.unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0)
        z.exp_()
        sums = torch.stack([z.sum(-1), pred])          # one all-reduce for both
        comm.all_reduce(sums)
        z.div_(sums[0].unsqueeze(-1))                   # this shard's softmax, kept for backward
        ctx.save_for_backward(z, t, inside)
        return sums[0].log() - sums[1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        soft, t, inside = ctx.saved_tensors
        g = soft * grad.unsqueeze(-1)
        g.scatter_add_(-1, t.unsqueeze(-1), (-grad * inside).unsqueeze(-1))
        return g, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, comm: TPComm, start: int,
                                 ignore_index: int = -100, num_items_in_batch: Any = None) -> torch.Tensor:
    """torch's cross_entropy(logits, target, ignore_index) over the full vocabulary, from this rank's shard: the
    mean over the non-ignored tokens, or their sum divided by num_items_in_batch when given (transformers' rule)."""
    logits = logits.float().reshape(-1, logits.shape[-1])
    target = target.reshape(-1).to(logits.device)
    keep = target != ignore_index
    per_token = VocabCrossEntropy.apply(logits, target.masked_fill(~keep, -1), start, comm)  # -1: in no shard
    total = (per_token * keep).sum()
    if num_items_in_batch is None:
        return total / keep.sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


class CausalLMLoss:
    """The model's loss_function under tensor parallelism: vocabulary-sharded logits (VocabHead in a training
    forward with labels) -> the vocab-parallel cross-entropy with transformers' ForCausalLM label shift; full logits
    -> the model's own loss function."""

    def __init__(self, original: Callable, comm: TPComm) -> None:
        self.original, self.comm = original, comm

    def __call__(self, logits: torch.Tensor, labels: Optional[torch.Tensor], vocab_size: Optional[int] = None,
                 num_items_in_batch: Any = None, ignore_index: int = -100, shift_labels: Optional[torch.Tensor] = None,
                 **kwargs: Any) -> torch.Tensor:
        shard = getattr(logits, VOCAB, None)
        if shard is None:
            return self.original(logits=logits, labels=labels, vocab_size=vocab_size,
                                 num_items_in_batch=num_items_in_batch, ignore_index=ignore_index,
                                 shift_labels=shift_labels, **kwargs)
        if shift_labels is None:
            padded = F.pad(labels, (0, 1), value=ignore_index)
            shift_labels = padded[..., 1:].contiguous()
        return vocab_parallel_cross_entropy(logits, shift_labels, self.comm, shard[0], ignore_index,
                                            num_items_in_batch)
