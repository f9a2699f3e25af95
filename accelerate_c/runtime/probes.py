# accelerate_c/runtime/probes.py: the plugin attributes and feature probes HF scripts read on AcceleratorState
# (deepspeed_plugin, device_mesh, is_fsdp2, get/select_deepspeed_plugin), as a mixin; state.py sets the plugins.
# Not for: the Accelerator's probes (facade/probes.py) or the features themselves.
from __future__ import annotations

from typing import Any, Optional

from ..base.dataclasses import DistributedType, TorchDynamoPlugin

NO_DEEPSPEED = ("DeepSpeed is not enabled, please make sure that an `Accelerator` is configured for `deepspeed` "
                "before calling this function.")


class StateProbes:
    """AcceleratorState's plugin attributes and probes."""

    distributed_type: Any
    _PLUGINS = ("deepspeed_plugins", "torch_tp_plugin", "parallelism_config", "fsdp_plugin", "megatron_lm_plugin")
    parallelism_config: Any
    parallel_layout: Any

    def _init_plugins(self, dynamo_plugin: Optional[TorchDynamoPlugin]) -> None:
        # HF leaves fsdp_plugin / megatron_lm_plugin unset (AttributeError) when unused; None answers the
        # same `getattr(state, "fsdp_plugin", None)` checks without raising on plain attribute access.
        for name in self._PLUGINS:
            setattr(self, name, None)
        self.dynamo_plugin = dynamo_plugin if dynamo_plugin is not None else TorchDynamoPlugin()

    @property
    def deepspeed_plugin(self) -> Any:
        """The active DeepSpeedPlugin; None when DeepSpeed is not used."""
        if self.distributed_type != DistributedType.DEEPSPEED:
            return None
        plugins = self.deepspeed_plugins
        if not isinstance(plugins, dict):
            return plugins
        return next(p for p in plugins.values() if p.selected)

    @property
    def device_mesh(self) -> Any:
        """HF's torch DeviceMesh: the layout's (built on first use, a collective) when a ParallelismConfig is set,
        else None (as HF); one assigned to the attribute wins."""
        given = self.__dict__.get("_device_mesh")
        if given is not None or self.__dict__.get("parallelism_config") is None:
            return given
        return self.parallel_layout.torch_device_mesh

    @device_mesh.setter
    def device_mesh(self, value: Any) -> None:
        self.__dict__["_device_mesh"] = value

    @property
    def is_fsdp2(self) -> bool:
        return self.distributed_type == DistributedType.FSDP and self.fsdp_plugin.fsdp_version == 2

    def _require_deepspeed(self) -> None:
        if self.distributed_type != DistributedType.DEEPSPEED:
            raise ValueError(NO_DEEPSPEED)

    def get_deepspeed_plugin(self, name: str) -> Any:
        self._require_deepspeed()
        return self.deepspeed_plugins[name]

    def select_deepspeed_plugin(self, name: Optional[str] = None) -> None:
        """Makes the named plugin (of a dict passed as deepspeed_plugins) the active one, as HF."""
        self._require_deepspeed()
        for key, plugin in self.deepspeed_plugins.items():
            if key != name:
                plugin._unselect()
        self.deepspeed_plugins[name].select(_from_accelerator_state=True)
