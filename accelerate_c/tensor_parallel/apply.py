# accelerate_c/tensor_parallel/apply.py: apply_tensor_parallel(model, group, plan, sequence_parallel): slices the
# planned modules' weights in place (each rank keeps only its part; a Parameter keeps its identity, so an optimizer
# built before stays valid; a meta Parameter gets a meta slice, so materialising later allocates only the slice),
# swaps the modules' classes for their tensor-parallel forwards (linear.py, vocab.py), divides the attention heads on
# the attention modules (the model's config stays the logical one), and installs the hooks: the shared f of sibling
# column layers, the sequence-parallel entry of the residual stream (the embedding's partial sums reduce-scattered
# along the sequence where the first layer / norm takes them), the gradient all-reduce of replicated parameters that
# see only sequence shards, and the root's hooks (sequence length; labels -> the vocab-parallel loss).
# Everything is validated before anything changes: sizes the group does not divide are errors naming the module.
# Not for: the collectives' transport (the caller passes a CollectiveGroup), checkpoints and norms (state.py).
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from .comm import GradAllReduce, ReduceScatterSeq, SplitSeq, TPComm
from .linear import ColwiseLinear, RowwiseLinear, SiblingGroup, first_input, replace_first
from .plan import COLUMN_KINDS, find_sequence_norms, head_name, model_plan, parent_name, resolve
from .vocab import PARTIAL, CausalLMLoss, VocabEmbedding, VocabHead

HEAD_ATTRS = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads", "n_head", "n_heads",
              "n_kv_heads")
# kind -> (the weight's split dimension, the module attribute holding its size)
_SPLIT = {"colwise": (0, "out_features"), "colwise_rep": (0, "out_features"), "rowwise": (1, "in_features"),
          "rowwise_split": (1, "in_features"), "vocab_embedding": (0, "num_embeddings")}


@dataclass(frozen=True)
class TPSlice:
    """A parameter holds elements [start, start + length) of dimension `dim` of its logical tensor `shape`."""

    dim: int
    start: int
    length: int
    shape: tuple


@dataclass
class TPState:
    comm: TPComm
    kinds: dict
    head: Optional[str]


def tp_state(model: nn.Module) -> TPState:
    for m in (model, getattr(model, "module", None), getattr(model, "_orig_mod", None)):
        st = getattr(m, "_tp_state", None) if m is not None else None
        if st is not None:
            return st
    raise ValueError(f"{type(model).__name__} is not tensor-parallel (apply_tensor_parallel was not applied)")


def _first_param(m: nn.Module) -> Optional[str]:
    try:
        params = list(inspect.signature(m.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    return params[0].name if params and params[0].kind not in (params[0].VAR_POSITIONAL, params[0].VAR_KEYWORD) \
        else None


# ---- validation (nothing changes before every check passed) -----------------------------------------------------
def _check_module(name: str, m: nn.Module, kind: str, size: int) -> None:
    base = nn.Embedding if kind == "vocab_embedding" else nn.Linear
    if kind not in _SPLIT:
        return
    if not isinstance(m, base) or type(m).forward is not base.forward:
        raise ValueError(f"tensor parallelism: {kind} needs a plain nn.{base.__name__}; module {name!r} is "
                         f"{type(m).__name__}")
    attr = _SPLIT[kind][1]
    n = getattr(m, attr)
    if n % size:
        what = f"{n} vocabulary rows (num_embeddings)" if kind == "vocab_embedding" else f"{attr}={n}"
        raise ValueError(f"tensor parallelism: module {name!r} ({kind}) has {what}, not divisible by the "
                         f"tensor-parallel size {size}")


def _check_heads(modules: dict, kinds: dict, size: int) -> None:
    for parent in sorted({parent_name(n) for n, k in kinds.items() if k == "colwise"}):
        p = modules[parent]
        hd = getattr(p, "head_dim", None)
        for attr in HEAD_ATTRS:
            v = getattr(p, attr, None)
            if isinstance(v, int) and v % size:
                raise ValueError(f"tensor parallelism: attention module {parent!r} has {attr}={v}, not divisible by "
                                 f"the tensor-parallel size {size}")
        if not isinstance(hd, int) or hd <= 0:
            continue
        for n, k in kinds.items():
            if k == "colwise" and parent_name(n) == parent and modules[n].out_features % hd == 0:
                heads = modules[n].out_features // hd
                if heads % size:
                    raise ValueError(f"tensor parallelism: module {n!r} computes {heads} heads (out_features "
                                     f"{modules[n].out_features} = {heads} x head_dim {hd}), not divisible by the "
                                     f"tensor-parallel size {size}")


def _validate(model: nn.Module, kinds: dict, comm: TPComm) -> dict:
    if getattr(model, "_tp_state", None) is not None:
        raise ValueError(f"tensor parallelism is already applied to this {type(model).__name__}")
    modules = dict(model.named_modules())
    for name, kind in kinds.items():
        _check_module(name, modules[name], kind, comm.size)
    _check_heads(modules, kinds, comm.size)
    if comm.sp and "vocab_embedding" not in kinds.values():
        raise ValueError("sequence parallelism needs the input embedding in the plan as 'embedding_rowwise' (its "
                         "partial sums are reduce-scattered along the sequence); none of the plan's entries is one")
    return modules


# ---- slicing ------------------------------------------------------------------------------------------------------
def slice_parameter(p: nn.Parameter, dim: int, comm: TPComm) -> None:
    """Replaces the contents of `p` by this rank's block of dimension `dim` (the same Parameter object)."""
    spec = getattr(p, "_tp_slice", None)
    if spec is not None:  # tied: already cut through another module
        if spec.dim != dim:
            raise ValueError(f"tensor parallelism: a parameter tied between modules is split along dimensions "
                             f"{spec.dim} and {dim}")
        return
    full = tuple(p.shape)
    n = full[dim] // comm.size
    start = comm.rank * n
    if p.is_meta:
        data = torch.empty(full[:dim] + (n,) + full[dim + 1:], dtype=p.dtype, device="meta")
    else:
        data = p.detach().narrow(dim, start, n).clone(memory_format=torch.contiguous_format)
    new = nn.Parameter(data, requires_grad=p.requires_grad)
    torch.utils.swap_tensors(p, new)
    p._tp_slice = TPSlice(dim, start, n, full)


_CLASSES: dict = {}


def _swap_class(m: nn.Module, cls: type) -> None:
    """m's class becomes `cls` (its forward), or a subclass of both when m is a subclass of cls's torch base."""
    base = type(m)
    if not issubclass(cls, base):
        key = (cls, base)
        if key not in _CLASSES:
            _CLASSES[key] = type(f"{cls.__name__}_{base.__name__}", (cls, base), {})
        cls = _CLASSES[key]
    m.__class__ = cls


def _slice_module(name: str, m: nn.Module, kind: str, comm: TPComm) -> None:
    dim, attr = _SPLIT[kind]
    full = getattr(m, attr)
    slice_parameter(m.weight, dim, comm)
    if dim == 0 and getattr(m, "bias", None) is not None:
        slice_parameter(m.bias, 0, comm)
    setattr(m, attr, full // comm.size)
    m._tp_start = comm.rank * (full // comm.size)
    if kind == "vocab_embedding" and m.padding_idx is not None:
        local = m.padding_idx - m._tp_start
        m.padding_idx = local if 0 <= local < m.num_embeddings else None


def _divide_heads(modules: dict, kinds: dict, comm: TPComm) -> None:
    for parent in {parent_name(n) for n, k in kinds.items() if k == "colwise"}:
        p = modules[parent]
        for attr in HEAD_ATTRS:
            v = getattr(p, attr, None)
            if isinstance(v, int) and not isinstance(v, bool):
                setattr(p, attr, v // comm.size)


# ---- hooks --------------------------------------------------------------------------------------------------------
def _sp_entry_hook(comm: TPComm, first_arg: Optional[str]) -> Any:
    """Where the residual stream enters a layer or a norm under sequence parallelism: the embedding's partial sums are
    reduce-scattered along the sequence (once per forward), a replicated full-sequence input is split (no
    communication); a shard passes."""
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple]:
        x, where = first_input(args, kwargs, first_arg)
        d = comm.seq_dim
        if not (isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() > d and comm.seq_full is not None):
            return None
        if comm.entry is not None and comm.entry[0] is x:
            y = comm.entry[1]
        elif getattr(x, PARTIAL, False):
            y = ReduceScatterSeq.apply(x, comm, d)
        elif x.shape[d] == comm.seq_full:
            y = SplitSeq.apply(x, comm, d)
        else:
            return None
        comm.entry = (x, y)
        return replace_first(args, kwargs, where, y)
    return hook


def _grad_reduce_hooks(m: nn.Module, comm: TPComm) -> None:
    """The module's own parameters see only this rank's part of the data: during its forward each is replaced by
    GradAllReduce(p), so its gradient is summed over the group before it reaches .grad."""
    saved: list = []

    def pre(module: nn.Module, args: tuple) -> None:
        if torch.is_grad_enabled():
            for k, p in module._parameters.items():
                if p is not None and p.requires_grad:
                    saved.append((k, p))
                    module._parameters[k] = GradAllReduce.apply(p, comm)

    def post(module: nn.Module, args: tuple, output: Any) -> None:
        while saved:
            k, p = saved.pop()
            module._parameters[k] = p
    m.register_forward_pre_hook(pre)
    m.register_forward_hook(post, always_call=True)


def _root_hooks(model: nn.Module, comm: TPComm, vocab_loss: bool) -> None:
    first = _first_param(model)
    try:
        labels_at = list(inspect.signature(model.forward).parameters).index("labels")
    except (TypeError, ValueError):
        labels_at = -1

    def pre(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if comm.sp:
            x, _ = first_input(args, kwargs, first)
            x = x if isinstance(x, torch.Tensor) else kwargs.get("inputs_embeds")
            comm.seq_full = None
            if isinstance(x, torch.Tensor) and x.dim() > comm.seq_dim:
                comm.set_sequence(x.shape[comm.seq_dim])
        labels = kwargs.get("labels", args[labels_at] if 0 <= labels_at < len(args) else None)
        comm.vocab_loss = vocab_loss and labels is not None and torch.is_grad_enabled()

    def post(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        comm.vocab_loss, comm.entry = False, None
    model.register_forward_pre_hook(pre, with_kwargs=True)
    model.register_forward_hook(post, with_kwargs=True, always_call=True)


def _install_columns(model: nn.Module, modules: dict, kinds: dict, comm: TPComm, head: Optional[str]) -> None:
    parents: dict[str, list[str]] = {}
    for n, k in kinds.items():
        if k in COLUMN_KINDS:
            parents.setdefault(parent_name(n), []).append(n)
    for parent, names in parents.items():
        pm = modules[parent]
        group = SiblingGroup(comm, [modules[n] for n in names], _first_param(pm))
        for i, n in enumerate(names):
            m = modules[n]
            _swap_class(m, VocabHead if n == head else ColwiseLinear)
            m._tp_group, m._tp_index, m._tp_gather = group, i, kinds[n] == "colwise_rep"
            if n == head:
                m._tp_vocab = m.out_features * comm.size
        if comm.sp and pm is not model:
            pm.register_forward_pre_hook(group.parent_pre_hook, with_kwargs=True)
        pm.register_forward_hook(group.parent_post_hook, with_kwargs=True, always_call=True)


def _install_loss(model: nn.Module, comm: TPComm, head: Optional[str]) -> bool:
    """transformers' causal-LM loss -> CausalLMLoss (vocab-parallel when the head returns its shard)."""
    if head is None:
        return False
    try:
        original = getattr(model, "loss_function", None)
    except Exception:
        return False
    if getattr(original, "__name__", "") != "ForCausalLMLoss":
        return False
    model.loss_function = CausalLMLoss(original, comm)
    return True


def apply_tensor_parallel(model: nn.Module, group: Any, plan: Optional[dict] = None,
                          sequence_parallel: bool = False) -> nn.Module:
    """Tensor (and sequence) parallelism over `group` (a CollectiveGroup: accelerate_c.comm.get_group(pg) of the TP
    process group), in place; returns `model`. plan: {module-name pattern: style} (transformers' style names), None
    for the model's own plan. sequence_parallel=True, or a "sequence_parallel" entry, turns on Megatron-SP.
    No collective runs here: every rank of the group calls it on the same model."""
    kinds = resolve(model, model_plan(model) if plan is None else plan)
    sp = bool(sequence_parallel) or "sequence_parallel" in kinds.values()
    if sp and "sequence_parallel" not in kinds.values():
        kinds.update({n: "sequence_parallel" for n in find_sequence_norms(model, kinds)})
    comm = TPComm(group, sp)
    modules = _validate(model, kinds, comm)
    head = head_name(model, kinds)
    for name, kind in kinds.items():
        if kind in _SPLIT:
            _slice_module(name, modules[name], kind, comm)
    _divide_heads(modules, kinds, comm)
    _install_columns(model, modules, kinds, comm, head)
    for name, kind in kinds.items():
        m = modules[name]
        if kind in ("rowwise", "rowwise_split"):
            _swap_class(m, RowwiseLinear)
            m._tp_comm, m._tp_split_input = comm, kind == "rowwise_split"
        elif kind == "vocab_embedding":
            _swap_class(m, VocabEmbedding)
            m._tp_comm = comm
        elif kind == "grad_allreduce" or (kind == "sequence_parallel" and sp):
            _grad_reduce_hooks(m, comm)
    if sp:
        entries = {n for n, k in kinds.items() if k == "sequence_parallel"}
        for n in sorted(entries | {parent_name(n) for n in entries}):
            m = modules[n] if n else model
            if m is not model:
                m.register_forward_pre_hook(_sp_entry_hook(comm, _first_param(m)), with_kwargs=True)
    _root_hooks(model, comm, _install_loss(model, comm, head))
    model._tp_state = TPState(comm, kinds, head)
    return model
