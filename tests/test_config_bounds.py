# Tests of the bounds of `launch`'s configuration (issue 18, part 5): config files read within limits (YAML alias
# bombs, deep nesting, huge or non-regular files), each launch value's type and bounds (file and flags), the
# documented oversubscription rule (local processes x threads per process <= 16 x the cores unless
# --allow_oversubscribe), --rdzv_conf values, FSDP / DeepSpeed settings validated by the launcher with the plugins'
# own validators, ACCELERATE_C_* variables validated at launch, and a config too large for exec() named. Every case
# here was accepted, or a raw traceback / E2BIG / minutes of CPU, before. In-process parse tests, except a few CLI
# runs (each ends before any rank starts; output in files, a guard timeout).
import argparse
import json
import math
import os
import re
import sys

import pytest
import yaml

from accelerate_c.base import settings
from accelerate_c.commands import config_args as ca
from accelerate_c.commands import config_bounds, launch, yaml_safe
from accelerate_c.commands.config_args import ClusterConfig, ConfigError, load_config
from conftest import Job, finish_all

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GUARD_S = 120  # a CLI run here ends before any rank starts; only a hang gets to the guard


def _bomb(levels: int, size: int) -> str:
    """The classic alias bomb (9 aliases per level, 9**levels strings once expanded) under a free-form block,
    padded with a comment to exactly `size` bytes (the issue's files were 387 and 595 bytes)."""
    lines = ["use_cpu: true", "mpirun_config:", '  a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    names = "abcdefghijklmnop"
    lines += [f"  {names[i + 1]}: &{names[i + 1]} [" + ",".join([f"*{names[i]}"] * 9) + "]" for i in range(levels)]
    text = "\n".join(lines) + "\n"
    pad = size - len(text) - 2
    assert pad >= 0, (len(text), size)
    return text + "#" + "x" * pad + "\n"


def _write(tmp_path, text, name="c.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def parse(argv):
    parser = argparse.ArgumentParser()
    launch.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["launch", *argv])


@pytest.fixture
def two_cores(monkeypatch, tmp_path):
    """resolve_config on a 2-core machine without GPUs, no default config file and no OMP_NUM_THREADS."""
    monkeypatch.setattr(launch, "_cores", lambda: 2)
    monkeypatch.setattr(launch, "_cuda_count", lambda: 0)
    monkeypatch.setenv("ACCELERATE_C_CONFIG_DIR", str(tmp_path / "cfgdir"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for name in [k for k in os.environ if k.startswith(settings.PREFIX)]:
        if not settings.setting(name[len(settings.PREFIX):]).internal:
            monkeypatch.delenv(name)
    return tmp_path


def cli(args, tmp_path, env=None):
    full = dict(os.environ, PYTHONPATH=ROOT, ACCELERATE_C_CONFIG_DIR=str(tmp_path / "cfgdir"),
                HF_HOME=str(tmp_path / "hf_home"), XDG_CACHE_HOME=str(tmp_path / "xdg"))
    full.update(env or {})
    job = Job([sys.executable, "-m", "accelerate_c", *args], str(tmp_path / "logs"), "cli", full, cwd=str(tmp_path))
    (rc, out, err), = finish_all([job], GUARD_S)
    return rc, out, err


# ---- reading the file ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("levels,size", [(7, 387), (10, 595)])
def test_alias_bombs_are_a_named_error(tmp_path, levels, size):
    text = _bomb(levels, size)
    assert len(text.encode()) == size
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError, match=r"alias expansion.*10_000 nodes.*alias bomb") as e:
        load_config(path)
    assert path in str(e.value)


def test_alias_bomb_launch_exits_2_before_any_rank(tmp_path):
    """Was: E2BIG from exec() (387 bytes) or minutes of CPU in the launcher (595 bytes)."""
    script = _write(tmp_path, "open('ran', 'w').write('x')\n", "s.py")
    for levels, size in ((7, 387), (10, 595)):
        path = _write(tmp_path, _bomb(levels, size))
        rc, _, err = cli(["launch", "--config_file", path, script], tmp_path)
        assert rc == 2 and "alias expansion" in err and "Argument list too long" not in err, err
    assert not (tmp_path / "ran").exists()


def test_aliases_within_the_limits_still_work(tmp_path):
    text = ("use_cpu: true\nmegatron_lm_config: &m {megatron_lm_tp_degree: 2, megatron_lm_pp_degree: 1}\n"
            "mpirun_config: {<<: *m, extra: [*m, *m]}\nfp8_config: {}\n")
    cfg = load_config(_write(tmp_path, text))
    assert cfg.mpirun_config == yaml.safe_load(text)["mpirun_config"]
    assert cfg.mpirun_config["extra"][1] == {"megatron_lm_tp_degree": 2, "megatron_lm_pp_degree": 1}
    assert cfg.megatron_lm_config == {"megatron_lm_tp_degree": 2, "megatron_lm_pp_degree": 1}


@pytest.mark.parametrize("text,what", [
    ("a: &a [1, *a]\n", "recursive structure"),
    ("mpirun_config: " + "[" * 200_000 + "\n", "nested more than 32 levels"),
    ("mpirun_config:\n  x: " + "{a: " * 40 + "1" + "}" * 40 + "\n", "nested more than 32 levels"),
    ("mpirun_config:\n  x: &x " + "[" * 20 + "1" + "]" * 20 + "\n  y: " + "[" * 20 + "*x" + "]" * 20 + "\n",
     "aliases expanded"),
    ("mpirun_config:\n  s: &s " + "x" * 100_000 + "\n  t: [" + ",".join(["*s"] * 20) + "]\n",
     "1_048_576 characters"),
    ("- a\n- b\n", "must be a mapping"),
    ("just text\n", "must be a mapping"),
])
def test_bad_yaml_shapes_are_named(tmp_path, text, what):
    with pytest.raises(ConfigError, match=re.escape(what)):
        load_config(_write(tmp_path, text))


def test_json_config_nesting_and_size(tmp_path):
    with pytest.raises(ConfigError, match="nested more than 32 levels"):
        load_config(_write(tmp_path, '{"mpirun_config": ' + "[" * 200_000 + "]" * 200_000 + "}", "c.json"))
    with pytest.raises(ConfigError, match="nested more than 32 levels"):
        load_config(_write(tmp_path, '{"mpirun_config": ' + "[" * 40 + "]" * 40 + "}", "c.json"))
    big = json.dumps({"mpirun_config": {"x": "y" * (yaml_safe.MAX_BYTES + 1)}})
    with pytest.raises(ConfigError, match="larger than 1_048_576 bytes"):
        load_config(_write(tmp_path, big, "c.json"))
    assert load_config(_write(tmp_path, '{"num_processes": 2, "use_cpu": true}', "ok.json")).num_processes == 2


def test_fifo_config_file_is_refused_not_waited_on(tmp_path):
    fifo = tmp_path / "c.yaml"
    os.mkfifo(fifo)
    rc, _, err = cli(["launch", "--config_file", str(fifo), "x.py"], tmp_path)  # (a hang: the guard fails it)
    assert rc == 2 and "not a regular file" in err, err


# ---- each value's type and bounds ---------------------------------------------------------------------------
@pytest.mark.parametrize("text,key,allowed", [
    ("max_restarts: -5", "max_restarts", "an integer in 0..10_000"),
    ("num_cpu_threads_per_process: 100000", "num_cpu_threads_per_process", "an integer in 1..65_536"),
    ("num_cpu_threads_per_process: 0", "num_cpu_threads_per_process", "an integer in 1..65_536"),
    ("monitor_interval: -1", "monitor_interval", "a finite number in 0.01..3_600"),
    ("monitor_interval: 0", "monitor_interval", "a finite number in 0.01..3_600"),
    ("monitor_interval: .nan", "monitor_interval", "a finite number"),
    ("monitor_interval: .inf", "monitor_interval", "a finite number"),
    ("gradient_clipping: .nan", "gradient_clipping", "a finite number >= 0"),
    ("gradient_clipping: -1", "gradient_clipping", "a finite number >= 0"),
    ("num_processes: 0", "num_processes", "an integer in 1..1_048_576"),
    ("num_processes: 2000000", "num_processes", "an integer in 1..1_048_576"),
    ("num_machines: 0", "num_machines", "an integer in 1..65_536"),
    ("num_machines: 2\nnum_processes: 2\nmachine_rank: 2", "machine_rank", "0..1"),
    ("machine_rank: -1", "machine_rank", "an integer in 0..65_535"),
    ("main_process_port: 70000", "main_process_port", "an integer in 0..65_535"),
    ("main_process_port: -1", "main_process_port", "an integer in 0..65_535"),
    ("gradient_accumulation_steps: 0", "gradient_accumulation_steps", "an integer >= 1"),
    ("startup_report_interval: 0.5", "startup_report_interval", "0 (off)"),
    ("startup_report_interval: -1", "startup_report_interval", "a finite number in 0..86_400"),
    ("startup_report_interval: .nan", "startup_report_interval", "a finite number"),
    ("mixed_precision: fp8\nfp8_config: {amax_history_len: 0}", "fp8_config.amax_history_len", "an integer in 1.."),
    ("fp8_config: {interval: 0}", "fp8_config.interval", "an integer >= 1"),
    ("fp8_config: {margin: 1000}", "fp8_config.margin", "an integer in -64..64"),
    ("deepspeed_config: {gradient_clipping: .nan}", "deepspeed_config.gradient_clipping", "a finite number >= 0"),
    ("deepspeed_config: {gradient_accumulation_steps: 0}", "deepspeed_config.gradient_accumulation_steps", ">= 1"),
    ("fsdp_config: {fsdp_min_num_params: -1}", "fsdp_config.min_num_params", "an integer >= 0"),
    ("rdzv_conf: join_timeout=abc", "rdzv_conf", "join_timeout='abc'"),
])
def test_bad_values_in_a_file_name_key_value_and_rule(tmp_path, text, key, allowed):
    with pytest.raises(ConfigError) as e:
        load_config(_write(tmp_path, text + "\n"))
    msg = str(e.value)
    assert f"config key `{key}`" in msg and "allowed:" in msg and allowed in msg, msg
    assert len(msg) < 1000, msg  # a huge value is shown cut, not whole


def test_huge_numbers_are_named(tmp_path):
    """Was: a raw ValueError from PyYAML's int() (over Python's 4300 digits) or an OverflowError in float()."""
    with pytest.raises(ConfigError, match=r"c\.yaml: an integer of 5_000 digits; allowed: at most 100 digits \(line 1\)"):
        load_config(_write(tmp_path, "num_processes: " + "9" * 5000 + "\n"))
    with pytest.raises(ConfigError, match=r"config key `gradient_clipping`: got 9999.*allowed: a finite number"):
        load_config(_write(tmp_path, '{"gradient_clipping": ' + "9" * 400 + "}", "c.json"))
    with pytest.raises(ConfigError, match=r"config key `num_processes`: got 9{100}.*\(4000 characters\); allowed: an"):
        load_config(_write(tmp_path, '{"num_processes": ' + "9" * 4000 + "}", "c.json"))
    with pytest.raises(ConfigError, match=r"config key `num_processes`: got an integer of about 500\d digits"):
        ClusterConfig(num_processes=10 ** 5000)
    with pytest.raises(ConfigError, match="digits"):
        load_config(_write(tmp_path, '{"num_processes": ' + "9" * 5000 + "}", "c.json"))


@pytest.mark.parametrize("argv,key", [
    (["--max_restarts", "-5"], "max_restarts"),
    (["--num_cpu_threads_per_process", "100000"], "num_cpu_threads_per_process"),
    (["--monitor_interval", "-1"], "monitor_interval"),
    (["--monitor_interval", "nan"], "monitor_interval"),
    (["--monitor_interval", "inf"], "monitor_interval"),
    (["--gradient_clipping", "nan"], "gradient_clipping"),
    (["--main_process_port", "65536"], "main_process_port"),
    (["--num_processes", "0"], "num_processes"),
    (["--num_machines", "0"], "num_machines"),
    (["--startup_report_interval", "0.2"], "startup_report_interval"),
    (["--rdzv_conf", "join_timeout=abc"], "rdzv_conf"),
    (["--rdzv_conf", "timeout=-1"], "rdzv_conf"),
    (["--fp8_amax_history_len", "0"], "fp8_config.amax_history_len"),
])
def test_bad_flags_name_key_value_and_rule(two_cores, argv, key):
    with pytest.raises(ConfigError, match=re.escape(f"config key `{key}`")) as e:
        launch.resolve_config(parse(["--cpu", *argv, "x.py"]))
    assert "allowed:" in str(e.value)


def test_good_values_still_pass(two_cores):
    cfg = launch.resolve_config(parse(["--cpu", "--num_processes", "2", "--max_restarts", "0", "--monitor_interval",
                                       "0.01", "--startup_report_interval", "0", "--main_process_port", "65535",
                                       "--num_cpu_threads_per_process", "16", "--gradient_clipping", "0", "x.py"]))
    assert (cfg.max_restarts, cfg.monitor_interval, cfg.startup_report_interval) == (0, 0.01, 0.0)
    assert ClusterConfig().startup_report_interval == 60.0  # the default report interval
    assert ClusterConfig(monitor_interval=3600, startup_report_interval=86400, max_restarts=10_000)


@pytest.mark.parametrize("text,key", [
    ("join_timeout=abc", "join_timeout"), ("last_call_timeout=0", "last_call_timeout"),
    ("close_timeout=99999999", "close_timeout"), ("read_timeout=1.5", "read_timeout"),
    ("keep_alive_max_attempt=0", "keep_alive_max_attempt"), ("is_host=maybe", "is_host"),
    ("store_type=redis", "store_type"), ("rank=-1", "rank"), ("heartbeat_timeout=", "heartbeat_timeout"),
])
def test_rdzv_conf_values_torch_reads_are_checked(text, key):
    with pytest.raises(ConfigError, match=re.escape(f"config key `rdzv_conf`: {key}=")):
        ca.parse_rdzv_conf(text)


def test_rdzv_conf_good_values_and_other_keys_pass():
    assert ca.parse_rdzv_conf("join_timeout=600, is_host=False, store_type=TCP, custom=anything, timeout= 45 ") == \
        {"join_timeout": "600", "is_host": "False", "store_type": "TCP", "custom": "anything", "timeout": "45"}


# ---- the machine's limit ------------------------------------------------------------------------------------
def test_num_processes_100000_in_a_file_is_refused_on_a_small_machine(two_cores):
    """Was: thousands of ranks started on a 2-core box."""
    path = _write(two_cores, "use_cpu: true\nnum_processes: 100000\n")
    with pytest.raises(ConfigError) as e:
        launch.resolve_config(parse(["--config_file", path, "x.py"]))
    msg = str(e.value)
    assert "config key `num_processes`: got 100000" in msg and "16 x the cores = 32" in msg, msg
    assert "--allow_oversubscribe" in msg, msg
    cfg = launch.resolve_config(parse(["--config_file", path, "--allow_oversubscribe", "x.py"]))
    assert cfg.num_processes == 100000  # the flag forces it
    forced = _write(two_cores, "use_cpu: true\nnum_processes: 100000\nallow_oversubscribe: true\n", "f.yaml")
    assert launch.resolve_config(parse(["--config_file", forced, "x.py"])).allow_oversubscribe


def test_oversubscription_rule_at_its_edge(two_cores, monkeypatch):
    assert launch.resolve_config(parse(["--cpu", "--num_processes", "32", "x.py"])).num_processes == 32
    with pytest.raises(ConfigError, match="num_processes"):
        launch.resolve_config(parse(["--cpu", "--num_processes", "33", "x.py"]))
    ok = launch.resolve_config(parse(["--cpu", "--num_processes", "2", "--num_cpu_threads_per_process", "16", "x.py"]))
    assert ok.num_cpu_threads_per_process == 16
    with pytest.raises(ConfigError, match=r"config key `num_cpu_threads_per_process`: got 17: 2 local process\(es\)"):
        launch.resolve_config(parse(["--cpu", "--num_processes", "2", "--num_cpu_threads_per_process", "17", "x.py"]))
    with pytest.raises(ConfigError, match=r"config key `num_cpu_threads_per_process`: got 1000: 1 local process"):
        launch.resolve_config(parse(["--cpu", "--num_cpu_threads_per_process", "1000", "x.py"]))
    monkeypatch.setenv("OMP_NUM_THREADS", "64")
    with pytest.raises(ConfigError, match=r"environment variable OMP_NUM_THREADS='64'"):
        launch.resolve_config(parse(["--cpu", "--num_processes", "2", "x.py"]))
    # several machines: the rule is per machine (4 machines x 32 local processes on 2 cores each)
    monkeypatch.delenv("OMP_NUM_THREADS")
    cfg = ClusterConfig(num_processes=128, num_machines=4, use_cpu=True)
    config_bounds.check_machine(cfg, 2, {})
    with pytest.raises(ConfigError, match="over 4 machines"):
        config_bounds.check_machine(ClusterConfig(num_processes=132, num_machines=4, use_cpu=True), 2, {})


# ---- FSDP and DeepSpeed, validated by the launcher ------------------------------------------------------------
@pytest.mark.parametrize("argv,words", [
    (["--use_fsdp", "--fsdp_sharding_strategy", "FULL_SHAR"], ["fsdp_config", "sharding_strategy='FULL_SHAR'"]),
    (["--use_fsdp", "--fsdp_state_dict_type", "LOCAL_STATE_DICT"], ["fsdp_config", "LOCAL_STATE_DICT"]),
    (["--use_fsdp", "--fsdp_auto_wrap_policy", "bogus"], ["fsdp_config", "BOGUS"]),
    (["--use_fsdp", "--fsdp_version", "2", "--fsdp_reshard_after_forward", "sometimes"],
     ["fsdp_config", "reshard_after_forward"]),
])
def test_fsdp_values_are_checked_by_the_launcher(two_cores, argv, words):
    before = dict(os.environ)
    with pytest.raises(ConfigError) as e:
        launch.resolve_config(parse(["--cpu", "--num_processes", "2", *argv, "x.py"]))
    assert all(w in str(e.value) for w in words), str(e.value)
    assert dict(os.environ) == before  # the check ran in the ranks' environment, then put it back
    assert launch.resolve_config(parse(["--cpu", "--num_processes", "2", "--use_fsdp", "x.py"]))


def test_deepspeed_json_is_checked_by_the_launcher(two_cores):
    def run(config):
        path = two_cores / "ds.json"
        path.write_text(config if isinstance(config, str) else json.dumps(config))
        return launch.resolve_config(parse(["--cpu", "--num_processes", "2", "--use_deepspeed",
                                            "--deepspeed_config_file", str(path), "x.py"]))

    base = {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2}}
    assert run(base).distributed_type == "DEEPSPEED"
    for bad, words in (({**base, "bogus_field": 1}, "`bogus_field` is not supported"),
                       ({**base, "zero_optimization": {"stage": 7}}, "`zero_optimization.stage`: got 7"),
                       ({**base, "optimizer": {"type": "Lamb"}}, "'Lamb' is not supported"),
                       ({**base, "gradient_clipping": "lots"}, "`gradient_clipping`: got 'lots'"),
                       ("[" * 100_000 + "]" * 100_000, "nested more than 32 levels"),
                       ("{not json", "not valid JSON")):
        with pytest.raises(ConfigError, match=re.escape(words)) as e:
            run(bad)
        assert "config key `deepspeed_config`" in str(e.value)
    with pytest.raises(ConfigError, match="Expected a string path to an existing deepspeed config"):
        launch.resolve_config(parse(["--cpu", "--num_processes", "2", "--use_deepspeed", "--deepspeed_config_file",
                                     str(two_cores / "missing.json"), "x.py"]))
    fifo = two_cores / "fifo.json"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="not a regular file"):
        launch.resolve_config(parse(["--cpu", "--num_processes", "2", "--use_deepspeed", "--deepspeed_config_file",
                                     str(fifo), "x.py"]))


# ---- ACCELERATE_C_* variables at launch ---------------------------------------------------------------------------
def _bad_value(s):
    return {"bool": "maybe", "choice": "bogus", "int": "1.5", "float": "nan"}[s.kind]


@pytest.mark.parametrize("key", [s.key for s in settings.TABLE
                                 if s.scope in ("run", "native", "launcher") and s.kind != "str"])
def test_bad_settings_stop_the_launch_naming_variable_and_value(two_cores, monkeypatch, key):
    """Was: accepted by the launcher (each rank failed later, or never read it)."""
    s = settings.setting(key)
    raw = _bad_value(s)
    monkeypatch.setenv(s.name, raw)
    with pytest.raises(ConfigError, match=re.escape(f"environment variable {s.name}={raw!r}: allowed: ")):
        launch.resolve_config(parse(["--cpu", "x.py"]))


@pytest.mark.parametrize("key,raw", [("SIMD", "avx9"), ("SHM_SPIN_US", "10000001"), ("SHM_SPIN_US", "-1"),
                                     ("SHM_INNER_SPIN_US", "1e9"), ("SHARD_KERNELS", "2"), ("OUTPUT_CACHE_MB", "inf"),
                                     ("OUTPUT_CACHE_MB", "2000000"), ("RDZV_TIMEOUT", "99999999999")])
def test_settings_bounds(two_cores, monkeypatch, key, raw):
    monkeypatch.setenv(settings.var(key), raw)
    with pytest.raises(ConfigError, match=re.escape(f"{settings.var(key)}={raw!r}")):
        launch.resolve_config(parse(["--cpu", "x.py"]))


def test_unknown_own_variable_is_warned_about(two_cores, monkeypatch, capsys):
    name = settings.PREFIX + "SIMD_LEVEL"
    monkeypatch.setenv(name, "scalar")
    launch.resolve_config(parse(["--cpu", "x.py"]))
    assert f"{name} is not one of accelerate_c's" in capsys.readouterr().err
    assert settings.unknown_names({name: "1", settings.var("SIMD"): "avx2", "OTHER": "1"}) == [name]


def test_bad_setting_launch_exits_2_before_any_rank(tmp_path):
    script = _write(tmp_path, "open('ran', 'w').write('x')\n", "s.py")
    rc, _, err = cli(["launch", "--cpu", "--num_processes", "2", script], tmp_path, env={settings.var("SIMD"): "avx9"})
    assert rc == 2 and f"{settings.var('SIMD')}='avx9'" in err, err
    assert not (tmp_path / "ran").exists()


# ---- what exec() can take ---------------------------------------------------------------------------------------
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's per-variable limit")
def test_config_too_large_for_the_ranks_environment_is_named(two_cores):
    """Within the file limits (under 10_000 nodes, 1 MiB of text) but over what one variable of exec() holds."""
    path = _write(two_cores, "use_cpu: true\nmpirun_config:\n  blob: " + "x" * 200_000 + "\n")
    with pytest.raises(ConfigError, match=re.escape(f"environment variable {settings.var('CONFIG')} for the ranks "
                                                    "would be")) as e:
        launch.resolve_config(parse(["--config_file", path, "x.py"]))
    assert "131_072 bytes" in str(e.value)


def test_limits_are_far_above_hf_configs(tmp_path):
    """HF's `accelerate config` output (the largest block it writes) is nowhere near a limit."""
    text = ("compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nfsdp_config:\n  fsdp_auto_wrap_policy: "
            "TRANSFORMER_BASED_WRAP\n  fsdp_backward_prefetch: BACKWARD_PRE\n  fsdp_cpu_ram_efficient_loading: true\n"
            "  fsdp_forward_prefetch: false\n  fsdp_offload_params: false\n  fsdp_sharding_strategy: FULL_SHARD\n"
            "  fsdp_state_dict_type: SHARDED_STATE_DICT\n  fsdp_sync_module_states: true\n  fsdp_use_orig_params: true\n"
            "machine_rank: 0\nmain_training_function: main\nmixed_precision: bf16\nnum_machines: 1\nnum_processes: 2\n"
            "rdzv_backend: static\nsame_network: true\ntpu_env: []\ntpu_use_cluster: false\ntpu_use_sudo: false\n"
            "use_cpu: false\n")
    assert load_config(_write(tmp_path, text)).fsdp_config["fsdp_sharding_strategy"] == "FULL_SHARD"
    assert math.isfinite(ClusterConfig().monitor_interval)
