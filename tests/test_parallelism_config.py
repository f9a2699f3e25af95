# tests/test_parallelism_config.py: the parallel layout's faces in one process: ParallelismConfig against HF 1.15's
# class on a table of inputs (same outcome, same error text; the two relaxed checks named), its variables, its
# properties and mesh shape; the checks against the world (HF's _validate_accelerator texts); MegatronLMPlugin's
# fields, defaults and variables against HF's class, and the fields accelerate_c refuses; the launcher's flags and
# config-file blocks down to the variables the ranks read and the faces built from them; HF's import paths; the
# layout's rank arithmetic; the Accelerator on one process (refusals, HF's own config classes, Megatron's clipping).
# Not for: the layout on several processes (test_layout_mp.py).
import argparse
import dataclasses
import re
import sys
import types
import warnings

import pytest
import torch

import accelerate.parallelism_config as hf_pc
import accelerate.utils.dataclasses as hf_dc
import accelerate_c.utils.dataclasses as our_dc
from accelerate_c.base.dataclasses import DistributedType
from accelerate_c.base.megatron_plugin import IMPLEMENTED, MegatronLMPlugin
from accelerate_c.base.parallelism_config import ParallelismConfig
from accelerate_c.commands import launch
from accelerate_c.commands.config_args import ConfigError, from_dict, load_config, save_config
from accelerate_c.runtime.layout import Degrees, ParallelLayout, coordinates, group_ranks, partition, rank_of

HF_ONLY_REFUSES = [dict(dp_replicate_size=2, tp_size=2), dict(dp_replicate_size=4, tp_size=2)]  # relaxed check 1
TABLE = [{}, dict(tp_size=2), dict(dp_shard_size=2, tp_size=2), dict(dp_replicate_size=2, dp_shard_size=2),
         dict(dp_replicate_size=2, dp_shard_size=2, tp_size=2), dict(tp_size=0), dict(dp_replicate_size=0),
         dict(dp_shard_size=-1), dict(cp_size=0), dict(sp_size=0), dict(cp_backend="jax"), dict(sp_backend="torch"),
         dict(cp_size=2, sp_size=2), dict(cp_size=2, dp_replicate_size=2), dict(cp_size=2, dp_shard_size=2),
         dict(sp_size=2), dict(cp_size=2), dict(cp_size=2, cp_handler=object()),
         dict(tp_size=2, tp_handler=hf_dc.TorchTensorParallelConfig()), dict(dp_shard_size=8, cp_size=2, tp_size=4)]
PC_VARS = ("PARALLELISM_CONFIG_", "ACCELERATE_USE_PARALLELISM_CONFIG", "MEGATRON_LM_", "ACCELERATE_USE_MEGATRON_LM")


@pytest.fixture(autouse=True)
def _no_layout_vars(monkeypatch):
    import os
    for k in list(os.environ):
        if k.startswith(PC_VARS):
            monkeypatch.delenv(k)


def _outcome(cls, kw):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            c = cls(**kw)
    except Exception as e:  # the class path of a handler differs (accelerate... vs accelerate_c...): not compared
        return type(e).__name__, re.sub(r"<class '[\w.]+\.(\w+)'>", r"\1", str(e))
    props = ("dp_dim_names", "non_dp_dim_names", "dp_shard_cp_dim_names", "dp_cp_dim_names", "fsdp_dim_names",
             "total_size", "non_data_parallel_size", "data_parallel_size", "active_mesh_dims", "dp_replicate_enabled",
             "dp_shard_enabled", "tp_enabled", "cp_enabled", "sp_enabled")
    handlers = tuple(type(getattr(c, h)).__name__ for h in ("tp_handler", "cp_handler", "sp_handler"))
    return "ok", {p: getattr(c, p) for p in props}, c._get_mesh(), repr(c), handlers


def _case_id(kw: dict) -> str:
    """A stable test id (an object's repr carries its address: pytest-xdist workers would collect different ids)."""
    return ",".join(f"{k}={v if isinstance(v, (int, str)) else type(v).__name__}" for k, v in kw.items()) or "default"


@pytest.mark.parametrize("kw", TABLE, ids=_case_id)
def test_same_validation_as_hf(kw):
    ours = dict(kw, tp_handler=our_dc.TorchTensorParallelConfig()) if "tp_handler" in kw else kw  # each its own
    assert _outcome(ParallelismConfig, ours) == _outcome(hf_pc.ParallelismConfig, kw)


@pytest.mark.parametrize("kw", HF_ONLY_REFUSES)
def test_relaxed_pure_replication_with_tp(kw):
    """HF refuses tp_size > 1 with dp_replicate_size > 1 and dp_shard_size == 1; we run DDP over the TP slices
    (docs/differences.md). With cp_size > 1 HF's error stays."""
    assert _outcome(hf_pc.ParallelismConfig, kw)[0] == "ValueError"
    c = ParallelismConfig(**kw)
    assert c.dp_dim_names == ["dp_replicate"] and c.non_dp_dim_names == ["tp"] and c.total_size == kw[
        "dp_replicate_size"] * 2


def test_variables_fill_unset_fields_as_in_hf(monkeypatch):
    for name, value in (("DP_SHARD_SIZE", "2"), ("TP_SIZE", "4"), ("CP_BACKEND", "torch")):
        monkeypatch.setenv("PARALLELISM_CONFIG_" + name, value)
    assert _outcome(ParallelismConfig, {}) == _outcome(hf_pc.ParallelismConfig, {})
    assert _outcome(ParallelismConfig, dict(tp_size=1)) == _outcome(hf_pc.ParallelismConfig, dict(tp_size=1))
    monkeypatch.setenv("PARALLELISM_CONFIG_PP_SIZE", "2")  # ours
    c = ParallelismConfig()
    assert (c.pp_size, c.total_size, c.non_dp_dim_names, c._get_mesh()) == (2, 16, ["pp", "tp"],
                                                                           (("pp", "dp_shard", "tp"), (2, 2, 4)))
    assert "pp_size=2" in repr(c)
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "two")
    with pytest.raises(ValueError, match="PARALLELISM_CONFIG_TP_SIZE='two': allowed: an integer"):
        ParallelismConfig()


def test_bad_field_types_and_pp_size():
    with pytest.raises(ValueError, match=r"ParallelismConfig.tp_size must be an integer, got '2' \(str\)"):
        ParallelismConfig(tp_size="2")
    with pytest.raises(ValueError, match="pp_size must be at least 1, but got 0"):
        ParallelismConfig(pp_size=0)
    c = ParallelismConfig(dp_shard_size=2, tp_size=2)
    assert c.to_json()["tp_size"] == 2 and c.to_json()["tp_handler"] == {"enable_async_tp": False}
    assert ParallelismConfig(dp_shard_size=2, tp_size=2, pp_size=2)._get_mesh() == (("pp", "dp_shard", "tp"), (2, 2, 2))


def _hf_accelerator(n, dtype, fsdp2=False):
    return types.SimpleNamespace(num_processes=n, distributed_type=dtype, is_fsdp2=fsdp2, is_main_process=True,
                                 multi_device=dtype == hf_dc.DistributedType.MULTI_GPU)


@pytest.mark.parametrize("kw,n,dtype,fsdp2", [
    (dict(tp_size=3), 4, "MULTI_GPU", False), (dict(dp_shard_size=2, tp_size=2), 4, "MULTI_GPU", False),
    ({}, 4, "MULTI_GPU", False), (dict(tp_size=4), 4, "FSDP", True), (dict(dp_shard_size=4), 4, "FSDP", True),
    (dict(dp_replicate_size=2, dp_shard_size=2), 4, "FSDP", True), (dict(tp_size=2), 4, "MULTI_GPU", False)])
def test_world_checks_as_hf(kw, n, dtype, fsdp2):
    """HF's _validate_accelerator outcomes and texts (ours is the relaxed one: CPU processes and FSDP1 pass)."""
    def run(cls, acc_dtype):
        c = cls(**kw)
        try:
            if cls is ParallelismConfig:
                c._validate_world(n, dtype)
            else:
                c._validate_accelerator(_hf_accelerator(n, acc_dtype, fsdp2))
        except ValueError as e:
            return str(e)
        return c.dp_replicate_size, c.total_size
    assert run(ParallelismConfig, dtype) == run(hf_pc.ParallelismConfig, hf_dc.DistributedType(dtype))


def test_relaxed_cpu_processes():
    """HF wants FSDP2, DeepSpeed or several GPUs; MULTI_CPU processes (and FSDP1) are accepted here."""
    with pytest.raises(ValueError, match="only compatible"):
        hf_pc.ParallelismConfig(tp_size=4)._validate_accelerator(_hf_accelerator(4, hf_dc.DistributedType.MULTI_CPU))
    ParallelismConfig(tp_size=4)._validate_world(4, "MULTI_CPU")
    ParallelismConfig(dp_shard_size=4)._validate_world(4, "FSDP")


def test_megatron_fields_defaults_and_variables_as_hf(monkeypatch):
    ours = {f.name for f in dataclasses.fields(MegatronLMPlugin)}
    assert ours == {f.name for f in dataclasses.fields(hf_dc.MegatronLMPlugin)}

    def values(p):
        return {n: getattr(p, n) for n in sorted(ours)}
    assert values(MegatronLMPlugin()) == values(hf_dc.MegatronLMPlugin())
    for name, value in (("TP_DEGREE", "2"), ("NUM_MICRO_BATCHES", "4"), ("SEQUENCE_PARALLELISM", "true"),
                        ("GRADIENT_CLIPPING", "0.5"), ("CONTEXT_PARALLEL_SIZE", "1")):
        monkeypatch.setenv("MEGATRON_LM_" + name, value)
    p = MegatronLMPlugin()
    assert values(p) == values(hf_dc.MegatronLMPlugin())
    assert (p.tp_degree, p.num_micro_batches, p.sequence_parallelism, p.clip_norm) == (2, 4, True, 0.5)
    assert MegatronLMPlugin(gradient_clipping=0).clip_norm is None


UNSUPPORTED = [("recompute_activations", True), ("use_distributed_optimizer", True), ("seq_length", 128),
               ("context_parallel_size", 4), ("expert_model_parallel_size", 2), ("other_megatron_args", {"a": 1}),
               ("is_train_batch_min", False), ("attention_dropout", 0.1), ("custom_loss_function", print)]


@pytest.mark.parametrize("name,value", UNSUPPORTED)
def test_megatron_unsupported_fields_are_named(name, value):
    with pytest.raises(NotImplementedError, match=rf"MegatronLMPlugin\.{name} is not supported by accelerate_c"):
        MegatronLMPlugin(**{name: value})


def test_megatron_bad_values_and_env(monkeypatch):
    with pytest.raises(ValueError, match="MegatronLMPlugin.tp_degree must be an integer >= 1, got 0"):
        MegatronLMPlugin(tp_degree=0)
    with pytest.raises(ValueError, match="MegatronLMPlugin.gradient_clipping must be a finite number >= 0"):
        MegatronLMPlugin(gradient_clipping=-1.0)
    monkeypatch.setenv("MEGATRON_LM_USE_DISTRIBUTED_OPTIMIZER", "true")
    with pytest.raises(NotImplementedError, match="use_distributed_optimizer"):
        MegatronLMPlugin()
    assert set(IMPLEMENTED) == {"tp_degree", "pp_degree", "num_micro_batches", "sequence_parallelism",
                                "gradient_clipping"}


def _resolve(*flags):
    p = argparse.ArgumentParser()
    launch.add_parser(p.add_subparsers())
    return launch.resolve_config(p.parse_args(["launch", "--cpu", *flags, "x.py"]))


def _faces_from(env, monkeypatch):
    for k, v in env.items():
        if k.startswith(PC_VARS):
            monkeypatch.setenv(k, v)
    return env


def test_launch_flags_to_the_ranks_faces(monkeypatch):
    cfg = _resolve("--num_processes", "8", "--use_parallelism_config", "--parallelism_config_dp_shard_size", "2",
                   "--parallelism-config-tp-size", "2", "--parallelism_config_dp_replicate_size", "2")
    env = _faces_from(cfg.env(), monkeypatch)
    assert env["ACCELERATE_USE_PARALLELISM_CONFIG"] == "true" and env["PARALLELISM_CONFIG_TP_SIZE"] == "2"
    assert "PARALLELISM_CONFIG_CP_COMM_STRATEGY" not in env  # HF: only with cp_size > 1
    c = ParallelismConfig()
    assert (c.dp_replicate_size, c.dp_shard_size, c.tp_size, c.total_size) == (2, 2, 2, 8)
    assert _resolve("--num_processes", "2").env().get("ACCELERATE_USE_PARALLELISM_CONFIG") is None
    m = _resolve("--num_processes", "4", "--use_megatron_lm", "--megatron_lm_tp_degree", "2",
                 "--megatron_lm_sequence_parallelism", "true", "--megatron_lm_gradient_clipping", "0.5")
    assert m.distributed_type == "MEGATRON_LM"
    env = _faces_from(m.env(), monkeypatch)
    assert env["ACCELERATE_USE_MEGATRON_LM"] == "true"
    p = MegatronLMPlugin()
    assert (p.tp_degree, p.sequence_parallelism, p.gradient_clipping) == (2, True, 0.5)


@pytest.mark.parametrize("flags,text", [
    (["--num_processes", "4", "--parallelism_config_tp_size", "3"], "ParallelismConfig total_size (3) does not match "
                                                                   "num_processes (4)"),
    (["--num_processes", "4", "--use_parallelism_config", "--parallelism_config_pp_size", "2",
      "--parallelism_config_tp_size", "3"], "ParallelismConfig total_size (6) does not match num_processes (4)"),
    (["--num_processes", "2", "--parallelism_config_cp_size", "2"], "context parallelism"),
    (["--num_processes", "4", "--use_megatron_lm", "--megatron_lm_recompute_activations", "true"],
     "MegatronLMPlugin.recompute_activations is not supported"),
    (["--num_processes", "4", "--use_megatron_lm", "--megatron_lm_tp_degree", "3"], "does not divide"),
    (["--num_processes", "4", "--parallelism_config_tp_size", "0"], "parallelism_config.tp_size`: got 0"),
])
def test_launch_refuses_what_the_ranks_would(flags, text):
    with pytest.raises(ConfigError, match=re.escape(text)):
        _resolve(*flags)


def test_config_file_blocks_round_trip(tmp_path, monkeypatch):
    """HF's keys (written prefixed by HF's `config`) in both blocks, saved and read back, down to the faces."""
    data = {"distributed_type": "MEGATRON_LM", "num_processes": 4,
            "megatron_lm_config": {"megatron_lm_tp_degree": 2, "megatron_lm_pp_degree": 1,
                                   "megatron_lm_gradient_clipping": 1.0, "megatron_lm_sequence_parallelism": True}}
    path = save_config(from_dict(data), str(tmp_path / "m.yaml"))
    cfg = load_config(path)
    assert cfg.megatron_lm_config == data["megatron_lm_config"]
    _faces_from(cfg.env(), monkeypatch)
    assert (MegatronLMPlugin().tp_degree, MegatronLMPlugin().sequence_parallelism) == (2, True)
    pc = {"parallelism_config_dp_shard_size": 2, "parallelism_config_tp_size": 2}
    cfg = load_config(save_config(from_dict({"num_processes": 4, "parallelism_config": pc}), str(tmp_path / "p.yaml")))
    assert cfg.parallelism_config == pc and cfg.env()["ACCELERATE_USE_PARALLELISM_CONFIG"] == "true"
    with pytest.raises(ConfigError, match="megatron_lm_tp_degrees"):
        from_dict({"megatron_lm_config": {"megatron_lm_tp_degrees": 2}})


def test_hf_import_paths():
    import accelerate_c
    import accelerate_c.parallelism_config as face
    import accelerate_c.utils as u
    import accelerate_c.utils.dataclasses as d
    assert face is sys.modules["accelerate_c.base.parallelism_config"]
    assert accelerate_c.ParallelismConfig is face.ParallelismConfig is u.ParallelismConfig is ParallelismConfig
    assert u.MegatronLMPlugin is d.MegatronLMPlugin is MegatronLMPlugin
    for name in ("TorchTensorParallelConfig", "TorchContextParallelConfig", "DeepSpeedSequenceParallelConfig",
                 "TorchTensorParallelPlugin"):
        assert getattr(u, name) is getattr(d, name)


def test_rank_arithmetic():
    """tp innermost, pp outermost; "dp" is dp_replicate x dp_shard flattened (dr-major)."""
    d = Degrees(pp=2, dp_replicate=2, dp_shard=2, cp=1, tp=2)
    assert [rank_of(d, coordinates(d, r)) for r in range(16)] == list(range(16))
    assert coordinates(d, 13) == {"pp": 1, "dp_replicate": 1, "dp_shard": 0, "cp": 0, "tp": 1}
    assert partition(d, ("tp",))[:3] == [[0, 1], [2, 3], [4, 5]]
    assert group_ranks(d, 13, ("dp_replicate", "dp_shard")) == [9, 11, 13, 15]
    assert group_ranks(d, 13, ("pp",)) == [5, 13]
    lay = ParallelLayout(d, 13)
    assert (lay.dp_size, lay.dp_rank, lay.tp_rank, lay.pp_rank, lay.data_replicated) == (4, 2, 1, 1, True)
    assert lay.data_representatives() == [0, 2, 4, 6]
    assert lay.mesh_config()._get_mesh() == (("pp", "dp_replicate", "dp_shard", "tp"), (2, 2, 2, 2))
    with pytest.raises(ValueError, match="the tp degree must be an integer >= 1, got 0"):
        Degrees(tp=0)


def test_solo_group_is_the_identity():
    lay = ParallelLayout(Degrees(), 0)
    for name in ("tp", "dp", "pp", "dp_shard", "dp_replicate", "cp"):
        g = lay.dim(name).group
        assert (g.size, g.rank, lay.dim(name).process_group) == (1, 0, None)
    g = lay.tp_group
    t = torch.arange(4.0)
    assert g.all_reduce(t, "avg") is t and torch.equal(g.all_gather(torch.empty(4), t), t)
    assert torch.equal(g.reduce_scatter(torch.empty(4), t), t) and g.all_reduce_async(t).wait()
    with pytest.raises(ValueError, match="unknown reduction op"):
        g.all_reduce(t, "prod")


@pytest.fixture
def one_process(clean_state, monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    from accelerate_c import Accelerator
    return lambda **kw: Accelerator(cpu=True, **kw)


def test_accelerator_on_one_process(one_process):
    acc = one_process()
    assert acc.parallelism_config is None and acc.torch_device_mesh is None
    assert acc.state.parallel_layout.is_trivial and acc.state.parallel_layout.dp_size == 1
    with pytest.raises(RuntimeError, match="Tensor parallelism is not configured"):
        acc.tensor_parallel_rank


@pytest.mark.parametrize("kw,error,text", [
    (dict(parallelism_config=ParallelismConfig(tp_size=2)), ValueError, "total_size (2) does not match"),
    (dict(parallelism_config=ParallelismConfig(pp_size=2)), ValueError, "total_size (2) does not match"),
    (dict(parallelism_config=ParallelismConfig(cp_size=2)), NotImplementedError, "context parallelism"),
    (dict(parallelism_config=ParallelismConfig(sp_size=2)), NotImplementedError, "sequence parallelism"),
    (dict(parallelism_config=ParallelismConfig(), megatron_lm_plugin=MegatronLMPlugin()), ValueError, "not both"),
    (dict(megatron_lm_plugin="tp=2"), TypeError, "`megatron_lm_plugin` must be a MegatronLMPlugin object."),
])
def test_accelerator_refusals(one_process, kw, error, text):
    with pytest.raises(error, match=re.escape(text)):
        one_process(**kw)


def test_hf_classes_and_variables_are_taken(one_process, monkeypatch):
    acc = one_process(parallelism_config=hf_pc.ParallelismConfig(tp_size=1))
    assert isinstance(acc.parallelism_config, ParallelismConfig) and acc.tensor_parallel_rank == 0
    from accelerate_c.state import AcceleratorState
    AcceleratorState._reset_state(True)
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    assert one_process().parallelism_config.total_size == 1
    AcceleratorState._reset_state(True)
    from accelerate_c.utils import TorchTensorParallelPlugin
    assert one_process(torch_tp_plugin=TorchTensorParallelPlugin(tp_size=1)).parallelism_config.tp_size == 1


def test_megatron_gradient_clipping_is_applied(one_process):
    """MegatronLMPlugin(gradient_clipping=...) clips the global gradient norm at every step (HF's Megatron default
    1.0), as DeepSpeed's gradient_clipping does."""
    acc = one_process(megatron_lm_plugin=MegatronLMPlugin(gradient_clipping=0.5))
    assert acc.state.parallel_layout.gradient_clipping == 0.5 and acc.distributed_type == DistributedType.NO
    model = torch.nn.Linear(4, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=1.0))
    acc.backward((model(torch.full((2, 4), 10.0)) - 100.0).pow(2).mean())
    opt.step()
    assert model.weight.norm().item() == pytest.approx(0.5, rel=1e-5)


def test_pipeline_fields(monkeypatch):
    """pp_schedule / pp_num_micro_batches / pp_virtual_stages (ours): defaults, variables, and bad values named."""
    pc = ParallelismConfig(pp_size=2)
    assert (pc.pp_schedule, pc.pp_num_micro_batches, pc.pp_virtual_stages) == ("1f1b", 2, 1)
    monkeypatch.setenv("PARALLELISM_CONFIG_PP_SCHEDULE", "zb_h1")
    monkeypatch.setenv("PARALLELISM_CONFIG_PP_NUM_MICRO_BATCHES", "8")
    pc = ParallelismConfig(pp_size=2)
    assert (pc.pp_schedule, pc.pp_num_micro_batches) == ("zb_h1", 8)
    with pytest.raises(ValueError, match="pp_schedule must be one of"):
        ParallelismConfig(pp_size=2, pp_schedule="zb")
    with pytest.raises(ValueError, match="pp_num_micro_batches must be an integer of at least 1, but got 0"):
        ParallelismConfig(pp_size=2, pp_num_micro_batches=0)
    with pytest.raises(ValueError, match="pp_virtual_stages=2 needs pp_schedule='interleaved_1f1b'"):
        ParallelismConfig(pp_size=2, pp_virtual_stages=2)
