# accelerate_c/pipeline/stages.py: cutting a model's layer list into pipeline stages, and pruning a model down to
# what one rank holds. A cut is a list of layer-index ranges, contiguous and in order: from a user split (the layer
# index, or the module name such as "model.layers.2", at which each stage after the first begins: torch pipelining's
# split points at the beginning of a module), balanced by parameter count (the embedding counted with the first
# stage, the final norm and the head with the last), or equal (interleaved schedules: the layers must divide by the
# p·v stages). Pruning removes the other stages' layers and the first/last modules a rank does not hold, in place,
# keeping every remaining tensor's logical name (a kept layer stays "model.layers.5"), so the pruned model's
# state_dict() is that rank's share of the model's logical tensors. A meta-device model is pruned before it is
# materialised, so the other stages' tensors never take memory.
# Not for: how a family of models runs a stage (adapters.py), executing schedules (runtime.py).
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
from torch import nn

Split = Optional[Sequence[Union[int, str]]]


def _cuts_of(split: Sequence[Union[int, str]], layer_path: str, n: int) -> list:
    cuts = []
    for c in split:
        if isinstance(c, str):
            prefix = layer_path + "." if layer_path else ""
            tail = c[len(prefix):] if c.startswith(prefix) else None
            if tail is None or not tail.isdigit():
                raise ValueError(f"pipeline split point {c!r} is not a layer of {layer_path or 'the model'} "
                                 f"(expected '{prefix}<index>' with an index below {n})")
            c = int(tail)
        cuts.append(int(c))
    return cuts


def from_split(split: Sequence[Union[int, str]], num_layers: int, num_stages: int,
               layer_path: str = "") -> list:
    """Stages from split points: stage k+1 begins at split[k]. Errors name the stage left empty or the numbers."""
    cuts = _cuts_of(split, layer_path, num_layers)
    if len(cuts) != num_stages - 1:
        raise ValueError(f"pipeline split {list(split)} has {len(cuts)} split points; {num_stages} stages need "
                         f"{num_stages - 1}")
    bounds = [0] + cuts + [num_layers]
    for k in range(num_stages):
        lo, hi = bounds[k], bounds[k + 1]
        if not 0 <= lo < hi <= num_layers:
            raise ValueError(f"pipeline split {list(split)} leaves stage {k} empty (its layers would be "
                             f"{lo}..{hi - 1} of {num_layers})")
    return [list(range(bounds[k], bounds[k + 1])) for k in range(num_stages)]


def balanced(weights: Sequence[int], num_stages: int, first_extra: int = 0, last_extra: int = 0) -> list:
    """Contiguous stages minimising the heaviest stage's weight (layer weights, plus the extras on the first and
    last stage), and among those the sum of squared stage weights (the most even); exact, by dynamic programming."""
    n, S = len(weights), num_stages
    pre = [0]
    for w in weights:
        pre.append(pre[-1] + w)

    def cost(k: int, lo: int, hi: int) -> int:
        return pre[hi] - pre[lo] + (first_extra if k == 0 else 0) + (last_extra if k == S - 1 else 0)

    def solve(key, cap: float) -> tuple:
        """best[k][i]: the first i layers in k stages (each at most cap), minimising key-combined costs."""
        inf = float("inf")
        best = [[inf] * (n + 1) for _ in range(S + 1)]
        arg = [[0] * (n + 1) for _ in range(S + 1)]
        best[0][0] = 0
        for k in range(1, S + 1):
            for i in range(k, n - (S - k) + 1):
                for j in range(k - 1, i):
                    c = cost(k - 1, j, i)
                    if c <= cap and best[k - 1][j] < inf and key(best[k - 1][j], c) < best[k][i]:
                        best[k][i], arg[k][i] = key(best[k - 1][j], c), j
        return best[S][n], arg

    top, _ = solve(max, float("inf"))
    _, arg = solve(lambda acc, c: acc + c * c, top)
    bounds, i = [n], n
    for k in range(S, 0, -1):
        i = arg[k][i]
        bounds.append(i)
    bounds.reverse()
    return [list(range(bounds[k], bounds[k + 1])) for k in range(S)]


def plan_stages(num_layers: int, num_stages: int, *, split: Split = None, weights: Optional[Sequence[int]] = None,
                first_extra: int = 0, last_extra: int = 0, equal: bool = False, layer_path: str = "",
                pp_size: int = 0, virtual: int = 1) -> list:
    """The layer indices of each of `num_stages` stages (see the header). `equal`: interleaved schedules, where
    every stage gets num_layers / num_stages layers."""
    what = f"{num_stages} pipeline stages" + (f" (pp_size={pp_size} x {virtual} virtual stages)" if virtual > 1 else "")
    where = f" ({layer_path})" if layer_path else ""
    if num_layers < num_stages:
        raise ValueError(f"{what} but the model has only {num_layers} layers{where}")
    if split is not None:
        return from_split(split, num_layers, num_stages, layer_path)
    if equal:
        if num_layers % num_stages:
            raise ValueError(f"interleaved 1F1B needs the layers to divide by pp_size x virtual stages: "
                             f"{num_layers} layers{where}, {what}")
        per = num_layers // num_stages
        return [list(range(k * per, (k + 1) * per)) for k in range(num_stages)]
    return balanced(list(weights) if weights is not None else [1] * num_layers, num_stages, first_extra, last_extra)


def get_module(root: nn.Module, path: str) -> Optional[nn.Module]:
    return root.get_submodule(path) if path else root


def _drop(root: nn.Module, path: str) -> None:
    parent, _, name = path.rpartition(".")
    owner = get_module(root, parent)
    if owner is not None and name in owner._modules:
        owner._modules[name] = None


def prune(root: nn.Module, layer_path: str, keep_layers: set, drop_modules: Sequence[str]) -> None:
    """In place: the layer list at `layer_path` keeps only `keep_layers` (under their own indices), and each module
    of `drop_modules` (first/last-stage modules this rank does not hold) is removed."""
    layers = get_module(root, layer_path)
    for key in list(layers._modules):
        if int(key) not in keep_layers:
            del layers._modules[key]
    for path in drop_modules:
        _drop(root, path)


def kept_layers(root: nn.Module, layer_path: str) -> dict:
    """index -> layer module, of the layers a pruned model still holds."""
    return {int(k): m for k, m in get_module(root, layer_path)._modules.items() if m is not None}


def param_count(module: Optional[nn.Module]) -> int:
    return sum(p.numel() for p in module.parameters()) if module is not None else 0


def tied_groups(root: nn.Module) -> list:
    """Groups of parameter names that share one Parameter object (tied weights), each in registration order."""
    by_id: dict = {}
    for name, p in root.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def meta_tensors(root: nn.Module) -> bool:
    return any(t.is_meta for t in root.parameters()) or any(t.is_meta for t in root.buffers())


def sizes_of(root: nn.Module) -> dict:
    """name -> (shape, dtype) of every parameter and buffer (logical names), readable on the meta device."""
    out = {n: (tuple(t.shape), t.dtype) for n, t in root.named_parameters(remove_duplicate=False)}
    out.update({n: (tuple(t.shape), t.dtype) for n, t in root.named_buffers()})
    return out


def first_param_dtype(root: nn.Module) -> torch.dtype:
    return next((p.dtype for p in root.parameters()), torch.float32)
