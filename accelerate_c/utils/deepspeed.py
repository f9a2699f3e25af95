# accelerate_c/utils/deepspeed.py: HF's `accelerate.utils.deepspeed` names, re-exported from where they live
# (deepspeed/: the schema's HfDeepSpeedConfig, the plugin and its dummies; optimizer.py / scheduler.py: the wrapper
# classes transformers checks with isinstance).
# Not for: behaviour of its own.
from ..deepspeed.plugin import DummyOptim, DummyScheduler, get_active_deepspeed_plugin
from ..deepspeed.schema import HfDeepSpeedConfig
from ..optimizer import DeepSpeedOptimizerWrapper
from ..scheduler import DeepSpeedSchedulerWrapper

__all__ = ["DeepSpeedOptimizerWrapper", "DeepSpeedSchedulerWrapper", "DummyOptim", "DummyScheduler",
           "HfDeepSpeedConfig", "get_active_deepspeed_plugin"]
