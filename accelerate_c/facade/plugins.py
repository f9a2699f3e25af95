# accelerate_c/facade/plugins.py: the Accelerator's FSDP / DeepSpeed plugins, settled as HF 1.15 settles them
# before the state is built (`sharding_plugins`): built from the launcher's variables when none was passed, a
# second Accelerator reusing the state's DeepSpeed plugins, the type checks, the ACCELERATE_USE_* variables set.
# Not for: the plugin classes (base/fsdp_plugin.py, deepspeed/plugin.py) or what the state does with them
# (runtime/state.py AcceleratorState._init_sharding, which only duck-types them).
from __future__ import annotations

from typing import Any

from ..base import settings
from ..base.dataclasses import DistributedType
from ..base.fsdp_plugin import FullyShardedDataParallelPlugin
from ..deepspeed.plugin import DeepSpeedPlugin
from ..runtime.state import AcceleratorState


def sharding_plugins(fsdp_plugin: Any, deepspeed_plugin: Any) -> tuple[Any, Any]:
    """The Accelerator's FSDP / DeepSpeed plugins, as HF 1.15 settles them: a plugin built from the FSDP_* /
    ACCELERATE_DEEPSPEED_* variables when ACCELERATE_USE_FSDP / ACCELERATE_USE_DEEPSPEED is true and none was
    passed (a second Accelerator reuses the state's DeepSpeed plugins), the type checks, and the USE variable set
    when a plugin is passed."""
    state = AcceleratorState._shared_state
    ds_in_use = state != {} and state.get("distributed_type") == DistributedType.DEEPSPEED
    if deepspeed_plugin is None:
        if ds_in_use:
            deepspeed_plugin = AcceleratorState().deepspeed_plugins
        elif settings.env_flag("ACCELERATE_USE_DEEPSPEED"):
            deepspeed_plugin = DeepSpeedPlugin()
    else:
        if ds_in_use and state.get("deepspeed_plugins") is not None:
            raise NotImplementedError("You cannot pass in a `deepspeed_plugin` when creating a second `Accelerator`. "
                                      "Please make sure the first `Accelerator` is initialized with all the plugins "
                                      "you want to use.")
        for plugin in deepspeed_plugin.values() if isinstance(deepspeed_plugin, dict) else [deepspeed_plugin]:
            if not isinstance(plugin, DeepSpeedPlugin):
                raise TypeError("`deepspeed_plugin` must be a DeepSpeedPlugin object.")
    if deepspeed_plugin is not None:
        settings.env_set("ACCELERATE_USE_DEEPSPEED", "true")
    if fsdp_plugin is None:
        if settings.env_flag("ACCELERATE_USE_FSDP") and deepspeed_plugin is None:
            fsdp_plugin = FullyShardedDataParallelPlugin()
    else:
        if not isinstance(fsdp_plugin, FullyShardedDataParallelPlugin):
            raise TypeError("`fsdp_plugin` must be a FullyShardedDataParallelPlugin object.")
        settings.env_set("ACCELERATE_USE_FSDP", "true")
    if fsdp_plugin is not None and deepspeed_plugin is not None:
        raise ValueError("Accelerator: pass either fsdp_plugin or deepspeed_plugin (or set ACCELERATE_USE_FSDP / "
                         "ACCELERATE_USE_DEEPSPEED), not both")
    return fsdp_plugin, deepspeed_plugin
