# The launch/config settings as ONE dataclass (`ClusterConfig`) whose fields are the YAML keys of
# HF Accelerate's ClusterConfig (1.15) plus a few accelerate_c extensions. Everything else is derived
# from the field metadata: reading/writing YAML or JSON, validation (unknown key / wrong type / value
# not allowed -> ConfigError naming the key and the allowed values), the ACCELERATE_* environment
# variables handed to the ranks, and (config_flags.py) the `launch` flags; where the default file is.
# Not for: the launching itself (launch.py), the flags (config_flags.py), the nested blocks
# (config_blocks.py) or the interactive questions (config.py).
from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass
from typing import Any

import yaml

from ..base import settings
from . import yaml_safe
from .config_blocks import BLOCKS as _BASE_BLOCKS, DynamoConfig, FP8Config, env_str as _env_str, setting as _opt
from .config_parallel import MegatronBlock, ParallelismBlock
from .config_sharding import DeepSpeedBlock, FSDPBlock
# (ARG_TYPES, ConfigError, parse_answer, parse_rdzv_conf, _parse_bool: re-exported for the commands)
from .config_values import (ARG_TYPES, MAX_MACHINES, MAX_PROCESSES, MAX_RESTARTS, MAX_THREADS, OVERSUBSCRIBE_FACTOR,
                            ConfigError, _build, _check, _default, _parse_bool, parse_answer, parse_rdzv_conf)

BLOCKS = {**_BASE_BLOCKS, "fsdp_config": FSDPBlock, "deepspeed_config": DeepSpeedBlock,
          "parallelism_config": ParallelismBlock, "megatron_lm_config": MegatronBlock}

# HF's DistributedType values: all are accepted in a file; the launcher runs every one of them
# through torch's elastic agent (except XLA, which needs torch_xla).
DISTRIBUTED_TYPES = ("NO", "MULTI_CPU", "MULTI_GPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA",
                     "MULTI_XPU", "DEEPSPEED", "FSDP", "XLA", "MEGATRON_LM", "MULTI_HPU", "MULTI_NEURON")
MIXED_PRECISION = ("no", "fp16", "bf16", "fp8")
CONFIG_ENV = settings.var("CONFIG")  # the launcher's resolved config, as JSON, in every rank


@dataclass
class ClusterConfig:
    """Every key of an accelerate(_c) config file. HF's keys first, then ours (ext=True)."""
    compute_environment: str = _opt("LOCAL_MACHINE", "str", "where to run (SageMaker is not supported)",
                                    choices=("LOCAL_MACHINE",))
    distributed_type: str = _opt("NO", "str", "HF's distributed type (all run on torch's elastic agent)",
                                 choices=DISTRIBUTED_TYPES, question="Distributed type",
                                 switches={"--multi_gpu": ("MULTI_GPU", "one process per GPU; without CUDA "
                                                           "the processes run on CPU, with a warning"),
                                           "--use_fsdp": ("FSDP", "fully sharded data parallelism (the --fsdp_* "
                                                          "flags / fsdp_config; CPU processes shard too)"),
                                           "--use_deepspeed": ("DEEPSPEED", "DeepSpeed ZeRO on accelerate_c's "
                                                               "engine (deepspeed_config; no DeepSpeed needed)"),
                                           "--use_megatron_lm": ("MEGATRON_LM", "Megatron-LM's tensor/pipeline "
                                                                 "layout on accelerate_c's engines (the "
                                                                 "--megatron_lm_* flags / megatron_lm_config; no "
                                                                 "Megatron-LM needed)")})
    mixed_precision: str = _opt("no", "str", "mixed precision", choices=MIXED_PRECISION,
                                env="ACCELERATE_MIXED_PRECISION", flag="--mixed_precision",
                                question="Mixed precision")
    use_cpu: bool = _opt(False, "bool", "train on CPU even when GPUs are present (the default config file is "
                         "then not read, as in HF)", env="ACCELERATE_USE_CPU", flag="--cpu",
                         question="Run on CPU only")
    debug: bool = _opt(False, "bool", "check distributed operations for errors", env="ACCELERATE_DEBUG_MODE",
                       flag="--debug", question="Check distributed operations for errors (debug mode)")
    num_processes: int = _opt(1, "int", "total number of processes over all machines (a launch also checks "
                              "local processes x threads per process <= 16 x the cores, see --allow_oversubscribe)",
                              flag="--num_processes", question="Total number of processes (all machines)",
                              bounds=(1, MAX_PROCESSES))
    machine_rank: int = _opt(0, "int", "rank of this machine (0..num_machines - 1)", flag="--machine_rank",
                             question="Rank of this machine", bounds=(0, MAX_MACHINES - 1))
    num_machines: int = _opt(1, "int", "number of machines", flag="--num_machines",
                             question="Number of machines", bounds=(1, MAX_MACHINES))
    gpu_ids: str | None = _opt(None, "str", "comma-separated GPU ids to use, or 'all'", flag="--gpu_ids")
    main_process_ip: str | None = _opt(None, "str", "address of the machine with rank 0",
                                       flag="--main_process_ip", question="Main process IP")
    main_process_port: int | None = _opt(None, "int", "port on the main machine (0 = pick a free one; "
                                         "one machine only)", flag="--main_process_port",
                                         question="Main process port", bounds=(0, 65535))
    rdzv_backend: str = _opt("static", "str", "rendezvous backend for several machines",
                             choices=("static", "c10d"), flag="--rdzv_backend")
    same_network: bool = _opt(False, "bool", "machines share a local network (accepted; the rendezvous on the "
                              "main machine's address is the same either way)", flag="--same_network")
    main_training_function: str = _opt("main", "str", "TPU only: the function to launch")
    enable_cpu_affinity: bool = _opt(False, "bool", "bind each rank to CPUs: its GPU's NUMA node, or on the CPU a "
                                     "disjoint share of the cores", env="ACCELERATE_CPU_AFFINITY",
                                     flag="--enable_cpu_affinity")
    fp8_config: dict = _opt({}, "dict", "FP8 recipe (see FP8Config)")
    deepspeed_config: dict = _opt({}, "dict", "DeepSpeed/ZeRO settings (see DeepSpeedBlock; docs/sharding_config.md)")
    fsdp_config: dict = _opt({}, "dict", "FSDP settings (see FSDPBlock; docs/sharding_config.md)")
    parallelism_config: dict = _opt({}, "dict", "parallel sizes (see ParallelismBlock; docs/parallelism.md); a block "
                                    "that is not empty is used as --use_parallelism_config")
    megatron_lm_config: dict = _opt({}, "dict", "Megatron-LM settings, read with distributed_type MEGATRON_LM (see "
                                    "MegatronBlock; docs/parallelism.md)")
    mpirun_config: dict = _opt({}, "dict", "mpirun settings (not used: accelerate_c needs no MPI)")
    dynamo_config: dict = _opt({}, "dict", "torch.compile settings (see DynamoConfig)")
    downcast_bf16: bool = _opt(False, "bool", "TPU only: downcast to bf16", env="ACCELERATE_DOWNCAST_BF16")
    tpu_name: str | None = _opt(None, "str", "TPU only")
    tpu_zone: str | None = _opt(None, "str", "TPU only")
    tpu_use_cluster: bool = _opt(False, "bool", "TPU only")
    tpu_use_sudo: bool = _opt(False, "bool", "TPU only")
    command_file: str | None = _opt(None, "str", "TPU only")
    commands: list | None = _opt(None, "list", "TPU only")
    tpu_vm: list | None = _opt(None, "list", "TPU only")
    tpu_env: list | None = _opt(None, "list", "TPU only")
    # accelerate_c extensions (written only when changed, so default files stay readable by HF; the
    # launch-only ones are HF `launch` flags that HF keeps out of its file).
    gradient_accumulation_steps: int | None = _opt(None, "int", "gradient accumulation steps",
                                                   env="ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
                                                   flag="--gradient_accumulation_steps", ext=True,
                                                   question="Gradient accumulation steps", bounds=(1, None))
    gradient_clipping: float | None = _opt(None, "float", "DeepSpeed's gradient clipping value, passed on as "
                                           "ACCELERATE_GRADIENT_CLIPPING (as in HF it acts with distributed_type "
                                           "DEEPSPEED only; elsewhere call accelerator.clip_grad_norm_)",
                                           env="ACCELERATE_GRADIENT_CLIPPING", flag="--gradient_clipping", ext=True,
                                           bounds=(0, None))
    num_cpu_threads_per_process: int | None = _opt(None, "int", "CPU threads per rank (OMP_NUM_THREADS; default: "
                                                   "the variable when set, else cores / local processes)",
                                                   env="OMP_NUM_THREADS", flag="--num_cpu_threads_per_process",
                                                   ext=True, bounds=(1, MAX_THREADS))
    use_parallelism_config: bool = _opt(False, "bool", "hand the ranks the parallelism_config block (PARALLELISM_"
                                        "CONFIG_*; HF's flag; also implied by a non-empty block or a "
                                        "--parallelism_config_* flag)", flag="--use_parallelism_config", ext=True)
    max_restarts: int = _opt(0, "int", "restarts of the whole local group after a failure",
                             flag="--max_restarts", ext=True, bounds=(0, MAX_RESTARTS))
    monitor_interval: float = _opt(0.1, "float", "seconds between health checks of the ranks",
                                   flag="--monitor_interval", ext=True, bounds=(0.01, 3600))
    rdzv_conf: str | None = _opt(None, "str", "more rendezvous settings, 'key=value,key2=value2' (torch's "
                                 "rendezvous configs, e.g. join_timeout=600)", flag="--rdzv_conf", ext=True)
    tee: str = _opt("0", "str", "copy the ranks' streams into log files too: 0 none, 1 stdout, 2 stderr, 3 both, "
                    "or per rank '0:3,1:1' (torch's --tee)", flag="--tee", aliases=("-t",), ext=True)
    log_dir: str | None = _opt(None, "str", "directory for torch elastic's per-rank log and error files (kept; "
                               "default: a temporary one, removed at exit)", flag="--log_dir", ext=True)
    allow_oversubscribe: bool = _opt(False, "bool", "launch even when this machine's processes x threads per "
                                     f"process exceed {OVERSUBSCRIBE_FACTOR} x its cores (otherwise an error)",
                                     flag="--allow_oversubscribe", ext=True)
    startup_report_interval: float = _opt(60.0, "float", "seconds: the launcher names the ranks that have not "
                                          "called init_process_group this long after the first rank of the machine "
                                          "did, and again every as many seconds (0 = off; 1..86400)",
                                          flag="--startup_report_interval", ext=True, bounds=(0, 86400))

    def __post_init__(self) -> None:
        validate(self)

    def block(self, key: str) -> Any:
        """The `key` block (fp8_config, dynamo_config, fsdp_config, deepspeed_config) as its validated dataclass."""
        cls = BLOCKS[key]
        obj = _build(cls, {cls.key_of(k): v for k, v in getattr(self, key).items()}, key + ".")
        try:
            getattr(obj, "check", lambda key: None)(key)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        return obj

    def fp8(self) -> FP8Config:
        return self.block("fp8_config")

    def dynamo(self) -> DynamoConfig:
        return self.block("dynamo_config")

    def to_dict(self) -> dict[str, Any]:
        """The file form: HF keys always (None dropped, like HF), extension keys only when not default."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None or (f.metadata["ext"] and value == _default(f)):
                continue
            out[f.name] = value
        return out

    def env(self) -> dict[str, str]:
        """Variables for the ranks, derived from the `env` metadata and the blocks' fields."""
        out: dict[str, str] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.metadata["env"] and value is not None:
                out[f.metadata["env"]] = _env_str(value)
        # HF's switches for the paradigm chosen by distributed_type (its strategies key off these).
        for kind, var in (("FSDP", "ACCELERATE_USE_FSDP"), ("DEEPSPEED", "ACCELERATE_USE_DEEPSPEED"),
                          ("MEGATRON_LM", "ACCELERATE_USE_MEGATRON_LM")):
            if self.distributed_type == kind:
                out[var] = "true"
        # The whole resolved config, so a strategy can read its own block (fsdp_config, ...) in a rank.
        out[CONFIG_ENV] = json.dumps(self.to_dict(), sort_keys=True)
        if self.mixed_precision == "fp8":
            out.update(self.fp8().env())
        out.update(self.dynamo().env())  # always, as HF does (backend NO when not configured)
        if self.use_parallelism_config or self.parallelism_config:  # HF: PARALLELISM_CONFIG_*
            out["ACCELERATE_USE_PARALLELISM_CONFIG"] = "true"
            out.update(self.block("parallelism_config").env())
        if self.distributed_type == "MEGATRON_LM":  # HF: MEGATRON_LM_* (ACCELERATE_USE_MEGATRON_LM above)
            out.update(self.block("megatron_lm_config").env())
        if self.distributed_type == "FSDP":  # HF's launcher: the FSDP_* variables, its defaults included
            out.update(self.block("fsdp_config").env())
        elif self.distributed_type == "DEEPSPEED":
            ds = self.block("deepspeed_config").env()
            # the top-level values (file or flag) win over the block's, as HF's flags do
            out.update({k: v for k, v in ds.items() if k not in out})
            # HF: the config file's deepspeed_config keys (launch sets ds_file_fields; flags are not among them)
            out["ACCELERATE_CONFIG_DS_FIELDS"] = ",".join(getattr(self, "ds_file_fields", self.deepspeed_config))
        return out


def validate(cfg: ClusterConfig) -> None:
    """Type/choice checks of every field, fp8_config keys, and the cross-field rules."""
    for f in dataclasses.fields(cfg):
        object.__setattr__(cfg, f.name, _check(f, getattr(cfg, f.name)))
    for key in BLOCKS:
        cfg.block(key)
    if not 0 <= cfg.machine_rank < cfg.num_machines:
        raise ConfigError(f"config key `machine_rank`: got {cfg.machine_rank}; allowed: 0..{cfg.num_machines - 1}")
    if cfg.num_processes % cfg.num_machines:
        raise ConfigError(f"config key `num_processes`: {cfg.num_processes} processes cannot be split evenly "
                          f"over num_machines={cfg.num_machines}; allowed: a multiple of num_machines")
    if 0 < cfg.startup_report_interval < 1:
        raise ConfigError(f"config key `startup_report_interval`: got {cfg.startup_report_interval}; allowed: 0 (off) "
                          "or a number of seconds in 1..86_400")
    if not re.fullmatch(r"[0-3]|\d+:[0-3](,\d+:[0-3])*", cfg.tee):
        raise ConfigError(f"config key `tee`: got {cfg.tee!r}; allowed: 0, 1, 2, 3 (none, stdout, stderr, both) or "
                          "per local rank 'rank:0-3,...' such as '0:3,1:1'")
    parse_rdzv_conf(cfg.rdzv_conf)


def from_dict(data: dict[str, Any]) -> ClusterConfig:
    """Build and validate a config from a file's mapping (HF's legacy keys are migrated like HF does)."""
    if not isinstance(data or {}, dict):
        raise ConfigError(f"config must be a mapping of keys to values, got {type(data).__name__}")
    data = dict(data or {})
    if "fp16" in data:  # HF legacy: `fp16: true` -> mixed_precision
        fp16 = data.pop("fp16")
        data.setdefault("mixed_precision", "fp16" if fp16 else "no")
    if "dynamo_backend" in data:  # HF legacy: top-level dynamo_backend -> dynamo_config
        backend = data.pop("dynamo_backend")
        no = backend in (None, False) or (isinstance(backend, str) and backend.upper() == "NO")  # unquoted NO: false
        data.setdefault("dynamo_config", {} if no else {"dynamo_backend": backend})
    if data.get("compute_environment") == "AMAZON_SAGEMAKER":
        raise ConfigError("config key `compute_environment`: AMAZON_SAGEMAKER is not supported by accelerate_c; "
                          "allowed: 'LOCAL_MACHINE'")
    cfg = _build(ClusterConfig, data)
    validate(cfg)
    return cfg


def config_from_env() -> "ClusterConfig | None":
    """In a rank: the config the launcher resolved (file + flags), or None when not launched by us."""
    text = settings.get("CONFIG")
    return from_dict(json.loads(text)) if text else None


def config_dir() -> str:
    """ACCELERATE_C_CONFIG_DIR, else $XDG_CACHE_HOME/accelerate_c, else ~/.cache/accelerate_c."""
    own = settings.get("CONFIG_DIR")
    if own:
        return os.path.expanduser(own)
    return os.path.join(os.path.expanduser(os.environ.get("XDG_CACHE_HOME", "~/.cache")), "accelerate_c")


def default_config_file() -> str:
    """Where `config` writes and `launch` looks first: <config_dir()>/default_config.yaml."""
    return os.path.join(config_dir(), "default_config.yaml")


def hf_default_config_file() -> str:
    """HF Accelerate's default file: $HF_HOME/accelerate/default_config.yaml, HF_HOME defaulting to
    $XDG_CACHE_HOME/huggingface (~/.cache/huggingface), read at call time (HF reads it at import)."""
    cache = os.environ.get("XDG_CACHE_HOME", "~/.cache")
    return os.path.join(os.path.expanduser(os.environ.get("HF_HOME", os.path.join(cache, "huggingface"))),
                        "accelerate", "default_config.yaml")


def find_default_config() -> str | None:
    """The default file in use: ours when it exists, else HF's when it exists, else None."""
    return next((p for p in (default_config_file(), hf_default_config_file()) if os.path.isfile(p)), None)


def load_config(path: str | None = None) -> ClusterConfig:
    """Read a YAML or JSON config (ours or HF's). ConfigError on bad content, FileNotFoundError if absent."""
    path = path or default_config_file()
    try:  # bounded: size, nesting, YAML aliases (yaml_safe.py)
        text = yaml_safe.read_text(path)
        data = yaml_safe.load_json(text, path) if path.endswith(".json") else yaml_safe.load_yaml(text, path)
    except yaml_safe.LimitError as exc:
        raise ConfigError(str(exc)) from None
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: not valid {'JSON' if path.endswith('.json') else 'YAML'}: {exc}") from None
    try:
        return from_dict(data or {})
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def save_config(cfg: ClusterConfig, path: str | None = None) -> str:
    """Write `cfg` (validated) as YAML, or JSON when the name ends in .json; returns the path."""
    validate(cfg)
    path = path or default_config_file()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    data = cfg.to_dict()
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        if path.endswith(".json"):
            fh.write(json.dumps(data, indent=2, sort_keys=True) + "\n")
        else:
            yaml.safe_dump(data, fh, sort_keys=True)
    os.replace(tmp, path)
    return path
