# benchmarks/_results.py: shared helpers for benchmark scripts: timing medians and appending a results
# block (date, exact command, machine, table) to benchmarks/RESULTS.md.
# Not for: measurement logic (each benchmark owns its own).
from __future__ import annotations

import datetime
import os
import platform
import shlex
import statistics
import sys
import time
from typing import Callable

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


def command_line() -> str:
    return " ".join(shlex.quote(a) for a in [os.path.relpath(sys.executable, os.getcwd()) if sys.executable.startswith(os.getcwd()) else "python", *sys.argv])


def append_results(title: str, lines: list[str]) -> None:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    cpu = platform.processor() or platform.machine()
    block = [f"## {title}", "", f"- date: {stamp}", f"- command: `{command_line()}`",
             f"- machine: {os.cpu_count()} cores, {cpu}, python {platform.python_version()}", "", *lines, ""]
    with open(RESULTS, "a") as f:
        f.write("\n".join(block) + "\n")
