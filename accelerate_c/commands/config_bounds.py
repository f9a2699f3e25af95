# What `launch` checks once the config file and the flags are merged, before any rank starts (each value's own
# type and bounds are ClusterConfig's, checked as the file is read): the machine can take the ranks (local
# processes x threads per process <= OVERSUBSCRIBE_FACTOR x the cores, unless allow_oversubscribe), every
# ACCELERATE_C_* variable in the environment is valid (the table of base/settings.py), the FSDP / DeepSpeed
# settings (and the DeepSpeed JSON file) and the parallel layout (ParallelismConfig / MegatronLMPlugin against
# num_processes) pass the faces' own validation, run here exactly as each rank will run it, and the ranks'
# environment fits what exec() accepts. Each failure is a ConfigError naming the key or
# variable, the value and the rule; `launch` exits with code 2.
# Not for: per-key types and bounds (config_args.py), reading files (yaml_safe.py), the launch itself (launch.py).
from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from typing import Callable, Iterator, Mapping

from ..base import settings
from . import yaml_safe
from .config_args import ClusterConfig
from .config_values import OVERSUBSCRIBE_FACTOR, ConfigError

# Linux: one "NAME=value" string handed to exec() may hold at most MAX_ARG_STRLEN (32 pages) bytes; beyond it
# the ranks cannot start (E2BIG, "Argument list too long").
MAX_ARG_STRLEN = 32 * 4096


def check_launch(cfg: ClusterConfig, cores: int, warn: Callable[[str], None]) -> None:
    """Every check of this module, in order (ConfigError at the first failure; `warn` gets the notes)."""
    check_settings(os.environ, warn)
    check_machine(cfg, cores, os.environ)
    check_plugins(cfg)
    check_env_size(cfg.env(), os.environ)


def threads_per_process(cfg: ClusterConfig, cores: int, local: int, environ: Mapping[str, str]) -> tuple[int, str]:
    """(threads each rank will use, where that number comes from) as the launcher sets OMP_NUM_THREADS:
    num_cpu_threads_per_process, else the variable when set (its first number), else cores / local processes."""
    if cfg.num_cpu_threads_per_process is not None:
        return cfg.num_cpu_threads_per_process, "num_cpu_threads_per_process"
    raw = environ.get("OMP_NUM_THREADS")
    if raw is not None:
        first = raw.split(",")[0].strip()  # OpenMP allows a list per nesting level; the first one counts here
        return (int(first) if first.isdigit() and int(first) > 0 else 1), "OMP_NUM_THREADS"
    return max(1, cores // local), "default"


def check_machine(cfg: ClusterConfig, cores: int, environ: Mapping[str, str]) -> None:
    """The documented rule: this machine's processes x threads per process <= OVERSUBSCRIBE_FACTOR x its cores,
    unless allow_oversubscribe (--allow_oversubscribe) is set. ConfigError naming the value that breaks it."""
    if cfg.allow_oversubscribe:
        return
    local = cfg.num_processes // cfg.num_machines
    threads, source = threads_per_process(cfg, cores, local, environ)
    limit = OVERSUBSCRIBE_FACTOR * cores
    if local * threads <= limit:
        return
    if source == "default" or local > limit:
        what = f"config key `num_processes`: got {cfg.num_processes}" + (
            f" over {cfg.num_machines} machines" if cfg.num_machines > 1 else "")
    elif source == "OMP_NUM_THREADS":
        what = f"environment variable OMP_NUM_THREADS={environ['OMP_NUM_THREADS']!r}"
    else:
        what = f"config key `num_cpu_threads_per_process`: got {threads}"
    raise ConfigError(f"{what}: {local} local process(es) x {threads} thread(s) per process = {local * threads:_} "
                      f"threads on {cores} core(s); allowed: local processes x threads per process <= "
                      f"{OVERSUBSCRIBE_FACTOR} x the cores = {limit:_}; pass --allow_oversubscribe (or "
                      "`allow_oversubscribe: true` in the config file) to launch anyway")


def check_settings(environ: Mapping[str, str], warn: Callable[[str], None]) -> None:
    """Every ACCELERATE_C_* variable the ranks, the C extension or the launcher read, parsed with its bounds from
    base/settings.py's table (SettingError -> ConfigError); a name that is not in the table is warned about."""
    try:
        settings.check(environ, scopes=("run", "native", "launcher"))
    except settings.SettingError as exc:
        raise ConfigError(str(exc)) from None
    for name in settings.unknown_names(environ):
        warn(f"environment variable {name} is not one of accelerate_c's (it has no effect; the variables are "
             "listed in docs/configuration.md)")


@contextlib.contextmanager
def _ranks_environ(env: Mapping[str, str]) -> Iterator[None]:
    """os.environ as a rank sees it (ours over the launcher's), put back whole afterwards (the plugins set
    variables, as HF's do); their warnings and log lines are left to the ranks, which emit them anyway."""
    saved = dict(os.environ)
    level = logging.root.manager.disable
    os.environ.update(env)
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(level)
        os.environ.clear()
        os.environ.update(saved)


def check_plugins(cfg: ClusterConfig) -> None:
    """distributed_type FSDP / DEEPSPEED: the plugin each rank's Accelerator builds from the launcher's variables
    (FullyShardedDataParallelPlugin / DeepSpeedPlugin, whose __post_init__ validates every value, and the DeepSpeed
    JSON file against the schema of what accelerate_c implements), built here first from the same variables; then
    the parallel layout (check_layout)."""
    check_layout(cfg)
    if cfg.distributed_type not in ("FSDP", "DEEPSPEED"):
        return
    key = "fsdp_config" if cfg.distributed_type == "FSDP" else "deepspeed_config"
    with _ranks_environ(cfg.env()):
        try:
            if cfg.distributed_type == "FSDP":
                from ..base.fsdp_plugin import FullyShardedDataParallelPlugin

                FullyShardedDataParallelPlugin()
            else:
                _check_deepspeed_file(os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE"))
                from ..deepspeed.plugin import DeepSpeedPlugin

                DeepSpeedPlugin()
        except (ValueError, TypeError, NotImplementedError) as exc:  # DeepSpeedConfigError is a ValueError
            raise ConfigError(f"config key `{key}` (distributed_type {cfg.distributed_type}), as every rank would "
                              f"read it: {exc}") from None


def check_layout(cfg: ClusterConfig) -> None:
    """The ParallelismConfig / MegatronLMPlugin every rank would build from the launcher's variables, and the layout
    they ask for against num_processes (HF's error when the sizes' product is not the number of processes; what
    accelerate_c does not implement), decided here first."""
    uses_pc = cfg.use_parallelism_config or bool(cfg.parallelism_config)
    if not uses_pc and cfg.distributed_type != "MEGATRON_LM":
        return
    key = "parallelism_config" if uses_pc else "megatron_lm_config"
    with _ranks_environ(cfg.env()):
        try:
            from ..base.megatron_plugin import MegatronLMPlugin
            from ..base.parallelism_config import ParallelismConfig
            from ..runtime.layout_build import decide

            pc = ParallelismConfig() if uses_pc else None
            mp = MegatronLMPlugin() if cfg.distributed_type == "MEGATRON_LM" else None
            decide(pc, mp, cfg.num_processes, cfg.distributed_type)
        except (ValueError, TypeError, NotImplementedError) as exc:
            raise ConfigError(f"config key `{key}`, as every rank would read it: {exc}") from None


def _check_deepspeed_file(path: str | None) -> None:
    """The DeepSpeed JSON file within the bounds of a config file (a regular file, its size, its nesting) before
    the plugin reads it; the plugin then checks its content."""
    if not path or path == "none" or not os.path.exists(path):
        return  # not a file: the plugin's own error (it also accepts a JSON or base64 string)
    try:
        yaml_safe.load_json(yaml_safe.read_text(path, "DeepSpeed config file"), f"DeepSpeed config file {path}")
    except yaml_safe.LimitError as exc:
        raise ValueError(str(exc)) from None
    except ValueError:
        pass  # not valid JSON: the plugin names it


def check_env_size(env: Mapping[str, str], environ: Mapping[str, str]) -> None:
    """Each variable the ranks receive fits one exec() string (Linux's MAX_ARG_STRLEN), and all of them together
    with the launcher's environment fit ARG_MAX, so that a large config is a named error, not E2BIG."""
    if not sys.platform.startswith("linux"):
        return
    for name, value in env.items():
        size = len(name.encode()) + len(value.encode()) + 2
        if size > MAX_ARG_STRLEN:
            what = " (the resolved config as JSON: shrink its free-form blocks)" if name == settings.var("CONFIG") \
                else ""
            raise ConfigError(f"environment variable {name} for the ranks would be {size:_} bytes{what}; allowed: at "
                              f"most {MAX_ARG_STRLEN:_} bytes (Linux's limit on one variable of a new process)")
    try:
        arg_max = os.sysconf("SC_ARG_MAX")
    except (ValueError, OSError):
        return
    total = sum(len(k.encode()) + len(v.encode()) + 2 + 8 for k, v in {**environ, **env}.items())
    if arg_max > 0 and total > arg_max - 65536:  # (room for the command line and the agent's own variables)
        raise ConfigError(f"the ranks' environment would be {total:_} bytes; allowed: at most {arg_max - 65536:_} "
                          "(ARG_MAX less room for the command line): unset large variables or shrink the config")
