# tests/fold.py: runs a group of sharded_train.py cases in one process / one launch (tests/scripts/sharded_cases.py)
# for the sharded test files: Case (a name, the script's arguments, per-case environment), Group (the cases that
# share one launch, and the single-process references they are checked against, each computed once), run_group
# (the references' process and the launch started together, one deadline, every output shown on failure).
# Not for: the checks themselves (the test files), or tests that need a process of their own.
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Optional

from conftest import SCRIPTS, Job, clean_env, describe_all, finish_all

RUNNER = os.path.join(SCRIPTS, "sharded_cases.py")


@dataclasses.dataclass
class Case:
    name: str
    argv: list                      # sharded_train.py's arguments without --out (kind "train"), else the function's
    env: dict = dataclasses.field(default_factory=dict)  # variables set for this case only
    kind: str = "train"
    out: Optional[Path] = None      # set by Group


class Group:
    """The cases of one launch (`nproc` ranks) and their references (one process computes every distinct one)."""

    def __init__(self, root: Path, nproc: int) -> None:
        self.root, self.nproc = Path(root), nproc
        self.cases: list[Case] = []
        self.refs: dict = {}  # tuple(argv) -> Case

    def add(self, case: Case) -> Case:
        assert all(c.name != case.name for c in self.cases), case.name
        case.out = self.root / "got" / case.name
        if case.kind == "train":
            case.argv = [str(a) for a in case.argv] + ["--out", str(case.out)]
        self.cases.append(case)
        return case

    def ref(self, argv: list) -> Path:
        """The output folder of the one-process run of sharded_train.py `argv` (without --out); computed once."""
        key = tuple(str(a) for a in argv)
        if key not in self.refs:
            out = self.root / "ref" / f"r{len(self.refs)}"
            self.refs[key] = Case(f"ref{len(self.refs)}", list(key) + ["--out", str(out)], out=out)
        return self.refs[key].out


def _write(path: Path, cases: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([{"name": c.name, "kind": c.kind, "argv": c.argv, "env": c.env} for c in cases]))
    return path


def launch_cmd(nproc: int, cases_file: Path, *launch_args: str) -> list:
    return [sys.executable, "-m", "accelerate_c", "launch", "--num_processes", str(nproc), *launch_args, RUNNER,
            str(cases_file)]


def run_group(group: Group, timeout: float, env: Optional[dict] = None, launches: Optional[list] = None) -> None:
    """The references' process and the launch (or `launches`: [(name, cmd)] built with launch_cmd over
    group.root / "cases.json", e.g. one per machine) together; raises with every output if one fails."""
    logs = group.root / "logs"
    jobs = []
    if group.refs:
        refs = _write(group.root / "refs.json", list(group.refs.values()))
        jobs.append(Job([sys.executable, RUNNER, refs], logs, "refs", clean_env()))
    cases = _write(group.root / "cases.json", group.cases)
    for name, cmd in launches or [("launch", launch_cmd(group.nproc, cases, "--main_process_port", "0"))]:
        jobs.append(Job(cmd, logs, name, clean_env(**(env or {}))))
    results = finish_all(jobs, timeout)
    if any(rc != 0 for rc, _, _ in results):
        raise AssertionError("a process of the group failed\n" + describe_all(jobs))
