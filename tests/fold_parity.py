# tests/fold_parity.py: the test side of folded launches (tests/scripts/fold_cases.py): several configurations
# of one script run one after the other in one launch (same nproc, launcher and launch environment), each case
# with its own output folder; and a check loop that tries every case and names each failing one.
# Not for: what a case checks (the test files) or launching itself (tests/conftest.py's run_script).
import json
import os
from typing import Callable

import pytest

from conftest import run_script


def case(*args: str, env: dict | None = None, expect_error: bool = False) -> dict:
    """One configuration: the script's arguments (without --out), its own environment variables."""
    return {"args": [str(a) for a in args], "env": dict(env or {}), "expect_error": expect_error}


def fold(script: str, cases: dict, root, nproc: int = 1, launcher: str = "torchrun", env: dict | None = None,
         timeout: float = 600) -> dict:
    """Runs every case of `cases` ({name: case(...)}) in one launch of tests/scripts/<script>, in order; case
    `name` writes to root/name. Returns {name: that folder}."""
    root = os.fspath(root)
    os.makedirs(root, exist_ok=True)
    outs = {name: os.path.join(root, name) for name in cases}
    listed = [{**c, "args": c["args"] + ["--out", outs[name]]} for name, c in cases.items()]
    path = os.path.join(root, "cases.json")
    with open(path, "w") as fh:
        json.dump(listed, fh, indent=1)
    run_script(script, ["--cases", path], nproc=nproc, launcher=launcher, timeout=timeout, env=env)
    return outs


def check_each(names, check: Callable[[str], None]) -> None:
    """check(name) for every name; fails once at the end listing every case whose check failed, and why."""
    failures = []
    for name in names:
        try:
            check(name)
        except AssertionError as exc:
            failures.append(f"[{name}] {exc}")
    if failures:
        pytest.fail(f"{len(failures)} case(s) failed:\n" + "\n".join(failures))
