# tests/scripts/fold_cases.py: the multi-case mode of the test scripts. `SCRIPT --cases FILE` runs the script's
# main once per case of FILE (a JSON list of {"args": [...], "env": {...}, "expect_error": bool}), one after the
# other in the same processes, so that a test pays the interpreter, torch and the launch once for many
# configurations. Between cases it puts process-wide state back: both libraries' AcceleratorState (with
# PartialState) and GradientState, and os.environ whole (a case's own variables, e.g. ACCELERATE_C_GRAD_SYNC,
# which the Accelerator reads when it is built, and whatever a plugin set). The default process group stays: only
# the last case's end_training destroys it (before that, torch.distributed.destroy_process_group does nothing:
# patched there rather than on the state classes, which a script may import only inside its case; our
# end_training still releases its shared-memory groups, and the next case builds new ones).
# A case with "expect_error" may raise (on every rank alike, before any collective): its error goes to
# <the case's --out>/error<RANK>.txt as "TypeName: message" and the next case runs; any other error ends the run.
# Not for: test logic (tests/fold_parity.py writes FILE and reads the results) or cases that need other processes.
import json
import os
import sys
from typing import Callable


def _reset_states() -> None:
    for name in ("accelerate_c.runtime.state", "accelerate.state"):
        mod = sys.modules.get(name)
        if mod is not None:
            mod.AcceleratorState._reset_state(True)
            mod.GradientState._reset_state()


def _out_of(args: list) -> str:
    return args[args.index("--out") + 1]


def run_case(main: Callable[[list], None], case: dict, last: bool) -> None:
    saved_env = dict(os.environ)
    os.environ.update({k: str(v) for k, v in case.get("env", {}).items()})
    import torch.distributed as dist
    destroy = dist.destroy_process_group
    try:
        if not last:  # keep the default process group for the next case (both libraries' states call this one)
            dist.destroy_process_group = lambda group=None: None
        try:
            main(list(case["args"]))
        except Exception as exc:  # noqa: BLE001 - recorded for the test, only where the case expects it
            if not case.get("expect_error"):
                raise
            out = _out_of(case["args"])
            os.makedirs(out, exist_ok=True)
            with open(os.path.join(out, f"error{os.environ.get('RANK', '0')}.txt"), "w") as fh:
                fh.write(f"{type(exc).__name__}: {exc}")
    finally:
        dist.destroy_process_group = destroy
        _reset_states()
        os.environ.clear()
        os.environ.update(saved_env)


def run(main: Callable[[list], None], argv: list) -> None:
    """main(argv) once, or once per case when argv is ["--cases", FILE]."""
    if argv[:1] != ["--cases"]:
        main(argv)
        return
    if len(argv) != 2:
        raise SystemExit(f"fold_cases: expected --cases FILE and nothing else, got {argv}")
    with open(argv[1]) as fh:
        cases = json.load(fh)
    for k, case in enumerate(cases):
        run_case(main, case, last=k == len(cases) - 1)
