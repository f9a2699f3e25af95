# accelerate_c/sharding/materialize.py: sharded construction. A model built on the meta device (no storage) is
# materialised one module at a time, in post-order (children before their parent, as transformers'
# initialize_weights and torch's reset_parameters convention do), and each finished tensor is handed to a sink
# (the engine keeps this rank's shard piece and drops the rest), so no rank ever holds the whole model.
# Initialisation: a transformers PreTrainedModel's own `_initialize_weights` (which dispatches to nested
# sub-models' own init), else each module's `reset_parameters()`; a module with meta tensors and neither is an
# error naming it. Tied parameters (one Parameter object reached from several modules) are materialised once and
# handed to the sink after the last module that uses them is initialised (its init may rewrite them). A meta
# Parameter keeps its identity (its contents are swapped for real ones), so optimizers and tables built over the
# meta model stay valid; an `alloc` hook may place each tensor (sharding/construct.py: straight into its unit's flat
# buffer). `check_initializable` raises the init error up front, for callers that must agree before communicating.
# Reference for tests: `materialize_model` does the same on one process; an eagerly built model re-initialised
# by `reinitialize(model)` from the same seed gets bitwise the same values.
# Not for: packing shards (the engine) or loading pretrained weights (checkpointing/).
from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Iterator, Optional

import torch
from torch import nn

Sink = Callable[[str, torch.Tensor, bool], None]  # (name, materialised tensor, is_parameter)


def has_meta(module: nn.Module) -> bool:
    """True when any parameter or buffer of `module` lives on the meta device."""
    return any(t.is_meta for t in module.parameters()) or any(t.is_meta for t in module.buffers())


def _post_order(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    for name, child in module.named_children():
        yield from _post_order(child, f"{prefix}{name}.")
    yield prefix[:-1], module


def _is_hf(m: nn.Module) -> bool:
    """A transformers PreTrainedModel (by what is used of it: its config and its own weight initialiser)."""
    return hasattr(m, "config") and callable(getattr(m, "_initialize_weights", None))


def _init_fn(root: nn.Module) -> Callable[[nn.Module], None]:
    """The function that initialises one module's own tensors (see the header)."""
    owners: dict[int, Callable[[nn.Module], None]] = {}
    if _is_hf(root):
        # a nested PreTrainedModel initialises its own subtree with its own _init_weights (transformers' smart_apply)
        def assign(m: nn.Module, fn: Callable[[nn.Module], None]) -> None:
            for child in m.children():
                assign(child, child._initialize_weights if _is_hf(child) else fn)
            owners[id(m)] = fn
        assign(root, root._initialize_weights)

        def init(m: nn.Module) -> None:
            fn = owners[id(m)]
            with torch.no_grad():
                try:
                    fn(m, False)
                except TypeError:  # older signature: (module)
                    fn(m)
        return init

    names = {id(m): n for n, m in root.named_modules()}

    def init_torch(m: nn.Module) -> None:
        own = [t for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False))]
        if not own:
            return
        reset = _reset_of(m)
        if reset is None:
            raise ValueError(_no_init(m, names.get(id(m), "")))
        with torch.no_grad():
            reset()
    return init_torch


def _reset_of(m: nn.Module) -> Optional[Callable[[], None]]:
    return getattr(m, "reset_parameters", None) or getattr(m, "_reset_parameters", None)


def _no_init(m: nn.Module, name: str) -> str:
    where = f" ({name!r})" if name else " (the root)"
    return (f"sharded construction: module {type(m).__name__}{where} has tensors on the meta device but no "
            "reset_parameters() to initialise them; build it on a real device or give it one")


def check_initializable(model: nn.Module) -> None:
    """Raises materialize_stream's error for a module it could not initialise, before anything is allocated (a
    collective caller checks first, so that no rank is left waiting for units that never come)."""
    if _is_hf(model):
        return
    for name, m in model.named_modules():
        own = list(m.parameters(recurse=False)) + list(m.buffers(recurse=False))
        if any(t.is_meta for t in own) and _reset_of(m) is None:
            raise ValueError(_no_init(m, name))


Alloc = Callable[[str, torch.Tensor, bool], Optional[torch.Tensor]]  # (name, meta tensor, is_param) -> storage
AroundInit = Callable[[nn.Module], ContextManager]  # module -> the context its initialisation runs in


def _plan(model: nn.Module, units: Optional[list[nn.Module]]) -> tuple[list[tuple[str, nn.Module]], dict[int, int],
                                                                          dict[int, str]]:
    """(post-order of the modules, id(tensor) -> the order index after which it goes to the sink, id -> first name).
    A tensor goes after the post-order visit of the nearest enclosing module among `units` (the model itself always
    counts) of every module that registers it (see materialize_stream)."""
    order = list(_post_order(model))
    pos = {id(m): i for i, (_, m) in enumerate(order)}
    boundary = {id(model)} | {id(u) for u in (units or [])}
    release: dict[int, int] = {}  # id(module) -> the order index after which its own tensors may go

    def walk(m: nn.Module, at: int) -> None:
        here = pos[id(m)] if id(m) in boundary else at
        release[id(m)] = here
        for child in m.children():
            walk(child, here)
    walk(model, pos[id(model)])
    names: dict[int, str] = {}
    for n, p in model.named_parameters():
        names.setdefault(id(p), n)
    for n, b in model.named_buffers():
        names.setdefault(id(b), n)
    last: dict[int, int] = {}
    for _, m in order:
        for t in list(m._parameters.values()) + list(m._buffers.values()):
            if t is not None:
                last[id(t)] = max(last.get(id(t), -1), release[id(m)])
    return order, last, names


def release_points(model: nn.Module, units: Optional[list[nn.Module]] = None) -> dict[int, int]:
    """id(tensor) -> the post-order index after which materialize_stream hands it to the sink (every rank computes
    the same schedule from the module structure alone, meta or not)."""
    return _plan(model, units)[1]


def _real_param(old: nn.Parameter, data: torch.Tensor) -> None:
    """Turns the meta Parameter `old` into one holding `data`, keeping the object (optimizers, tied modules and the
    engine's tables hold it by identity); Python attributes carry over except transformers' init flag."""
    new = nn.Parameter(data, requires_grad=old.requires_grad)
    new.__dict__.update({k: v for k, v in old.__dict__.items() if k != "_is_hf_initialized"})
    torch.utils.swap_tensors(old, new)


def materialize_stream(model: nn.Module, sink: Sink, device: torch.device | str = "cpu",
                       units: Optional[list[nn.Module]] = None, alloc: Optional[Alloc] = None,
                       around_init: Optional[AroundInit] = None) -> None:
    """Materialises every meta tensor of `model` on `device`, module by module in post-order, initialises each
    module and hands each tensor to `sink(name, tensor, is_param)` once initialisation can no longer touch it: after
    the post-order visit of the nearest enclosing module among `units` (the model itself always counts; a
    transformers init may rewrite a child's tensors from the parent, e.g. GPT-2's scaled c_proj), and after the last
    such point of every module that shares it (tied weights). Tensors already real are handed over too, so the sink
    sees every parameter and buffer once, by its first name in named_parameters()/named_buffers() order. The peak
    is the largest unit (plus tied tensors kept until their last use).
    A meta Parameter stays the same Python object (its contents are swapped for real ones); a meta buffer is
    replaced in its module. `alloc(name, meta tensor, is_param)` may supply the storage (e.g. a view of the unit's
    flat buffer, so nothing is copied afterwards); None or no alloc: a fresh torch.empty on `device`.
    `around_init(module)` (optional) returns a context manager each module's initialisation runs in (tensor
    parallelism: the random stream of a module holding slices, see tensor_parallel.init_rng)."""
    device = torch.device(device)
    init = _init_fn(model)
    hf = _is_hf(model)
    order, last, names = _plan(model, units)
    made: dict[int, torch.Tensor] = {}  # id(original tensor) -> its materialised replacement (or itself)
    was_meta: set[int] = set()          # a module sharing one of these (tied) is initialised too, as its first user
    pending: dict[int, list[tuple[str, torch.Tensor, bool]]] = {}
    for i, (_, m) in enumerate(order):
        touched = False
        for slot, is_param in ((m._parameters, True), (m._buffers, False)):
            for key, t in list(slot.items()):
                if t is None:
                    continue
                new = made.get(id(t))
                if new is None:
                    name = names.get(id(t), key)
                    new = t
                    if t.is_meta:
                        data = alloc(name, t, is_param) if alloc is not None else None
                        if data is None:
                            data = torch.empty(t.shape, dtype=t.dtype, device=device)
                        if is_param:
                            _real_param(t, data)
                        else:
                            new = data
                        was_meta.add(id(t))
                    made[id(t)] = new
                    pending.setdefault(last[id(t)], []).append((name, new, is_param))
                if new is not t:
                    slot[key] = new
                touched = touched or id(t) in was_meta
        if touched or hf:
            with around_init(m) if around_init is not None else contextlib.nullcontext():
                init(m)
        for name, t, is_param in pending.pop(i, []):
            sink(name, t, is_param)


def materialize_model(model: nn.Module, device: torch.device | str = "cpu",
                      around_init: Optional[AroundInit] = None) -> nn.Module:
    """The whole model at once (one process): the same values, in the same order, as sharded construction."""
    materialize_stream(model, lambda name, t, is_param: None, device, around_init=around_init)
    return model


def reinitialize(model: nn.Module) -> nn.Module:
    """Re-initialises an eagerly built model exactly as materialize_model initialises a meta one (post-order,
    same init functions): the reference for sharded construction's values."""
    for _, m in _post_order(model):
        if hasattr(m, "_is_hf_initialized"):
            m._is_hf_initialized = False
        for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False)):
            if hasattr(t, "_is_hf_initialized"):
                t._is_hf_initialized = False
    init = _init_fn(model)
    hf = _is_hf(model)
    for _, m in _post_order(model):
        if hf or any(True for _ in m.parameters(recurse=False)) or any(True for _ in m.buffers(recurse=False)):
            init(m)
    return model


def meta_names(model: nn.Module) -> Optional[list[str]]:
    """Names of the tensors still on the meta device (None when there are none)."""
    found = [n for n, p in model.named_parameters() if p.is_meta] + [n for n, b in model.named_buffers() if b.is_meta]
    return found or None
