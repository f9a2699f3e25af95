# accelerate_c/runtime/gradient.py: GradientState, the accumulation / end-of-dataloader bookkeeping shared by the
# Accelerator, its prepared optimizers and schedulers, and the prepared dataloaders (a "Borg" object, as in HF).
# Scripts import it from accelerate_c.runtime.state (HF's path), which re-exports it.
# Not for: the process or precision state (state.py) or the accumulation decision itself (accelerator.py).
from __future__ import annotations

import weakref
from typing import Any, Optional

from ..base.dataclasses import DistributedType, GradientAccumulationPlugin
from .borg import reduce_shared


class GradientState:
    """Accumulation and dataloader bookkeeping shared by the Accelerator, its optimizers/schedulers and the
    prepared dataloaders. While an Accelerator exists, `sync_gradients` is the C field of that Accelerator
    (accelerate_c._C.Accelerator._sync_gradients), so the per-step path is one C attribute."""

    _shared_state: dict[str, Any] = {}

    def __init__(self, gradient_accumulation_plugin: Optional[GradientAccumulationPlugin] = None) -> None:
        self.__dict__ = self._shared_state
        if not self.initialized:
            self._sync_gradients = True
            self._owner_ref = None
            self._dataloader_references_ref = [None]
            self.plugin_kwargs = gradient_accumulation_plugin.to_kwargs() if gradient_accumulation_plugin else {}
            self._is_xla_gradients_synced = False
        if gradient_accumulation_plugin is not None and self.plugin_kwargs != gradient_accumulation_plugin.to_kwargs():
            self.plugin_kwargs = gradient_accumulation_plugin.to_kwargs()

    @property
    def initialized(self) -> bool:
        return GradientState._shared_state != {}

    def __reduce__(self) -> tuple:
        return reduce_shared(self)

    def _attach(self, accelerator: Any) -> None:
        self._owner_ref = weakref.ref(accelerator)
        accelerator._sync_gradients = self._sync_gradients

    def _owner(self) -> Any:
        ref = self.__dict__.get("_owner_ref")
        return ref() if ref is not None else None

    @property
    def sync_gradients(self) -> bool:
        owner = self._owner()
        return bool(owner._sync_gradients) if owner is not None else self._sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        self._set_sync_gradients(value)

    def _set_sync_gradients(self, sync_gradients: bool) -> None:
        self._sync_gradients = bool(sync_gradients)
        owner = self._owner()
        if owner is not None:
            owner._sync_gradients = bool(sync_gradients)

    @property
    def is_xla_gradients_synced(self) -> bool:
        """HF's flag for XLA runs, where the code that reduces gradients sets it (nothing here does: no XLA); True
        under FSDP, whose gradients are always reduced (HF reads its FSDP variable, we the Accelerator's state)."""
        owner = self._owner()
        if owner is not None and owner.distributed_type == DistributedType.FSDP:
            return True
        return bool(self.__dict__.get("_is_xla_gradients_synced", False))

    @is_xla_gradients_synced.setter
    def is_xla_gradients_synced(self, is_synced: bool) -> None:
        self._is_xla_gradients_synced = is_synced

    @property
    def num_steps(self) -> int:
        return self.plugin_kwargs.get("num_steps", 1)

    @property
    def adjust_scheduler(self) -> bool:
        return self.plugin_kwargs.get("adjust_scheduler", False)

    @property
    def sync_with_dataloader(self) -> bool:
        return self.plugin_kwargs.get("sync_with_dataloader", True)

    @property
    def end_of_dataloader(self) -> bool:
        return bool(self.active_dataloader.end_of_dataloader) if self.in_dataloader else False

    @property
    def remainder(self) -> int:
        return self.active_dataloader.remainder if self.in_dataloader else -1

    @property
    def dataloader_references(self) -> list:
        return [r() if r is not None else None for r in self._dataloader_references_ref]

    @dataloader_references.setter
    def dataloader_references(self, references: list) -> None:
        self._dataloader_references_ref = [weakref.ref(d) if d is not None else None for d in references]

    @property
    def active_dataloader(self) -> Any:
        return self.dataloader_references[-1]

    @property
    def in_dataloader(self) -> bool:
        return self.active_dataloader is not None

    def _add_dataloader(self, dataloader: Any) -> None:
        self.dataloader_references = self.dataloader_references + [dataloader]

    def _remove_dataloader(self, dataloader: Any) -> None:
        self.dataloader_references = [d for d in self.dataloader_references if d is not dataloader]

    def __repr__(self) -> str:
        return (f"Sync Gradients: {self.sync_gradients}\nAt end of current dataloader: {self.end_of_dataloader}\n"
                f"Extra samples added: {self.remainder}\nGradient accumulation plugin: {self.plugin_kwargs}\n")

    @staticmethod
    def _reset_state() -> None:
        GradientState._shared_state.clear()
