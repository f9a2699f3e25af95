# tests/test_sharding_entry.py: how a run reaches the sharding faces, against HF Accelerate 1.15 where HF can run
# here: launcher flags and config-file blocks (fsdp_config / deepspeed_config) -> the rank variables HF's own
# launcher builds (prepare_multi_gpu_env / prepare_deepspeed_cmd_env, compared key by key), bad block values, the
# Accelerator building its plugin from ACCELERATE_USE_FSDP / ACCELERATE_USE_DEEPSPEED, AcceleratorState's
# distributed_type / plugin probes / DeepSpeed mixed precision, the Strategy.prepare_objects hook replacing
# DeepSpeed's Dummy objects in Accelerator.prepare, and one real 2-process launch (--cpu --use_fsdp) where the
# ranks report distributed_type FSDP.
# Not for: the plugins' own fields and the JSON rules (test_sharding_config.py) or the engine.
import argparse
import json
import os
import sys
import tempfile

import pytest
import torch

from accelerate_c.commands import launch
from accelerate_c.commands.config_args import ConfigError
from conftest import Job, clean_env, finish_all, reset_state

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREFIXES = ("FSDP_", "ACCELERATE_DEEPSPEED_", "ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED",
            "ACCELERATE_GRADIENT_", "ACCELERATE_CONFIG_DS_FIELDS")


@pytest.fixture(autouse=True)
def _clean(sharding_env, monkeypatch, tmp_path):
    monkeypatch.setenv("ACCELERATE_C_CONFIG_DIR", str(tmp_path / "ours"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    # the DeepSpeed file the flag sets below name: our launcher reads it, as every rank will (HF's only passes it on)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ds.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto",
                                                  "zero_optimization": {"stage": 2}}))
    yield


def _ours(argv):
    parser = argparse.ArgumentParser()
    launch.add_parser(parser.add_subparsers(dest="command"))
    env = launch.resolve_config(parser.parse_args(["launch", *argv, "x.py"])).env()
    return {k: v for k, v in env.items() if k.startswith(PREFIXES)}


def _hf(argv, monkeypatch, tmp_path):
    import accelerate.commands.launch as hf_launch
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env
    monkeypatch.setattr(hf_launch, "default_config_file", str(tmp_path / "no_hf_default.yaml"))
    args, defaults, mp_from_file = hf_launch._validate_launch_command(
        hf_launch.launch_command_parser().parse_args([*argv, "x.py"]))
    args.main_process_port = 0
    if args.use_deepspeed:  # what HF's launch_command adds before its DeepSpeed launcher
        args.deepspeed_fields_from_accelerate_config = ",".join(list(defaults.deepspeed_config) if defaults else [])
        env = prepare_deepspeed_cmd_env(args)[1]
    else:
        env = prepare_multi_gpu_env(args)
    return {k: v for k, v in env.items() if k.startswith(PREFIXES)}


FLAG_SETS = [
    ["--use_fsdp", "--num_processes", "2"],
    ["--use_fsdp", "--num_processes", "2", "--fsdp_version", "2", "--fsdp_reshard_after_forward", "false",
     "--fsdp_offload_params", "true", "--fsdp_auto_wrap_policy", "SIZE_BASED_WRAP", "--fsdp_min_num_params", "1000",
     "--fsdp_state_dict_type", "FULL_STATE_DICT", "--fsdp_activation_checkpointing", "true",
     "--fsdp_cpu_ram_efficient_loading", "false"],
    ["--use_fsdp", "--num_processes", "2", "--fsdp_sharding_strategy", "HYBRID_SHARD", "--fsdp_auto_wrap_policy",
     "TRANSFORMER_BASED_WRAP", "--fsdp_transformer_layer_cls_to_wrap", "Block,Attn", "--fsdp_backward_prefetch",
     "BACKWARD_PRE", "--fsdp_forward_prefetch", "true", "--fsdp_use_orig_params", "false"],
    ["--use_deepspeed", "--num_processes", "2"],
    ["--use_deepspeed", "--num_processes", "2", "--zero_stage", "3", "--offload_optimizer_device", "cpu",
     "--offload_param_device", "cpu", "--gradient_accumulation_steps", "4", "--gradient_clipping", "1.0",
     "--zero3_init_flag", "true", "--zero3_save_16bit_model", "true"],
    ["--use_deepspeed", "--num_processes", "2", "--deepspeed_config_file", "ds.json"],
]


@pytest.mark.parametrize("argv", FLAG_SETS, ids=lambda a: " ".join(a[3:])[:50] or a[0])
def test_flags_give_hf_rank_env(monkeypatch, tmp_path, argv):
    assert _ours(argv) == _hf(argv, monkeypatch, tmp_path)


CONFIG_FILES = [  # as HF's `accelerate config` writes them
    {"distributed_type": "FSDP", "num_processes": 2, "mixed_precision": "bf16",
     "fsdp_config": {"fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                     "fsdp_transformer_layer_cls_to_wrap": "GPT2Block", "fsdp_cpu_ram_efficient_loading": True,
                     "fsdp_offload_params": False, "fsdp_reshard_after_forward": True,
                     "fsdp_state_dict_type": "SHARDED_STATE_DICT", "fsdp_activation_checkpointing": False}},
    {"distributed_type": "FSDP", "num_processes": 2,
     "fsdp_config": {"fsdp_sharding_strategy": "SHARD_GRAD_OP", "fsdp_sync_module_states": True,
                     "fsdp_use_orig_params": True, "fsdp_backward_prefetch": "BACKWARD_PRE"}},
    {"distributed_type": "DEEPSPEED", "num_processes": 2,
     "deepspeed_config": {"zero_stage": 2, "offload_optimizer_device": "cpu", "offload_param_device": "none",
                          "gradient_accumulation_steps": 2, "gradient_clipping": 1.0, "zero3_init_flag": False}},
    {"distributed_type": "DEEPSPEED", "num_processes": 2,
     "deepspeed_config": {"deepspeed_config_file": "ds.json", "zero3_init_flag": True}},
]


@pytest.mark.parametrize("data", CONFIG_FILES, ids=lambda d: d["distributed_type"] + str(sorted(d)[:1]))
def test_config_file_blocks_give_hf_rank_env(monkeypatch, tmp_path, data):
    path = tmp_path / "cfg.yaml"
    import yaml
    path.write_text(yaml.safe_dump(data))
    argv = ["--config_file", str(path)]
    assert _ours(argv) == _hf(argv, monkeypatch, tmp_path)


@pytest.mark.parametrize("block,words", [
    ({"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 3}}, "fsdp_config.version"),
    ({"distributed_type": "FSDP", "fsdp_config": {"fsdp_cpu_ram_efficient_loading": True,
                                                  "fsdp_sync_module_states": False}}, "fsdp_sync_module_states"),
    ({"distributed_type": "FSDP", "fsdp_config": {"fsdp_bogus": 1}}, "fsdp_config.fsdp_bogus"),
    ({"distributed_type": "DEEPSPEED", "deepspeed_config": {"offload_param_device": "disk"}},
     "deepspeed_config.offload_param_device"),
    ({"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": 5}}, "deepspeed_config.zero_stage"),
])
def test_bad_block_values_name_the_key(tmp_path, block, words):
    import yaml
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(block))
    with pytest.raises(ConfigError, match=words.replace(".", r"\.")):
        _ours(["--config_file", str(path)])


def test_gradient_clipping_warns_outside_deepspeed(capsys):
    _ours(["--gradient_clipping", "0.5", "--cpu"])
    assert "only DeepSpeed applies it" in capsys.readouterr().err
    assert _ours(["--use_deepspeed", "--gradient_clipping", "0.5"])["ACCELERATE_GRADIENT_CLIPPING"] == "0.5"
    assert "only DeepSpeed" not in capsys.readouterr().err


# -- the Accelerator and AcceleratorState -------------------------------------------------------------------------
def test_fsdp_plugin_from_environment_single_process(monkeypatch):
    """One process: HF keeps distributed_type NO and leaves fsdp_plugin unset; the plugin still configures us."""
    import accelerate
    import accelerate_c
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_AUTO_WRAP_POLICY", "SIZE_BASED_WRAP")
    ours = accelerate_c.Accelerator(cpu=True)
    hf = accelerate.Accelerator(cpu=True)
    assert ours.distributed_type == hf.distributed_type == "NO"
    assert ours.is_fsdp2 == hf.is_fsdp2 is False
    assert getattr(ours.state, "fsdp_plugin", None) is getattr(hf.state, "fsdp_plugin", None) is None
    plugin = ours.handlers["FullyShardedDataParallelPlugin"]
    assert plugin.auto_wrap_policy.__name__ == "size_based_auto_wrap_policy"
    assert ours.strategy.name == "single"


def test_deepspeed_plugin_state(monkeypatch):
    import accelerate_c
    from accelerate_c.utils import DeepSpeedPlugin, get_active_deepspeed_plugin
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    acc = accelerate_c.Accelerator(cpu=True, mixed_precision="bf16")
    plugin = acc.deepspeed_plugin
    assert isinstance(plugin, DeepSpeedPlugin) and plugin.zero_stage == 3 and plugin.selected
    assert acc.distributed_type == "DEEPSPEED" and acc.state.deepspeed_plugins is plugin
    assert get_active_deepspeed_plugin(acc.state) is plugin and acc.handlers["DeepSpeedPlugin"] is plugin
    assert acc.mixed_precision == "bf16" and plugin.deepspeed_config["bf16"] == {"enabled": True}
    assert "ds_config" in repr(acc.state)
    reset_state("accelerate_c")
    with pytest.raises(ValueError, match="cannot be set to `fp16` when `bf16`"):
        accelerate_c.Accelerator(cpu=True, mixed_precision="fp16", deepspeed_plugin=DeepSpeedPlugin(
            hf_ds_config={"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}))
    reset_state("accelerate_c")
    json_bf16 = DeepSpeedPlugin(hf_ds_config={"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}})
    assert accelerate_c.Accelerator(cpu=True, deepspeed_plugin=json_bf16).mixed_precision == "bf16"  # the JSON's


def test_several_deepspeed_plugins_select():
    import accelerate_c
    from accelerate_c.utils import DeepSpeedPlugin
    a, b = DeepSpeedPlugin(zero_stage=2), DeepSpeedPlugin(zero_stage=3)
    acc = accelerate_c.Accelerator(cpu=True, deepspeed_plugins={"a": a, "b": b})
    assert acc.deepspeed_plugin is a and acc.state.get_deepspeed_plugin("b") is b
    acc.state.select_deepspeed_plugin("b")
    assert acc.deepspeed_plugin is b and not a.selected
    with pytest.raises(NotImplementedError, match="second `Accelerator`"):
        accelerate_c.Accelerator(cpu=True, deepspeed_plugin=DeepSpeedPlugin())
    assert accelerate_c.Accelerator(cpu=True).state.deepspeed_plugins == {"a": a, "b": b}  # a second one reuses them
    with pytest.raises(TypeError, match="FullyShardedDataParallelPlugin"):
        reset_state("accelerate_c")
        accelerate_c.Accelerator(cpu=True, fsdp_plugin=object())


def test_prepare_objects_hook_replaces_dummies():
    """Accelerator.prepare asks the strategy first; any strategy resolves DeepSpeed's Dummy objects and "auto"
    values, the single-process one included (it once passed the DummyOptim through unreplaced)."""
    import accelerate_c
    from accelerate_c.optim import AdamW
    from accelerate_c.utils import DeepSpeedPlugin, DummyOptim, DummyScheduler
    plugin = DeepSpeedPlugin(hf_ds_config={
        "zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto", "warmup_min_lr": "auto",
                                                     "warmup_max_lr": "auto"}}})
    acc = accelerate_c.Accelerator(cpu=True, deepspeed_plugin=plugin, gradient_accumulation_steps=2)
    assert acc.strategy.name == "single"
    model = torch.nn.Linear(3, 1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 3), torch.randn(8, 1)),
                                         batch_size=2)
    opt = DummyOptim(model.parameters(), lr=0.1)
    model, opt, loader, sched = acc.prepare(model, opt, loader, DummyScheduler(opt, warmup_num_steps=2))
    assert isinstance(opt.optimizer, AdamW) and plugin.deepspeed_config["train_batch_size"] == 4
    for x, y in loader:
        with acc.accumulate(model):
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
            sched.step()
            opt.zero_grad()
    assert sched.get_last_lr() == [0.1]  # warmup over after 2 optimizer steps (4 batches, GA 2)


LAUNCHED = """
import json, sys, torch
from accelerate_c import Accelerator
acc = Accelerator()
p = acc.state.fsdp_plugin
out = {"type": str(acc.distributed_type.value), "is_fsdp2": acc.is_fsdp2, "rs": p.reshard_after_forward,
       "param_dtype": str(p.mixed_precision_policy.param_dtype), "handler": acc.handlers[type(p).__name__] is p}
with open(f"{sys.argv[1]}/rank{acc.process_index}.json", "w") as fh:
    json.dump(out, fh)
acc.end_training()
"""


def test_two_processes_launched_with_use_fsdp_are_fsdp(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(LAUNCHED)
    cmd = [sys.executable, "-m", "accelerate_c", "launch", "--cpu", "--num_processes", "2", "--use_fsdp",
           "--fsdp_version", "2", "--fsdp_reshard_after_forward", "false", "--mixed_precision", "bf16",
           "--main_process_port", "0", "-q", str(script), str(tmp_path)]
    with tempfile.TemporaryDirectory(prefix="fsdp_launch_") as logdir:
        job = Job(cmd, logdir, "launch", clean_env())
        (rc, out, err), = finish_all([job], 240)
    assert rc == 0, out[-2000:] + err[-4000:]
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got == {"type": "FSDP", "is_fsdp2": True, "rs": False, "param_dtype": "torch.bfloat16",
                       "handler": True}, (rank, got)
