# accelerate_c/deepspeed/face.py: what a strategy asks of the run's DeepSpeedPlugin, in one object the strategy
# builds once (Strategy.deepspeed = deepspeed_face(plugin)): the configuration fields the JSON sets, the prepare-time
# resolution of "auto" values and Dummy objects, the config re-read after it, and HF's DeepSpeed-engine rules for
# state dicts and saved weights. Without a plugin the same questions get NO_DEEPSPEED's "nothing to do" answers, so
# the strategy code asks them unconditionally.
# Not for: the JSON schema (schema.py), the resolution itself (prepare.py), the sharded engine's fields
# (sharding/config.py reads them from the JSON).
from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from .prepare import prepare_deepspeed_objects
from .schema import gradient_clipping

_NO_16BIT_GATHER = ("Cannot get 16bit model weights because `stage3_gather_16bit_weights_on_model_save` in "
                    "DeepSpeed config is False. To save the model weights in 16bit, set "
                    "`stage3_gather_16bit_weights_on_model_save` to True in DeepSpeed config file or set "
                    "`zero3_save_16bit_model` to True when using `accelerate config`. To save the full "
                    "checkpoint, use `accelerator.save_state`.")


class NoDeepSpeed:
    """The face of a run without a DeepSpeedPlugin: every answer leaves the strategy as it is."""

    plugin: Any = None
    runs_engine = False  # whether HF 1.15 runs DeepSpeed's own engine (which saves the models its own way)

    @property
    def config(self) -> Mapping[str, Any]:
        """The plugin's DeepSpeed JSON (filled in place at prepare); empty without one."""
        return {}

    def clipping(self) -> Optional[float]:
        """DeepSpeed's gradient_clipping (None: no clipping)."""
        return None

    def config_fields(self) -> dict[str, Any]:
        """The StrategyConfig fields the JSON sets (gradient_clipping: every strategy's step applies it)."""
        return {}

    def prepare_objects(self, objects: list, accelerator: Any) -> list:
        """The objects of one prepare() call with DeepSpeed's "auto" values and Dummy objects resolved."""
        return objects

    def resolved(self, config: Any) -> Any:
        """The strategy's config re-read from the JSON once prepare_objects filled its "auto" values."""
        return config

    def saved_weights_dtype(self, compute_dtype: Optional[torch.dtype]) -> Optional[torch.dtype]:
        """The dtype `save_model` writes floating tensors in (None: as held), given the run's compute dtype."""
        return None

    def state_dict_everywhere(self, stage: int) -> bool:
        """The sharded engine's get_state_dict: True where HF's engine answers on every rank, False where rank 0
        alone gathers the full state dict (FSDP, any stage)."""
        return False

    def state_dict_off_rank0(self, gathered: dict) -> Optional[dict]:
        """What get_state_dict answers on the other ranks when rank 0 alone gathers: FSDP's {} (as gathered)."""
        return gathered


class DeepSpeedFace(NoDeepSpeed):
    """The face of a run configured by a DeepSpeedPlugin (any strategy, one process included: HF 1.15 still runs
    DeepSpeed's engine there). The JSON is read when asked: prepare fills it in place."""

    runs_engine = True

    def __init__(self, plugin: Any) -> None:
        self.plugin = plugin

    @property
    def config(self) -> Mapping[str, Any]:
        return getattr(self.plugin, "deepspeed_config", None) or {}

    def clipping(self) -> Optional[float]:
        """A positive number clips; absent, 0 or still "auto" (prepare fills it: 1.0, as HF): None."""
        return gradient_clipping(self.config)

    def config_fields(self) -> dict[str, Any]:
        return {"gradient_clipping": self.clipping()}

    def prepare_objects(self, objects: list, accelerator: Any) -> list:
        """prepare.prepare_deepspeed_objects: `accelerator` is the calling Accelerator (run settings such as its
        gradient_accumulation_steps may be updated)."""
        return prepare_deepspeed_objects(self.plugin, objects, accelerator)

    def resolved(self, config: Any) -> Any:
        """config.with_deepspeed_json(JSON): each config class re-reads the fields it takes from the JSON."""
        return config.with_deepspeed_json(self.config)

    def saved_weights_dtype(self, compute_dtype: Optional[torch.dtype]) -> Optional[torch.dtype]:
        """What HF's DeepSpeed engine hands save_model: the fp16/bf16 compute dtype when the JSON enables one (ZeRO
        0-2: the module's own half weights; ZeRO-3: the gathered 16-bit weights), and under ZeRO-3 only with
        stage3_gather_16bit_weights_on_model_save, else HF's error (on every rank, before any collective)."""
        zero = self.config.get("zero_optimization", {})
        if zero.get("stage") == 3 and zero.get("stage3_gather_16bit_weights_on_model_save") is not True:
            raise ValueError(_NO_16BIT_GATHER)
        return compute_dtype

    def state_dict_everywhere(self, stage: int) -> bool:
        """ZeRO 0-2: every rank (the module's own weights); ZeRO-3: rank 0 (_zero3_consolidated_16bit_state_dict)."""
        return stage < 3

    def state_dict_off_rank0(self, gathered: dict) -> Optional[dict]:
        return None  # (DeepSpeed's consolidated ZeRO-3 state dict exists on rank 0 only)


NO_DEEPSPEED = NoDeepSpeed()


def deepspeed_face(plugin: Any) -> NoDeepSpeed:
    """The face of `plugin` (the Accelerator's DeepSpeedPlugin handler, duck-typed); NO_DEEPSPEED for None."""
    return NO_DEEPSPEED if plugin is None else DeepSpeedFace(plugin)
