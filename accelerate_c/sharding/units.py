# accelerate_c/sharding/units.py: which parameters the sharded engine groups into units (FSDP's wrapped modules,
# one flat buffer each) and which it leaves replicated. Policies (ShardedConfig.auto_wrap_policy):
#   transformer_based_wrap: every module whose class name is in transformer_layer_cls starts a unit;
#   size_based_wrap:        bottom-up, a module holding >= min_num_params not-yet-wrapped parameters is a unit;
#   no_wrap:                the whole model is one unit;
#   callable:               the user's policy function (torch's signature: module, recurse, nonwrapped_numel;
#                           e.g. functools.partial(transformer_auto_wrap_policy, ...)), walked as FSDP's
#                           recursive wrap does: a unit per module for which it says wrap.
# transformer_based_wrap without class names takes them from the model's `_no_split_modules` (transformers
# models), as HF does at prepare.
# The root module is always a unit and takes what no inner unit took. A parameter registered in several modules
# (tied weights) belongs to the deepest unit that contains every place it is registered, so a unit never needs
# another unit's parameters. Parameters of ignored_modules and frozen ones (requires_grad False) stay out of
# every unit: they are replicated (ignored ones are averaged like DDP's; frozen ones never stepped).
# Not for: buffers and their layout (flat.py) or anything that communicates (engine.py).
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch

POLICIES = ("transformer_based_wrap", "size_based_wrap", "no_wrap", "callable")


@dataclass
class UnitSpec:
    """One unit: the module whose forward brackets its use (`name` "" is the root) and its parameters, in
    registration order, each under its first name."""

    name: str
    module: torch.nn.Module
    params: list[tuple[str, torch.nn.Parameter]]


def _ignored_params(model: torch.nn.Module, ignored: Iterable[Any]) -> set[int]:
    """ids of the parameters of ignored modules (module objects, or regex strings matched against module names)."""
    out: set[int] = set()
    items = list(ignored)
    for item in items:
        if isinstance(item, str):
            pattern = re.compile(item)
            mods = [m for n, m in model.named_modules() if n and pattern.fullmatch(n)]
        elif isinstance(item, torch.nn.Module):
            mods = [item]
        else:
            raise TypeError(f"ignored_modules: expected modules or a regex string, got {type(item).__name__}: {item!r}")
        for m in mods:
            out.update(id(p) for p in m.parameters())
    return out


def _callable_units(model: torch.nn.Module, fn: Callable[..., Any], ignored: set[int]) -> list[str]:
    """FSDP's recursive wrap with a policy function: a module is descended into when fn(recurse=True) says so, and
    becomes a unit when fn(recurse=False) says so for the parameters its inner units left (never the root: it
    is always a unit). Names in post-order."""
    chosen: list[str] = []

    def visit(prefix: str, module: torch.nn.Module) -> int:
        numel = sum(p.numel() for p in module.parameters() if id(p) not in ignored)
        if not fn(module=module, recurse=True, nonwrapped_numel=numel):
            return 0
        wrapped = sum(visit(f"{prefix}.{n}" if prefix else n, c) for n, c in module.named_children())
        if prefix and fn(module=module, recurse=False, nonwrapped_numel=numel - wrapped):
            chosen.append(prefix)
            return numel
        return wrapped

    visit("", model)
    return chosen


def _unit_modules(model: torch.nn.Module, policy: str, layer_cls: tuple[str, ...], min_num_params: int,
                  trainable: set[int], policy_fn: Optional[Callable[..., Any]] = None,
                  ignored: frozenset = frozenset()) -> list[str]:
    """Names of the modules that start a unit (root "" first, then registration order)."""
    if policy not in POLICIES:
        raise ValueError(f"auto_wrap_policy={policy!r}: allowed values are {', '.join(POLICIES)}")
    names = [""]
    if policy == "callable":
        if not callable(policy_fn):
            raise ValueError(f"auto_wrap_policy='callable' needs the policy function (auto_wrap_callable); got "
                             f"{policy_fn!r}")
        order = {n: i for i, (n, _) in enumerate(model.named_modules())}
        return names + sorted(_callable_units(model, policy_fn, set(ignored)), key=order.__getitem__)
    if policy == "transformer_based_wrap":
        if not layer_cls:  # HF at prepare: the model's own list (transformers' PreTrainedModel._no_split_modules)
            layer_cls = tuple(getattr(model, "_no_split_modules", None) or ())
        if not layer_cls:
            raise ValueError("auto_wrap_policy='transformer_based_wrap' needs transformer_layer_cls (class names "
                             f"of the layers to wrap, e.g. GPT2Block): none given and {type(model).__name__} has no "
                             "_no_split_modules")
        wanted = set(layer_cls)
        found = {type(m).__name__ for m in model.modules()}
        missing = sorted(wanted - found)
        if missing:
            raise ValueError(f"transformer_layer_cls: no module of class {', '.join(missing)} in the model "
                             f"({type(model).__name__})")
        names += [n for n, m in model.named_modules() if n and type(m).__name__ in wanted]
    elif policy == "size_based_wrap":
        taken: set[int] = set()
        chosen: list[str] = []

        def visit(prefix: str, module: torch.nn.Module) -> None:  # post-order: inner units first
            for child_name, child in module.named_children():
                visit(f"{prefix}.{child_name}" if prefix else child_name, child)
            if not prefix:
                return
            free = {id(p): p.numel() for p in module.parameters() if id(p) in trainable and id(p) not in taken}
            if sum(free.values()) >= min_num_params:
                chosen.append(prefix)
                taken.update(free)

        visit("", model)
        order = {n: i for i, (n, _) in enumerate(model.named_modules())}
        names += sorted(chosen, key=order.__getitem__)
    return names


def build_units(model: torch.nn.Module, policy: str = "no_wrap", layer_cls: tuple[str, ...] = (),
                min_num_params: int = 100_000_000, ignored_modules: Iterable[Any] = (),
                policy_fn: Optional[Callable[..., Any]] = None
                ) -> tuple[list[UnitSpec], list[tuple[str, torch.nn.Parameter]]]:
    """(units in forward/registration order with the root first, replicated parameters). Units left without
    trainable parameters are dropped (the root is kept only when it has some). policy_fn: the function of policy
    "callable"."""
    ignored = _ignored_params(model, ignored_modules)
    trainable = {id(p) for p in model.parameters() if p.requires_grad and id(p) not in ignored}
    unit_names = _unit_modules(model, policy, tuple(layer_cls), int(min_num_params), trainable, policy_fn,
                               frozenset(ignored))
    modules = dict(model.named_modules())
    # every place each parameter is registered
    places: dict[int, list[str]] = {}
    first: dict[int, tuple[str, torch.nn.Parameter]] = {}
    for full, p in model.named_parameters(remove_duplicate=False):
        places.setdefault(id(p), []).append(full.rpartition(".")[0])
        first.setdefault(id(p), (full, p))

    def inside(mod: str, unit: str) -> bool:
        return unit == "" or mod == unit or mod.startswith(unit + ".")

    by_unit: dict[str, list[tuple[str, torch.nn.Parameter]]] = {n: [] for n in unit_names}
    replicated: list[tuple[str, torch.nn.Parameter]] = []
    for pid, (name, p) in first.items():
        if pid not in trainable:
            replicated.append((name, p))
            continue
        # the deepest unit containing every registration (unit names are in pre-order: the last match is deepest)
        owner = ""
        for u in unit_names:
            if all(inside(m, u) for m in places[pid]):
                owner = u if len(u) >= len(owner) else owner
        by_unit[owner].append((name, p))
    units = [UnitSpec(n, modules[n], ps) for n, ps in by_unit.items() if ps]
    return units, replicated
