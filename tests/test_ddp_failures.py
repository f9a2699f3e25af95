# tests/test_ddp_failures.py: failures of DDP training and of Accelerator collectives, end to end
# (tests/scripts/ddp_fault.py): a rank SIGKILLed mid-training under our launcher (by itself at a chosen
# step, or by the test from outside) ends the job naming the rank, with no rank left running and nothing of
# the job left in /dev/shm; accelerator.reduce / gather with a dead peer or with mismatched sizes (debug mode
# off) raise clear errors on the survivors instead of hanging; two simultaneous launches get distinct 0600
# segments and leave nothing behind; Ctrl-C mid-training stops the whole job.
# Transport-level failure cases live in test_shm.py.
# No timing is asserted. "Promptly" is shown by what the survivors report: a peer's death is found by the
# transport's liveness check ("died"), never by the collective timeout ("timed out"), and ranks that train
# until stopped end before the test's guard only because the launcher stopped them. Every process writes to
# files (conftest.Job) shown on failure and is killed with its whole tree if it outlives the guard.
import json
import os
import signal
import sys
import time

import pytest

from conftest import SCRIPTS, Job, alive, clean_env, describe_all, finish_all, free_port

SCRIPT = os.path.join(SCRIPTS, "ddp_fault.py")
GUARD_S = 300  # only a hang reaches it
TRAIN_UNTIL_STOPPED = ["--steps", "0", "--max_seconds", str(3 * GUARD_S), "--timeout", "60"]


def _shm_of(port) -> list:
    """This job's entries in /dev/shm: segment names are /accc-<MASTER_PORT>-<creator pid>-<token>[-r]."""
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"accc-{port}-"))


def _info(out, rank) -> dict:
    with open(os.path.join(out, f"info{rank}.json")) as fh:
        return json.load(fh)


def _launch(out, *args, nproc=2) -> Job:
    out.mkdir(exist_ok=True)
    return Job([sys.executable, "-m", "accelerate_c", "launch", "-q", "--cpu", "--num_processes", nproc, SCRIPT,
                "--out", out, *args], out.parent / "logs", out.name, clean_env())


def _finish(job):
    (rc, out, err), = finish_all([job], GUARD_S)
    return rc, out, err


def _wait_ready(job, out) -> None:
    """Until both ranks wrote their ready file (they are in their training loops)."""
    deadline = time.monotonic() + GUARD_S
    while not all((out / f"ready{r}").exists() for r in (0, 1)):
        if job.poll() is not None or time.monotonic() >= deadline:
            job.kill_tree()
            pytest.fail("training did not start\n" + job.describe())
        time.sleep(0.05)


def _check_killed_job(out, rc, err, victim, job):
    infos = [_info(out, r) for r in (0, 1)]
    port, pid0 = infos[0]["master_port"], infos[0]["pid"]
    assert infos[0]["group"] == "ShmGroup" and infos[0]["shm_name"].startswith(f"/accc-{port}-{pid0}-"), infos[0]
    assert rc == 1, job.describe()
    line = [ln for ln in err.splitlines() if ln.startswith("accelerate_c launch:")]
    assert line, job.describe()
    # Usually the victim is named first; if the survivor noticed the death and exited with its own error
    # before the launcher stopped it, the survivor comes first and both its error and the tail name the victim.
    first = f"rank {victim} (local rank {victim} on machine 0) failed, killed by signal SIGKILL"
    later = f"rank {victim} killed by signal SIGKILL"
    assert first in line[-1] or (later in line[-1] and f"peer rank(s) {victim} died" in line[-1]), line[-1]
    assert "timed out" not in err, job.describe()  # nobody waited for the dead rank until the 60 s timeout
    running = [i["pid"] for i in infos if alive(i["pid"])]
    for pid in running:
        os.kill(pid, signal.SIGKILL)  # leave nothing running even when the check fails
    assert not running
    assert _shm_of(port) == []


@pytest.mark.parametrize("victim", [1, 0])
def test_rank_sigkills_itself_mid_training(tmp_path, victim):
    out = tmp_path / "out"
    job = _launch(out, *TRAIN_UNTIL_STOPPED, "--kill_rank", str(victim), "--kill_step", "5")
    rc, so, se = _finish(job)
    _check_killed_job(out, rc, se, victim, job)


def test_rank_sigkilled_from_outside_mid_training(tmp_path):
    out = tmp_path / "out"
    job = _launch(out, *TRAIN_UNTIL_STOPPED, "--ready_step", "3")
    try:
        _wait_ready(job, out)
        os.kill(_info(out, 1)["pid"], signal.SIGKILL)  # both ranks are in their training loops
    finally:
        rc, so, se = _finish(job)
    _check_killed_job(out, rc, se, 1, job)


def test_ctrl_c_mid_training_stops_the_job(tmp_path):
    """Ctrl-C (SIGINT to the launcher's whole process group, as a terminal sends it) while both ranks train:
    the job ends with 128 + SIGINT, no rank left, nothing in /dev/shm, and no rank ran into its 60 s collective
    timeout: the agent stops both ranks, and one waiting inside a C collective for a peer that is already
    gone notices its death (checked every 0.1 s)."""
    out = tmp_path / "out"
    job = _launch(out, *TRAIN_UNTIL_STOPPED, "--ready_step", "3")
    try:
        _wait_ready(job, out)
        os.killpg(job.pid, signal.SIGINT)  # Job starts its command in a session (and process group) of its own
    finally:
        rc, so, se = _finish(job)
    infos = [_info(out, r) for r in (0, 1)]
    running = [i["pid"] for i in infos if alive(i["pid"])]
    for pid in running:
        os.kill(pid, signal.SIGKILL)
    assert rc == 128 + signal.SIGINT and "received SIGINT" in se, job.describe()
    assert "timed out" not in se, job.describe()
    assert not running and _shm_of(infos[0]["master_port"]) == []


def _spawn_two(out, mode):
    """Both ranks started by the test itself (our launcher would stop the survivor as soon as a rank dies).
    The 60 s collective timeout is never what ends a call here: a dead peer is found by the liveness check,
    mismatched calls by comparing their headers."""
    out.mkdir(exist_ok=True)
    env = clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2",
                    ACCELERATE_C_HOST_ID=f"test-{os.getpid()}-{mode}")
    env.pop("ACCELERATE_DEBUG_MODE", None)
    jobs = [Job([sys.executable, SCRIPT, "--mode", mode, "--out", out, "--timeout", "60"], out / "logs",
                f"rank{r}", dict(env, RANK=str(r), LOCAL_RANK=str(r))) for r in (0, 1)]
    results = finish_all(jobs, GUARD_S)
    return jobs, [(rc, so + se) for rc, so, se in results], env["MASTER_PORT"]


def test_accelerator_collectives_with_a_dead_peer(tmp_path):
    jobs, ((rc0, so0), (rc1, _)), _ = _spawn_two(tmp_path, "reduce_dead")
    assert rc1 == -signal.SIGKILL and rc0 == 0, describe_all(jobs)
    info = _info(tmp_path, 0)
    name, msg, _ = info["reduce"]
    # "died": found by the liveness check, not by waiting out the 60 s timeout
    assert name == "RuntimeError" and "all_reduce" in msg and "rank(s) 1" in msg and "died" in msg, msg
    assert "timed out" not in msg, msg
    name, msg, _ = info["gather"]  # the group stays unusable and says why
    assert "all_gather" in msg and "unusable" in msg and "rank(s) 1" in msg, msg
    assert _shm_of(info["master_port"]) == []


def test_accelerator_collectives_with_mismatched_sizes(tmp_path):
    jobs, results, port = _spawn_two(tmp_path, "mismatch")
    for r, (rc, so) in enumerate(results):
        assert rc == 0, describe_all(jobs)
        info = _info(tmp_path, r)
        name, msg, dt = info["reduce"]
        assert name == "RuntimeError" and "mismatched" in msg and "count=10" in msg and "count=11" in msg, msg
        name, msg, dt = info["gather"]  # 5 vs 7 float32 elements: 20 vs 28 bytes
        assert name == "RuntimeError" and "mismatched" in msg and "all_gather" in msg, msg
        assert "count=20" in msg and "count=28" in msg, msg
    assert _shm_of(port) == []


def test_two_launches_at_once_distinct_private_segments(tmp_path):
    outs = [tmp_path / "a", tmp_path / "b"]
    jobs = [_launch(o, "--steps", "20", "--timeout", "60") for o in outs]
    results = finish_all(jobs, GUARD_S)
    assert all(rc == 0 for rc, _, _ in results), describe_all(jobs)
    names = set()
    for o in outs:
        infos = [_info(o, r) for r in (0, 1)]
        assert [i["steps"] for i in infos] == [20, 20]
        assert infos[0]["shm_name"] == infos[1]["shm_name"]  # one segment per job, shared by its ranks
        names.add(infos[0]["shm_name"])
        for i in infos:
            # the job's mappings: the control segment and the gradient region, already unlinked, mode 0600
            assert len(i["modes"]) >= 2 and all("(deleted)" in k for k in i["modes"]), i["modes"]
            assert set(i["modes"].values()) == {0o600}, i["modes"]
            assert all(k.startswith(f"/dev/shm/accc-{i['master_port']}-{infos[0]['pid']}-") for k in i["modes"])
        assert _shm_of(infos[0]["master_port"]) == []
    assert len(names) == 2
