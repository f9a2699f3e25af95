# tests/test_ddp_cross_host.py: DDP training across "machines" on one box: two launchers of
# `python -m accelerate_c launch --num_machines 2` on loopback (each launcher is its own host id), running
# tests/scripts/parity_train.py. Per-step losses and final weights must equal a single-process run with the
# same global batch (1e-6), and every rank must report the transport its gradient buckets really used:
# HierarchicalGroup (shm in a host + gloo between host leaders) for 2 x 2 ranks, TorchGroup for 2 x 1.
# Not for: one-host parity (test_parity.py) or launcher behaviour (test_launch.py).
# Every launcher's output goes to files shown on failure; rendezvous and process-group timeouts are short
# (a launcher or rank that waits for a peer gives up with an error long before the test's own guard).
import os
import sys

from fold import check_each

from conftest import SCRIPTS, Job, clean_env, describe_all, finish_all, free_port, run_script
from test_parity import _close, _load

ARGS = ["--global_batch", "8", "--steps", "12", "--no_scheduler"]
TIMEOUTS = {"ACCELERATE_C_RDZV_TIMEOUT": "120"}  # the process-group timeout is --timeout below
GUARD_S = 300  # only a hang reaches it


def _two_machines(tmp_path, per_machine, grad_sync="bucketed"):
    """One 2-machine run (two launchers); returns its output folder."""
    out = tmp_path / f"multi{per_machine}"
    port = str(free_port())
    env = clean_env(ACCELERATE_C_GRAD_SYNC=grad_sync, **TIMEOUTS)
    jobs = [Job([sys.executable, "-m", "accelerate_c", "launch", "-q", "--cpu", "--num_processes", 2 * per_machine,
                 "--num_machines", "2", "--machine_rank", m, "--main_process_ip", "127.0.0.1",
                 "--main_process_port", port, os.path.join(SCRIPTS, "parity_train.py"), *ARGS, "--report_group",
                 "--timeout", "120", "--out", out], tmp_path / "logs", f"{per_machine}_per_machine.machine{m}", env)
            for m in (0, 1)]
    results = finish_all(jobs, GUARD_S)
    assert all(rc == 0 for rc, _, _ in results), describe_all(jobs)
    return out


def _reports(out, per_machine):
    reports = {}
    for r in range(2 * per_machine):
        world, group = (out / f"group{r}.txt").read_text().split()
        assert world == str(2 * per_machine)
        reports[r] = group
    return reports


def test_two_machines(tmp_path):
    """2 x 2 ranks: HierarchicalGroup on every rank; 2 x 1 ranks: TorchGroup; both equal one process (one
    reference run for both)."""
    single = tmp_path / "single"
    run_script("parity_train.py", ARGS + ["--out", str(single)], nproc=1)
    outs = {per: _two_machines(tmp_path, per) for per in (2, 1)}
    want = {2: "HierarchicalGroup", 1: "TorchGroup"}

    def check(per):
        reports = _reports(outs[per], per)
        assert reports == {r: want[per] for r in range(2 * per)}, reports
        _close(_load(single), _load(outs[per]))

    check_each([2, 1], check)
