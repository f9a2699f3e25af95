# The launch/config settings as ONE dataclass (`ClusterConfig`) whose fields are the YAML keys of
# HF Accelerate's ClusterConfig (1.15) plus a few accelerate_c extensions. Everything else is derived
# from the field metadata: reading/writing YAML or JSON, validation (unknown key / wrong type / value
# not allowed -> ConfigError naming the key and the allowed values), `launch` flags and their
# defaults, and the ACCELERATE_* environment variables handed to the ranks.
# Not for: the launching itself (launch.py) or the interactive questions (config.py).
from __future__ import annotations

import dataclasses
import difflib
import json
import os
from dataclasses import dataclass, field
from typing import Any

import yaml

# HF's DistributedType values: all are accepted in a file; the launcher runs every one of them
# through torch's elastic agent (except XLA, which needs torch_xla).
DISTRIBUTED_TYPES = ("NO", "MULTI_CPU", "MULTI_GPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA",
                     "MULTI_XPU", "DEEPSPEED", "FSDP", "XLA", "MEGATRON_LM", "MULTI_HPU", "MULTI_NEURON")
MIXED_PRECISION = ("no", "fp16", "bf16", "fp8")
CONFIG_ENV = "ACCELERATE_C_CONFIG"  # the launcher's resolved config, as JSON, in every rank


class ConfigError(ValueError):
    """A bad config key or value; the message names the key and what is allowed."""


def _opt(default: Any, kind: str, help: str, *, choices: tuple | None = None, env: str | None = None,
         flag: str | None = None, ext: bool = False, question: str | None = None) -> Any:
    """One setting. kind: int|float|str|bool|dict|list; flag: the `launch` option (None = no flag);
    env: the variable the ranks receive; ext: an accelerate_c key, written only when not default;
    question: asked by the interactive `config`."""
    meta = dict(kind=kind, help=help, choices=choices, env=env, flag=flag, ext=ext, question=question)
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class FP8Config:
    """The `fp8_config` block. Keys are HF's; `fp8_`-prefixed spellings are accepted too. Each key has a
    `launch --fp8_<key>` flag and an ACCELERATE_FP8_<KEY> variable (HF's names)."""
    backend: str | None = _opt(None, "str", "FP8 backend (HF: TE|MSAMP|AO); accelerate_c uses its own",
                               choices=("TE", "MSAMP", "AO", "te", "msamp", "ao"))
    fp8_format: str = _opt("HYBRID", "str", "FP8 recipe format", choices=("E4M3", "HYBRID", "E5M2"))
    amax_history_len: int = _opt(1024, "int", "length of the amax history for scaling")
    amax_compute_algo: str = _opt("most_recent", "str", "how the scale is derived from the amax history",
                                  choices=("max", "most_recent"))
    margin: int = _opt(0, "int", "margin (power of two) for the fp8 scale")
    interval: int = _opt(1, "int", "how often (steps) the scale is recomputed")
    override_linear_precision: Any = _opt(None, "list", "(fprop, dgrad, wgrad) in higher precision")
    use_autocast_during_eval: bool = _opt(False, "bool", "keep fp8 autocast during eval")
    opt_level: str | None = _opt(None, "str", "MS-AMP optimisation level", choices=("O1", "O2"))
    enable_fsdp_float8_all_gather: bool = _opt(False, "bool", "fp8 all-gather for FSDP2 (torchao)")
    pad_inner_dim: bool = _opt(False, "bool", "pad inner dims of fp8 GEMMs (torchao)")

    @staticmethod
    def key_of(name: str) -> str:
        """Canonical field name for a file key ('fp8_margin' -> 'margin'; 'fp8_format' stays)."""
        names = {f.name for f in dataclasses.fields(FP8Config)}
        if name in names:
            return name
        if name.startswith("fp8_") and name[4:] in names:
            return name[4:]
        return name

    @staticmethod
    def flag_of(name: str) -> str:
        return "--fp8_" + name.removeprefix("fp8_")

    @staticmethod
    def env_of(name: str) -> str:
        return "ACCELERATE_FP8_" + name.removeprefix("fp8_").upper()


@dataclass
class ClusterConfig:
    """Every key of an accelerate(_c) config file. HF's keys first, then ours (ext=True)."""
    compute_environment: str = _opt("LOCAL_MACHINE", "str", "where to run (SageMaker is not supported)",
                                    choices=("LOCAL_MACHINE",))
    distributed_type: str = _opt("NO", "str", "HF's distributed type (all run on torch's elastic agent)",
                                 choices=DISTRIBUTED_TYPES, question="Distributed type")
    mixed_precision: str = _opt("no", "str", "mixed precision", choices=MIXED_PRECISION,
                                env="ACCELERATE_MIXED_PRECISION", flag="--mixed_precision",
                                question="Mixed precision")
    use_cpu: bool = _opt(False, "bool", "train on CPU even when GPUs are present", env="ACCELERATE_USE_CPU",
                         flag="--cpu", question="Run on CPU only")
    debug: bool = _opt(False, "bool", "check distributed operations for errors", env="ACCELERATE_DEBUG_MODE",
                       flag="--debug", question="Check distributed operations for errors (debug mode)")
    num_processes: int = _opt(1, "int", "total number of processes over all machines",
                              flag="--num_processes", question="Total number of processes (all machines)")
    machine_rank: int = _opt(0, "int", "rank of this machine", flag="--machine_rank",
                             question="Rank of this machine")
    num_machines: int = _opt(1, "int", "number of machines", flag="--num_machines",
                             question="Number of machines")
    gpu_ids: str | None = _opt(None, "str", "comma-separated GPU ids to use, or 'all'", flag="--gpu_ids")
    main_process_ip: str | None = _opt(None, "str", "address of the machine with rank 0",
                                       flag="--main_process_ip", question="Main process IP")
    main_process_port: int | None = _opt(None, "int", "port on the main machine (0 = pick a free one; "
                                         "one machine only)", flag="--main_process_port",
                                         question="Main process port")
    rdzv_backend: str = _opt("static", "str", "rendezvous backend for several machines",
                             choices=("static", "c10d"), flag="--rdzv_backend")
    same_network: bool = _opt(False, "bool", "machines share a local network (informational)")
    main_training_function: str = _opt("main", "str", "TPU only: the function to launch")
    enable_cpu_affinity: bool = _opt(False, "bool", "bind ranks to NUMA nodes", env="ACCELERATE_CPU_AFFINITY",
                                     flag="--enable_cpu_affinity")
    fp8_config: dict = _opt({}, "dict", "FP8 recipe (see FP8Config)")
    deepspeed_config: dict = _opt({}, "dict", "DeepSpeed/ZeRO settings (read by the ZeRO strategy)")
    fsdp_config: dict = _opt({}, "dict", "FSDP settings (read by the FSDP strategy)")
    parallelism_config: dict = _opt({}, "dict", "parallelism sizes (read by the parallelism config)")
    megatron_lm_config: dict = _opt({}, "dict", "Megatron-LM settings (read by the TP/PP strategies)")
    mpirun_config: dict = _opt({}, "dict", "mpirun settings (not used: accelerate_c needs no MPI)")
    dynamo_config: dict = _opt({}, "dict", "torch.compile settings")
    downcast_bf16: bool = _opt(False, "bool", "TPU only: downcast to bf16", env="ACCELERATE_DOWNCAST_BF16")
    tpu_name: str | None = _opt(None, "str", "TPU only")
    tpu_zone: str | None = _opt(None, "str", "TPU only")
    tpu_use_cluster: bool = _opt(False, "bool", "TPU only")
    tpu_use_sudo: bool = _opt(False, "bool", "TPU only")
    command_file: str | None = _opt(None, "str", "TPU only")
    commands: list | None = _opt(None, "list", "TPU only")
    tpu_vm: list | None = _opt(None, "list", "TPU only")
    tpu_env: list | None = _opt(None, "list", "TPU only")
    # accelerate_c extensions (written only when changed, so default files stay readable by HF).
    gradient_accumulation_steps: int | None = _opt(None, "int", "gradient accumulation steps",
                                                   env="ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
                                                   flag="--gradient_accumulation_steps", ext=True,
                                                   question="Gradient accumulation steps")
    max_restarts: int = _opt(0, "int", "restarts of the whole local group after a failure",
                             flag="--max_restarts", ext=True)
    monitor_interval: float = _opt(0.1, "float", "seconds between health checks of the ranks",
                                   flag="--monitor_interval", ext=True)

    def __post_init__(self) -> None:
        validate(self)

    def fp8(self) -> FP8Config:
        """The fp8_config block as a validated FP8Config."""
        return _build(FP8Config, {FP8Config.key_of(k): v for k, v in self.fp8_config.items()}, "fp8_config.")

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
        """Variables for the ranks, derived from the `env` metadata (+ ACCELERATE_FP8_* for fp8)."""
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
            fp8 = self.fp8()
            for f in dataclasses.fields(fp8):
                value = getattr(fp8, f.name)
                if value is None:
                    continue
                if f.name == "override_linear_precision":
                    for part, v in zip(("FPROP", "DGRAD", "WGRAD"), value):
                        out["ACCELERATE_FP8_OVERRIDE_" + part] = _env_str(v)
                else:
                    out[FP8Config.env_of(f.name)] = _env_str(value)
        return out


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]


def _env_str(value: Any) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def _allowed(f: dataclasses.Field) -> str:
    meta = f.metadata
    if meta["choices"]:
        return "one of " + ", ".join(repr(c) for c in meta["choices"])
    return {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false",
            "dict": "a mapping", "list": "a list"}[meta["kind"]] + (" or null" if _default(f) is None else "")


def _check(f: dataclasses.Field, value: Any, prefix: str = "") -> Any:
    """Return `value` converted to the field's kind, or raise ConfigError naming key and allowed values."""
    kind, choices = f.metadata["kind"], f.metadata["choices"]
    if value is None and (_default(f) is None or kind in ("dict", "list")):
        return _default(f)
    ok = False
    if kind == "bool":
        ok = isinstance(value, bool)
    elif kind == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind == "float":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif kind == "str":
        if value is False and choices:  # YAML 1.1 reads an unquoted `no`/`NO` as false
            value = next((c for c in choices if c.lower() == "no"), value)
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and not choices:
            value = str(value)  # e.g. `gpu_ids: 0`
        ok = isinstance(value, str) and (not choices or value in choices)
    elif kind == "dict":
        ok = isinstance(value, dict)
    elif kind == "list":
        ok = isinstance(value, (list, tuple))
        value = list(value) if ok else value
    if not ok:
        raise ConfigError(f"config key `{prefix}{f.name}`: got {value!r}; allowed: {_allowed(f)}")
    return value


def _build(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"config{' ' + prefix if prefix else ''} must be a mapping of keys to values, "
                          f"got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        near = [m for k in unknown for m in difflib.get_close_matches(k, fields, n=1)]
        hint = f" (did you mean {', '.join(prefix + m for m in near)}?)" if near else ""
        raise ConfigError(f"unknown config key(s) {', '.join(prefix + k for k in unknown)}{hint}; allowed keys: "
                          f"{', '.join(prefix + k for k in fields)}")
    obj = cls.__new__(cls)
    for name, f in fields.items():
        object.__setattr__(obj, name, _check(f, data[name], prefix) if name in data else _default(f))
    return obj


def validate(cfg: ClusterConfig) -> None:
    """Type/choice checks of every field, fp8_config keys, and the cross-field rules."""
    for f in dataclasses.fields(cfg):
        object.__setattr__(cfg, f.name, _check(f, getattr(cfg, f.name)))
    cfg.fp8()
    for key in ("num_processes", "num_machines"):
        if getattr(cfg, key) < 1:
            raise ConfigError(f"config key `{key}`: got {getattr(cfg, key)}; allowed: an integer >= 1")
    if not 0 <= cfg.machine_rank < cfg.num_machines:
        raise ConfigError(f"config key `machine_rank`: got {cfg.machine_rank}; allowed: 0..{cfg.num_machines - 1}")
    if cfg.num_processes % cfg.num_machines:
        raise ConfigError(f"config key `num_processes`: {cfg.num_processes} processes cannot be split evenly "
                          f"over num_machines={cfg.num_machines}; allowed: a multiple of num_machines")
    if cfg.gradient_accumulation_steps is not None and cfg.gradient_accumulation_steps < 1:
        raise ConfigError("config key `gradient_accumulation_steps`: allowed: an integer >= 1")
    if cfg.main_process_port is not None and not 0 <= cfg.main_process_port < 65536:
        raise ConfigError(f"config key `main_process_port`: got {cfg.main_process_port}; allowed: 0..65535")


def from_dict(data: dict[str, Any]) -> ClusterConfig:
    """Build and validate a config from a file's mapping (HF's legacy keys are migrated like HF does)."""
    data = dict(data or {})
    if "fp16" in data:  # HF legacy: `fp16: true` -> mixed_precision
        fp16 = data.pop("fp16")
        data.setdefault("mixed_precision", "fp16" if fp16 else "no")
    if "dynamo_backend" in data:  # HF legacy: top-level dynamo_backend -> dynamo_config
        backend = data.pop("dynamo_backend")
        data.setdefault("dynamo_config", {} if backend == "NO" else {"dynamo_backend": backend})
    if data.get("compute_environment") == "AMAZON_SAGEMAKER":
        raise ConfigError("config key `compute_environment`: AMAZON_SAGEMAKER is not supported by accelerate_c; "
                          "allowed: 'LOCAL_MACHINE'")
    cfg = _build(ClusterConfig, data)
    validate(cfg)
    return cfg


def config_from_env() -> "ClusterConfig | None":
    """In a rank: the config the launcher resolved (file + flags), or None when not launched by us."""
    text = os.environ.get(CONFIG_ENV)
    return from_dict(json.loads(text)) if text else None


def config_dir() -> str:
    """ACCELERATE_C_CONFIG_DIR, else $XDG_CACHE_HOME/accelerate_c, else ~/.cache/accelerate_c."""
    if os.environ.get("ACCELERATE_C_CONFIG_DIR"):
        return os.path.expanduser(os.environ["ACCELERATE_C_CONFIG_DIR"])
    return os.path.join(os.path.expanduser(os.environ.get("XDG_CACHE_HOME", "~/.cache")), "accelerate_c")


def default_config_file() -> str:
    return os.path.join(config_dir(), "default_config.yaml")


def load_config(path: str | None = None) -> ClusterConfig:
    """Read a YAML or JSON config (ours or HF's). ConfigError on bad content, FileNotFoundError if absent."""
    path = path or default_config_file()
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    try:
        data = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
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


# ---- CLI derivation -------------------------------------------------------------------------------

def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "y", "on"):
        return True
    if low in ("0", "false", "no", "n", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


_ARG_TYPES = {"int": int, "float": float, "str": str}


def add_config_flags(parser: Any) -> None:
    """Add one option per field that has a `flag` (+ the --fp8_* options). Defaults are None so that
    `apply_flags` can tell a given flag from an absent one (config file values fill the rest)."""
    for f in dataclasses.fields(ClusterConfig):
        meta = f.metadata
        if not meta["flag"]:
            continue
        if meta["kind"] == "bool":
            parser.add_argument(meta["flag"], dest=f.name, action="store_const", const=True, default=None,
                                help=meta["help"])
        else:
            parser.add_argument(meta["flag"], dest=f.name, type=_ARG_TYPES[meta["kind"]], default=None,
                                choices=meta["choices"], help=meta["help"])
    for f in dataclasses.fields(FP8Config):
        meta = f.metadata
        if f.name == "override_linear_precision":
            continue
        kw: dict[str, Any] = dict(dest="fp8__" + f.name, default=None, help=f"fp8: {meta['help']}")
        if meta["kind"] == "bool":
            parser.add_argument(FP8Config.flag_of(f.name), action="store_const", const=True, **kw)
        else:
            parser.add_argument(FP8Config.flag_of(f.name), type=_ARG_TYPES[meta["kind"]], choices=meta["choices"],
                                metavar=f.name.removeprefix("fp8_").upper() if not meta["choices"] else None, **kw)


def apply_flags(cfg: ClusterConfig, args: Any) -> ClusterConfig:
    """A copy of `cfg` with every flag that was given on the command line put over it (flags win)."""
    updates = {f.name: getattr(args, f.name) for f in dataclasses.fields(ClusterConfig)
               if f.metadata["flag"] and getattr(args, f.name, None) is not None}
    fp8 = {f.name: getattr(args, "fp8__" + f.name) for f in dataclasses.fields(FP8Config)
           if getattr(args, "fp8__" + f.name, None) is not None}
    if fp8:
        merged = {FP8Config.key_of(k): v for k, v in cfg.fp8_config.items()}
        merged.update(fp8)
        updates["fp8_config"] = merged
    return dataclasses.replace(cfg, **updates)


def parse_answer(f: dataclasses.Field, text: str) -> Any:
    """Turn a typed answer into the field's kind (for the interactive `config`); ConfigError if bad."""
    kind = f.metadata["kind"]
    try:
        value: Any = _parse_bool(text) if kind == "bool" else _ARG_TYPES[kind](text.strip())
    except (ValueError, KeyError):
        raise ConfigError(f"config key `{f.name}`: got {text!r}; allowed: {_allowed(f)}") from None
    return _check(f, value)
