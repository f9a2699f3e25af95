# Tests of the launcher's report of ranks that have not arrived (issue 18, part 6): a rank that hangs before
# init_process_group used to keep the others waiting there for the process group's timeout (1800 s) in silence.
# The report's logic (commands/arrivals.py) runs on a fake clock with notes written by hand; the rank side
# (_bootstrap.py's import hook) in one process; then a real 2-rank launch where rank 1 does not call
# init_process_group until the launcher has named it twice in its stderr (read from the file it goes to), so the
# test depends on no timing: without the report rank 1 would wait past the guard and the test fail.
import os
import re
import sys
import textwrap

import pytest

from accelerate_c.base import settings
from accelerate_c.commands import arrivals
from accelerate_c.commands.arrivals import ArrivalWatch
from accelerate_c.commands.config_args import ClusterConfig, ConfigError
from conftest import Job, finish_all, free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BOOTSTRAP = os.path.join(ROOT, "accelerate_c", "commands", "_bootstrap.py")
GUARD_S = 300


def _note(folder, name, text=""):
    (folder / name).write_text(text)


def test_nothing_is_said_before_a_rank_arrives_or_once_all_have(tmp_path):
    w = ArrivalWatch(str(tmp_path), 2, 60, 0)
    assert w.tick(0) is None and w.tick(1000) is None  # no notes at all
    _note(tmp_path, "0-0.started", "rank=0 group_rank=0 pid=11")
    _note(tmp_path, "0-1.started", "rank=1 group_rank=0 pid=12")
    assert w.tick(2000) is None  # started, nobody called init_process_group yet: nobody waits
    _note(tmp_path, "0-0.arrived")
    assert w.tick(3000) is None  # the clock starts now
    assert w.tick(3059) is None
    line = w.tick(3060)
    assert line.startswith("accelerate_c launch: rank 1 has not called init_process_group 60 s after rank 0 did "), line
    assert "rank 1: local rank 1, pid 12" in line and "rank 0 waits there" in line and "1800 s" in line, line
    assert "--startup_report_interval" in line
    assert w.tick(3061) is None and w.tick(3119) is None  # once per interval
    assert "120 s after" in w.tick(3120)
    assert w.tick(3400) is not None and w.tick(3401) is None  # a late tick says it once, not once per missed interval
    _note(tmp_path, "0-1.arrived")
    assert w.tick(4000) is None and w.tick(9000) is None  # all arrived


def test_several_late_ranks_unstarted_ones_and_restarts(tmp_path):
    w = ArrivalWatch(str(tmp_path), 4, 10, 1)
    _note(tmp_path, "0-0.started", "rank=4 group_rank=1 pid=40")
    _note(tmp_path, "0-0.arrived")
    _note(tmp_path, "0-2.started", "rank=6 group_rank=1 pid=42")
    _note(tmp_path, "0-2.arrived")
    _note(tmp_path, "0-1.started", "rank=5 group_rank=1 pid=41")
    assert w.tick(0) is None
    line = w.tick(10)
    assert "rank 5, rank 7 have not called init_process_group 10 s after rank 4, rank 6 did (machine 1;" in line, line
    assert "rank 5: local rank 5, pid 41" not in line and "rank 5: local rank 1, pid 41" in line, line
    assert "rank 7: local rank 3, not started yet" in line and "rank 4, rank 6 wait there" in line, line
    # the agent restarted the group: the new attempt's notes count, its clock starts afresh
    _note(tmp_path, "1-3.started", "rank=7 group_rank=1 pid=53")
    _note(tmp_path, "1-3.arrived")
    assert w.tick(11) is None and w.tick(20) is None
    assert "after rank 7 did" in w.tick(21)
    junk = ArrivalWatch(str(tmp_path / "none"), 2, 1, 0)  # a missing folder, odd names: nothing, no error
    _note(tmp_path, "x-1.arrived")
    assert junk.tick(5) is None


def test_report_switch_and_variable(tmp_path):
    assert ArrivalWatch(str(tmp_path / "a"), 2, 0, 0).rank_env() == {}  # 0 = off: the ranks note nothing
    assert not (tmp_path / "a").exists()
    on = ArrivalWatch(str(tmp_path / "b"), 2, 5, 0)
    assert on.rank_env() == {settings.var("ARRIVAL_DIR"): str(tmp_path / "b")} and (tmp_path / "b").is_dir()
    with on:  # the thread starts and stops
        pass
    with pytest.raises(ConfigError, match="startup_report_interval"):
        ClusterConfig(startup_report_interval=0.5)
    assert arrivals.HF_PG_TIMEOUT_S == 1800


def test_bootstrap_notes_start_and_the_first_init_process_group(tmp_path):
    """The rank side: `.started` before the script runs, `.arrived` only once init_process_group is called; the
    wrapped function is torch.distributed's (same name, signature, module attribute and re-export)."""
    notes = tmp_path / "notes"
    notes.mkdir()
    script = tmp_path / "s.py"
    script.write_text(textwrap.dedent(f"""
        import inspect, os, sys
        folder = {str(notes)!r}
        assert sorted(os.listdir(folder)) == ["0-3.started"], os.listdir(folder)
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d
        assert dist.init_process_group is c10d.init_process_group
        assert dist.init_process_group.__name__ == "init_process_group"
        assert "backend" in inspect.signature(dist.init_process_group).parameters
        assert sorted(os.listdir(folder)) == ["0-3.started"]
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        assert sorted(os.listdir(folder)) == ["0-3.arrived", "0-3.started"], os.listdir(folder)
        dist.destroy_process_group()
        print("ok")
    """))
    env = dict(os.environ, PYTHONPATH=ROOT, LOCAL_RANK="3", RANK="7", GROUP_RANK="1", TORCHELASTIC_RESTART_COUNT="0",
               **{settings.var("ARRIVAL_DIR"): str(notes)})
    job = Job([sys.executable, BOOTSTRAP, str(script)], str(tmp_path / "logs"), "rank", env)
    (rc, out, err), = finish_all([job], GUARD_S)
    assert rc == 0 and "ok" in out, out + err
    assert (notes / "0-3.started").read_text() == f"rank=7 group_rank=1 pid={job.pid}"


def test_launch_names_the_rank_that_has_not_arrived(tmp_path):
    """Rank 1 blocks before init_process_group until the launcher's stderr has named it twice; rank 0 waits in
    init_process_group meanwhile. The run then ends normally and the lines say who, where and how long."""
    (tmp_path / "tmp").mkdir()
    err_file = tmp_path / "logs" / "launch.err"
    script = tmp_path / "late.py"
    script.write_text(textwrap.dedent(f"""
        import os, time
        import torch.distributed as dist
        if os.environ["RANK"] == "1":
            while open({str(err_file)!r}).read().count("rank 1 has not called init_process_group") < 2:
                time.sleep(0.1)
        dist.init_process_group("gloo")
        dist.barrier()
        dist.destroy_process_group()
    """))
    env = dict(os.environ, PYTHONPATH=ROOT, ACCELERATE_C_CONFIG_DIR=str(tmp_path / "cfgdir"),
               HF_HOME=str(tmp_path / "hf_home"), XDG_CACHE_HOME=str(tmp_path / "xdg"), TMPDIR=str(tmp_path / "tmp"))
    env.pop("OMP_NUM_THREADS", None)
    job = Job([sys.executable, "-m", "accelerate_c", "launch", "--cpu", "--num_processes", "2", "-q",
               "--startup_report_interval", "1", str(script)], str(tmp_path / "logs"), "launch", env,
              cwd=str(tmp_path))
    (rc, out, err), = finish_all([job], GUARD_S)
    assert rc == 0, out + err
    lines = [ln for ln in err.splitlines() if "has not called init_process_group" in ln]
    assert len(lines) >= 2, err
    waited = []
    for line in lines:
        m = re.fullmatch(r"accelerate_c launch: rank 1 has not called init_process_group (\d+) s after rank 0 did "
                         r"\(machine 0; rank 1: local rank 1, pid \d+\); rank 0 waits there, up to the process "
                         r"group's timeout \(1800 s by default\); repeated every 1 s \(--startup_report_interval\)",
                         line)
        assert m, line
        waited.append(int(m.group(1)))
    assert waited == sorted(set(waited)) and waited[0] >= 1, lines  # once per interval, counting up
    assert os.listdir(tmp_path / "tmp") == []  # the notes went with the launcher's temporary folder

