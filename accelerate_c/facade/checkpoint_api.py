# accelerate_c/facade/checkpoint_api.py: the checkpoint half of the Accelerator API (save_state, load_state,
# save_model, save, register_for_checkpointing, state hooks), as a mixin delegating to
# accelerate_c.checkpointing, which owns the on-disk format and the atomic writes (`save` is utils.other.save).
# Not for: the format itself (checkpointing/).
from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch


class _RemovableHandle:
    def __init__(self, registry: dict, key: int) -> None:
        self._registry, self._key = registry, key

    def remove(self) -> None:
        self._registry.pop(self._key, None)


class CheckpointAPI:
    _custom_objects: list
    project_configuration: Any
    _save_model_state_pre_hook: dict
    _load_model_state_pre_hook: dict

    def save_state(self, output_dir: Optional[str] = None, safe_serialization: bool = True, **kwargs: Any) -> str:
        from ..checkpointing import save_state
        return save_state(self, output_dir, safe_serialization=safe_serialization, **kwargs)

    def load_state(self, input_dir: Optional[str] = None, load_kwargs: Optional[dict] = None, **kwargs: Any) -> None:
        from ..checkpointing import load_state
        return load_state(self, input_dir, load_kwargs=load_kwargs, **kwargs)

    def save_model(self, model: torch.nn.Module, save_directory: str, max_shard_size: Union[int, str] = "10GB",
                   safe_serialization: bool = True) -> None:
        from ..checkpointing import save_model
        return save_model(self, model, save_directory, max_shard_size=max_shard_size,
                          safe_serialization=safe_serialization)

    def save(self, obj: Any, f: Any, safe_serialization: bool = False) -> None:
        from ..utils.other import save
        save(obj, f, save_on_each_node=self.project_configuration.save_on_each_node,
             safe_serialization=safe_serialization)

    def register_for_checkpointing(self, *objects: Any) -> None:
        invalid = [o for o in objects if not (hasattr(o, "state_dict") and hasattr(o, "load_state_dict"))]
        if invalid:
            names = "\n".join(f"\t- Item at index {i}, `{type(o).__name__}`" for i, o in enumerate(invalid))
            raise ValueError("All `objects` must include a `state_dict` and `load_state_dict` function to be "
                             f"stored. The following inputs are invalid:\n{names}")
        self._custom_objects.extend(objects)

    def register_save_state_pre_hook(self, hook: Callable) -> _RemovableHandle:
        key = id(hook)
        self._save_model_state_pre_hook[key] = hook
        return _RemovableHandle(self._save_model_state_pre_hook, key)

    def register_load_state_pre_hook(self, hook: Callable) -> _RemovableHandle:
        key = id(hook)
        self._load_model_state_pre_hook[key] = hook
        return _RemovableHandle(self._load_model_state_pre_hook, key)
