# tests/test_leaks.py: what a SIGKILL leaves is reclaimed. Processes kill themselves at named points of start-up and
# save (ACCELERATE_C_KILL_AT, accelerate_c/base/killpoints.py: no timing luck), then the documented clean-up (the
# next run, the launcher at the end of the job, or `python -m accelerate_c cleanup`) leaves nothing of the job in
# /dev/shm, in the temp directory (a private TMPDIR per test) or next to its checkpoints; a load never reads a
# killed save's folder; the sweeps never touch what a running process, another pid namespace or another name owns.
# Ranks started by tests/scripts/kill_points.py (forked from one parent: 17 points x 1 run + a chain of 4 runs) and
# under our launcher (tests/scripts/shm_start.py: 3 launches). Every wait has a deadline; every process's output
# is in a file shown on failure. The test suite itself leaves nothing in the temp directory either.
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT, SCRIPTS, Job, alive, clean_env, finish_all, free_port

from accelerate_c.base import killpoints, leftovers
from accelerate_c.checkpointing import atomic, interrupted

GUARD_S = 240  # only a hang reaches it
SEED = 18      # the order of the kill points (kill_points.py --seed)


def _env(tmp_path, **extra) -> dict:
    """A private TMPDIR; torch's own persistent cache (torchinductor_<user>, made when torch.optim imports
    torch._dynamo) kept out of it."""
    (tmp_path / "tmp").mkdir(exist_ok=True)
    return clean_env(TMPDIR=str(tmp_path / "tmp"), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "torch-cache"), **extra)


def _logs(paths) -> str:
    return "\n".join(f"--- {p}:\n{open(p, errors='replace').read()[-3000:]}" for p in paths if os.path.exists(p))


@pytest.mark.exclusive  # another job's sweep would reclaim what this test expects to find left
def test_kill_points_of_start_up_and_save_leave_nothing(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    job = Job([sys.executable, os.path.join(SCRIPTS, "kill_points.py"), "--out", out, "--mode", "cleanup", "next",
               "--seed", SEED], tmp_path / "logs", "kill_points", _env(tmp_path))
    (rc, _, _), = finish_all([job], GUARD_S)
    assert rc == 0, job.describe()
    runs = json.loads((out / "report.json").read_text())
    assert len(runs) == 21
    bad = [r for r in runs if r["problems"]]
    assert not bad, "\n".join(f"{r['spec']}: {r['problems']}\n{_logs(r['logs'])}" for r in bad) + job.describe()
    tested = {r["spec"].split("@")[0] for r in runs if r["spec"]}
    assert tested | {"launch.temp_dir"} == set(killpoints.POINTS)  # every point (the launcher's: below)
    assert os.listdir(tmp_path / "tmp") == []


def _launch(tmp_path, name, kill_at) -> tuple:
    run_out = tmp_path / name
    run_out.mkdir()
    job = Job([sys.executable, "-m", "accelerate_c", "launch", "-q", "--cpu", "--num_processes", 2,
               os.path.join(SCRIPTS, "shm_start.py"), run_out], tmp_path / "logs", name,
              _env(tmp_path, ACCELERATE_C_KILL_AT=kill_at))
    (rc, _, _), = finish_all([job], GUARD_S)
    ranks = [json.loads((run_out / f"rank{r}.json").read_text()) for r in (0, 1)
             if (run_out / f"rank{r}.json").exists()]
    deadline = time.monotonic() + GUARD_S  # ranks of a killed launcher end on their own (SIGTERM at its death)
    while any(alive(r["pid"]) for r in ranks) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(r["pid"]) for r in ranks), job.describe()
    return rc, (ranks[0]["port"] if ranks else None), job


def _segments(port) -> list:
    return sorted(n for n in os.listdir(leftovers.SHM_DIR) if n.startswith(f"accc-{port}-"))


@pytest.mark.exclusive
def test_killed_launcher_and_ranks_leave_nothing_the_next_launch_or_cleanup_keeps(tmp_path):
    tmpdir = tmp_path / "tmp"
    rc, _, job1 = _launch(tmp_path, "launcher_after_mkdtemp", "launch.temp_dir")
    assert rc == -9, job1.describe()
    first = os.listdir(tmpdir)
    assert len(first) == 1 and first[0].startswith(leftovers.LAUNCH_PREFIX), first
    # rank 0 kills the launcher after creating the group's segment, before rank 1 attached (the case)
    rc, port, job2 = _launch(tmp_path, "launcher_killed_by_rank0", "shm.group.created:launcher")
    assert rc == -9 and port, job2.describe()
    left = os.listdir(tmpdir)
    assert first[0] not in left and len(left) == 1, left  # the next launch removed the first launcher's folder
    assert len(_segments(port)) == 1, job2.describe()
    done = subprocess.run([sys.executable, "-m", "accelerate_c", "cleanup"], env=_env(tmp_path), capture_output=True,
                          text=True, timeout=GUARD_S)
    assert done.returncode == 0, done
    assert _segments(port) == [] and os.listdir(tmpdir) == [], done.stdout
    assert f"removed {leftovers.SHM_DIR}/accc-{port}-" in done.stdout and left[0] in done.stdout, done.stdout
    # rank 0 killed with the launcher alive: the launcher removes the segment at the end of the job
    rc, port, job3 = _launch(tmp_path, "rank0_killed", "shm.group.created")
    assert rc == 1 and "rank 0" in job3.output()[1], job3.describe()
    assert _segments(port) == [] and os.listdir(tmpdir) == [], job3.describe()


def test_sweeps_touch_only_what_a_gone_process_left(tmp_path):
    """Removed: names of this format whose maker is gone (no such pid, or a pid reused by a later process).
    Kept: a running maker's, another pid namespace's, any other name."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    pid, start, ns = leftovers.owner().split("-")
    names = {"live": f"accc-t{os.getpid()}-{pid}-{start}-{ns}-{'a' * 16}",
             "dead": f"accc-t{os.getpid()}-{gone.pid}-{start}-{ns}-{'b' * 16}",
             "reused": f"accc-t{os.getpid()}-{pid}-{int(start) + 1}-{ns}-{'c' * 16}-r",
             "other_ns": f"accc-t{os.getpid()}-{gone.pid}-{start}-{int(ns) + 1}-{'d' * 16}",
             "other_name": f"accc-test-{gone.pid}-{os.getpid()}"}
    try:
        for n in names.values():
            os.close(os.open(os.path.join(leftovers.SHM_DIR, n), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        for what, name in (("live", pid), ("dead", gone.pid)):
            (tmp_path / f"{leftovers.LAUNCH_PREFIX}{name}-{start}-{ns}_x1").mkdir()
        removed = {os.path.basename(x.path) for x in leftovers.remove(leftovers.stale_segments())}
        assert {k for k, n in names.items() if n in removed} == {"dead", "reused"}
        assert {k for k, n in names.items() if os.path.exists(os.path.join(leftovers.SHM_DIR, n))} == \
            {"live", "other_ns", "other_name"}
        assert [x.pid for x in leftovers.stale_launch_dirs(str(tmp_path))] == [gone.pid]
    finally:
        for n in names.values():
            if os.path.exists(os.path.join(leftovers.SHM_DIR, n)):
                os.unlink(os.path.join(leftovers.SHM_DIR, n))


class _Killed(BaseException):
    pass


def _kill_at(monkeypatch, point):
    """The in-process stand-in for a SIGKILL at `point` (atomic.py's points): nothing after it runs."""
    def hit(name):
        if name == point:
            raise _Killed(name)
    monkeypatch.setattr(atomic, "kill_point", hit)


def test_a_load_never_reads_a_killed_saves_folder(tmp_path, clean_state, monkeypatch):
    from accelerate_c import Accelerator
    from accelerate_c.utils import ProjectConfiguration

    pc = ProjectConfiguration(project_dir=str(tmp_path / "proj"), automatic_checkpoint_naming=True)
    acc = Accelerator(cpu=True, project_config=pc)
    model = acc.prepare(torch.nn.Linear(2, 2))

    def save(value, point=None, path=None):
        with torch.no_grad():
            model.weight.fill_(value)
        _kill_at(monkeypatch, point)
        if point is None:
            return acc.save_state(path)
        with pytest.raises(_Killed):
            acc.save_state(path)

    def loaded(path=None):
        with torch.no_grad():
            model.weight.fill_(-1.0)
        acc.load_state(path)
        return model.weight[0, 0].item()

    save(1.0)                               # checkpoint_0
    save(2.0, "save.before_rename")         # checkpoint_1: a complete-looking temp folder, never published
    assert os.path.isfile(tmp_path / "proj" / "checkpoints" / ".checkpoint_1.accelerate_c-tmp" / "checkpoint.json")
    assert loaded() == 1.0                  # the newest complete checkpoint: checkpoint_0
    pc.automatic_checkpoint_naming = False
    path = str(tmp_path / "x")
    save(3.0, "save.before_rename", path)   # a first save to `path`, killed: `path` does not exist
    with pytest.raises(ValueError, match="does not exist"):
        acc.load_state(path)
    save(4.0, path=path)
    save(5.0, "save.before_exchange", path)  # the new one complete in the temp folder, the old one in place
    assert loaded(path) == 4.0
    save(6.0, "save.after_exchange", path)   # published; the temp folder holds the previous checkpoint
    assert loaded(path) == 6.0
    tmp_x, tmp_1 = atomic.temp_dir_for(path), str(tmp_path / "proj" / "checkpoints" / ".checkpoint_1.accelerate_c-tmp")
    assert [(i.path, i.what) for i in interrupted.find(str(tmp_path))] == \
        [(tmp_x, "save_state temp folder"), (tmp_1, "save_state temp folder")]
    atomic.hold(tmp_x)                       # as a running save: cleanup keeps it
    items = interrupted.find(str(tmp_path))
    assert [i.in_use for i in items] == [True, False]
    assert [interrupted.remove(i).split()[0] for i in items] == ["kept", "removed"]
    atomic.release(tmp_x)
    assert interrupted.remove(interrupted.find(str(tmp_path))[0]).startswith("removed")
    assert interrupted.find(str(tmp_path)) == [] and loaded(path) == 6.0


def test_kill_at_names_its_points():
    with pytest.raises(ValueError, match="ACCELERATE_C_KILL_AT='save.nowhere'.*save.mid_piece"):
        killpoints._parse("save.nowhere")
    assert killpoints._parse("save.mid_piece@1:launcher") == ("save.mid_piece", 1, True)


def test_torchrun_keeps_its_folders_in_the_session_scratch(tmp_path):
    """A launch started with clean_env() makes its temp folders (torch's elastic launcher: torchelastic_*) in the
    pytest process's scratch folder, which the session removes; the inner test of the one below."""
    env = clean_env()
    before = set(os.listdir(env["TMPDIR"]))
    job = Job([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
               "--no-python", "true"], tmp_path, "torchrun", env)
    (rc, _, _), = finish_all([job], 120)
    assert rc == 0, job.describe()
    assert any(n.startswith("torchelastic_") for n in set(os.listdir(env["TMPDIR"])) - before), job.describe()


def test_a_test_session_leaves_nothing_in_the_temp_directory(tmp_path):
    """pytest over a torchrun launch, and over a test that builds torch's LaunchConfig in the pytest process, in a
    TMPDIR of its own: afterwards nothing of the session is left there (before: a torchelastic_* folder per torchrun
    launch, and one per LaunchConfig built without logs_specs, stayed in the machine's temp directory)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(TMPDIR=str(tmp), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "torch-cache"))
    nodes = [f"{__file__}::test_torchrun_keeps_its_folders_in_the_session_scratch",
             os.path.join(os.path.dirname(__file__), "test_launch.py") +
             "::test_launch_config_on_a_torch_without_shutdown_timeout"]
    job = Job([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
               f"--basetemp={tmp_path / 'basetemp'}", *nodes], tmp_path / "logs", "pytest", env)
    (rc, _, _), = finish_all([job], 240)
    assert rc == 0, job.describe()
    assert sorted(os.listdir(tmp)) == [], job.describe()


def test_a_killed_process_that_imports_the_test_helpers_leaves_nothing(tmp_path):
    """Checkpoint tests start scripts that import test modules (and so conftest) and kill them mid-save: importing
    conftest makes no folder (before: each killed script left an accelerate_c_tests_* folder in /tmp)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    code = ("import os, signal, sys; sys.path.insert(0, sys.argv[1]); import conftest; "
            "os.kill(os.getpid(), signal.SIGKILL)")
    job = Job([sys.executable, "-c", code, os.path.dirname(__file__)], tmp_path / "logs", "child",
              dict(clean_env(), TMPDIR=str(tmp)))
    (rc, _, _), = finish_all([job], 120)
    assert rc == -9, job.describe()
    assert sorted(os.listdir(tmp)) == [], job.describe()


def test_a_benchmark_launch_leaves_nothing_in_the_temp_directory(tmp_path):
    """benchmarks/_results.run_ranks over torchrun, in a TMPDIR of its own: nothing is left there (before: a
    torchelastic_* folder per launch of tp_step, pp_step, zero_step, memory and ddp_step's HF run)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    rank_script = tmp_path / "rank.py"
    rank_script.write_text("import json, os, sys\nrank = os.environ['RANK']\n"
                           "json.dump({'rank': int(rank)}, open(f'{sys.argv[1]}.{rank}.json', 'w'))\n")
    driver = ("import sys; sys.path.insert(0, sys.argv[1]); from _results import run_ranks; "
              "cmd = [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', '2', '--master_port', "
              "sys.argv[4], sys.argv[2], sys.argv[3]]; "
              "import os; recs = run_ranks('t', cmd, dict(os.environ), sys.argv[1], sys.argv[3], 2, 120); "
              "assert [r['rank'] for r in recs] == [0, 1], recs")
    job = Job([sys.executable, "-c", driver, os.path.join(ROOT, "benchmarks"), str(rank_script),
               str(tmp_path / "out"), str(free_port())], tmp_path / "logs", "bench",
              dict(clean_env(), TMPDIR=str(tmp)))
    (rc, _, _), = finish_all([job], 180)
    assert rc == 0, job.describe()
    assert sorted(os.listdir(tmp)) == [], job.describe()
