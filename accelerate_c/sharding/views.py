# accelerate_c/sharding/views.py: what user code sees of a sharded model's unit parameters. The engine keeps their
# values and gradients in flat buffers and shards (engine.py, zero3.py); these classes make every tensor user code
# can reach from a parameter valid, with DDP's meaning, whatever the engine is doing with the buffers behind it:
#   `.grad`: each unit parameter's class becomes a subclass of its own (made once per class, as torch's FSDP2 swaps
#            module classes) whose `grad` property asks the engine (gradviews.py: visible_grad / set_visible_grad): the
#            local gradient while it is unreduced, the averaged one after a synced backward. An averaged gradient
#            that lives sharded comes back as a PendingGrad: full shape, no storage of its own, gathered (collective:
#            every rank reads, in the same order, as torch FSDP2's DTensor gradients) the first time an op uses it,
#            so `p.grad is not None` and `p.grad = None` (Module.zero_grad) cost nothing.
#   stage 3, outside a unit's use: the parameter is a stand-in (its full shape over one element, stride 0: never a
#            shape larger than its storage) of a class whose __torch_function__ first gathers the unit into fresh
#            storage of the parameter's own (materialize_param, zero3.py; collective), then runs the op: reading a
#            weight, `.cpu()`, `state_dict()` or `load_state_dict` after prepare or after training gives the values.
#            Metadata (shape, numel, dtype, requires_grad, hooks) is answered without gathering.
# Not for: the buffers and collectives themselves (engine.py, zero3.py).
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.utils._pytree import tree_flatten, tree_map

_RAW = torch._C.TensorBase.grad  # the C grad slot, what autograd accumulates into


def raw_grad(p: torch.Tensor) -> Optional[torch.Tensor]:
    with torch._C.DisableTorchFunctionSubclass():  # (a stand-in's __torch_function__ would gather)
        return _RAW.__get__(p)


def set_raw_grad(p: torch.Tensor, g: Optional[torch.Tensor]) -> None:
    with torch._C.DisableTorchFunctionSubclass():
        _RAW.__set__(p, g)


class PendingGrad(torch.Tensor):
    """A gradient the engine holds sharded: full shape and dtype, materialized by `resolve()` (collective) the first
    time an op reads or writes it; in-place writes land in the materialized tensor, which the engine steps with."""

    @staticmethod
    def __new__(cls, shape: tuple, dtype: torch.dtype, device: torch.device, resolve: Callable[[], torch.Tensor]):
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=False)
        t._resolve, t._real = resolve, None
        return t

    def materialize(self) -> torch.Tensor:
        if self._real is None:
            self._real = self._resolve()
        return self._real

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        real = tree_map(lambda x: x.materialize() if isinstance(x, PendingGrad) else x, (args, kwargs))
        return func(*real[0], **real[1])

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        raise RuntimeError(f"a sharded gradient reached {func} below Python; use it through torch's Python API")

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return repr(self.materialize())


def _metadata() -> set:
    T = torch.Tensor
    props = ("shape", "dtype", "device", "requires_grad", "is_leaf", "grad_fn", "layout", "ndim", "names", "_version",
             "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_mkldnn", "is_nested", "output_nr",
             "itemsize", "nbytes", "_backward_hooks", "_post_accumulate_grad_hooks")
    out = {getattr(T, n).__get__ for n in props if hasattr(T, n)}
    out |= {getattr(T, n).__set__ for n in ("requires_grad", "_backward_hooks", "_post_accumulate_grad_hooks")}
    for n in ("size", "dim", "numel", "nelement", "element_size", "is_floating_point", "is_complex", "get_device",
              "requires_grad_", "register_hook", "register_post_accumulate_grad_hook", "__len__", "__hash__",
              "_is_view", "is_shared", "is_pinned"):
        if hasattr(T, n):
            out.add(getattr(T, n))
    return out


_METADATA = _metadata()


class _Visible:
    """Mixin of a unit parameter's class: `.grad` is the engine's visible gradient."""

    @property
    def grad(self) -> Optional[torch.Tensor]:
        view = self.__dict__.get("_acc_view")
        return raw_grad(self) if view is None else view[0].visible_grad(view[1])

    @grad.setter
    def grad(self, value: Optional[torch.Tensor]) -> None:
        view = self.__dict__.get("_acc_view")
        if view is None:
            set_raw_grad(self, value)
        else:
            view[0].set_visible_grad(view[1], value)

    @grad.deleter
    def grad(self) -> None:
        self.grad = None

    def __deepcopy__(self, memo: dict) -> torch.nn.Parameter:
        plain = _plain_class(type(self))
        with torch.no_grad():
            out = plain(self.data.clone(memory_format=torch.preserve_format), self.requires_grad)
        memo[id(self)] = out
        return out


class _StandIn(_Visible):
    """Mixin of a stage-3 parameter's class while its unit is not gathered: any op gathers it first."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        for x in tree_flatten((args, kwargs))[0]:
            if isinstance(x, _StandIn):
                view = x.__dict__.get("_acc_view")
                if view is not None:
                    view[0].materialize_param(view[1])
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


_CLASSES: dict[tuple[type, bool], type] = {}


def _plain_class(cls: type) -> type:
    while issubclass(cls, _Visible):
        cls = cls.__bases__[-1]
    return cls


def view_class(cls: type, standin: bool) -> type:
    """The subclass of parameter class `cls` (the user's: nn.Parameter or a subclass) for a unit parameter: with the
    visible-gradient property, and for a stand-in the gathering __torch_function__."""
    cls = _plain_class(cls)
    key = (cls, standin)
    out = _CLASSES.get(key)
    if out is None:
        mixin = _StandIn if standin else _Visible
        out = type(f"{'ShardedStandIn' if standin else 'Sharded'}{cls.__name__}", (mixin, cls), {})
        _CLASSES[key] = out
    return out


def attach(p: torch.nn.Parameter, views: Any, index: int, standin: bool = False) -> None:
    """p becomes entry `index` of an engine's GradViews `views` as user code sees it (its visible class, a
    stand-in's or not)."""
    p.__dict__["_acc_view"] = (views, index)
    p.__class__ = view_class(type(p), standin)


def set_standin(p: torch.nn.Parameter, standin: bool) -> None:
    """Switch p between its stand-in class and its plain visible class (before p.data is replaced, when leaving
    the stand-in; after it, when becoming one: the stand-in's __torch_function__ would gather)."""
    p.__class__ = view_class(type(p), standin)


def detach_view(p: torch.nn.Parameter) -> None:
    """p back to its own class, no engine behind it (the engine is removed)."""
    p.__dict__.pop("_acc_view", None)
    p.__class__ = _plain_class(type(p))


_ZEROS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def standin_data(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The data of a stage-3 parameter outside its unit's use: its shape over one zero element (stride 0)."""
    key = (dtype, torch.device(device))
    z = _ZEROS.get(key)
    if z is None:
        z = _ZEROS[key] = torch.zeros(1, dtype=dtype, device=device)
    return z.expand(shape) if shape else z.reshape(())
