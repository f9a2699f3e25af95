# tests/scripts/fold_cases.py: the multi-case mode of the test scripts. `SCRIPT --cases FILE` runs the script's
# body once per case of FILE (a JSON list of {"args": [...], "env": {...}, "expect_error": bool}; tests/fold.py
# writes it), one after the other in the same processes, so that a test pays the interpreter, torch and the launch
# once for many configurations. Each case starts as a fresh process would: os.environ back to what the process
# started with plus the case's own variables (the ACCELERATE_C_* settings are read when an Accelerator is built;
# what a plugin set goes), both libraries' AcceleratorState (with PartialState) and GradientState reset. The default
# process group lives on: before the last case, torch.distributed.destroy_process_group does nothing (patched on
# torch.distributed, which both libraries' end_training reach, rather than on state classes a script may import
# only inside its case), so a case ends with its ordinary end_training; our shared-memory groups are still released
# (the next case builds its own), and every rank ends a case with a barrier, so that what case i prints lies
# between the marks of case i and i + 1 (tests/fold.py: case_output).
# A case with "expect_error" may raise (on every rank alike, before any collective): its error goes to
# <the case's --out>/error<RANK>.txt as "TypeName: message" and the next case runs; any other error ends the run.
# Not for: test logic (tests/fold.py writes FILE and reads the results) or cases that need other processes.
from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
from typing import Callable, Iterator

MARK = "fold_cases: begins case "  # written to stdout and stderr as each process begins case i


def reset_state() -> None:
    """AcceleratorState / GradientState of accelerate_c, and of HF's accelerate when loaded, back to none."""
    for name in ("accelerate_c.runtime.state", "accelerate.state"):
        mod = sys.modules.get(name)
        if mod is not None:
            mod.AcceleratorState._reset_state(True)
            mod.GradientState._reset_state()


@contextlib.contextmanager
def keep_default_group(keep: bool) -> Iterator[None]:
    """While `keep`, torch.distributed.destroy_process_group does nothing."""
    import torch.distributed as dist
    destroy = dist.destroy_process_group
    if keep:
        dist.destroy_process_group = lambda group=None: None
    try:
        yield
    finally:
        dist.destroy_process_group = destroy


def _close_groups(destroy: bool) -> None:
    """Our cached communication groups released after a barrier; the default process group too when `destroy`."""
    import torch.distributed as dist
    if not dist.is_initialized():
        return
    dist.barrier()
    if "accelerate_c.comm" in sys.modules:
        sys.modules["accelerate_c.comm"].release_groups()
    if destroy:
        dist.destroy_process_group()


def _record_error(args: list, exc: BaseException) -> None:
    out = args[args.index("--out") + 1]
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"error{os.environ.get('RANK', '0')}.txt"), "w") as fh:
        fh.write(f"{type(exc).__name__}: {exc}")


def load_cases(path: str) -> list:
    with open(path) as f:
        cases = json.load(f)
    if not isinstance(cases, list) or not cases or not all(isinstance(c, dict) and "args" in c for c in cases):
        raise SystemExit(f"--cases {path}: expected a non-empty JSON list of {{'args': [...], 'env': {{...}}}}")
    return cases


def run_cases(path: str, body: Callable[[list], None]) -> None:
    """body(args) for every case of the file `path`, in order, each in the state a fresh process would have."""
    cases = load_cases(path)
    start = dict(os.environ)
    for i, case in enumerate(cases):
        last = i == len(cases) - 1
        os.environ.clear()
        os.environ.update(start)
        os.environ.update({k: str(v) for k, v in case.get("env", {}).items()})
        reset_state()
        for stream in (sys.stdout, sys.stderr):
            stream.write(f"{MARK}{i}\n")  # one write: print writes its newline apart, and another rank's line
            stream.flush()                # could land between them
        with keep_default_group(not last):
            try:
                body(list(case["args"]))
            except Exception as exc:  # noqa: BLE001 - recorded for the test, only where the case expects it
                if not case.get("expect_error"):
                    raise
                _record_error(case["args"], exc)
            if not last:
                _close_groups(destroy=False)
        gc.collect()
    _close_groups(destroy=True)  # where the last case left it up (e.g. it raised as expected)
    reset_state()
    os.environ.clear()
    os.environ.update(start)


def run(main: Callable[[list], None], argv: list) -> None:
    """main(argv) once, or once per case when argv is ["--cases", FILE]."""
    if argv[:1] != ["--cases"]:
        main(argv)
        return
    if len(argv) != 2:
        raise SystemExit(f"fold_cases: expected --cases FILE and nothing else, got {argv}")
    run_cases(argv[1], main)
