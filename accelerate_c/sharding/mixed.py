# accelerate_c/sharding/mixed.py: the edges of the sharded engine's mixed precision (a compute dtype below fp32),
# what the flat units alone do not cover:
#  - modules kept in full precision (ShardedConfig.fp32_module_classes; default BatchNorm, FSDP1's
#    MixedPrecision._module_classes_to_ignore): their parameters stay out of the units (replicated, fp32, their
#    gradients averaged in fp32 as ignored modules' are), their buffers keep their dtype (buffer_dtype skips them),
#    their floating inputs are cast to fp32 on entry and their floating outputs back to the dtype the inputs had
#    (FSDP1's forward pre/post hooks on such modules), so the next layer computes in the compute dtype again;
#  - frozen parameters (requires_grad False, outside ignored and fp32 modules): kept out of the units, but cast to
#    the compute dtype for compute (FSDP2 casts every parameter of a fully_shard'ed module to param_dtype); the
#    fp32 value is kept here and is what a full state dict and the checkpoint slices give.
# Not for: the units' compute copy and master shards (engine.py) or floating buffers in general (buffers.py).
from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from ..runtime.operations import recursively_apply

FP32_MODULE_CLASSES: tuple[type, ...] = (_BatchNorm,)


def fp32_modules(model: torch.nn.Module, classes: Optional[Iterable[type]]) -> list[torch.nn.Module]:
    """The modules of `model` kept in full precision (classes None: the default, BatchNorm)."""
    classes = FP32_MODULE_CLASSES if classes is None else tuple(classes)
    for c in classes:
        if not (isinstance(c, type) and issubclass(c, torch.nn.Module)):
            raise TypeError(f"sharded engine: fp32_module_classes must be torch.nn.Module subclasses; got {c!r}")
    return [m for m in model.modules() if classes and isinstance(m, classes)]


class MixedEdges:
    """Hooks and fp32 values of one prepared model under a compute dtype `pdt` (see the file header)."""

    def __init__(self, model: torch.nn.Module, pdt: torch.dtype, fp32_mods: list[torch.nn.Module],
                 frozen: list[torch.nn.Parameter]) -> None:
        self.pdt = pdt
        self._handles: list[Any] = []
        self._in_dtype: dict[int, torch.dtype] = {}   # id(module) -> the dtype its floating inputs had
        for m in fp32_mods:
            # appended last, as FSDP1 does: the module's other hooks see the original inputs / fp32 outputs
            self._handles.append(m.register_forward_pre_hook(self._to_fp32))
            self._handles.append(m.register_forward_hook(self._back))
        self.frozen_master: dict[int, torch.Tensor] = {}  # id(param) -> its fp32 value
        self._frozen = []
        with torch.no_grad():
            for p in frozen:
                if p.dtype == torch.float32 and p.device.type != "meta":
                    self.frozen_master[id(p)] = p.data
                    self._frozen.append(p)
                    p.data = p.data.to(pdt)

    def _to_fp32(self, module: torch.nn.Module, args: tuple) -> tuple:
        self._in_dtype.pop(id(module), None)  # this call's inputs decide (a previous call's must not linger)

        def cast(x: torch.Tensor) -> torch.Tensor:
            if not x.is_floating_point() or x.dtype == torch.float32:
                return x
            self._in_dtype[id(module)] = x.dtype
            return x.float()
        return recursively_apply(cast, args)

    def _back(self, module: torch.nn.Module, args: tuple, output: Any) -> Any:
        dt = self._in_dtype.get(id(module))
        if dt is None:  # no low-precision floating input: nothing to cast back (as FSDP1)
            return output
        return recursively_apply(lambda x: x.to(dt) if x.is_floating_point() and x.dtype != dt else x, output)

    def fp32(self, t: torch.Tensor) -> torch.Tensor:
        """A frozen parameter's fp32 value (any other tensor unchanged)."""
        return self.frozen_master.get(id(t), t)

    @torch.no_grad()
    def refresh(self) -> None:
        """After a loader wrote the fp32 values: into the compute copies."""
        for p in self._frozen:
            p.data.copy_(self.frozen_master[id(p)])

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        for p in self._frozen:  # the model as the user gave it
            p.data = self.frozen_master[id(p)]
        self._frozen, self.frozen_master = [], {}
