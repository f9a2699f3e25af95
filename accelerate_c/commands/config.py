# `python -m accelerate_c config [default|update]`: write the config file that `launch` reads.
# `config` asks questions on stdin (plain lines, so piped answers work; an empty answer keeps the
# default shown in brackets), `config default` writes detected defaults (+ any config flag given),
# `config update` re-validates an existing file (ours or HF's) and rewrites it in the current format.
# `write_basic_config` (HF's utils function, exported by accelerate_c.utils) is `config default` for code.
# The question texts, types and allowed values come from ClusterConfig's field metadata.
# HF's `accelerate.commands.config` names for code that reads configs (transformers' and TRL's env reports):
# `default_config_file` (a path, as HF's module-level string: the default file launch would read, set at import)
# and `load_config_from_file(path)`.
# Not for: the key set or validation rules (config_args.py).
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any, Callable

from .config_args import ClusterConfig, ConfigError, find_default_config, load_config, parse_answer, save_config
from .config_args import default_config_file as default_path
from .config_flags import HelpFormatter, add_config_flags, add_flag, apply_flags

default_config_file: str = find_default_config() or default_path()


def load_config_from_file(config_file: str | None) -> ClusterConfig:
    """HF's loader: `config_file` (FileNotFoundError naming it when missing), else the default file; YAML or JSON
    (ConfigError naming the file and key on bad content); returns the ClusterConfig (`.to_dict()` as HF's)."""
    if config_file is not None and not os.path.isfile(config_file):
        raise FileNotFoundError(f"The passed configuration file `{config_file}` does not exist. Please pass an "
                                "existing file to `accelerate launch`, or use the default one created through "
                                "`accelerate config` and run `accelerate launch` without the `--config_file` argument.")
    return load_config(config_file or default_config_file)


# Order of the questions; a predicate decides whether a question applies given the answers so far.
QUESTIONS: list[tuple[str, Callable[[dict[str, Any]], bool]]] = [
    ("use_cpu", lambda a: True),
    ("num_machines", lambda a: True),
    ("machine_rank", lambda a: a["num_machines"] > 1),
    ("main_process_ip", lambda a: a["num_machines"] > 1),
    ("main_process_port", lambda a: a["num_machines"] > 1),
    ("num_processes", lambda a: True),
    ("mixed_precision", lambda a: True),
    ("gradient_accumulation_steps", lambda a: True),
    ("debug", lambda a: True),
]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("config", help="create or update the config file `launch` reads")
    add_flag(p, "--config_file", default=None, help=f"where to write (default: {default_path()})")
    p.set_defaults(func=config_command)
    sub = p.add_subparsers(dest="config_command", metavar="{default,update}")
    d = sub.add_parser("default", help="write a default config without questions", formatter_class=HelpFormatter)
    add_flag(d, "--config_file", default=None, help="where to write")
    add_config_flags(d)
    d.set_defaults(func=default_command)
    u = sub.add_parser("update", help="validate an existing config and rewrite it in the current format")
    add_flag(u, "--config_file", default=None, help="the file to update")
    u.set_defaults(func=update_command)
    return p


def _detect() -> ClusterConfig:
    """Defaults from the hardware: all visible GPUs, else one CPU process."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus > 1:
        return ClusterConfig(distributed_type="MULTI_GPU", num_processes=gpus)
    return ClusterConfig(use_cpu=gpus == 0)


def _with_distributed_type(cfg: ClusterConfig) -> ClusterConfig:
    """Fill in HF's distributed_type from the process count when it was left at NO / MULTI_*."""
    if cfg.distributed_type not in ("NO", "MULTI_CPU", "MULTI_GPU"):
        return cfg
    if cfg.num_processes == 1 and cfg.num_machines == 1:
        kind = "NO"
    else:
        kind = "MULTI_CPU" if cfg.use_cpu else "MULTI_GPU"
    return dataclasses.replace(cfg, distributed_type=kind)


def ask(defaults: ClusterConfig, read: Callable[[], str] = input, out: Any = sys.stdout) -> ClusterConfig:
    """Ask QUESTIONS in order; an empty answer (or end of input) keeps the default, a bad one is asked again."""
    fields = {f.name: f for f in dataclasses.fields(ClusterConfig)}
    answers: dict[str, Any] = {f: getattr(defaults, f) for f in fields}
    eof = False
    for name, applies in QUESTIONS:
        if not applies(answers):
            continue
        f = fields[name]
        default = answers[name]
        if name == "main_process_ip" and default is None:
            default = answers[name] = "127.0.0.1"
        if name == "main_process_port" and default is None:
            default = answers[name] = 29500
        choices = f.metadata["choices"]
        hint = f" ({'/'.join(choices)})" if choices else (" (yes/no)" if f.metadata["kind"] == "bool" else "")
        shown = ("yes" if default else "no") if isinstance(default, bool) else ("" if default is None else default)
        for _attempt in range(5):
            print(f"{f.metadata['question']}{hint} [{shown}]: ", end="", file=out, flush=True)
            try:
                text = "" if eof else read()
            except EOFError:
                eof, text = True, ""
            if eof:
                print(file=out)
            if not text.strip():
                break
            try:
                answers[name] = parse_answer(f, text)
                break
            except ConfigError as exc:
                print(f"  {exc}", file=out)
        else:
            raise ConfigError(f"config key `{name}`: no valid answer given")
    return _with_distributed_type(dataclasses.replace(defaults, **answers))


def config_command(args: argparse.Namespace) -> int:
    path = args.config_file or default_path()
    defaults = load_config(path) if os.path.isfile(path) else _detect()
    cfg = ask(defaults)
    print(f"accelerate_c config saved at {save_config(cfg, path)}")
    return 0


def _write_default(cfg: ClusterConfig, path: str) -> Path | None:
    """Save the detected defaults + `cfg`'s settings at `path`, or None (and say so) when a file is there."""
    if os.path.exists(path):
        print(f"accelerate_c config: {path} already exists; not overwriting it (use `config update`, pass another "
              f"location, or remove it first)", file=sys.stderr)
        return None
    return Path(save_config(_with_distributed_type(cfg), path))


def write_basic_config(mixed_precision: str = "no", save_location: str | None = None) -> Path | bool:
    """HF's `write_basic_config`: a config for this machine (all visible GPUs, else one CPU process) with
    `mixed_precision`, saved at `save_location` (default: our default file; .json -> JSON, else YAML).
    Returns the path, or False without touching an existing file."""
    mixed_precision = mixed_precision.lower()  # HF accepts any case
    path = _write_default(dataclasses.replace(_detect(), mixed_precision=mixed_precision),
                          str(save_location or default_path()))
    return False if path is None else path


def default_command(args: argparse.Namespace) -> int:
    path = _write_default(apply_flags(_detect(), args), args.config_file or default_path())
    if path is None:
        return 1
    print(f"accelerate_c config saved at {path}")
    return 0


def update_command(args: argparse.Namespace) -> int:
    path = args.config_file or default_path()
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config file at {path}; create one with `python -m accelerate_c config`")
    cfg = load_config(path)
    print(f"accelerate_c config updated at {save_config(cfg, path)}")
    return 0
