# tests/test_config_wild.py: config files HF's `accelerate config` wrote over the years load with HF's meaning: quoted
# 'no' / 'yes' booleans (`downcast_bf16: 'no'`, as HF's questionnaire wrote them), unquoted YAML 1.1 words
# (`mixed_precision: no`, `dynamo_backend: NO`), the legacy top-level `dynamo_backend: 'NO'`, `gpu_ids: all`, empty
# `*_config: {}` blocks, nulls for what was not asked, the older `fsdp_backward_prefetch_policy` key and numeric
# `fsdp_sharding_strategy: 1`; while a value outside what a key allows is still refused naming the key.
# Not for: the key set and its bounds (test_config.py, test_config_bounds.py).
import pytest

from accelerate_c.commands import config_args as ca

COMMON = "compute_environment: LOCAL_MACHINE\nmachine_rank: 0\nnum_machines: 1\nmain_training_function: main\n"
FILES = {
    # HF's `accelerate config` (0.2x .. 1.x) for one CPU/GPU, quoted words, nulls and empty blocks
    "questionnaire": COMMON + "debug: false\ndistributed_type: 'NO'\ndowncast_bf16: 'no'\ndynamo_backend: 'NO'\n"
                     "enable_cpu_affinity: false\nfsdp_config: {}\ndeepspeed_config: {}\nmegatron_lm_config: {}\n"
                     "gpu_ids: all\nmixed_precision: 'no'\nnum_processes: 1\nrdzv_backend: static\n"
                     "same_network: true\ntpu_env: []\ntpu_use_cluster: false\ntpu_use_sudo: false\nuse_cpu: false\n"
                     "main_process_ip: null\nmain_process_port: null\n",
    # hand-edited: unquoted YAML 1.1 words
    "unquoted": COMMON + "distributed_type: MULTI_CPU\ndowncast_bf16: no\ndynamo_backend: NO\nmixed_precision: no\n"
                "use_cpu: yes\nnum_processes: 2\ntpu_use_sudo: 'yes'\ndebug: null\n",
    # an older FSDP answer set
    "fsdp": COMMON + "distributed_type: FSDP\ndowncast_bf16: 'no'\nmixed_precision: bf16\nnum_processes: 2\n"
            "fsdp_config:\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n  fsdp_backward_prefetch_policy: BACKWARD_PRE\n"
            "  fsdp_offload_params: false\n  fsdp_sharding_strategy: 1\n  fsdp_state_dict_type: FULL_STATE_DICT\n"
            "  fsdp_transformer_layer_cls_to_wrap: GPT2Block\n  fsdp_use_orig_params: 'true'\n",
    # DeepSpeed answers with 'none' devices and a dynamo block
    "deepspeed": COMMON + "distributed_type: DEEPSPEED\ndowncast_bf16: 'no'\nmixed_precision: 'no'\nnum_processes: 2\n"
                 "deepspeed_config:\n  gradient_accumulation_steps: 1\n  offload_optimizer_device: none\n"
                 "  offload_param_device: none\n  zero3_init_flag: false\n  zero_stage: 2\n"
                 "dynamo_config:\n  dynamo_backend: NO\n",
}


def _load(tmp_path, name: str, text: str) -> ca.ClusterConfig:
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return ca.load_config(str(path))


def test_files_hf_wrote_load_with_hfs_meaning(tmp_path):
    cfgs = {name: _load(tmp_path, name, text) for name, text in FILES.items()}
    q = cfgs["questionnaire"]
    assert (q.downcast_bf16, q.use_cpu, q.mixed_precision, q.gpu_ids) == (False, False, "no", "all")
    assert q.fsdp_config == {} and q.deepspeed_config == {} and q.dynamo_config == {}
    env = q.env()
    assert env["ACCELERATE_DYNAMO_BACKEND"] == "NO" and env["ACCELERATE_DOWNCAST_BF16"] == "false"
    u = cfgs["unquoted"]
    assert (u.downcast_bf16, u.use_cpu, u.mixed_precision, u.tpu_use_sudo, u.debug) == (False, True, "no", True, False)
    assert u.env()["ACCELERATE_DYNAMO_BACKEND"] == "NO"
    f = cfgs["fsdp"].env()
    assert f["FSDP_BACKWARD_PREFETCH"] == "BACKWARD_PRE" and f["FSDP_USE_ORIG_PARAMS"] == "true"
    assert f["FSDP_SHARDING_STRATEGY"] == "1" and f["ACCELERATE_USE_FSDP"] == "true"
    d = cfgs["deepspeed"].env()
    assert d["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "2" and d["ACCELERATE_DYNAMO_BACKEND"] == "NO"


@pytest.mark.parametrize("line,key", [("downcast_bf16: 'maybe'", "downcast_bf16"), ("use_cpu: 3", "use_cpu"),
                                      ("num_processes: -1", "num_processes"), ("mixed_precision: 'fp7'",
                                                                                "mixed_precision")])
def test_values_outside_a_key_are_still_refused(tmp_path, line, key):
    with pytest.raises(ca.ConfigError, match=f"`{key}`"):
        _load(tmp_path, "bad", COMMON + line + "\n")
