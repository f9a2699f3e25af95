# tests/test_deepspeed_face.py: the DeepSpeed face a strategy holds (accelerate_c/deepspeed/face.py): built once
# from the DeepSpeedPlugin handler, NO_DEEPSPEED without one, the same questions answered by both.
from __future__ import annotations

import pytest
import torch

from accelerate_c.deepspeed.face import NO_DEEPSPEED, DeepSpeedFace, NoDeepSpeed, deepspeed_face
from accelerate_c.ddp.config import StrategyConfig
from accelerate_c.strategies.base import Strategy, StrategyContext
from accelerate_c.utils.deepspeed_plugin import DeepSpeedPlugin


def _public(cls: type) -> set[str]:
    return {n for n in dir(cls) if not n.startswith("_")}


def test_both_faces_answer_the_same_questions():
    assert _public(DeepSpeedFace) == _public(NoDeepSpeed)
    assert deepspeed_face(None) is NO_DEEPSPEED


def test_no_deepspeed_leaves_the_strategy_as_it_is():
    objects, config = [torch.nn.Linear(2, 2)], StrategyConfig(gradient_clipping=0.5)
    assert NO_DEEPSPEED.prepare_objects(objects, None) is objects and NO_DEEPSPEED.resolved(config) is config
    assert NO_DEEPSPEED.config_fields() == {} and NO_DEEPSPEED.clipping() is None and not NO_DEEPSPEED.runs_engine
    assert NO_DEEPSPEED.saved_weights_dtype(torch.bfloat16) is None
    assert not NO_DEEPSPEED.state_dict_everywhere(1) and NO_DEEPSPEED.state_dict_off_rank0({}) == {}


def test_the_face_reads_the_plugin_json():
    plugin = DeepSpeedPlugin(hf_ds_config={"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.5,
                                           "zero_optimization": {"stage": 3}})
    face = deepspeed_face(plugin)
    assert face.runs_engine and face.config is plugin.deepspeed_config and face.clipping() == 0.5
    assert face.config_fields() == {"gradient_clipping": 0.5}
    assert face.resolved(StrategyConfig()).gradient_clipping == 0.5
    assert face.state_dict_everywhere(2) and not face.state_dict_everywhere(3)
    assert face.state_dict_off_rank0({}) is None
    with pytest.raises(ValueError, match="stage3_gather_16bit_weights_on_model_save"):
        face.saved_weights_dtype(torch.bfloat16)
    plugin.deepspeed_config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    assert face.saved_weights_dtype(torch.bfloat16) is torch.bfloat16  # (the JSON read when asked)


def test_the_strategy_holds_one_face():
    class _State:
        mixed_precision, num_processes, process_index = "no", 1, 0

    assert Strategy(StrategyContext(_State(), {})).deepspeed is NO_DEEPSPEED
    plugin = DeepSpeedPlugin(hf_ds_config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}})
    strategy = Strategy(StrategyContext(_State(), {"DeepSpeedPlugin": plugin}))
    assert isinstance(strategy.deepspeed, DeepSpeedFace) and strategy.deepspeed.plugin is plugin
    assert strategy.hooks_get_no_weights()
