# tests/test_ddp_failures.py: failures of DDP training and of Accelerator collectives, end to end
# (tests/scripts/ddp_fault.py): a rank SIGKILLed mid-training under our launcher (by itself at a chosen
# step, or by the test from outside) ends the job within 30 s naming the rank, with no rank left running and
# nothing of the job left in /dev/shm; accelerator.reduce / gather with a dead peer or with mismatched sizes
# (debug mode off) raise clear errors on the survivors instead of hanging; two simultaneous launches get
# distinct 0600 segments and leave nothing behind; Ctrl-C mid-training stops the whole job promptly.
# Transport-level failure cases live in test_shm.py.
# Every process is bounded by a timeout and killed by the test if it outlives it.
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, SCRIPTS, alive, clean_env, free_port

SCRIPT = os.path.join(SCRIPTS, "ddp_fault.py")


def _shm_of(port) -> list:
    """This job's entries in /dev/shm: segment names are /accc-<MASTER_PORT>-<creator pid>-<token>[-r]."""
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"accc-{port}-"))


def _info(out, rank) -> dict:
    with open(os.path.join(out, f"info{rank}.json")) as fh:
        return json.load(fh)


def _launch(out, *args, nproc=2, new_session=False) -> subprocess.Popen:
    out.mkdir(exist_ok=True)
    return subprocess.Popen([sys.executable, "-m", "accelerate_c", "launch", "-q", "--cpu", "--num_processes",
                             str(nproc), SCRIPT, "--out", str(out), *args], env=clean_env(), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=new_session)


def _finish(proc, timeout=60):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the launcher stops its ranks on SIGTERM
        try:
            out, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        pytest.fail(f"launch did not end within {timeout} s\n{out}\n{err}")
    return proc.returncode, out, err


def _wait_ready(proc, out, timeout=60) -> None:
    """Until both ranks wrote their ready file (they are in their training loops)."""
    deadline = time.monotonic() + timeout
    while not all((out / f"ready{r}").exists() for r in (0, 1)):
        assert proc.poll() is None and time.monotonic() < deadline, "training did not start"
        time.sleep(0.05)


def _check_killed_job(out, rc, err, elapsed, victim):
    infos = [_info(out, r) for r in (0, 1)]
    port, pid0 = infos[0]["master_port"], infos[0]["pid"]
    assert infos[0]["group"] == "ShmGroup" and infos[0]["shm_name"].startswith(f"/accc-{port}-{pid0}-"), infos[0]
    assert rc != 0 and elapsed < 30, (rc, elapsed, err[-3000:])
    line = [ln for ln in err.splitlines() if ln.startswith("accelerate_c launch:")]
    assert line, err[-3000:]
    # Usually the victim is named first; if the survivor noticed the death and exited with its own error
    # before the launcher stopped it, the survivor comes first and both its error and the tail name the victim.
    first = f"rank {victim} (local rank {victim} on machine 0) failed, killed by signal SIGKILL"
    later = f"rank {victim} killed by signal SIGKILL"
    assert first in line[-1] or (later in line[-1] and f"peer rank(s) {victim}" in line[-1]), line[-1]
    assert "still training" not in err  # no rank ran into its own time limit
    running = [i["pid"] for i in infos if alive(i["pid"])]
    for pid in running:
        os.kill(pid, signal.SIGKILL)  # leave nothing running even when the check fails
    assert not running
    assert _shm_of(port) == []


@pytest.mark.parametrize("victim", [1, 0])
def test_rank_sigkills_itself_mid_training(tmp_path, victim):
    out = tmp_path / "out"
    start = time.monotonic()
    rc, so, se = _finish(_launch(out, "--steps", "0", "--kill_rank", str(victim), "--kill_step", "5"))
    _check_killed_job(out, rc, se, time.monotonic() - start, victim)


def test_rank_sigkilled_from_outside_mid_training(tmp_path):
    out = tmp_path / "out"
    proc = _launch(out, "--steps", "0", "--ready_step", "3")
    start = time.monotonic()
    try:
        _wait_ready(proc, out)
        pid1 = _info(out, 1)["pid"]
        start = time.monotonic()
        os.kill(pid1, signal.SIGKILL)  # both ranks are in their training loops (steps: until stopped)
    finally:
        rc, so, se = _finish(proc)
    _check_killed_job(out, rc, se, time.monotonic() - start, 1)


def test_ctrl_c_mid_training_stops_the_job(tmp_path):
    """Ctrl-C (SIGINT to the launcher's whole process group, as a terminal sends it) while both ranks train:
    the job ends long before the 60 s collective timeout, non-zero, no rank left, nothing in /dev/shm. A rank
    waiting inside a C collective notices its interrupted peer's death (checked every 0.1 s)."""
    out = tmp_path / "out"
    proc = _launch(out, "--steps", "0", "--ready_step", "3", "--timeout", "60", new_session=True)
    start = time.monotonic()
    try:
        _wait_ready(proc, out)
        start = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
    finally:
        rc, so, se = _finish(proc)
    elapsed = time.monotonic() - start
    infos = [_info(out, r) for r in (0, 1)]
    running = [i["pid"] for i in infos if alive(i["pid"])]
    for pid in running:
        os.kill(pid, signal.SIGKILL)
    assert rc != 0 and elapsed < 20, (rc, elapsed, se[-3000:])
    assert "received SIGINT" in se, se[-3000:]
    assert not running and _shm_of(infos[0]["master_port"]) == []


def _spawn_two(out, mode, timeout=60):
    """Both ranks started by the test itself (our launcher would stop the survivor as soon as a rank dies)."""
    out.mkdir(exist_ok=True)
    env = clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2",
                    ACCELERATE_C_HOST_ID=f"test-{os.getpid()}-{mode}")
    env.pop("ACCELERATE_DEBUG_MODE", None)
    procs = [subprocess.Popen([sys.executable, SCRIPT, "--mode", mode, "--out", str(out), "--timeout", "10"],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    results = []
    try:
        for p in procs:
            so, _ = p.communicate(timeout=timeout)
            results.append((p.returncode, so))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return results, env["MASTER_PORT"]


def test_accelerator_collectives_with_a_dead_peer(tmp_path):
    (rc0, so0), (rc1, _), = _spawn_two(tmp_path, "reduce_dead")[0]
    assert rc1 == -signal.SIGKILL and rc0 == 0, so0
    info = _info(tmp_path, 0)
    name, msg, dt = info["reduce"]
    assert name == "RuntimeError" and "all_reduce" in msg and "rank(s) 1" in msg and "died" in msg, msg
    assert dt < 10, dt  # found dead before the 10 s timeout
    name, msg, dt = info["gather"]  # the group stays unusable and says why
    assert "all_gather" in msg and "unusable" in msg and "rank(s) 1" in msg, msg
    assert _shm_of(info["master_port"]) == []


def test_accelerator_collectives_with_mismatched_sizes(tmp_path):
    results, port = _spawn_two(tmp_path, "mismatch")
    for r, (rc, so) in enumerate(results):
        assert rc == 0, so
        info = _info(tmp_path, r)
        name, msg, dt = info["reduce"]
        assert name == "RuntimeError" and "mismatched" in msg and "count=10" in msg and "count=11" in msg, msg
        name, msg, dt = info["gather"]  # 5 vs 7 float32 elements: 20 vs 28 bytes
        assert name == "RuntimeError" and "mismatched" in msg and "all_gather" in msg, msg
        assert "count=20" in msg and "count=28" in msg, msg
    assert _shm_of(port) == []


def test_two_launches_at_once_distinct_private_segments(tmp_path):
    outs = [tmp_path / "a", tmp_path / "b"]
    procs = [_launch(o, "--steps", "20") for o in outs]
    results = [_finish(p) for p in procs]
    assert all(rc == 0 for rc, _, _ in results), [se[-2000:] for _, _, se in results]
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
