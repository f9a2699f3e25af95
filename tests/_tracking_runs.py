# tests/_tracking_runs.py: runs tests/scripts/tracking_run.py once per pytest session on 2 real processes
# under HF Accelerate 1.15 (torchrun) and under accelerate_c (our launcher), and hands both output folders
# to tests/test_tracking.py and tests/test_logging.py (one pair of launches serves both files).
# Not for: test logic.
import os

from conftest import run_script

_RUNS: dict = {}


def two_process_runs(tmp_path_factory) -> dict:
    """{"accelerate": dir, "accelerate_c": dir}: each holds rank<i>.log, order.log, state<i>.json, logs/, trace/."""
    if not _RUNS:
        base = tmp_path_factory.mktemp("tracking_2proc")
        for impl, launcher in (("accelerate", "torchrun"), ("accelerate_c", "accelerate_c")):
            out = os.path.join(base, impl)
            os.makedirs(out)
            run_script("tracking_run.py", ["--out", out, "--impl", impl], nproc=2, launcher=launcher, timeout=180)
            _RUNS[impl] = out
    return _RUNS
