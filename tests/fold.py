# tests/fold.py: the test side of the scripts' multi-case mode (tests/scripts/fold_cases.py): write a group of
# cases (the same script, the same process count and launcher) to one --cases file, each case with an output
# folder of its own, run them in one launch, then check every case in turn so that a failure names its case
# (and every failing case is reported, not only the first); split a folded launch's output into its cases' parts;
# give a case the variables the launcher would give its ranks for launcher flags (a case of a launch without them).
# Not for: what is checked (the test files), or processes and timeouts (tests/conftest.py's run_script / Job).
from __future__ import annotations

import json
import os
import pathlib
from typing import Any, Callable

import pytest


class Case:
    """One run of a script: `name` (shown on failure), its arguments (without the output flag), its environment."""

    def __init__(self, name: str, args: list, env: dict | None = None, **info: Any) -> None:
        self.name, self.args, self.env, self.info = name, [str(a) for a in args], dict(env or {}), info

    def __repr__(self) -> str:
        return f"Case({self.name!r})"


def run_folded(run: Callable, script: str, cases: list, folder: pathlib.Path, out_flag: str | None = "--out",
               nproc: int = 1, launcher: str = "accelerate_c", timeout: float = 300, env: dict | None = None,
               per_case_s: float = 60, done: list | None = None) -> dict:
    """Runs every case of `cases` in one launch of tests/scripts/<script> (`--cases FILE`); case c writes into
    folder/<c.name> (passed as `out_flag` when not None). Returns {name: its folder}; `done`, when given, gets the
    completed process (its output: case_output). `timeout` plus `per_case_s` per case bounds the whole launch
    (conftest's run_script kills it past that and fails)."""
    folder.mkdir(parents=True, exist_ok=True)
    names = [c.name for c in cases]
    assert len(set(names)) == len(names), f"case names must differ: {names}"
    outs = {c.name: folder / c.name for c in cases}
    spec = [{"args": c.args + ([out_flag, str(outs[c.name])] if out_flag else []), "env": c.env} for c in cases]
    path = folder / "cases.json"
    path.write_text(json.dumps(spec, indent=1))
    proc = run(script, ["--cases", str(path)], nproc=nproc, launcher=launcher,
               timeout=timeout + per_case_s * len(cases), env=env)
    if done is not None:
        done.append(proc)
    return outs


MARK = "fold_cases: begins case "  # tests/scripts/fold_cases.py prints it as every process begins a case


def case_output(text: str, n: int) -> list:
    """`text` (a folded launch's stdout or stderr) split into its n cases' parts: case i's part runs from the first
    mark of case i to the first mark of case i + 1 (every rank ends a case with a barrier). A mark is found
    anywhere in a line (the ranks share the output file: another rank's unfinished line may precede it)."""
    parts, current = [[] for _ in range(n)], None
    for line in text.splitlines():
        while MARK in line:
            before, line = line.split(MARK, 1)
            if before and current is not None:
                parts[current].append(before)
            digits = len(line) - len(line.lstrip("0123456789"))
            i, line = int(line[:digits]), line[digits:]
            current = i if current is None else max(current, i)
        if line and current is not None:
            parts[current].append(line)
    return ["\n".join(p) for p in parts]


def launcher_env(flags: list, nproc: int) -> dict:
    """The variables `accelerate_c launch --num_processes nproc <flags>` gives its ranks for these flags (the
    launcher's own resolve_config and ClusterConfig.env, read under the tests' clean environment: no config file
    of the machine's), for a case run in a launch without them."""
    from accelerate_c.commands.launch import launch_command_parser, resolve_config
    from conftest import clean_env
    args = launch_command_parser().parse_args(["--num_processes", str(nproc), *flags, "script.py"])
    saved = dict(os.environ)
    try:
        os.environ.clear()
        os.environ.update(clean_env())
        return resolve_config(args).env()
    finally:
        os.environ.clear()
        os.environ.update(saved)


def check_each(cases: list, check: Callable[[Any], None]) -> None:
    """check(case) for every case; fails once at the end with every failing case's name and message."""
    failed = []
    for c in cases:
        try:
            check(c)
        except AssertionError as e:
            failed.append(f"[{c.name}] {e}")
    if failed:
        pytest.fail(f"{len(failed)} of {len(cases)} cases failed:\n" + "\n".join(failed), pytrace=False)
