# accelerate_c/tensor_parallel/plan.py: which module gets which tensor-parallel style. A plan is {module-name pattern:
# style} with transformers' names: a pattern is a dotted module name in which `*` stands for one name component
# ("model.layers.*.self_attn.q_proj"); every entry must match at least one module. plan=None takes the model's own
# plan: transformers' `tp_plan` (the class `_tp_plan` entries such as the LM head's plus the config's
# `base_model_tp_plan` under the base model's prefix, and the input embedding as "embedding_rowwise"). Styles are
# mapped to the engine's kinds (STYLES); sequence parallelism without "sequence_parallel" entries adds the norms of
# the residual stream (find_sequence_norms).
# Not for: slicing or hooks (apply.py).
from __future__ import annotations

import re
from typing import Optional

from torch import nn

# transformers' style name -> the engine's kind
STYLES = {
    "colwise": "colwise",
    "colwise_rep": "colwise_rep",
    "colwise_gather_output": "colwise_rep",
    "rowwise": "rowwise",
    "rowwise_rep": "rowwise_split",
    "rowwise_split_input": "rowwise_split",
    "embedding_rowwise": "vocab_embedding",
    "sequence_parallel": "sequence_parallel",
    "replicated_with_grad_allreduce": "grad_allreduce",
    "replicate": "replicate",
}
COLUMN_KINDS = ("colwise", "colwise_rep")


def model_plan(model: nn.Module) -> dict[str, str]:
    """The model's own plan (transformers' tp_plan, else the class plan plus the config's base-model plan)."""
    plan = getattr(model, "tp_plan", None)
    if isinstance(plan, dict) and plan:
        return dict(plan)
    plan = dict(getattr(type(model), "_tp_plan", None) or {})
    base = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    inner = prefix if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""
    plan.update({f"{inner}.{k}" if inner else k: v for k, v in base.items()})
    if not plan:
        raise ValueError(f"tensor parallelism: {type(model).__name__} has no tensor-parallel plan (no tp_plan, "
                         "_tp_plan or config.base_model_tp_plan); pass plan={module-name pattern: style}")
    return plan


def pattern_regex(pattern: str) -> re.Pattern:
    return re.compile(r"\.".join(r"[^.]+" if part == "*" else re.escape(part) for part in pattern.split(".")))


def resolve(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """{module name: kind} for every module the plan names (in model order). Unknown styles, entries that match no
    module and modules given two different kinds are errors naming them."""
    if not isinstance(plan, dict):
        raise TypeError(f"tensor parallelism: plan must be a dict {{module-name pattern: style}}, got "
                        f"{type(plan).__name__}")
    names = [n for n, _ in model.named_modules() if n]
    kinds: dict[str, str] = {}
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ValueError(f"tensor-parallel plan: unknown style {style!r} for {pattern!r} (supported: "
                             f"{', '.join(sorted(STYLES))})")
        rx = pattern_regex(pattern)
        hits = [n for n in names if rx.fullmatch(n)]
        if not hits:
            params = any(rx.fullmatch(n) for n, _ in model.named_parameters())
            raise ValueError(f"tensor-parallel plan: the pattern {pattern!r} matches no module of "
                             f"{type(model).__name__}" + (" (it names a parameter; plan entries name modules)"
                                                          if params else ""))
        for n in hits:
            kind = STYLES[style]
            if kinds.get(n, kind) != kind:
                raise ValueError(f"tensor-parallel plan: module {n!r} is given two styles ({kinds[n]} and {kind})")
            kinds[n] = kind
    order = {n: i for i, n in enumerate(names)}
    return dict(sorted(kinds.items(), key=lambda kv: order[kv[0]]))


def parent_name(name: str) -> str:
    return name.rpartition(".")[0]


def _is_norm(m: nn.Module) -> bool:
    return isinstance(m, (nn.LayerNorm, nn.RMSNorm)) or type(m).__name__.endswith(("Norm", "LayerNorm"))


def find_sequence_norms(model: nn.Module, kinds: dict[str, str]) -> list[str]:
    """The norms of the residual stream: norm modules outside any module that holds a column-parallel child (an
    attention's per-head q_norm/k_norm sees only this rank's heads: not a sequence-parallel norm) and outside planned
    modules."""
    inside = {parent_name(n) for n, k in kinds.items() if k in COLUMN_KINDS} | set(kinds)
    found = []
    for name, m in model.named_modules():
        if not name or not _is_norm(m):
            continue
        if any(name == p or name.startswith(p + ".") for p in inside if p):
            continue
        found.append(name)
    return found


def head_name(model: nn.Module, kinds: dict[str, str]) -> Optional[str]:
    """The LM head among the column-parallel entries: the module transformers' get_output_embeddings() returns (or
    one named lm_head)."""
    head = None
    getter = getattr(model, "get_output_embeddings", None)
    if callable(getter):
        try:
            head = getter()
        except (NotImplementedError, AttributeError):
            head = None
    for name, m in model.named_modules():
        if name in kinds and kinds[name] in COLUMN_KINDS and (m is head or (head is None and name == "lm_head")):
            return name
    return None
