# tests/test_ddp_cross_host.py: DDP training across "machines" on one box: two launchers of
# `python -m accelerate_c launch --num_machines 2` on loopback (each launcher is its own host id), running
# tests/scripts/parity_train.py. Per-step losses and final weights must equal a single-process run with the
# same global batch (1e-6), and every rank must report the transport its gradient buckets really used:
# HierarchicalGroup (shm in a host + gloo between host leaders) for 2 x 2 ranks, TorchGroup for 2 x 1.
# Not for: one-host parity (test_parity.py) or launcher behaviour (test_launch.py).
import os
import subprocess
import sys

import pytest

from conftest import ROOT, SCRIPTS, clean_env, free_port, run_script
from test_parity import _close, _load

ARGS = ["--global_batch", "8", "--steps", "12", "--no_scheduler"]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    run_script("parity_train.py", ARGS + ["--out", str(out)], nproc=1, timeout=120)
    return _load(out)


def _two_machines(out, per_machine, grad_sync="bucketed"):
    port = str(free_port())
    env = clean_env(ACCELERATE_C_GRAD_SYNC=grad_sync)
    procs = [subprocess.Popen(
        [sys.executable, "-m", "accelerate_c", "launch", "-q", "--cpu", "--num_processes", str(2 * per_machine),
         "--num_machines", "2", "--machine_rank", str(m), "--main_process_ip", "127.0.0.1",
         "--main_process_port", port, os.path.join(SCRIPTS, "parity_train.py"), *ARGS, "--report_group",
         "--out", str(out)], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for m in (0, 1)]
    results = []
    try:
        for p in procs:
            so, se = p.communicate(timeout=120)
            results.append((p.returncode, so, se))
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()  # the launcher stops its ranks on SIGTERM
                try:
                    p.communicate(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.communicate()
    for rc, so, se in results:
        assert rc == 0, f"launcher failed ({rc}):\n{so[-2000:]}\n{se[-4000:]}"
    reports = {}
    for r in range(2 * per_machine):
        world, transport, group = (out / f"group{r}.txt").read_text().split()
        assert world == str(2 * per_machine)
        reports[r] = (transport, group)
    return reports


def test_two_machines_two_ranks_each_hierarchical(tmp_path, single):
    reports = _two_machines(tmp_path / "multi", per_machine=2)
    assert reports == {r: ("CommTransport", "HierarchicalGroup") for r in range(4)}, reports
    _close(single, _load(tmp_path / "multi"))


def test_two_machines_one_rank_each_torch(tmp_path, single):
    reports = _two_machines(tmp_path / "multi", per_machine=1)
    assert reports == {r: ("CommTransport", "TorchGroup") for r in range(2)}, reports
    _close(single, _load(tmp_path / "multi"))
