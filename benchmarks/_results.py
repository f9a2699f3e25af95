# benchmarks/_results.py: shared helpers for benchmark scripts: timing medians, running a multi-process worker
# and reading each rank's JSON, the process's RSS figures and peak reset (/proc/self), and appending a results block
# (date, exact command, machine, table) to benchmarks/RESULTS.md.
# Not for: measurement logic (each benchmark owns its own).
from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Iterator

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")


def median_time(fn: Callable[[], object], reps: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


@contextlib.contextmanager
def private_tmp(env: dict) -> Iterator[dict]:
    """`env` with TMPDIR set to a folder removed afterwards: torchrun leaves a torchelastic_* folder per launch."""
    with tempfile.TemporaryDirectory(prefix="bench_tmp_") as tmp:
        yield dict(env, TMPDIR=tmp)


def status_bytes(key: str) -> int:
    """A byte figure of this process from /proc/self/status ("VmRSS", "VmHWM", ...)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def reset_peak_rss() -> None:
    """VmHWM := VmRSS now (Linux), so a later status_bytes("VmHWM") is the peak from here on."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def run_ranks(kind: str, cmd: list[str], env: dict, cwd: str, out: str, nranks: int, timeout: float) -> list[dict]:
    """Runs a launcher command whose ranks each write <out>.<rank>.json; their records, in rank order. A failed run
    raises with the end of its output."""
    with private_tmp(env) as env:
        p = subprocess.run(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"{kind} run failed ({p.returncode}):\n{p.stdout[-4000:]}")
    records = []
    for r in range(nranks):
        with open(f"{out}.{r}.json") as f:
            records.append(json.load(f))
    return records


def command_line() -> str:
    return " ".join(shlex.quote(a) for a in [os.path.relpath(sys.executable, os.getcwd()) if sys.executable.startswith(os.getcwd()) else "python", *sys.argv])


def append_results(title: str, lines: list[str]) -> None:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    cpu = platform.processor() or platform.machine()
    block = [f"## {title}", "", f"- date: {stamp}", f"- command: `{command_line()}`",
             f"- machine: {os.cpu_count()} cores, {cpu}, python {platform.python_version()}", "", *lines, ""]
    with open(RESULTS, "a") as f:
        f.write("\n".join(block) + "\n")
