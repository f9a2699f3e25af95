# Tests of the config file and the `config` / `env` commands: round trips (YAML and JSON), HF
# Accelerate's own files read by us and ours read by HF (HF 1.15 is the reference), errors that name
# the key and the allowed values, piped interactive answers. No processes are launched here.
import dataclasses
import json
import os
import subprocess
import sys

import pytest
import yaml

from accelerate_c.commands import config_args as ca
from accelerate_c.commands import config_flags as cf
from accelerate_c.commands.config_args import ClusterConfig, ConfigError, load_config, save_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli(args, tmp_path, stdin=None, timeout=60):
    env = dict(os.environ, PYTHONPATH=ROOT, ACCELERATE_C_CONFIG_DIR=str(tmp_path / "cfgdir"),
               HF_HOME=str(tmp_path / "hf_home"), XDG_CACHE_HOME=str(tmp_path / "xdg"))  # never the real home
    return subprocess.run([sys.executable, "-m", "accelerate_c", *args], input=stdin, capture_output=True,
                          text=True, env=env, timeout=timeout, cwd=str(tmp_path))


@pytest.mark.parametrize("suffix", ["yaml", "json"])
def test_round_trip(tmp_path, suffix):
    cfg = ClusterConfig(distributed_type="MULTI_CPU", use_cpu=True, num_processes=4, num_machines=2,
                        machine_rank=1, main_process_ip="10.0.0.1", main_process_port=1234,
                        mixed_precision="fp8", fp8_config={"fp8_format": "E4M3", "margin": 2},
                        gradient_accumulation_steps=4, monitor_interval=0.5, fsdp_config={"fsdp_version": 2})
    path = save_config(cfg, str(tmp_path / f"c.{suffix}"))
    back = load_config(path)
    assert back == cfg
    raw = json.load(open(path)) if suffix == "json" else yaml.safe_load(open(path))
    assert raw["num_processes"] == 4 and raw["gradient_accumulation_steps"] == 4
    assert "max_restarts" not in raw  # extension keys at their default are not written


def test_hf_written_file_is_read(tmp_path):
    from accelerate.commands.config.config_args import ClusterConfig as HFClusterConfig
    from accelerate.utils import ComputeEnvironment, DistributedType

    hf = HFClusterConfig(compute_environment=ComputeEnvironment.LOCAL_MACHINE,
                         distributed_type=DistributedType.MULTI_GPU, mixed_precision="bf16", use_cpu=False,
                         debug=True, num_processes=8, num_machines=2, machine_rank=0, main_process_ip="1.2.3.4",
                         main_process_port=29501, rdzv_backend="static", same_network=True, gpu_ids="all",
                         fsdp_config={"fsdp_version": 2, "fsdp_reshard_after_forward": True},
                         fp8_config={"backend": "TE", "fp8_format": "HYBRID", "amax_history_len": 16},
                         dynamo_config={"dynamo_backend": "INDUCTOR"})
    for suffix, write in (("yaml", hf.to_yaml_file), ("json", hf.to_json_file)):
        path = str(tmp_path / f"hf.{suffix}")
        write(path)
        ours = load_config(path)
        assert (ours.distributed_type, ours.mixed_precision, ours.num_processes, ours.num_machines) == \
               ("MULTI_GPU", "bf16", 8, 2)
        assert ours.debug is True and ours.main_process_port == 29501
        assert ours.fsdp_config == {"fsdp_version": 2, "fsdp_reshard_after_forward": True}
        assert ours.fp8().amax_history_len == 16 and ours.fp8().backend == "TE"


def test_our_default_file_is_read_by_hf(tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file

    cfg = ClusterConfig(distributed_type="MULTI_CPU", use_cpu=True, num_processes=2, mixed_precision="bf16")
    path = save_config(cfg, str(tmp_path / "ours.yaml"))
    hf = load_config_from_file(path)
    assert hf.num_processes == 2 and hf.mixed_precision == "bf16" and hf.use_cpu is True
    assert hf.distributed_type.value == "MULTI_CPU"


def test_hf_template_texts(tmp_path):
    # Files as users have them: unquoted `no`/`NO` (YAML 1.1 booleans), legacy `fp16: true`.
    (tmp_path / "a.yaml").write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: NO\n"
                                     "mixed_precision: no\nnum_processes: 1\ngpu_ids: 0\nuse_cpu: false\n"
                                     "deepspeed_config: {}\nfsdp_config: {}\nmegatron_lm_config: {}\n")
    cfg = load_config(str(tmp_path / "a.yaml"))
    assert (cfg.distributed_type, cfg.mixed_precision, cfg.gpu_ids) == ("NO", "no", "0")
    (tmp_path / "b.yaml").write_text("distributed_type: MULTI_GPU\nfp16: true\nnum_processes: 2\n"
                                     "dynamo_backend: INDUCTOR\n")
    cfg = load_config(str(tmp_path / "b.yaml"))
    assert cfg.mixed_precision == "fp16" and cfg.dynamo_config == {"dynamo_backend": "INDUCTOR"}


@pytest.mark.parametrize("text, key, allowed", [
    ("distributed_type: NO\nnum_procs: 2\n", "num_procs", "num_processes"),
    ("mixed_precision: fp32\n", "mixed_precision", "'bf16'"),
    ("num_processes: two\n", "num_processes", "an integer"),
    ("use_cpu: 3\n", "use_cpu", "true or false"),
    ("distributed_type: MULTI_TPU\n", "distributed_type", "'MULTI_GPU'"),
    ("mixed_precision: fp8\nfp8_config: {amax_compute_algo: mean}\n", "fp8_config.amax_compute_algo", "'max'"),
    ("fp8_config: {fp8_bogus: 1}\n", "fp8_config.fp8_bogus", "fp8_config.margin"),
    ("num_processes: 3\nnum_machines: 2\n", "num_processes", "multiple of num_machines"),
    ("compute_environment: AMAZON_SAGEMAKER\ndistributed_type: NO\n", "compute_environment", "LOCAL_MACHINE"),
])
def test_bad_files_name_key_and_allowed(tmp_path, text, key, allowed):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    assert key in str(info.value) and allowed in str(info.value)


def test_bad_file_cli_exit_code(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("mixed_precision: fp32\n")
    for args in (["config", "update", "--config_file", str(path)], ["env", "--config_file", str(path)],
                 ["launch", "--config_file", str(path), "x.py"]):
        res = cli(args, tmp_path)
        assert res.returncode != 0, args
        assert "mixed_precision" in res.stderr and "'fp16'" in res.stderr, res.stderr


def test_env_vars_and_flag_precedence():
    cfg = ClusterConfig(mixed_precision="fp8", use_cpu=True, gradient_accumulation_steps=2,
                        fp8_config={"fp8_format": "E4M3", "amax_history_len": 8})
    env = cfg.env()
    assert env["ACCELERATE_MIXED_PRECISION"] == "fp8" and env["ACCELERATE_USE_CPU"] == "true"
    assert env["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] == "2"
    assert (env["ACCELERATE_FP8_FORMAT"], env["ACCELERATE_FP8_AMAX_HISTORY_LEN"]) == ("E4M3", "8")
    assert env["ACCELERATE_FP8_AMAX_COMPUTE_ALGO"] == "most_recent" and env["ACCELERATE_FP8_MARGIN"] == "0"
    assert "ACCELERATE_FP8_FORMAT" not in ClusterConfig(mixed_precision="bf16").env()
    assert ClusterConfig(distributed_type="FSDP").env()["ACCELERATE_USE_FSDP"] == "true"
    assert "ACCELERATE_USE_FSDP" not in env
    os.environ[ca.CONFIG_ENV] = env[ca.CONFIG_ENV]
    try:
        assert ca.config_from_env() == cfg  # a rank sees exactly the launcher's resolved config
    finally:
        del os.environ[ca.CONFIG_ENV]
    assert "ACCELERATE_GRADIENT_ACCUMULATION_STEPS" not in ClusterConfig().env()

    import argparse

    parser = argparse.ArgumentParser()
    cf.add_config_flags(parser)
    args = parser.parse_args(["--mixed_precision", "bf16", "--fp8_margin", "3", "--num_processes", "4"])
    merged = cf.apply_flags(cfg, args)
    assert (merged.mixed_precision, merged.num_processes, merged.use_cpu) == ("bf16", 4, True)
    assert merged.fp8().margin == 3 and merged.fp8().fp8_format == "E4M3"
    with pytest.raises(ConfigError, match="num_processes"):
        cf.apply_flags(cfg, parser.parse_args(["--num_processes", "0"]))


def test_config_default_command(tmp_path):
    path = tmp_path / "d.yaml"
    res = cli(["config", "default", "--config_file", str(path), "--cpu", "--num_processes", "2",
               "--mixed_precision", "bf16"], tmp_path)
    assert res.returncode == 0, res.stderr
    cfg = load_config(str(path))
    assert (cfg.distributed_type, cfg.num_processes, cfg.mixed_precision, cfg.use_cpu) == \
           ("MULTI_CPU", 2, "bf16", True)
    again = cli(["config", "default", "--config_file", str(path)], tmp_path)
    assert again.returncode != 0 and "already exists" in again.stderr
    # Without --config_file it goes to ACCELERATE_C_CONFIG_DIR/default_config.yaml.
    assert cli(["config", "default"], tmp_path).returncode == 0
    assert load_config(str(tmp_path / "cfgdir" / "default_config.yaml")).num_processes >= 1


def test_config_update_rewrites(tmp_path):
    path = tmp_path / "u.yaml"
    path.write_text("distributed_type: MULTI_CPU\nfp16: true\nnum_processes: 2\nuse_cpu: true\n")
    res = cli(["config", "update", "--config_file", str(path)], tmp_path)
    assert res.returncode == 0, res.stderr
    raw = yaml.safe_load(path.read_text())
    assert raw["mixed_precision"] == "fp16" and "fp16" not in raw and raw["compute_environment"] == "LOCAL_MACHINE"
    assert cli(["config", "update", "--config_file", str(tmp_path / "none.yaml")], tmp_path).returncode != 0


def test_interactive_piped(tmp_path):
    path = tmp_path / "i.yaml"
    # use_cpu, num_machines, num_processes (bad then good), mixed_precision, GA steps (empty), debug (EOF)
    res = cli(["config", "--config_file", str(path)], tmp_path, stdin="yes\n1\nmany\n4\nbf16\n\n")
    assert res.returncode == 0, res.stderr + res.stdout
    assert "num_processes" in res.stdout and "an integer" in res.stdout  # the bad answer was explained
    cfg = load_config(str(path))
    assert (cfg.use_cpu, cfg.num_processes, cfg.mixed_precision, cfg.distributed_type) == (True, 4, "bf16",
                                                                                             "MULTI_CPU")
    assert cfg.gradient_accumulation_steps is None and cfg.debug is False
    # All defaults (empty input) on a fresh file.
    res = cli(["config", "--config_file", str(tmp_path / "e.yaml")], tmp_path, stdin="")
    assert res.returncode == 0 and load_config(str(tmp_path / "e.yaml")).num_machines == 1
    # Multi-machine questions appear only with num_machines > 1.
    res = cli(["config", "--config_file", str(tmp_path / "m.yaml")], tmp_path,
              stdin="yes\n2\n1\n10.1.1.1\n1234\n4\n")
    cfg = load_config(str(tmp_path / "m.yaml"))
    assert (cfg.num_machines, cfg.machine_rank, cfg.main_process_ip, cfg.main_process_port, cfg.num_processes) == \
           (2, 1, "10.1.1.1", 1234, 4)


def test_env_command(tmp_path):
    save_config(ClusterConfig(mixed_precision="bf16"), str(tmp_path / "cfgdir" / "default_config.yaml"))
    res = cli(["env"], tmp_path)
    assert res.returncode == 0, res.stderr
    import torch

    assert f"PyTorch version: {torch.__version__}" in res.stdout
    assert "CPU SIMD detected" in res.stdout and "mixed_precision: bf16" in res.stdout
    assert "C kernels' threads: openmp (from the main thread" in res.stdout  # torch's libgomp found by _C


def test_every_field_is_described():
    for f in dataclasses.fields(ClusterConfig):
        assert f.metadata["help"] and f.metadata["kind"] in ("int", "float", "str", "bool", "dict", "list")


def test_dynamo_config_block(tmp_path):
    # HF's `config` writes the keys dynamo_-prefixed and the backend upper-case; both spellings and any case read.
    (tmp_path / "d.yaml").write_text("distributed_type: NO\ndynamo_config:\n  dynamo_backend: inductor\n"
                                     "  dynamo_mode: max-autotune\n  use_fullgraph: true\n")
    cfg = load_config(str(tmp_path / "d.yaml"))
    dyn = cfg.dynamo()
    assert (dyn.backend, dyn.mode, dyn.use_fullgraph, dyn.use_dynamic) == ("INDUCTOR", "max-autotune", True, False)
    env = cfg.env()
    assert (env["ACCELERATE_DYNAMO_BACKEND"], env["ACCELERATE_DYNAMO_USE_FULLGRAPH"]) == ("INDUCTOR", "true")
    for text, key, allowed in (("dynamo_backend: fast", "dynamo_config.backend", "'INDUCTOR'"),
                               ("dynamo_bogus: 1", "dynamo_config.dynamo_bogus", "dynamo_config.mode"),
                               ("dynamo_use_dynamic: maybe", "dynamo_config.use_dynamic", "true or false")):
        (tmp_path / "bad.yaml").write_text(f"dynamo_config:\n  {text}\n")
        with pytest.raises(ConfigError) as info:
            load_config(str(tmp_path / "bad.yaml"))
        assert key in str(info.value) and allowed in str(info.value), info.value
    # Flags go into the block under HF's file keys, and HF reads the saved file.
    import argparse

    from accelerate.commands.config.config_args import load_config_from_file

    parser = argparse.ArgumentParser()
    cf.add_config_flags(parser)
    merged = cf.apply_flags(cfg, parser.parse_args(["--dynamo-use-dynamic", "--dynamo_backend", "eager"]))
    assert merged.dynamo_config == {"dynamo_backend": "EAGER", "dynamo_mode": "max-autotune",
                                    "dynamo_use_fullgraph": True, "dynamo_use_dynamic": True}
    hf = load_config_from_file(save_config(merged, str(tmp_path / "saved.yaml")))
    assert hf.dynamo_config["dynamo_backend"] == "EAGER" and hf.dynamo_config["dynamo_use_dynamic"] is True


def test_launch_only_keys_round_trip(tmp_path):
    cfg = ClusterConfig(num_cpu_threads_per_process=2, gradient_clipping=1.0, tee="3", log_dir="/tmp/x",
                        rdzv_conf="join_timeout=9", same_network=True)
    assert load_config(save_config(cfg, str(tmp_path / "l.yaml"))) == cfg
    assert cfg.env()["OMP_NUM_THREADS"] == "2" and cfg.env()["ACCELERATE_GRADIENT_CLIPPING"] == "1.0"
    assert ca.parse_rdzv_conf("a=1, b = x,,") == {"a": "1", "b": "x"}
    for bad in (dict(num_cpu_threads_per_process=0), dict(tee="7"), dict(tee="0:3,x"), dict(rdzv_conf="=1")):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            ClusterConfig(**bad)


def test_write_basic_config(tmp_path, monkeypatch):
    from accelerate.commands.config.default import write_basic_config as hf_write_basic_config

    from accelerate_c.utils import write_basic_config  # exported lazily, like HF's accelerate.utils name

    monkeypatch.setenv("ACCELERATE_C_CONFIG_DIR", str(tmp_path / "cfgdir"))
    path = write_basic_config(mixed_precision="BF16", save_location=str(tmp_path / "basic.yaml"))
    hf_path = hf_write_basic_config(mixed_precision="bf16", save_location=str(tmp_path / "hf.yaml"))
    assert str(path) == str(tmp_path / "basic.yaml") and type(path) is type(hf_path)
    # Same machine, same settings: our file and HF's describe the same config (read by us and by HF).
    assert load_config(str(path)) == load_config(str(hf_path))
    from accelerate.commands.config.config_args import load_config_from_file

    assert load_config_from_file(str(path)).to_dict() == load_config_from_file(str(hf_path)).to_dict()
    # HF's refusal to overwrite: returns False and leaves the file as it was.
    before = path.read_text()
    assert write_basic_config(mixed_precision="fp16", save_location=str(path)) is False
    assert hf_write_basic_config(mixed_precision="fp16", save_location=str(hf_path)) is False
    assert path.read_text() == before
    with pytest.raises(ValueError, match="mixed_precision"):
        write_basic_config(mixed_precision="fp32", save_location=str(tmp_path / "other.yaml"))
    # Default location: our default file; .json names give JSON.
    assert str(write_basic_config()) == ca.default_config_file()
    json_path = write_basic_config(save_location=str(tmp_path / "basic.json"))
    assert json.loads(json_path.read_text())["mixed_precision"] == "no"
