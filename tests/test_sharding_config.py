# tests/test_sharding_config.py: the two sharding configuration faces against HF Accelerate 1.15 run side by side
# in the same process: FullyShardedDataParallelPlugin and DeepSpeedPlugin defaults, every environment fallback,
# value forms and validation errors (field values compared with HF's own plugin objects, which construct on CPU
# under FSDP2 and without DeepSpeed), the DeepSpeed JSON (unknown fields, "auto" filling at prepare, batch-size
# consistency, DummyOptim/DummyScheduler and the optimizers/schedulers built from the JSON), ShardedConfig from each
# source, launcher flags and config-file blocks -> the rank variables HF's launcher sets, and the Accelerator /
# AcceleratorState entry points (one 2-process run for distributed_type FSDP).
# Not for: the sharded engine itself (its own tests) or checkpoints.
import dataclasses
import json
import math
import types

import pytest
import torch
from torch.distributed.fsdp import (CPUOffload, CPUOffloadPolicy, MixedPrecision, MixedPrecisionPolicy,
                                    OffloadPolicy, ShardingStrategy)

import accelerate.utils as hf_utils
from accelerate_c.sharding.config import ShardedConfig
from accelerate_c.deepspeed.prepare import prepare_deepspeed_objects
from accelerate_c.deepspeed.schema import DeepSpeedConfigError
from accelerate_c.utils.deepspeed_plugin import DeepSpeedPlugin, DummyOptim, DummyScheduler
from accelerate_c.utils.sharding_plugins import FullyShardedDataParallelPlugin as FSDP

HF_FSDP, HF_DS = hf_utils.FullyShardedDataParallelPlugin, hf_utils.DeepSpeedPlugin
FSDP_VARS = ["VERSION", "SHARDING_STRATEGY", "RESHARD_AFTER_FORWARD", "OFFLOAD_PARAMS", "MIN_NUM_PARAMS",
             "AUTO_WRAP_POLICY", "TRANSFORMER_CLS_TO_WRAP", "BACKWARD_PREFETCH", "STATE_DICT_TYPE", "FORWARD_PREFETCH",
             "USE_ORIG_PARAMS", "CPU_RAM_EFFICIENT_LOADING", "SYNC_MODULE_STATES", "ACTIVATION_CHECKPOINTING",
             "ACTIVATION_CHECKPOINTING_OFFLOAD", "IGNORED_MODULES"]


@pytest.fixture(autouse=True)
def _clean(sharding_env):
    """No sharding variable from outside; os.environ restored (plugins and the Accelerator set some)."""
    yield


def _fields(plugin, cls=HF_FSDP):
    return {f.name: repr(getattr(plugin, f.name)) for f in dataclasses.fields(cls)}


# -- FullyShardedDataParallelPlugin -------------------------------------------------------------------------------
FSDP2_CASES = [
    {}, {"reshard_after_forward": False}, {"reshard_after_forward": "false"},
    {"auto_wrap_policy": "transformer_based_wrap", "transformer_cls_names_to_wrap": "Block,Attn"},
    {"auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 1000}, {"auto_wrap_policy": "size_based_wrap"},
    {"mixed_precision_policy": "bf16"}, {"mixed_precision_policy": "fp16"},
    {"mixed_precision_policy": {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32,
                                "output_dtype": torch.bfloat16}},
    {"mixed_precision_policy": MixedPrecisionPolicy(param_dtype=torch.float16)},
    {"cpu_offload": True}, {"cpu_offload": CPUOffloadPolicy(pin_memory=False)},
    {"state_dict_type": "full_state_dict"}, {"state_dict_type": "3"}, {"ignored_modules": "lm_head"},
    {"activation_checkpointing": True, "activation_checkpointing_offload": True},
    {"cpu_ram_efficient_loading": True}, {"sync_module_states": True, "use_orig_params": True},
    {"backward_prefetch": "BACKWARD_PRE"}, {"limit_all_gathers": False},
]


@pytest.mark.parametrize("kwargs", FSDP2_CASES, ids=lambda kw: ",".join(kw) or "defaults")
def test_fsdp2_fields_match_hf(kwargs):
    assert _fields(FSDP(fsdp_version=2, **kwargs)) == _fields(HF_FSDP(fsdp_version=2, **kwargs))


ENV_CASES = [("RESHARD_AFTER_FORWARD", "false"), ("OFFLOAD_PARAMS", "true"), ("AUTO_WRAP_POLICY", "SIZE_BASED_WRAP"),
             ("MIN_NUM_PARAMS", "5000"), ("AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP"),
             ("TRANSFORMER_CLS_TO_WRAP", "Block"), ("BACKWARD_PREFETCH", "BACKWARD_POST"),
             ("STATE_DICT_TYPE", "FULL_STATE_DICT"), ("CPU_RAM_EFFICIENT_LOADING", "true"),
             ("ACTIVATION_CHECKPOINTING", "true"), ("IGNORED_MODULES", "head.*"), ("SYNC_MODULE_STATES", "true"),
             ("USE_ORIG_PARAMS", "true"), ("SHARDING_STRATEGY", "NO_SHARD")]


@pytest.mark.parametrize("name,value", ENV_CASES)
def test_fsdp2_env_fallbacks_match_hf(monkeypatch, name, value):
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_" + name, value)
    if name in ("MIN_NUM_PARAMS", "TRANSFORMER_CLS_TO_WRAP"):  # read only under their policy
        monkeypatch.setenv("FSDP_AUTO_WRAP_POLICY", "SIZE_BASED_WRAP" if name == "MIN_NUM_PARAMS" else
                           "TRANSFORMER_BASED_WRAP")
    assert _fields(FSDP()) == _fields(HF_FSDP())


@pytest.mark.parametrize("name,value", [("SHARDING_STRATEGY", "SHARD_GRAD_OP"), ("SHARDING_STRATEGY", "4"),
                                        ("OFFLOAD_PARAMS", "true"), ("FORWARD_PREFETCH", "true"),
                                        ("ACTIVATION_CHECKPOINTING", "true"), ("STATE_DICT_TYPE", "SHARDED_STATE_DICT"),
                                        ("AUTO_WRAP_POLICY", "NO_WRAP")])
def test_fsdp1_env_is_mapped_like_to_fsdp2(monkeypatch, name, value):
    """FSDP_VERSION=1 (HF's launcher default): HF's v1 values, then `accelerate to-fsdp2`'s mapping."""
    monkeypatch.setenv("FSDP_" + name, value)
    ours, hf = FSDP(), HF_FSDP()
    assert ours.fsdp_version == 2 and hf.fsdp_version == 1
    assert ours.sharding_strategy == hf.sharding_strategy
    assert ours.reshard_after_forward == {"FULL_SHARD": True, "SHARD_GRAD_OP": False, "HYBRID_SHARD": True,
                                          "NO_SHARD": False}[hf.sharding_strategy.name]
    assert isinstance(ours.cpu_offload, CPUOffloadPolicy) == hf.cpu_offload.offload_params
    same = ["auto_wrap_policy", "activation_checkpointing", "ignored_modules", "cpu_ram_efficient_loading",
            "sync_module_states", "transformer_cls_names_to_wrap", "min_num_params"]
    assert {k: repr(getattr(ours, k)) for k in same} == {k: repr(getattr(hf, k)) for k in same}
    assert ours.forward_prefetch is None and ours.use_orig_params is None and ours.backward_prefetch is None


def test_fsdp_value_forms():
    for form in ("shard_grad_op", "SHARD_GRAD_OP", 2, "2", ShardingStrategy.SHARD_GRAD_OP):
        p = FSDP(fsdp_version=1, sharding_strategy=form)
        assert (p.sharding_strategy, p.reshard_after_forward) == (ShardingStrategy.SHARD_GRAD_OP, False)
    p = FSDP(fsdp_version=1, sharding_strategy="HYBRID_SHARD_ZERO2")
    assert p.sharding_strategy == ShardingStrategy._HYBRID_SHARD_ZERO2
    assert isinstance(FSDP(cpu_offload=CPUOffload(offload_params=True)).cpu_offload, CPUOffloadPolicy)
    assert isinstance(FSDP(cpu_offload=CPUOffload(offload_params=False)).cpu_offload, OffloadPolicy)
    mp = FSDP(mixed_precision_policy={"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32,
                                      "buffer_dtype": torch.bfloat16}).mixed_precision_policy
    assert isinstance(mp, MixedPrecision) and mp.buffer_dtype == torch.bfloat16  # FSDP1's keys keep buffers' dtype
    policy = lambda module, recurse, nonwrapped_numel: False  # noqa: E731
    assert FSDP(auto_wrap_policy=policy).auto_wrap_policy is policy


BAD_FSDP = [  # (kwargs, words our message must contain); HF 1.15 refuses each of these too
    ({"fsdp_version": 2, "reshard_after_forward": "FULL_SHARD"}, ["reshard_after_forward", "FULL_SHARD"]),
    ({"fsdp_version": 1, "reshard_after_forward": True}, ["reshard_after_forward", "True"]),
    ({"fsdp_version": 2, "forward_prefetch": True}, ["forward_prefetch"]),
    ({"fsdp_version": 2, "activation_checkpointing_offload": True}, ["activation_checkpointing"]),
    ({"fsdp_version": 1, "activation_checkpointing": True, "activation_checkpointing_offload": True}, ["fsdp_version"]),
    ({"auto_wrap_policy": "bogus"}, ["auto wrap policy", "bogus"]),
    ({"auto_wrap_policy": "size_based_wrap", "min_num_params": "10"}, ["min_num_params", "10"]),
    ({"fsdp_version": 2, "mixed_precision_policy": "fp64"}, ["mixed precision", "fp64"]),
    ({"fsdp_version": 2, "mixed_precision_policy": {"param_dtype": torch.bfloat16}}, ["reduce_dtype"]),
    ({"fsdp_version": 2, "mixed_precision_policy": 3}, ["mixed_precision_policy"]),
    ({"fsdp_version": 2, "state_dict_type": "LOCAL_STATE_DICT"}, ["LOCAL_STATE_DICT"]),
    ({"fsdp_version": 2, "cpu_offload": "yes"}, ["cpu_offload", "yes"]),
    ({"fsdp_version": 1, "sharding_strategy": "BOGUS"}, ["sharding_strategy", "BOGUS", "FULL_SHARD"]),
    ({"fsdp_version": 2, "state_dict_type": "NOPE"}, ["state_dict_type", "NOPE"]),
]


@pytest.mark.parametrize("kwargs,words", BAD_FSDP, ids=lambda x: str(x)[:40])
def test_fsdp_validation_errors(kwargs, words):
    with pytest.raises(Exception):
        HF_FSDP(**kwargs)
    with pytest.raises(ValueError) as err:
        FSDP(**kwargs)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_fsdp_bad_env_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", "maybe")
    with pytest.raises(ValueError, match="FSDP_OFFLOAD_PARAMS='maybe'"):
        FSDP()


# -- ShardedConfig from the FSDP face -----------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,expect", [
    ({"fsdp_version": 2}, {"stage": 3, "hybrid": False, "reshard_after_forward": True}),
    ({"fsdp_version": 2, "reshard_after_forward": False}, {"stage": 2, "reshard_after_forward": False}),
    ({"fsdp_version": 1, "sharding_strategy": "NO_SHARD"}, {"stage": 0}),
    ({"fsdp_version": 1, "sharding_strategy": "HYBRID_SHARD"}, {"stage": 3, "hybrid": True}),
    ({"fsdp_version": 1, "sharding_strategy": "HYBRID_SHARD_ZERO2"}, {"stage": 2, "hybrid": True}),
    ({"auto_wrap_policy": "transformer_based_wrap", "transformer_cls_names_to_wrap": ["Block"]},
     {"auto_wrap_policy": "transformer_based_wrap", "transformer_layer_cls": ("Block",)}),
    ({"auto_wrap_policy": "size_based_wrap", "min_num_params": 123},
     {"auto_wrap_policy": "size_based_wrap", "min_num_params": 123}),
    ({"auto_wrap_policy": "size_based_wrap"}, {"auto_wrap_policy": "no_wrap"}),  # HF: min_num_params 0 wraps nothing
    ({"mixed_precision_policy": "bf16"}, {"param_dtype": torch.bfloat16, "reduce_dtype": torch.bfloat16}),
    ({"cpu_offload": True, "state_dict_type": "FULL_STATE_DICT", "activation_checkpointing": True,
      "ignored_modules": "head"},
     {"cpu_offload": True, "state_dict_type": "FULL_STATE_DICT", "activation_checkpointing": True,
      "ignored_modules": ("head",)}),
    ({"fsdp_version": 1, "cpu_ram_efficient_loading": True}, {"cpu_ram_efficient_loading": True,
                                                               "sync_module_states": True}),
    ({"fsdp_version": 2, "cpu_ram_efficient_loading": True}, {"sync_module_states": True}),
])
def test_sharded_config_from_fsdp_plugin(kwargs, expect):
    cfg = ShardedConfig.from_sources({"FullyShardedDataParallelPlugin": FSDP(**kwargs)}, env={})
    assert cfg.face == "fsdp"
    assert {k: getattr(cfg, k) for k in expect} == expect
    if kwargs.get("fsdp_version") == 2:  # HF's own plugin object maps to the same config
        assert ShardedConfig.from_sources({"FullyShardedDataParallelPlugin": HF_FSDP(**kwargs)}, env={}) == cfg


def test_sharded_config_callable_wrap_policy():
    policy = lambda module, recurse, nonwrapped_numel: False  # noqa: E731
    cfg = ShardedConfig.from_sources({"FullyShardedDataParallelPlugin": FSDP(auto_wrap_policy=policy)}, env={})
    assert (cfg.auto_wrap_policy, cfg.auto_wrap_callable) == ("callable", policy)


# -- DeepSpeedPlugin ----------------------------------------------------------------------------------------------
DS_FIELDS = [f.name for f in dataclasses.fields(HF_DS) if f.name != "hf_ds_config"]


def _ds_state(p):
    return {**{k: getattr(p, k) for k in DS_FIELDS}, "config": json.dumps(p.deepspeed_config, sort_keys=True),
            "zero3": p.hf_ds_config.is_zero3(), "offload": p.hf_ds_config.is_offload(), "selected": p.selected}


@pytest.mark.parametrize("env", [{}, {"ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}, {"ACCELERATE_GRADIENT_CLIPPING": "0.5"},
                                 {"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4"},
                                 {"ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu"},
                                 {"ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "cpu"},
                                 {"ACCELERATE_DEEPSPEED_ZERO3_INIT": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"},
                                 {"ACCELERATE_DEEPSPEED_ZERO3_INIT": "false", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"},
                                 {"ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": "true"}], ids=lambda e: ",".join(e))
def test_deepspeed_defaults_and_env_match_hf(monkeypatch, env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert _ds_state(DeepSpeedPlugin()) == _ds_state(HF_DS())


DS_JSON = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
           "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                 "stage3_gather_16bit_weights_on_model_save": "auto"},
           "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                        "warmup_num_steps": "auto"}}}


@pytest.mark.parametrize("form", ["dict", "path", "json"])
def test_deepspeed_config_forms_match_hf(tmp_path, monkeypatch, form):
    monkeypatch.setenv("ACCELERATE_GRADIENT_CLIPPING", "0.7")  # a plugin value fills an "auto" in the JSON
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(DS_JSON))
    given = {"dict": DS_JSON, "path": str(path), "json": json.dumps(DS_JSON)}[form]
    with pytest.warns(UserWarning, match="pin_memory"):  # a tuning knob with no effect here: said, not silent
        ours = DeepSpeedPlugin(hf_ds_config=given, zero3_init_flag=True)
    assert _ds_state(ours) == _ds_state(HF_DS(hf_ds_config=given, zero3_init_flag=True))
    assert ours.deepspeed_config["gradient_clipping"] == 0.7 and DS_JSON["gradient_clipping"] == "auto"


@pytest.mark.parametrize("mp", ["no", "fp16", "bf16"])
@pytest.mark.parametrize("block", [{}, {"bf16": {"enabled": True}}, {"fp16": {"enabled": "auto"}}])
def test_deepspeed_set_mixed_precision_matches_hf(mp, block):
    cfg = {"zero_optimization": {"stage": 2}, **block}
    results = []
    for cls in (DeepSpeedPlugin, HF_DS):
        p = cls(hf_ds_config=cfg)
        try:
            p.set_mixed_precision(mp)
            results.append(json.dumps(p.deepspeed_config, sort_keys=True))
        except ValueError as e:
            results.append(("error", str(e)))
    assert results[0] == results[1]


@pytest.mark.parametrize("config,path", [
    ({"zero_optimization": {"stage": 2}, "amp": {"enabled": True}}, "amp"),
    ({"zero_optimization": {"stage": 2, "zero_hpz_partition_size": 2}}, "zero_optimization.zero_hpz_partition_size"),
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage"),
    ({"zero_optimization": {"stage": "3"}}, "zero_optimization.stage"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/x"}}},
     "zero_optimization.offload_param.device"),
    ({"zero_optimization": {"stage": 2}, "fp16": {"enabled": True, "fp16_master_weights_and_grads": True}},
     "fp16.fp16_master_weights_and_grads"),
    ({"zero_optimization": {"stage": 2}, "train_batch_size": "sixteen"}, "train_batch_size"),
    ({"zero_optimization": {"stage": 2}, "optimizer": {"params": {}}}, "optimizer"),
    ({"zero_optimization": {"stage": 2}, "wall_clock_breakdown": True}, "wall_clock_breakdown"),
])
def test_deepspeed_json_errors_name_the_field(config, path):
    with pytest.raises(DeepSpeedConfigError, match=f"`{path}`"):
        DeepSpeedPlugin(hf_ds_config=config)


def test_deepspeed_plugin_errors_like_hf(monkeypatch):
    with pytest.raises(ValueError, match="ZeRO optimization config"):
        DeepSpeedPlugin(hf_ds_config={"train_batch_size": 8})
    monkeypatch.setenv("ACCELERATE_CONFIG_DS_FIELDS", "zero_stage,deepspeed_config_file")
    with pytest.raises(ValueError, match="will be ignored"):
        DeepSpeedPlugin(hf_ds_config={"zero_optimization": {"stage": 2}})
    monkeypatch.delenv("ACCELERATE_CONFIG_DS_FIELDS")
    with pytest.warns(UserWarning, match="only applicable for ZeRO Stage 3"):
        assert DeepSpeedPlugin(zero_stage=2, zero3_init_flag=True).zero3_init_flag is False
    with pytest.raises(NotImplementedError, match="transformer_moe_cls_names"):
        DeepSpeedPlugin(transformer_moe_cls_names="MixtralSparseMoeBlock")


def test_dummy_classes_match_hf():
    import accelerate.utils.deepspeed as hf_ds
    params = [torch.nn.Parameter(torch.zeros(2))]
    assert vars(DummyOptim(params, lr=0.1, betas=(0.8, 0.9))) == vars(hf_ds.DummyOptim(params, lr=0.1, betas=(0.8, 0.9)))
    assert vars(DummyScheduler("opt", total_num_steps=5, foo=1)) == vars(hf_ds.DummyScheduler("opt", 5, foo=1))


# -- prepare time: "auto", the Dummy objects, batch sizes ---------------------------------------------------------
def _acc(world=2, ga=1, split=False):
    return types.SimpleNamespace(num_processes=world, gradient_accumulation_steps=ga, split_batches=split,
                                 device=torch.device("cpu"))


def _objects(bs=4, n=64):
    model = torch.nn.Linear(3, 2)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(n, 3)), batch_size=bs)
    return model, loader


def test_auto_batch_sizes_ga_and_world():
    plugin = DeepSpeedPlugin(zero_stage=2)  # synthesised: train/micro "auto", GA "auto" (env unset)
    model, loader = _objects(bs=4)
    acc = _acc(world=2, ga=2)
    assert prepare_deepspeed_objects(plugin, [model, loader], acc) == [model, loader]
    c = plugin.deepspeed_config
    assert (c["train_micro_batch_size_per_gpu"], c["gradient_accumulation_steps"], c["train_batch_size"]) == (4, 2, 16)
    assert acc.deepspeed_config is c
    split = DeepSpeedPlugin(zero_stage=2)  # split_batches: the loader's batch is the global one
    prepare_deepspeed_objects(split, [model, _objects(bs=8)[1]], _acc(world=2, ga=1, split=True))
    assert (split.deepspeed_config["train_micro_batch_size_per_gpu"], split.deepspeed_config["train_batch_size"]) == (4, 8)
    two = DeepSpeedPlugin(zero_stage=2)  # train + eval loaders: is_train_batch_min picks the smaller
    prepare_deepspeed_objects(two, [model, _objects(bs=4)[1], _objects(bs=16)[1]], _acc(world=1))
    assert two.deepspeed_config["train_micro_batch_size_per_gpu"] == 4


def test_ds_gradient_accumulation_wins(caplog):
    plugin = DeepSpeedPlugin(hf_ds_config={"zero_optimization": {"stage": 1}, "gradient_accumulation_steps": 4,
                                           "train_micro_batch_size_per_gpu": 2})
    acc = _acc(world=2, ga=1)
    prepare_deepspeed_objects(plugin, [torch.nn.Linear(2, 2)], acc)
    assert acc.gradient_accumulation_steps == 4 and "Using DeepSpeed's value" in caplog.text
    assert plugin.deepspeed_config["train_batch_size"] == 16


def test_auto_values_resolve_per_accelerator():
    """HF keeps the first Accelerator's plugin for later ones: what an earlier Accelerator's prepare() filled in from
    "auto" is "auto" again for a new one (HF's test_sync: a second Accelerator with 2 accumulation steps ran with 1),
    while the same Accelerator's second prepare() and a value set by hand keep theirs."""
    plugin = DeepSpeedPlugin(zero_stage=2)
    model, loader = _objects(bs=4)
    first = _acc(world=2, ga=1)
    prepare_deepspeed_objects(plugin, [model, loader], first)
    prepare_deepspeed_objects(plugin, [model], first)  # (no loader: the batch size filled before stays)
    assert plugin.deepspeed_config["gradient_accumulation_steps"] == 1
    second = _acc(world=2, ga=2)
    prepare_deepspeed_objects(plugin, [model, _objects(bs=8)[1]], second)
    c = plugin.deepspeed_config
    assert second.gradient_accumulation_steps == 2
    assert (c["gradient_accumulation_steps"], c["train_micro_batch_size_per_gpu"], c["train_batch_size"]) == (2, 8, 32)
    c["gradient_accumulation_steps"] = 3  # set by hand: DeepSpeed's value wins, as HF
    third = _acc(world=2, ga=1)
    prepare_deepspeed_objects(plugin, [model, loader], third)
    assert third.gradient_accumulation_steps == 3


@pytest.mark.parametrize("config,objs,match", [
    ({"train_micro_batch_size_per_gpu": "auto"}, "model", "at least one of training or evaluation dataloaders"),
    ({"train_micro_batch_size_per_gpu": "auto"}, "none_bs", "has `None` as batch size"),
    ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}, "model",
     r"10 != 4 \* 1 \* 2"),
    ({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}}, "model",
     "model.config"),
    ({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"betas": "auto"}}}, "dummy",
     "optimizer.params.betas"),
])
def test_prepare_errors_like_hf(config, objs, match):
    plugin = DeepSpeedPlugin(hf_ds_config={"zero_optimization": {"stage": 2}, **config})
    model, loader = _objects()
    given = {"model": [model], "dummy": [model, DummyOptim(model.parameters())],
             "none_bs": [model, torch.utils.data.DataLoader(loader.dataset, batch_sampler=[[0, 1]])]}[objs]
    with pytest.raises(ValueError, match=match):
        prepare_deepspeed_objects(plugin, given, _acc(world=2))


def test_dummy_optimizer_and_scheduler_rules():
    model, loader = _objects()
    real_opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cases = [({"optimizer": {"type": "Adam"}}, [real_opt], "in the config file and in the code"),
             ({}, [DummyOptim(model.parameters())], "without specifying an optimizer"),
             ({"scheduler": {"type": "WarmupLR"}}, [torch.optim.lr_scheduler.StepLR(real_opt, 1)], "scheduler"),
             ({}, [DummyScheduler(real_opt)], "lr_scheduler_callable"),
             ({"optimizer": {"type": "Adam"}}, [DummyOptim(model.parameters()), torch.optim.lr_scheduler.StepLR(
                 real_opt, 1)], "only specify `accelerate.utils.DummyScheduler`")]
    for config, objs, match in cases:
        plugin = DeepSpeedPlugin(hf_ds_config={"zero_optimization": {"stage": 2}, **config})
        with pytest.raises(ValueError, match=match):
            prepare_deepspeed_objects(plugin, [model, loader, *objs], _acc())
    plugin = DeepSpeedPlugin(zero_stage=2)  # a real optimizer without a JSON block: HF marks it untested-ok
    prepare_deepspeed_objects(plugin, [model, loader, real_opt], _acc())
    assert plugin.deepspeed_config["zero_allow_untested_optimizer"] is True


def test_dummies_become_the_json_optimizer_and_scheduler():
    from accelerate_c.optim import Adam, AdamW
    model, loader = _objects()
    model.config = types.SimpleNamespace(hidden_size=8)
    config = dict(DS_JSON, zero_optimization={"stage": 3, "reduce_bucket_size": "auto",
                                              "stage3_gather_16bit_weights_on_model_save": "auto",
                                              "stage3_prefetch_bucket_size": "auto",
                                              "stage3_param_persistence_threshold": "auto"})
    plugin = DeepSpeedPlugin(hf_ds_config=config)
    plugin.set_mixed_precision("no")
    opt = DummyOptim(model.parameters(), lr=0.02, weight_decay=0.1)
    out = prepare_deepspeed_objects(plugin, [model, opt, loader, DummyScheduler(opt, warmup_num_steps=3)], _acc(ga=2))
    c = plugin.deepspeed_config
    assert isinstance(out[1], AdamW) and out[1].defaults["weight_decay"] == 0.1 and out[1].defaults["lr"] == 0.02
    assert c["scheduler"]["params"] == {"warmup_min_lr": 0, "warmup_max_lr": 0.02, "warmup_num_steps": 3}
    assert c["gradient_clipping"] == 1.0 and c["bf16"]["enabled"] is False
    assert c["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is False
    assert c["zero_optimization"]["reduce_bucket_size"] == 64 and c["zero_optimization"][
        "stage3_param_persistence_threshold"] == 80 and c["zero_optimization"]["stage3_prefetch_bucket_size"] == 57
    assert out[3].optimizer is out[1] and out[3].calls_per_step == 2
    adam = DeepSpeedPlugin(hf_ds_config={"zero_optimization": {"stage": 1}, "train_micro_batch_size_per_gpu": 1,
                                         "optimizer": {"type": "adam", "params": {"adam_w_mode": False}}})
    built = prepare_deepspeed_objects(adam, [model, DummyOptim(model.parameters())], _acc())[1]
    assert type(built) is Adam and built.defaults["weight_decay"] == 0.0  # DeepSpeed's default, not torch's 0.01
    callable_ = DeepSpeedPlugin(hf_ds_config={"zero_optimization": {"stage": 1}, "train_micro_batch_size_per_gpu": 1,
                                              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    o = DummyOptim(model.parameters())
    out = prepare_deepspeed_objects(callable_, [model, o, DummyScheduler(
        o, lr_scheduler_callable=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1))], _acc())
    assert isinstance(out[2], torch.optim.lr_scheduler.StepLR) and out[2].optimizer is out[1]


@pytest.mark.parametrize("block,match", [({"type": "Lamb"}, "optimizer.type"),
                                         ({"type": "AdamW", "params": {"foo": 1}}, "optimizer.params.foo")])
def test_unsupported_optimizer_names_the_field(block, match):
    from accelerate_c.deepspeed.builders import build_optimizer
    with pytest.raises(DeepSpeedConfigError, match=match):
        build_optimizer(block, torch.nn.Linear(2, 2).parameters())


def _lrs(block, steps, calls_per_step=1):
    from accelerate_c.deepspeed.builders import build_scheduler
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
    sched = build_scheduler(block, opt, calls_per_step)
    out = [opt.param_groups[0]["lr"]]
    for _ in range(steps):
        for _ in range(calls_per_step):
            sched.step()
        out.append(opt.param_groups[0]["lr"])
    return out


def test_deepspeed_schedules_follow_deepspeeds_numbering():
    """DeepSpeed's documented formulas, iteration -1 at construction and k after the (k+1)-th step."""
    lin = {"warmup_type": "linear", "warmup_num_steps": 4, "warmup_min_lr": 0.0, "warmup_max_lr": 1.0}
    assert _lrs({"type": "WarmupLR", "params": lin}, 6) == [0, 0, 0.25, 0.5, 0.75, 1, 1]
    assert _lrs({"type": "WarmupLR", "params": lin}, 6, calls_per_step=2) == [0, 0, 0.25, 0.5, 0.75, 1, 1]
    decay = _lrs({"type": "WarmupDecayLR", "params": dict(lin, total_num_steps=8)}, 10)
    assert decay[5:] == [1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    log = _lrs({"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 1.0}}, 3)
    assert log[2] == pytest.approx(math.log(2) / math.log(4))
    cos = _lrs({"type": "WarmupCosineLR", "params": {"total_num_steps": 6, "warmup_num_steps": 2,
                                                     "warmup_type": "linear", "cos_min_ratio": 0.0}}, 7)
    assert cos[:3] == [0.0, 0.0, 0.5] and cos[3] == pytest.approx((1 + math.cos(math.pi / 4)) / 2)
    assert cos[6:] == [0.0, 0.0]
    with pytest.raises(DeepSpeedConfigError, match="scheduler.type"):
        _lrs({"type": "OneCycle", "params": {}}, 1)


def test_sharded_config_from_deepspeed_plugin():
    plugin = DeepSpeedPlugin(hf_ds_config={"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                                                 "reduce_bucket_size": 2**20},
                                           "gradient_clipping": 0.5, "gradient_accumulation_steps": 2,
                                           "fp16": {"enabled": True, "initial_scale_power": 12,
                                                    "loss_scale_window": 100}})
    cfg = ShardedConfig.from_sources({"DeepSpeedPlugin": plugin}, env={})
    assert (cfg.face, cfg.stage, cfg.gradient_clipping, cfg.gradient_accumulation_steps, cfg.cpu_offload,
            cfg.zero3_init, cfg.bucket_cap_mb) == ("deepspeed", 3, 0.5, 2, True, True, 4.0)
    from accelerate_c.deepspeed.loss_scale import deepspeed_scaler_args  # the fp16 block is the scaler's (loss_scale.py)
    assert deepspeed_scaler_args(plugin.deepspeed_config["fp16"]) == {
        "static_scale": None, "init_scale": 4096.0, "scale_window": 100, "hysteresis": 2,
        "consecutive_hysteresis": False, "min_scale": 1.0}
    assert cfg.deepspeed_config is plugin.deepspeed_config
    assert ShardedConfig.from_sources({"DeepSpeedPlugin": DeepSpeedPlugin(zero_stage=1)}, env={}).stage == 1


@pytest.mark.parametrize("block,match", [({"optimizer": {"type": "Lamb"}}, "optimizer.type"),
                                         ({"optimizer": {"type": "Adam", "params": {"foo": 1}}}, "optimizer.params.foo"),
                                         ({"scheduler": {"type": "OneCycle"}}, "scheduler.type"),
                                         ({"scheduler": {"type": "WarmupLR", "params": {"bar": 1}}},
                                          "scheduler.params.bar")])
def test_optimizer_and_scheduler_blocks_checked_at_construction(block, match):
    with pytest.raises(DeepSpeedConfigError, match=match):
        DeepSpeedPlugin(hf_ds_config={"zero_optimization": {"stage": 2}, **block})


def test_json_blocks_need_their_objects_in_the_model_call():
    plugin = DeepSpeedPlugin(hf_ds_config={"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 1,
                                           "optimizer": {"type": "AdamW"}})
    with pytest.raises(ValueError, match="pass a `DummyOptim`"):
        prepare_deepspeed_objects(plugin, [torch.nn.Linear(2, 2)], _acc())


def test_sharded_config_rereads_deepspeed_values_filled_at_prepare():
    from accelerate.utils.deepspeed import HfDeepSpeedConfig as HFConfig
    plugin = DeepSpeedPlugin(hf_ds_config=HFConfig({"zero_optimization": {"stage": 2}, "gradient_clipping": "auto",
                                                    "train_micro_batch_size_per_gpu": 2}))  # HF's object form
    cfg = ShardedConfig.from_sources({"DeepSpeedPlugin": plugin}, env={})
    assert cfg.gradient_clipping is None  # still "auto"
    prepare_deepspeed_objects(plugin, [torch.nn.Linear(2, 2)], _acc(world=2))
    assert cfg.with_resolved_deepspeed().gradient_clipping == 1.0  # HF fills "auto" clipping with 1.0
    no_clip = DeepSpeedPlugin(hf_ds_config={"zero_optimization": {"stage": 2}, "gradient_clipping": 0.0})
    assert ShardedConfig.from_sources({"DeepSpeedPlugin": no_clip}, env={}).gradient_clipping is None


def test_callable_and_no_split_wrap_policies_give_units(sharding_env):
    """The FSDP face's policy function (auto_wrap_policy "callable") and transformer_based_wrap without class
    names (HF: model._no_split_modules at prepare) reach the engine's units (sharding/units.py)."""
    import functools
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    from accelerate_c.sharding.units import build_units
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))

    def units(cfg):
        specs, _ = build_units(model, cfg.auto_wrap_policy, cfg.transformer_layer_cls, cfg.min_num_params,
                               cfg.ignored_modules, cfg.auto_wrap_callable)
        return [u.name for u in specs]

    layers = ["", "transformer.h.0", "transformer.h.1"]
    partial = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={GPT2Block})
    cfg = ShardedConfig.from_sources({"FullyShardedDataParallelPlugin":
                                      FSDP(auto_wrap_policy=partial)}, env={})
    assert cfg.auto_wrap_policy == "callable" and units(cfg) == layers
    sized = functools.partial(size_based_auto_wrap_policy, min_num_params=4000)
    cfg = ShardedConfig.from_sources({"FullyShardedDataParallelPlugin":
                                      FSDP(auto_wrap_policy=sized)}, env={})
    # the same units as our size_based_wrap with that threshold (torch's recursive wrap, bottom-up)
    assert units(cfg) == [u.name for u in build_units(model, "size_based_wrap", min_num_params=4000)[0]]
    cfg = ShardedConfig.from_sources({"FullyShardedDataParallelPlugin":
                                      FSDP(auto_wrap_policy="TRANSFORMER_BASED_WRAP")},
                                     env={})
    assert cfg.transformer_layer_cls == () and units(cfg) == layers  # from GPT2's _no_split_modules


def test_param_init_fn_is_named_as_not_called(caplog):
    # FSDP1's param_init_fn was accepted and silently never called; under version 1 the conversion notes now say so
    # (FSDP2, HF's default, does not use it in HF either)
    import logging
    with caplog.at_level(logging.WARNING):
        plugin = FSDP(fsdp_version=1, param_init_fn=lambda m: None)
    assert "param_init_fn is not called" in caplog.text and plugin.fsdp_version == 2
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        FSDP(fsdp_version=2, param_init_fn=lambda m: None)
    assert "param_init_fn" not in caplog.text
