# Tests of `python -m accelerate_c launch`: flag parsing and config/flag precedence in-process, then real
# launches of tiny plain-torch.distributed (gloo) scripts on 2 CPU processes: the ranks' environment,
# all_reduce across the world, a failing rank, two launches at once, two "machines" on loopback (a rank's
# failure on either machine, a late failure while the other machine waits in torch's exit barrier, a
# launcher that fails before its ranks start), SIGTERM.
# The launched scripts use torch.distributed only (not the Accelerator). Output goes to files (conftest.Job),
# shown on failure; every launch has a guard timeout that kills its process tree. No timing is asserted:
# "stops promptly" means a job whose ranks would sleep past the guard ends, with the right rank named.
import argparse
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from accelerate_c.commands import config_args as ca
from accelerate_c.commands import launch
from accelerate_c.commands.config_args import ClusterConfig, ConfigError, save_config
from conftest import Job, alive, describe_all, finish_all, free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GUARD_S = 300  # every launch is killed (with its ranks) and the test failed if it runs this long: only a hang does
FOREVER_S = 3 * GUARD_S  # a rank sleeping this long ends before the guard only if the launcher stops it
TIMEOUTS = {"ACCELERATE_C_RDZV_TIMEOUT": "120"}  # machines that never meet give up well before the guard

# Writes what a rank sees to OUT/rank<RANK>.json after an all_reduce over the whole world.
ENV_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    info = {k: v for k, v in os.environ.items()
            if k.startswith("ACCELERATE") or k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                                  "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")}
    info.update(sum=t.item(), dist_rank=dist.get_rank(), dist_world=dist.get_world_size(), argv=sys.argv[1:],
                name=__name__, torch_threads=torch.get_num_threads())
    out = sys.argv[1]
    with open(os.path.join(out, "rank%d.json" % dist.get_rank()), "w") as fh:
        json.dump(info, fh)
    dist.destroy_process_group()
""")
_names = itertools.count()


def cli(args, tmp_path, env=None, name=None) -> Job:
    """`python -m accelerate_c ARGS` in tmp_path; stdout/stderr go to files under tmp_path/logs."""
    # Both default config files (ours and HF's) point into tmp_path: the real home is never read.
    # Temporary files go under tmp_path too: a launcher that a test SIGKILLs cannot remove its log folder,
    # and the tests that end normally check that nothing is left there.
    (tmp_path / "tmp").mkdir(exist_ok=True)
    full = dict(os.environ, PYTHONPATH=ROOT, ACCELERATE_C_CONFIG_DIR=str(tmp_path / "cfgdir"),
                HF_HOME=str(tmp_path / "hf_home"), XDG_CACHE_HOME=str(tmp_path / "xdg"), TMPDIR=str(tmp_path / "tmp"))
    full.pop("OMP_NUM_THREADS", None)
    full.update(env or {})
    return Job([sys.executable, "-m", "accelerate_c", *args], str(tmp_path / "logs"),
               name or f"cli{next(_names)}", full, cwd=str(tmp_path))


def finish(job, timeout=GUARD_S):
    """(returncode, stdout, stderr) of a finished job; a job still running at `timeout` fails the test."""
    (rc, out, err), = finish_all([job], timeout)
    return rc, out, err


def read_ranks(out_dir, n):
    return [json.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in range(n)]


@pytest.fixture
def env_script(tmp_path):
    path = tmp_path / "envcheck.py"
    path.write_text(ENV_SCRIPT)
    return str(path)


def parse(argv):
    parser = argparse.ArgumentParser()
    launch.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["launch", *argv])


def test_parse_flags_and_script_args():
    args = parse(["--num_processes", "3", "--cpu", "--fp8_format", "E4M3", "train.py", "--lr", "1", "--cpu"])
    assert args.num_processes == 3 and args.use_cpu is True and args.fp8__fp8_format == "E4M3"
    assert args.training_script == "train.py" and args.training_script_args == ["--lr", "1", "--cpu"]
    assert args.mixed_precision is None  # absent flags stay None so the config file can fill them
    with pytest.raises(SystemExit):
        parse(["--mixed_precision", "fp32", "train.py"])
    # HF's hyphenated spellings are the same options; after the script everything belongs to the script.
    args = parse(["--num-processes", "2", "--mixed-precision", "bf16", "--dynamo-backend", "inductor", "--multi-gpu",
                  "--num-cpu-threads-per-process", "2", "-t", "3", "--rdzv-conf", "a=1", "--same-network",
                  "train.py", "--num-processes", "7"])
    assert (args.num_processes, args.mixed_precision, args.dynamo__backend, args.distributed_type) == \
           (2, "bf16", "INDUCTOR", "MULTI_GPU")
    assert (args.num_cpu_threads_per_process, args.tee, args.rdzv_conf, args.same_network) == (2, "3", "a=1", True)
    assert args.training_script_args == ["--num-processes", "7"]
    with pytest.raises(SystemExit):
        parse(["--dynamo_backend", "nonsense", "train.py"])


def test_config_file_then_flags(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_C_CONFIG_DIR", str(tmp_path))
    path = save_config(ClusterConfig(num_processes=4, mixed_precision="bf16", gradient_accumulation_steps=8,
                                     use_cpu=True), str(tmp_path / "c.yaml"))
    cfg = launch.resolve_config(parse(["--config_file", path, "--mixed_precision", "fp16", "x.py"]))
    assert (cfg.num_processes, cfg.mixed_precision, cfg.gradient_accumulation_steps) == (4, "fp16", 8)
    # The default file is used when no --config_file is given.
    save_config(ClusterConfig(num_processes=3, use_cpu=True), str(tmp_path / "default_config.yaml"))
    assert launch.resolve_config(parse(["x.py"])).num_processes == 3
    with pytest.raises(ConfigError, match="multiple of num_machines"):
        launch.resolve_config(parse(["--num_processes", "3", "--num_machines", "2", "x.py"]))


def test_rendezvous_choice():
    one = launch.rendezvous(ClusterConfig())
    assert one["rdzv_backend"] == "c10d" and one["rdzv_endpoint"].endswith(":0")
    assert one["run_id"] != launch.rendezvous(ClusterConfig())["run_id"]
    fixed = launch.rendezvous(ClusterConfig(main_process_port=1234))
    assert fixed["rdzv_backend"] == "static" and fixed["rdzv_endpoint"] == "127.0.0.1:1234"
    multi = [launch.rendezvous(ClusterConfig(num_machines=2, num_processes=4, machine_rank=r,
                                             main_process_ip="10.0.0.1", main_process_port=2000)) for r in (0, 1)]
    assert [m["rdzv_configs"]["rank"] for m in multi] == [0, 1] and multi[0]["run_id"] == multi[1]["run_id"]
    with pytest.raises(ConfigError, match="main_process_ip"):
        launch.rendezvous(ClusterConfig(num_machines=2, num_processes=2))
    with pytest.raises(ConfigError, match="main_process_port"):
        launch.rendezvous(ClusterConfig(num_machines=2, num_processes=2, main_process_ip="a", main_process_port=0))


def test_rendezvous_timeout_from_the_environment(monkeypatch):
    two = ClusterConfig(num_machines=2, num_processes=2, main_process_ip="10.0.0.1", main_process_port=2000)
    assert "timeout" not in launch.rendezvous(two)["rdzv_configs"]  # torch's default
    monkeypatch.setenv("ACCELERATE_C_RDZV_TIMEOUT", "45")
    assert launch.rendezvous(two)["rdzv_configs"] == {"rank": 0, "timeout": 45}
    for bad in ("0", "-3", "1.5", "soon"):
        monkeypatch.setenv("ACCELERATE_C_RDZV_TIMEOUT", bad)
        with pytest.raises(ConfigError, match=f"ACCELERATE_C_RDZV_TIMEOUT={bad!r}"):
            launch.rendezvous(two)


def test_launch_config_on_a_torch_without_shutdown_timeout(monkeypatch, tmp_path):
    # torch 2.11 (the H200 machine's) has no LaunchConfig.shutdown_timeout: `launch` and notebook_launcher built the
    # config with it and failed with a TypeError before any rank started (found by benchmarks/gpu_check.py).
    # (logs_specs given: torch's default one makes a torchelastic_* folder in the machine's temp directory)
    import dataclasses
    import torch.distributed.launcher.api as api
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    real = api.LaunchConfig
    fields = [(f.name, f.type, f) for f in dataclasses.fields(real) if f.name != "shutdown_timeout"]
    older = dataclasses.make_dataclass("LaunchConfig", fields)
    monkeypatch.setattr(api, "LaunchConfig", older)
    logs = DefaultLogsSpecs(log_dir=str(tmp_path / "logs"))
    cfg = launch.launch_config(min_nodes=1, max_nodes=1, nproc_per_node=2, run_id="x", logs_specs=logs)
    assert isinstance(cfg, older) and cfg.nproc_per_node == 2
    monkeypatch.setattr(api, "LaunchConfig", real)
    if "shutdown_timeout" in {f.name for f in dataclasses.fields(real)}:
        assert launch.launch_config(min_nodes=1, max_nodes=1, nproc_per_node=2,
                                    logs_specs=logs).shutdown_timeout == launch.SHUTDOWN_TIMEOUT_S
    import accelerate_c
    pkg = os.path.dirname(accelerate_c.__file__)
    direct = [os.path.relpath(os.path.join(d, f), pkg) for d, _, fs in os.walk(pkg) for f in fs if f.endswith(".py")
              and re.search(r"\bLaunchConfig\(", open(os.path.join(d, f)).read())]
    assert direct == [os.path.join("commands", "launch.py")], direct  # every other caller goes through launch_config


def test_launch_env_and_allreduce(tmp_path, env_script):
    cfg = save_config(ClusterConfig(mixed_precision="fp8", num_processes=2, use_cpu=True,
                                    fp8_config={"fp8_format": "E4M3"}), str(tmp_path / "c.yaml"))
    out = tmp_path / "out"
    out.mkdir()
    rc, so, se = finish(cli(["launch", "--config_file", cfg, "--gradient_accumulation_steps", "4",
                             "--fp8_amax_history_len", "16", env_script, str(out), "--lr", "3"], tmp_path))
    assert rc == 0, se
    ranks = read_ranks(out, 2)
    for r, info in enumerate(ranks):
        assert (info["RANK"], info["LOCAL_RANK"], info["WORLD_SIZE"], info["LOCAL_WORLD_SIZE"]) == \
               (str(r), str(r), "2", "2")
        assert info["dist_rank"] == r and info["dist_world"] == 2 and info["sum"] == 3.0
        assert info["argv"] == [str(out), "--lr", "3"] and info["name"] == "__main__"
        assert info["ACCELERATE_MIXED_PRECISION"] == "fp8" and info["ACCELERATE_USE_CPU"] == "true"
        assert info["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] == "4"
        assert (info["ACCELERATE_FP8_FORMAT"], info["ACCELERATE_FP8_AMAX_HISTORY_LEN"]) == ("E4M3", "16")
        assert info["ACCELERATE_FP8_AMAX_COMPUTE_ALGO"] == "most_recent" and info["ACCELERATE_FP8_MARGIN"] == "0"
        want_threads = max(1, len(os.sched_getaffinity(0)) // 2)
        assert info["OMP_NUM_THREADS"] == str(want_threads) and info["torch_threads"] == want_threads
    assert ranks[0]["ACCELERATE_C_HOST_ID"] == ranks[1]["ACCELERATE_C_HOST_ID"]
    assert ranks[0]["ACCELERATE_C_RUN_ID"] == ranks[1]["ACCELERATE_C_RUN_ID"]
    resolved = json.loads(ranks[0]["ACCELERATE_C_CONFIG"])
    assert resolved["gradient_accumulation_steps"] == 4 and resolved["fp8_config"]["amax_history_len"] == 16


def test_failing_rank_stops_all(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys, time
        import torch.distributed as dist
        dist.init_process_group("gloo")
        open(os.path.join(sys.argv[1], "pid%d" % dist.get_rank()), "w").write(str(os.getpid()))
        dist.barrier()
        if dist.get_rank() == 1:
            raise ValueError("boom from the second rank")
        time.sleep({FOREVER_S})  # the job can only end before the test's guard if the launcher stops rank 0
    """))
    rc, so, se = finish(cli(["launch", "--num_processes", "2", "--cpu", str(script), str(tmp_path)], tmp_path))
    assert rc == 1, se
    line = [ln for ln in se.splitlines() if ln.startswith("accelerate_c launch:")]
    assert line and "rank 1" in line[-1] and "ValueError: boom from the second rank" in line[-1], se
    assert "exit code 1" in line[-1]
    pid0 = int((tmp_path / "pid0").read_text())
    assert not alive(pid0)


def test_two_launches_at_once(tmp_path, env_script):
    (tmp_path / "envmod.py").write_text(ENV_SCRIPT)  # second launch runs it as a module (-m)
    outs = [tmp_path / "a", tmp_path / "b"]
    for o in outs:
        o.mkdir()
    procs = [cli(["launch", "--num_processes", "2", "--cpu", env_script, str(outs[0])], tmp_path),
             cli(["launch", "--num_processes", "2", "--cpu", "-m", "envmod", str(outs[1])], tmp_path)]
    results = [finish(p) for p in procs]
    assert all(rc == 0 for rc, _, _ in results), describe_all(procs)
    a, b = read_ranks(outs[0], 2), read_ranks(outs[1], 2)
    assert all(x["sum"] == 3.0 for x in a + b)
    assert a[0]["MASTER_PORT"] != b[0]["MASTER_PORT"]
    assert a[0]["ACCELERATE_C_RUN_ID"] != b[0]["ACCELERATE_C_RUN_ID"]
    assert a[0]["ACCELERATE_C_HOST_ID"] != b[0]["ACCELERATE_C_HOST_ID"]


def _two_machines(tmp_path, script_args, per_machine=2, scripts=None):
    """Two launchers of one job on loopback (machine 0 hosts the rendezvous store); returns their jobs."""
    port = str(free_port())
    scripts = scripts or [script_args[0]] * 2
    return [cli(["launch", "-q", "--cpu", "--num_processes", str(2 * per_machine), "--num_machines", "2",
                 "--machine_rank", str(m), "--main_process_ip", "127.0.0.1", "--main_process_port", port,
                 scripts[m], *script_args[1:]], tmp_path, env=TIMEOUTS, name=f"machine{m}") for m in (0, 1)]


def _last_line(err):
    lines = [ln for ln in err.splitlines() if ln.startswith("accelerate_c launch:")]
    return lines[-1] if lines else ""


def test_two_machines_on_loopback(tmp_path, env_script):
    out = tmp_path / "out"
    out.mkdir()
    jobs = _two_machines(tmp_path, [env_script, str(out)])
    results = finish_all(jobs, GUARD_S)
    assert all(rc == 0 for rc, _, _ in results), describe_all(jobs)
    ranks = read_ranks(out, 4)
    for r, info in enumerate(ranks):
        machine, local = divmod(r, 2)
        assert (info["RANK"], info["LOCAL_RANK"], info["GROUP_RANK"], info["WORLD_SIZE"]) == \
               (str(r), str(local), str(machine), "4")
        assert info["sum"] == 10.0 and info["ACCELERATE_C_NUM_MACHINES"] == "2"
    hosts = [info["ACCELERATE_C_HOST_ID"] for info in ranks]
    assert hosts[0] == hosts[1] and hosts[2] == hosts[3] and hosts[0] != hosts[2]
    assert not os.listdir(tmp_path / "tmp"), "temporary files left behind by the launchers"


@pytest.mark.parametrize("failing_rank", [3, 1])  # on the second machine / on the main (store) machine
def test_two_machines_failure_stops_both(tmp_path, failing_rank):
    """The other machine's ranks sleep past the test's guard: the job ends only through the notice."""
    script = tmp_path / "mmfail.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        import torch.distributed as dist
        dist.init_process_group("gloo")
        dist.barrier()
        if dist.get_rank() == int(sys.argv[1]):
            raise ValueError("boom on global rank %d" % dist.get_rank())
        time.sleep({FOREVER_S})  # the other machine's ranks would wait here without the cross-machine notice
    """))
    jobs = _two_machines(tmp_path, [str(script), str(failing_rank)])
    results = finish_all(jobs, GUARD_S)
    assert all(rc == 1 for rc, _, _ in results), describe_all(jobs)
    failed_machine = failing_rank // 2
    for m, (_, _, err) in enumerate(results):
        line = _last_line(err)
        assert f"rank {failing_rank} (local rank 1 on machine {failed_machine}) failed, exit code 1" in line, \
            describe_all(jobs)
        assert f"ValueError: boom on global rank {failing_rank}" in line
        if m != failed_machine:
            assert line.startswith(f"accelerate_c launch: stopped this machine's ranks because machine "
                                   f"{failed_machine}: rank {failing_rank}"), describe_all(jobs)
    assert not os.listdir(tmp_path / "tmp"), "temporary files left behind by the launchers"


# Machine 1's rank fails only once machine 0's agent waits in torch's exit barrier (its ranks are done): it
# waits on the barrier's key in the agent store the ranks share (MASTER_ADDR:MASTER_PORT); the key names
# are torch's (agent/server/api.py, utils/store.py).
LATE_FAIL = textwrap.dedent("""
    import datetime, os
    import torch.distributed as dist
    dist.init_process_group("gloo")
    dist.barrier()
    rank = dist.get_rank()
    dist.destroy_process_group()
    if rank == 3:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              wait_for_workers=False, timeout=datetime.timedelta(seconds=120))
        dist.PrefixStore(os.environ["ACCELERATE_C_RUN_ID"], store).wait(["torchelastic/agent/terminal_state/num_members"])
        raise RuntimeError("late failure on rank 3")
""")


def test_two_machines_late_failure_reaches_the_exit_barrier(tmp_path):
    """Regression: machine 0's agent, done and blocked in torch's exit barrier (a store.wait of up to 300 s
    that its SIGTERM handler cannot interrupt), used to sit there after machine 1 posted its failure."""
    script = tmp_path / "late.py"
    script.write_text(LATE_FAIL)
    jobs = _two_machines(tmp_path, [str(script)])
    (rc0, _, err0), (rc1, _, err1) = finish_all(jobs, GUARD_S)
    assert (rc0, rc1) == (1, 1), describe_all(jobs)
    assert "rank 3 (local rank 1 on machine 1) failed, exit code 1: RuntimeError: late failure on rank 3" in _last_line(err1), \
        describe_all(jobs)
    assert _last_line(err0).startswith("accelerate_c launch: stopped this machine's ranks because machine 1: "
                                       "rank 3"), describe_all(jobs)
    assert "Error waiting on exit barrier" not in err0, describe_all(jobs)  # it did not time out there


def test_two_machines_launcher_error_stops_the_other(tmp_path, env_script):
    """Machine 1's launcher fails before any rank starts (its script is missing): machine 0, waiting for it
    at the rendezvous (a blocking store call, up to ACCELERATE_C_RDZV_TIMEOUT), stops with its reason."""
    jobs = _two_machines(tmp_path, [env_script, str(tmp_path)], scripts=[env_script, str(tmp_path / "nope.py")])
    (rc0, _, err0), (rc1, _, err1) = finish_all(jobs, GUARD_S)
    assert rc1 == 2 and "nope.py" in err1, describe_all(jobs)
    assert rc0 == 1, describe_all(jobs)
    assert _last_line(err0).startswith("accelerate_c launch: stopped this machine's ranks because machine 1: "
                                       "the launcher failed: FileNotFoundError"), describe_all(jobs)


def _launch_sleepers(tmp_path):
    """Launches 2 ranks that write pid<rank> into tmp_path and sleep; returns once both wrote it."""
    script = tmp_path / "sleep.py"
    script.write_text("import os, sys, time\n"  # written, then renamed: the test never reads a file still empty
                      "path = os.path.join(sys.argv[1], 'pid' + os.environ['RANK'])\n"
                      "open(path + '.tmp', 'w').write(str(os.getpid()))\n"
                      "os.replace(path + '.tmp', path)\n"
                      f"time.sleep({FOREVER_S})\n")
    job = cli(["launch", "--num_processes", "2", "--cpu", str(script), str(tmp_path)], tmp_path)
    deadline = time.monotonic() + GUARD_S
    while not all((tmp_path / f"pid{r}").exists() for r in (0, 1)):
        if time.monotonic() >= deadline or job.poll() is not None:
            job.kill_tree()
            pytest.fail("ranks did not start\n" + job.describe())
        time.sleep(0.1)
    return job


def test_ranks_die_with_a_killed_launcher(tmp_path):
    job = _launch_sleepers(tmp_path)
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in (0, 1)]
    job.signal(signal.SIGKILL)  # the launcher cannot clean up itself
    job.proc.wait()
    deadline = time.monotonic() + GUARD_S  # they die at once (PR_SET_PDEATHSIG); the bound is only a guard
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    survivors = [p for p in pids if alive(p)]
    for p in survivors:
        os.kill(p, signal.SIGKILL)  # leave nothing running even when the check fails
    assert not survivors


# Rank 0 ends while a gloo collective it issued is still in flight; gloo's worker thread completes it (and
# runs a Python callback, which needs the GIL) once rank 1 takes part, which rank 1 does only once rank 0's
# interpreter is in its final teardown (an object freed there says so, and keeps it there) or gone.
GLOO_AT_EXIT = textwrap.dedent("""
    import os, sys, time, types
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank, out = dist.get_rank(), sys.argv[1]
    def exists(name):
        return os.path.exists(os.path.join(out, name))
    def gone(pid):
        try:
            with open("/proc/%d/stat" % pid) as fh:
                return fh.read().split(")")[-1].split()[0] == "Z"
        except FileNotFoundError:
            return True
    if rank == 0:
        with open(os.path.join(out, "pid0.tmp"), "w") as fh:  # renamed once written: rank 1 never reads it empty
            fh.write(str(os.getpid()))
        os.replace(os.path.join(out, "pid0.tmp"), os.path.join(out, "pid0"))
        dist.all_reduce(torch.ones(1000), async_op=True).get_future().then(lambda fut: None)
        class SlowTeardown:
            def __del__(self):
                open(os.path.join(out, "rank0_finalizing"), "w").close()
                deadline = time.monotonic() + 60  # a guard, not a timing check
                while not exists("rank1_done") and time.monotonic() < deadline:
                    time.sleep(0.01)
                time.sleep(0.5)
        holder = types.ModuleType("slow_teardown")  # freed in the interpreter's teardown, after the script
        holder.obj = SlowTeardown()
        sys.modules["slow_teardown"] = holder
    else:
        deadline = time.monotonic() + 60
        while not exists("pid0") and time.monotonic() < deadline:
            time.sleep(0.01)
        pid0 = int(open(os.path.join(out, "pid0")).read())
        while not (exists("rank0_finalizing") or gone(pid0)) and time.monotonic() < deadline:
            time.sleep(0.01)
        try:
            dist.all_reduce(torch.ones(1000))
        except Exception:  # rank 0 may be gone already: fine
            pass
        open(os.path.join(out, "rank1_done"), "w").close()
""")


def test_rank_exit_does_not_race_gloo_worker_threads(tmp_path):
    """Regression: a gloo worker thread that needed the GIL while a finished rank's interpreter finalized
    aborted that rank ("terminate called without an active exception", SIGABRT), failing a job that had
    done all its work; now and then in real runs (torch keeps the process group alive after
    destroy_process_group once an optimizer exists). The rank must leave with exit code 0."""
    script = tmp_path / "gloo_exit.py"
    script.write_text(GLOO_AT_EXIT)
    rc, _, se = finish(cli(["launch", "-q", "--num_processes", "2", "--cpu", str(script), str(tmp_path)], tmp_path))
    assert rc == 0 and "terminate called" not in se, se
    # the exit path's flush of open files printed torch's deprecation warning for dist.reduce_op on every rank
    assert "FutureWarning" not in se, se


EXIT_SCRIPT = textwrap.dedent("""
    import atexit, os, sys, threading, time
    out = sys.argv[1]
    atexit.register(lambda: open(os.path.join(out, "atexit"), "w").write("ran"))
    def late():
        time.sleep(0.5)
        open(os.path.join(out, "thread"), "w").write("joined")
    threading.Thread(target=late).start()  # not a daemon: exiting waits for it
    sys._kept_open = open(os.path.join(out, "unflushed"), "w")  # still open (and buffered) at exit
    sys._kept_open.write("flushed at exit")
    print("no newline, no flush", end="")
    sys.exit(int(sys.argv[2]) if sys.argv[2].isdigit() else sys.argv[2])
""")


@pytest.mark.parametrize("code", ["0", "7", "bye from the script"])
def test_rank_exit_keeps_python_exit_semantics(tmp_path, code):
    """The rank leaves through os._exit (see _bootstrap.py) but as Python would: SystemExit's code (a
    non-integer is printed and means 1), non-daemon threads joined, atexit handlers run, files flushed."""
    script = tmp_path / "exits.py"
    script.write_text(EXIT_SCRIPT)
    rc, so, se = finish(cli(["launch", "--num_processes", "1", "--cpu", str(script), str(tmp_path), code],
                            tmp_path))
    want = {"0": 0, "7": 7}.get(code, 1)
    assert rc == (0 if want == 0 else 1), se
    if want:
        assert f"exit code {want}" in [ln for ln in se.splitlines() if ln.startswith("accelerate_c launch:")][-1]
    if want == 1:
        assert "bye from the script" in se
    assert "no newline, no flush" in so
    assert (tmp_path / "atexit").read_text() == "ran" and (tmp_path / "thread").read_text() == "joined"
    assert (tmp_path / "unflushed").read_text() == "flushed at exit"


def test_host_id_flag(tmp_path, env_script):
    out = tmp_path / "out"
    out.mkdir()
    rc, _, se = finish(cli(["launch", "--num_processes", "2", "--cpu", "--host_id", "box7", env_script, str(out)],
                           tmp_path))
    assert rc == 0, se
    assert [i["ACCELERATE_C_HOST_ID"] for i in read_ranks(out, 2)] == ["box7", "box7"]


def test_sigterm_stops_ranks(tmp_path):
    job = _launch_sleepers(tmp_path)
    job.signal(signal.SIGTERM)
    rc, _, se = finish(job)
    assert rc == 128 + signal.SIGTERM and "received SIGTERM" in se, se
    for r in (0, 1):
        assert not alive(int((tmp_path / f"pid{r}").read_text()))


def test_bad_settings_exit_before_launch(tmp_path):
    rc, _, se = finish(cli(["launch", "--num_processes", "3", "--num_machines", "2", "--main_process_ip",
                            "127.0.0.1", "x.py"], tmp_path))
    assert rc == 2 and "num_processes" in se and "multiple of num_machines" in se


def test_max_restarts_relaunches(tmp_path):
    script = tmp_path / "flaky.py"
    script.write_text(textwrap.dedent("""
        import os, sys
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")
        attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        if attempt == 0 and dist.get_rank() == 0:
            sys.exit(3)
        t = torch.ones(1)
        dist.all_reduce(t)
        open(os.path.join(sys.argv[1], "ok%d_%d" % (dist.get_rank(), attempt)), "w").write(str(t.item()))
        dist.destroy_process_group()  # with restarts rank 0 hosts the store: leave cleanly (see launch.py)
    """))
    rc, _, se = finish(cli(["launch", "--num_processes", "2", "--cpu", "--max_restarts", "1", "--monitor_interval",
                            "0.2", str(script), str(tmp_path)], tmp_path))
    assert rc == 0, se
    assert (tmp_path / "ok0_1").read_text() == "2.0" and (tmp_path / "ok1_1").read_text() == "2.0"


def test_missing_script(tmp_path):
    rc, _, se = finish(cli(["launch", "--num_processes", "2", "--cpu", "nope.py"], tmp_path))
    assert rc == 2 and "nope.py" in se


# `python -m accelerate_c test`: its self-check script is first validated against the reference (HF
# Accelerate's Accelerator, swapped in by a sitecustomize shim), including that it catches a run whose
# gradients are not synchronised; then run as shipped (needs accelerate_c.Accelerator from the core).
SHIM = ("import accelerate_c\nfrom accelerate import Accelerator\naccelerate_c.Accelerator = Accelerator\n")


def _selfcheck(tmp_path, script, shim):
    env = {}
    if shim:
        (tmp_path / "shim").mkdir(exist_ok=True)
        (tmp_path / "shim" / "sitecustomize.py").write_text(SHIM)
        env["PYTHONPATH"] = os.pathsep.join([ROOT, str(tmp_path / "shim")])
    args = ["test"] if script is None else ["launch", "--num_processes", "2", "--cpu", "-q", script]
    return finish(cli(args, tmp_path, env=env))


def test_selfcheck_with_hf_accelerator(tmp_path):
    from accelerate_c.commands.test import SCRIPT

    rc, out, err = _selfcheck(tmp_path, SCRIPT, shim=True)
    assert rc == 0 and "self-check passed: 2 processes" in out, err
    broken = tmp_path / "broken.py"
    text = open(SCRIPT).read().replace(
        "        loss = torch.nn.functional.mse_loss(model(xb), yb)\n        accelerator.backward(loss)\n",
        "        with accelerator.no_sync(model):\n"
        "            loss = torch.nn.functional.mse_loss(model(xb), yb)\n"
        "            accelerator.backward(loss)\n")
    assert "no_sync" in text
    broken.write_text(text)
    rc, out, err = _selfcheck(tmp_path, str(broken), shim=True)
    assert rc != 0 and "self-check FAILED" in out


def test_test_command(tmp_path):
    import accelerate_c

    if not hasattr(accelerate_c, "Accelerator"):
        pytest.skip("accelerate_c.Accelerator is not in this branch yet (the core provides it)")
    rc, out, err = _selfcheck(tmp_path, None, shim=False)
    assert rc == 0 and "Test is a success!" in out, out + err


# ---- HF's launch flags, HF's default config file, -q --------------------------------------------------

HF_STYLE_FLAGS = ["--num-processes", "2", "--num-cpu-threads-per-process", "3", "--dynamo-backend", "inductor",
                  "--dynamo_mode", "max-autotune", "--dynamo-use-fullgraph", "--dynamo_use_dynamic",
                  "--dynamo-use-regional-compilation"]


def _hf_rank_env(argv, monkeypatch, tmp_path):
    """The rank environment HF Accelerate 1.15 builds for `accelerate launch ARGV x.py` (no default file)."""
    import accelerate.commands.launch as hf_launch
    from accelerate.utils.launch import prepare_multi_gpu_env

    monkeypatch.setattr(hf_launch, "default_config_file", str(tmp_path / "no_hf_default.yaml"))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    args, _, _ = hf_launch._validate_launch_command(hf_launch.launch_command_parser().parse_args([*argv, "x.py"]))
    args.main_process_port = 0  # HF would probe its default port 29500; any free one does here
    return prepare_multi_gpu_env(args)


def test_hf_flags_give_hf_rank_env(monkeypatch, tmp_path):
    from accelerate.utils import str_to_bool

    monkeypatch.setenv("ACCELERATE_C_CONFIG_DIR", str(tmp_path / "ours"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    argv = [*HF_STYLE_FLAGS, "--multi-gpu"]
    hf = _hf_rank_env(argv, monkeypatch, tmp_path)
    ours = launch.rank_env(launch.resolve_config(parse([*argv, "x.py"])), parse(["x.py"]), 2, "run")
    keys = sorted(k for k in hf if k.startswith("ACCELERATE_DYNAMO_")) + ["OMP_NUM_THREADS"]
    assert len(keys) == 6
    for key in keys:
        h, o = hf[key], ours[key]
        if h in ("True", "False"):
            h, o = str_to_bool(h), str_to_bool(o)
        assert o == h, (key, o, h)
    # HF passes ACCELERATE_GRADIENT_CLIPPING (DeepSpeedPlugin reads it); we pass it the same way.
    cfg = launch.resolve_config(parse(["--gradient-clipping", "0.5", "--cpu", "x.py"]))
    assert cfg.env()["ACCELERATE_GRADIENT_CLIPPING"] == "0.5"
    assert ClusterConfig().env()["ACCELERATE_DYNAMO_BACKEND"] == "NO"  # always set, as HF does


def test_multi_gpu_flag_rules(monkeypatch, tmp_path):
    monkeypatch.setenv("ACCELERATE_C_CONFIG_DIR", str(tmp_path))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(ConfigError, match="--cpu"):
        launch.resolve_config(parse(["--multi_gpu", "--cpu", "x.py"]))
    with pytest.raises(ConfigError, match="2 or more"):
        launch.resolve_config(parse(["--multi_gpu", "--num_processes", "1", "x.py"]))
    monkeypatch.setattr(launch, "_cuda_count", lambda: 0)
    cfg = launch.resolve_config(parse(["--multi_gpu", "--num_processes", "2", "x.py"]))
    assert (cfg.use_cpu, cfg.distributed_type, cfg.num_processes) == (True, "MULTI_CPU", 2)


def test_launch_config_arguments(monkeypatch, tmp_path):
    """--log_dir, --tee and --rdzv_conf reach torch's LaunchConfig (captured instead of launched)."""
    import torch.distributed.launcher.api as api

    seen = {}

    def fake_elastic_launch(config, entrypoint):
        seen["config"] = config
        return lambda *argv: None

    monkeypatch.setattr(api, "elastic_launch", fake_elastic_launch)
    monkeypatch.setenv("ACCELERATE_C_CONFIG_DIR", str(tmp_path))
    script = tmp_path / "x.py"
    script.write_text("")
    args = parse(["--cpu", "--num_processes", "2", "--log_dir", str(tmp_path / "logs"), "--tee", "0:3,1:1",
                  "--rdzv_conf", "join_timeout=77, custom=v", str(script)])
    assert launch.launch_command(args) == 0
    lc = seen["config"]
    assert lc.logs_specs.root_log_dir == str(tmp_path / "logs") and (tmp_path / "logs").is_dir()
    assert lc.rdzv_configs["join_timeout"] == "77" and lc.rdzv_configs["custom"] == "v"
    assert lc.rdzv_configs["is_host"] is True  # ours stay unless overridden
    with pytest.raises(ConfigError, match="rdzv_conf"):
        launch.resolve_config(parse(["--cpu", "--rdzv_conf", "novalue", str(script)]))
    with pytest.raises(ConfigError, match="tee"):
        launch.resolve_config(parse(["--cpu", "--tee", "4", str(script)]))
    with pytest.raises(ConfigError, match="log_dir"):
        launch.resolve_config(parse(["--cpu", "--log_dir", str(script), str(script)]))


def test_hf_flags_reach_the_ranks(tmp_path, env_script):
    """One real launch with HF's spellings: the ranks see the thread count, dynamo and clipping variables,
    and --tee 3 --log_dir leaves each rank's output in its log file."""
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "envprint.py"
    script.write_text(ENV_SCRIPT + "print('rank output', dist.get_rank() if dist.is_initialized() else '')\n")
    rc, so, se = finish(cli(["launch", *HF_STYLE_FLAGS, "--multi-gpu", "--gradient-clipping", "0.5", "--tee", "3",
                             "--log-dir", str(tmp_path / "logs"), "--rdzv-conf", "join_timeout=60", "--same-network",
                             str(script), str(out)], tmp_path))
    assert rc == 0, se
    import torch

    if not torch.cuda.is_available():
        assert "--multi_gpu" in se and "no CUDA GPU" in se and "running 2 CPU process(es)" in se, se
    assert "gradient_clipping=0.5" in se and "only DeepSpeed applies it" in se, se  # not DEEPSPEED here
    for info in read_ranks(out, 2):
        assert info["OMP_NUM_THREADS"] == "3"  # (torch caps its own count at the cores it may use)
        assert (info["ACCELERATE_DYNAMO_BACKEND"], info["ACCELERATE_DYNAMO_MODE"]) == ("INDUCTOR", "max-autotune")
        for flag in ("USE_FULLGRAPH", "USE_DYNAMIC", "USE_REGIONAL_COMPILATION"):
            assert info["ACCELERATE_DYNAMO_" + flag] == "true"
        assert info["ACCELERATE_GRADIENT_CLIPPING"] == "0.5"
    logs = sorted((tmp_path / "logs").rglob("stdout.log"))
    assert len(logs) == 2 and all("rank output" in p.read_text() for p in logs), logs
    assert "rank output" in so  # tee: on the console as well


def _write_default(path, num_processes, mixed_precision):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nnum_processes: "
                    f"{num_processes}\nmixed_precision: {mixed_precision}\nuse_cpu: true\n")


def test_hf_default_config_file(monkeypatch, tmp_path):
    """Our default file first, then HF's ($HF_HOME/accelerate, HF_HOME defaulting to $XDG_CACHE_HOME/
    huggingface); with --cpu neither is read. HF 1.15 on the same files is the reference."""
    import accelerate.commands.launch as hf_launch

    ours, hf_home, xdg = tmp_path / "ours", tmp_path / "hf_home", tmp_path / "xdg"
    monkeypatch.setenv("ACCELERATE_C_CONFIG_DIR", str(ours))
    monkeypatch.setenv("XDG_CACHE_HOME", str(xdg))
    monkeypatch.delenv("HF_HOME", raising=False)
    env = dict(os.environ, PYTHONPATH=ROOT)
    probe = "from accelerate.commands.config.config_args import default_config_file as f; print(f)"
    for home in (None, hf_home):  # HF's own path, computed by HF in a fresh process, is ours
        if home is not None:
            monkeypatch.setenv("HF_HOME", str(home))
            env["HF_HOME"] = str(home)
        hf_path = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                                 timeout=60).stdout.strip()
        assert hf_path == ca.hf_default_config_file(), (hf_path, ca.hf_default_config_file())
    assert ca.find_default_config() is None and launch.resolve_config(parse(["x.py"])).num_processes >= 1
    hf_file = hf_home / "accelerate" / "default_config.yaml"
    _write_default(hf_file, 3, "bf16")
    import accelerate.commands.config.config_args as hf_config_args

    for module in (hf_launch, hf_config_args):  # HF reads the path once, at import
        monkeypatch.setattr(module, "default_config_file", str(hf_file))
    for argv in (["x.py"], ["--cpu", "x.py"], ["--num_processes", "2", "x.py"]):
        cfg = launch.resolve_config(parse(argv))
        hf_args, _, _ = hf_launch._validate_launch_command(hf_launch.launch_command_parser().parse_args(argv))
        assert cfg.mixed_precision == hf_args.mixed_precision, argv  # bf16 only when the file was read
        if "--cpu" not in argv:  # (without a file HF leaves num_processes at the GPU count, 0 here)
            assert cfg.num_processes == hf_args.num_processes, argv
    assert launch.resolve_config(parse(["--cpu", "x.py"])).mixed_precision == "no"  # --cpu: not read
    assert launch.resolve_config(parse(["x.py"])).mixed_precision == "bf16"
    _write_default(ours / "default_config.yaml", 4, "fp16")  # ours wins over HF's
    assert (launch.resolve_config(parse(["x.py"])).num_processes, ca.find_default_config()) == \
           (4, str(ours / "default_config.yaml"))


# torch's log format ("E1130 23:36:13.005000 7676 torch/...py:1002] ...") or any mention of its launch modules.
TORCH_LOG_LINE = re.compile(r"^[DIWEC]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\]"
                            r"|torch[./]distributed[./](elastic|launcher|run)", re.MULTILINE)


def test_quiet_hides_torch_launcher_logs(tmp_path):
    """Regression: `launch -q` used to set a level on "torch.distributed.elastic", which elastic's own
    loggers ignore (each has its own level) and which let its ERROR "failed (exitcode ...)" line through."""
    script = tmp_path / "fail.py"
    script.write_text(textwrap.dedent("""
        import time
        import torch.distributed as dist
        dist.init_process_group("gloo")
        print("hello from rank %d" % dist.get_rank(), flush=True)
        dist.barrier()
        if dist.get_rank() == 1:
            raise ValueError("boom from rank 1")
        time.sleep(120)
    """))
    runs = {q: finish(cli(["launch", *q, "--num_processes", "2", "--cpu", str(script)], tmp_path))
            for q in ((), ("-q",))}
    loud, quiet = runs[()], runs[("-q",)]
    assert TORCH_LOG_LINE.search(loud[2]), loud[2]  # without -q torch's lines are there (the check can fail)
    rc, so, se = quiet
    assert rc == 1 and not TORCH_LOG_LINE.search(se), se
    assert "hello from rank 0" in so and "hello from rank 1" in so, so  # the script's own output is intact
    assert "ValueError: boom from rank 1" in se and "accelerate_c launch: rank 1 " in se, se


def test_import_and_cli_help_do_not_import_torch():
    """`import accelerate_c` resolves its public names on first use, so the CLI's commands that never touch torch
    (--help, config, env) start without paying for it; the first use of a name imports what it needs."""
    code = ("import sys, subprocess, accelerate_c\n"
            "from accelerate_c.commands import cli\n"
            "assert 'torch' not in sys.modules, 'torch imported by import accelerate_c'\n"
            "try:\n    cli.main(['launch', '--help'])\nexcept SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules, 'torch imported by launch --help'\n"
            "from accelerate_c import Accelerator, DeepSpeedPlugin\n"
            "assert 'torch' in sys.modules and Accelerator.__name__ == 'Accelerator'\n"
            "assert set(accelerate_c.__all__) <= set(dir(accelerate_c))\n"
            # HF's faces that transformers imports load no torch._dynamo (seconds, and its cache folder)
            "import accelerate_c.big_modeling, accelerate_c.hooks, accelerate_c.utils.modeling\n"
            "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo imported by the big-model faces'\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
