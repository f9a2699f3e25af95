# `python -m accelerate_c test`: launch the 2-process self-check (selfcheck.py) through our own launcher
# and report pass/fail with the exit code. Not for: the project's pytest suite.
from __future__ import annotations

import argparse
import os
from typing import Any

from . import launch

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "selfcheck.py")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("test", help="run a 2-process training self-check")
    p.add_argument("--config_file", default=None, help="config whose settings the check runs with")
    p.add_argument("--num_processes", type=int, default=2, help="processes for the check (default 2)")
    p.set_defaults(func=test_command)
    return p


def test_command(args: argparse.Namespace) -> int:
    import torch

    argv = ["--num_processes", str(args.num_processes), "--quiet"]
    if args.config_file:
        argv += ["--config_file", args.config_file]
    if not (torch.cuda.is_available() and torch.cuda.device_count() >= args.num_processes):
        argv.append("--cpu")
    parser = argparse.ArgumentParser(prog="accelerate_c test")
    launch.add_parser(parser.add_subparsers(dest="command"))
    launch_args = parser.parse_args(["launch", *argv, SCRIPT])
    rc = launch.launch_command(launch_args)
    if rc == 0:
        print("Test is a success! You are ready for your distributed training!")
    else:
        print(f"accelerate_c test: FAILED (exit code {rc})")
    return rc
