# tests/scripts/tp_util.py: helpers of the tensor-parallel tests (tests/scripts/tp_parity.py, tests/test_tensor_parallel*.py):
# a counting wrapper around a CollectiveGroup (op, payload bytes, async or not), a group that refuses to communicate
# (for the in-process checks of apply_tensor_parallel, which must not communicate), small transformers configs, a
# GPT-2-style model written with nn.Linear (transformers' GPT2 uses Conv1D and a fused qkv projection) and its plan.
# Not for: test logic.
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class CountingGroup:
    """Delegates to `inner`, recording (op, payload bytes, async) per call. Payload: the full tensor of the collective
    (all-reduce: the tensor; all-gather: the output; reduce-scatter: the input)."""

    def __init__(self, inner) -> None:
        self.inner, self.rank, self.size = inner, inner.rank, inner.size
        self.calls: list[tuple[str, int, bool]] = []

    def _rec(self, op: str, t: torch.Tensor, is_async: bool = False) -> None:
        self.calls.append((op, t.numel() * t.element_size(), is_async))

    def all_reduce(self, t, op="sum"):
        self._rec("all_reduce", t)
        return self.inner.all_reduce(t, op)

    def all_reduce_async(self, t, op="sum"):
        self._rec("all_reduce", t, True)
        return self.inner.all_reduce_async(t, op)

    def all_gather(self, out, inp):
        self._rec("all_gather", out)
        return self.inner.all_gather(out, inp)

    def all_gather_async(self, out, inp):
        self._rec("all_gather", out, True)
        return self.inner.all_gather_async(out, inp)

    def reduce_scatter(self, out, inp, op="sum"):
        self._rec("reduce_scatter", inp)
        return self.inner.reduce_scatter(out, inp, op)

    def reduce_scatter_async(self, out, inp, op="sum"):
        self._rec("reduce_scatter", inp, True)
        return self.inner.reduce_scatter_async(out, inp, op)

    def take(self) -> list[tuple[str, int, bool]]:
        calls, self.calls = self.calls, []
        return calls


def summarize(calls) -> dict:
    """{op: [count, bytes]}."""
    out: dict = {}
    for op, nbytes, _ in calls:
        c = out.setdefault(op, [0, 0])
        c[0] += 1
        c[1] += nbytes
    return out


class NoCommGroup:
    """A group of `size` ranks that fails on any collective: apply_tensor_parallel must not communicate."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def __getattr__(self, name):
        raise AssertionError(f"unexpected collective {name!r}")


def llama_config(**kw):
    from transformers import LlamaConfig
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64)
    base.update(kw)
    return LlamaConfig(**base)


class GPTAttention(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.n_head, self.head_dim = n_head, d // n_head
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.c_proj = nn.Linear(d, d)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, self.n_head, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, s, self.n_head * self.head_dim))


class GPTBlock(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(d), GPTAttention(d, n_head), nn.LayerNorm(d)
        self.mlp = nn.Sequential()
        self.mlp.c_fc, self.mlp.act, self.mlp.c_proj = nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2's architecture with nn.Linear (learned positions, LayerNorm with bias, biased projections, the LM head
    tied to the token embedding); forward returns (logits, loss over the full vocabulary)."""

    def __init__(self, vocab: int = 96, d: int = 48, n_head: int = 4, n_layer: int = 2, seq: int = 32) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.h = nn.ModuleList(GPTBlock(d, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02 * math.sqrt(2))

    def forward(self, input_ids, labels=None):
        pos = torch.arange(input_ids.shape[1])
        x = self.wte(input_ids) + self.wpe(pos)
        for blk in self.h:
            x = blk(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if labels is None else F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                           labels[:, 1:].reshape(-1))
        return logits, loss


GPT_PLAN = {"wte": "embedding_rowwise", "h.*.attn.q": "colwise", "h.*.attn.k": "colwise", "h.*.attn.v": "colwise",
            "h.*.attn.c_proj": "rowwise", "h.*.mlp.c_fc": "colwise", "h.*.mlp.c_proj": "rowwise",
            "lm_head": "colwise_rep"}
