# `python -m accelerate_c env`: the facts a bug report needs -- versions, CPU features, cores, memory,
# GPUs and the config in use. Not for: changing anything.
from __future__ import annotations

import argparse
import os
import platform
import sys
from typing import Any

from ..as_accelerate import describe as describe_switch
from .config_args import default_config_file, find_default_config, load_config


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("env", help="print versions, hardware and the config in use")
    p.add_argument("--config_file", default=None, help="config to show (default: the default config file)")
    p.set_defaults(func=env_command)
    return p


def _memory_gib() -> str:
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        return f"{pages * size / 2**30:.1f} GiB"
    except (ValueError, OSError, AttributeError):
        return "unknown"


def collect(config_file: str | None = None) -> dict[str, Any]:
    """The report as an ordered mapping (also used by tests)."""
    import torch

    try:
        from accelerate_c import _C  # type: ignore[attr-defined]

        simd = str(_C.simd_detected())
        threads = f"{_C.parallel_backend()} (from the main thread; ACCELERATE_C_OPENMP_POOL)"
    except Exception as exc:  # noqa: BLE001 - the report must still print without the extension
        simd = threads = f"unavailable ({type(exc).__name__}: {exc})"
    try:
        from importlib.metadata import version

        ours = version("accelerate_c")
    except Exception:  # noqa: BLE001 - not installed, running from a checkout
        ours = "0.1.0 (source checkout)"
    info: dict[str, Any] = {
        "accelerate_c version": ours,
        "Platform": platform.platform(),
        "Python version": sys.version.split()[0],
        "PyTorch version": torch.__version__,
        "CPU SIMD detected": simd,
        "C kernels' threads": threads,
        "CPU cores (usable)": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "System RAM": _memory_gib(),
        "`import accelerate` resolves to accelerate_c": describe_switch(),
    }
    if torch.cuda.is_available():
        info["GPUs"] = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        info["CUDA version"] = torch.version.cuda
    else:
        info["GPUs"] = "none"
    path = config_file or find_default_config() or default_config_file()
    if os.path.isfile(path):
        info["Config file"] = path
        info["Config"] = load_config(path).to_dict()
    else:
        info["Config file"] = f"not found ({path})"
    return info


def env_command(args: argparse.Namespace) -> int:
    print("Copy-and-paste the text below in your GitHub issue\n")
    for key, value in collect(args.config_file).items():
        if isinstance(value, dict):
            print(f"- {key}:")
            for k, v in value.items():
                print(f"\t- {k}: {v}")
        else:
            print(f"- {key}: {value}")
    return 0
