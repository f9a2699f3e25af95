# tests/fold.py: the test side of folded launches (tests/scripts/fold_cases.py runs them): several runs of one
# script with the same process count, launcher and launch environment become cases of one launch, each with an
# output folder of its own, so that a test pays the interpreter, the imports and the launch once per group. Here:
# Case and run_folded (write the --cases file, run it), check_each / run_checks (every case checked, each
# failure named),
# case_output (a folded launch's output split into its cases' parts), launcher_env (the variables the launcher
# gives its ranks for launcher flags, for a case of a launch without them), and for the sharded tests Group /
# run_group (the cases of one launch of sharded_cases.py started together with the one process that computes their
# single-process references, each distinct reference once, under one deadline).
# Not for: what is checked (the test files), or processes and timeouts themselves (tests/conftest.py).
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

from conftest import SCRIPTS, Job, clean_env, describe_all, finish_all, run_script

sys.path.insert(0, SCRIPTS)
from fold_cases import MARK  # noqa: E402 - the line the script side writes as every process begins a case


class Case:
    """One run of a script: `name` (its output folder, shown on failure), its arguments (without the output flag),
    its own environment variables; `expect_error`: the run may raise (on every rank alike), its error text is then
    written to <out>/error<RANK>.txt and the next case runs. `out`: its folder, once a Group places it."""

    def __init__(self, name: str, args: list, env: Optional[dict] = None, expect_error: bool = False,
                 **info: Any) -> None:
        self.name, self.args, self.env, self.info = name, [str(a) for a in args], dict(env or {}), info
        self.expect_error = expect_error
        self.out: Optional[Path] = None

    def spec(self) -> dict:
        return {"args": self.args, "env": self.env, "expect_error": self.expect_error}

    def __repr__(self) -> str:
        return f"Case({self.name!r})"


def write_cases(path: Path, specs: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(specs, indent=1))
    return path


def run_folded(script: str, cases: list, folder: Path, out_flag: Optional[str] = "--out", nproc: int = 1,
               launcher: str = "accelerate_c", timeout: float = 300, env: Optional[dict] = None,
               per_case_s: float = 60, done: Optional[list] = None) -> dict:
    """Runs every case of `cases` in one launch of tests/scripts/<script> (`--cases FILE`); case c writes into
    folder/<c.name> (passed as `out_flag` when not None). Returns {name: its folder}; `done`, when given, gets the
    completed process (its output: case_output). `timeout` plus `per_case_s` per case bounds the whole launch
    (conftest's run_script kills it past that and fails with every output)."""
    folder = Path(folder)
    names = [c.name for c in cases]
    assert len(set(names)) == len(names), f"case names must differ: {names}"
    outs = {c.name: folder / c.name for c in cases}
    specs = [{**c.spec(), "args": c.args + ([out_flag, str(outs[c.name])] if out_flag else [])} for c in cases]
    path = write_cases(folder / "cases.json", specs)
    proc = run_script(script, ["--cases", str(path)], nproc=nproc, launcher=launcher,
                      timeout=timeout + per_case_s * len(cases), env=env)
    if done is not None:
        done.append(proc)
    return outs


def check_each(items, check: Callable[[Any], None], name: Optional[Callable[[Any], str]] = None) -> None:
    """check(item) for every item; fails once at the end with every failing item's name (`name(item)`; by default
    a Case's name, or the item itself) and message."""
    items, failed = list(items), []
    for item in items:
        try:
            check(item)
        except AssertionError as e:
            failed.append(f"[{name(item) if name else getattr(item, 'name', item)}] {e}")
    if failed:
        pytest.fail(f"{len(failed)} of {len(items)} cases failed:\n" + "\n".join(failed), pytrace=False)


def run_checks(checks: list) -> None:
    """check_each over (name, function, *args) tuples: function(*args) for each."""
    check_each(checks, lambda c: c[1](*c[2:]), name=lambda c: c[0])


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
    args = launch_command_parser().parse_args(["--num_processes", str(nproc), *flags, "script.py"])
    saved = dict(os.environ)
    try:
        os.environ.clear()
        os.environ.update(clean_env())
        return resolve_config(args).env()
    finally:
        os.environ.clear()
        os.environ.update(saved)


# ------------------------------------------------------------------ sharded tests: a launch beside its references
RUNNER = os.path.join(SCRIPTS, "sharded_cases.py")


class Group:
    """The cases of one launch of sharded_cases.py (`nproc` ranks) and their single-process references (one
    process computes every distinct one). A case's info "kind" is "train" (sharded_train.py; its --out added here)
    or a function of construct_checks.py (its arguments as args)."""

    def __init__(self, root: Path, nproc: int) -> None:
        self.root, self.nproc = Path(root), nproc
        self.cases: list[Case] = []
        self.refs: dict = {}  # tuple(args) -> Case

    def add(self, case: Case) -> Case:
        assert all(c.name != case.name for c in self.cases), case.name
        case.out = self.root / "got" / case.name
        if case.info.setdefault("kind", "train") == "train":
            case.args = case.args + ["--out", str(case.out)]
        self.cases.append(case)
        return case

    def ref(self, args: list) -> Path:
        """The output folder of the one-process run of sharded_train.py `args` (without --out); computed once."""
        key = tuple(str(a) for a in args)
        if key not in self.refs:
            out = self.root / "ref" / f"r{len(self.refs)}"
            ref = Case(f"ref{len(self.refs)}", list(key) + ["--out", str(out)], kind="train")
            ref.out = out
            self.refs[key] = ref
        return self.refs[key].out


def _write_group(path: Path, cases: list) -> Path:
    return write_cases(path, [{**c.spec(), "args": [c.info["kind"], *c.args]} for c in cases])


def launch_cmd(nproc: int, cases_file: Path, *launch_args: str) -> list:
    return [sys.executable, "-m", "accelerate_c", "launch", "--num_processes", str(nproc), *launch_args, RUNNER,
            "--cases", str(cases_file)]


def run_group(group: Group, timeout: float, env: Optional[dict] = None, launches: Optional[list] = None) -> None:
    """The references' process and the launch (or `launches`: [(name, cmd)] built with launch_cmd over
    group.root / "cases.json", e.g. one per machine) together; raises with every output if one fails."""
    logs = group.root / "logs"
    jobs = []
    if group.refs:
        refs = _write_group(group.root / "refs.json", list(group.refs.values()))
        jobs.append(Job([sys.executable, RUNNER, "--cases", str(refs)], logs, "refs", clean_env()))
    cases = _write_group(group.root / "cases.json", group.cases)
    for name, cmd in launches or [("launch", launch_cmd(group.nproc, cases, "--main_process_port", "0"))]:
        jobs.append(Job(cmd, logs, name, clean_env(**(env or {}))))
    results = finish_all(jobs, timeout)
    if any(rc != 0 for rc, _, _ in results):
        raise AssertionError("a process of the group failed\n" + describe_all(jobs))
