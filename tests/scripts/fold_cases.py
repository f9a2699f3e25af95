# tests/scripts/fold_cases.py: the multi-case mode of the test scripts (join_train.py, sharded_fp16.py,
# sharded_wrap.py, views_walk.py): `--cases FILE` names a JSON list of {"args": [...], "env": {...}}, and the
# script runs every case in turn in the same processes (one interpreter start and one launch instead of one per
# case; a launch costs seconds of CPU in imports, a case of these scripts far less). Between cases the
# process-wide state goes back to what a fresh process would have: both libraries' AcceleratorState and
# GradientState reset, os.environ back to what the process started with and then the case's own variables (the
# ACCELERATE_C_* settings are read when an Accelerator is built; the plugins' ACCELERATE_USE_* switches are
# dropped), and the cached communication groups closed (they are built anew, reading the case's settings), while
# the default process group lives on. A case that is not the last ends as end_training does, without destroying
# the default group. tests/fold.py writes the file, lays out each case's output folder and splits the output.
# Not for: anything a test checks (the scripts do the work; this only sequences them).
from __future__ import annotations

import importlib
import json
import os
import sys
from typing import Any, Callable

# A line each process prints to stdout and stderr as it begins case i. A case ends with a barrier on every rank, so
# everything case i prints lies between the first mark of i and the first mark of i + 1.
MARK = "fold_cases: begins case "


def reset_state() -> None:
    """AcceleratorState / GradientState of accelerate_c, and of HF's accelerate when loaded, back to none."""
    for name in ("accelerate_c", "accelerate"):
        if name in sys.modules:
            state = importlib.import_module(f"{name}.state")
            state.AcceleratorState._reset_state(True)
            state.GradientState._reset_state()


def end_case(acc: Any, final: bool) -> None:
    """acc.end_training() for the last case; before that, what it does except destroying the default process
    group (trackers finished, the strategy's resources released, the cached groups closed, a barrier)."""
    if final:
        acc.end_training()
        return
    import torch.distributed as dist
    for tracker in getattr(acc, "trackers", []):
        tracker.finish()
    strategy = getattr(acc, "strategy", None)
    if strategy is not None:  # accelerate_c's Accelerator (HF's has no strategy and nothing cached to close)
        strategy.close()
        from accelerate_c.comm import release_groups
        release_groups()
    if dist.is_initialized():
        dist.barrier()


def load_cases(path: str) -> list[dict]:
    with open(path) as f:
        cases = json.load(f)
    if not isinstance(cases, list) or not cases:
        raise ValueError(f"--cases {path}: expected a non-empty JSON list of {{'args': [...], 'env': {{...}}}}")
    return cases


def run_cases(path: str, body: Callable[[list, bool], None]) -> None:
    """body(args, final) for every case of the file `path`, in order, with the state reset between cases."""
    cases = load_cases(path)
    start = dict(os.environ)
    for i, case in enumerate(cases):
        os.environ.clear()
        os.environ.update(start)
        os.environ.update({k: str(v) for k, v in case.get("env", {}).items()})
        reset_state()
        for stream in (sys.stdout, sys.stderr):  # where case i's output begins (tests/fold.py: case_output)
            stream.write(f"{MARK}{i}\n")  # one write (print writes the newline apart: another rank's line could
            stream.flush()                # land between them)
        body(list(case["args"]), i == len(cases) - 1)
    reset_state()
    os.environ.clear()
    os.environ.update(start)
