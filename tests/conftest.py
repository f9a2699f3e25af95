# tests/conftest.py: shared helpers: run a script on N CPU processes (torch's elastic launcher for HF
# Accelerate, ours for accelerate_c), free ports, and Job: a subprocess whose output goes to files and whose
# whole process tree is killed when it outlives its timeout (so no test can hang, and a failure shows
# every process's output).
# Not for: test logic.
import atexit
import fcntl
import importlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import psutil
import pytest

# The workers share the cores with the ranks other tests start: OpenMP threads that spin while they wait for work
# (libgomp's default) keep a core from the processes that have work (a 2 s test took 108 s in the suite). Set before
# any test module imports torch; the ranks inherit it (with OMP_NUM_THREADS=1, clean_env).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "scripts")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# One scratch folder per pytest process: `cfg` stays empty (the config/HF_HOME folder of every launched command) and
# `tmp` is their TMPDIR (torch's elastic launcher makes a torchelastic_* folder per run and leaves it), `inductor`
# torch.compile's cache. Made at pytest_configure (scripts that import test modules, some of them killed mid-save,
# make none); removed when the session ends (pytest_unconfigure, in every xdist worker too) or at the latest at exit.
_SCRATCH: "str | None" = None
_OWNER_PID = os.getpid()


def _scratch(sub: str) -> str:
    global _SCRATCH, _OWNER_PID
    if _SCRATCH is None:
        _SCRATCH, _OWNER_PID = tempfile.mkdtemp(prefix="accelerate_c_tests_"), os.getpid()
        for name in ("cfg", "tmp"):
            os.makedirs(os.path.join(_SCRATCH, name))
    return os.path.join(_SCRATCH, sub)


@atexit.register
def _remove_scratch() -> None:  # only in the process that made it, not in a forked child that exits normally
    if _SCRATCH is not None and os.getpid() == _OWNER_PID:
        shutil.rmtree(_SCRATCH, ignore_errors=True)


def pytest_configure(config) -> None:
    # torch.compile's inductor cache (a torchinductor_<user> folder in the system's temp folder, made by any test that
    # compiles, even with backend aot_eager) in the scratch folder; launched commands inherit it through clean_env()
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", _scratch("inductor"))


def pytest_unconfigure(config) -> None:
    _remove_scratch()


def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked `exclusive` first (stable order otherwise): pytest-xdist hands each worker a contiguous share
    of the list, so they run while the other worker starts its share, instead of holding a worker idle (up to the
    length of the other's running test, over a minute here) and then blocking it, in the middle of the run."""
    items.sort(key=lambda item: item.get_closest_marker("exclusive") is None)


def reset_state(mod_name: str) -> None:
    """`accelerate` or `accelerate_c` back to no AcceleratorState / GradientState (process-wide singletons)."""
    state = importlib.import_module(f"{mod_name}.state")
    state.AcceleratorState._reset_state(True)
    state.GradientState._reset_state()


@pytest.fixture
def clean_state():
    """Both libraries' states reset before and after the test (in-process Accelerator tests)."""
    for m in ("accelerate", "accelerate_c"):
        reset_state(m)
    yield
    for m in ("accelerate", "accelerate_c"):
        reset_state(m)


_PLUGIN_VARS = ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "FSDP_", "ACCELERATE_DEEPSPEED_",
                "ACCELERATE_USE_MEGATRON_LM", "MEGATRON_LM_", "ACCELERATE_USE_PARALLELISM_CONFIG", "PARALLELISM_CONFIG_")


@pytest.fixture(autouse=True)
def _restore_plugin_env():
    """An Accelerator given a sharding plugin or a MegatronLMPlugin sets ACCELERATE_USE_FSDP / _DEEPSPEED /
    _MEGATRON_LM (as HF does): put the environment back after each test, so a later in-process Accelerator() is not
    silently sharded or given a Megatron-LM layout (HF's Accelerator would ask for Megatron-LM)."""
    before = {k: v for k, v in os.environ.items() if k.startswith(_PLUGIN_VARS)}
    yield
    for k in [k for k in os.environ if k.startswith(_PLUGIN_VARS)]:
        if k not in before:
            del os.environ[k]
    os.environ.update(before)


_RUN_ID = os.environ.get("PYTEST_XDIST_TESTRUNUID")  # the same in every worker of one pytest run
_LOCK_WAIT_S = 900


def _run_lock(factory, name: str):
    """A file in the folder the workers' temp folders share (pytest-of-<user>/pytest-<n>, pruned by pytest)."""
    return open(os.path.join(str(factory.getbasetemp().parent), f"accelerate_c_tests_{_RUN_ID}.{name}"), "a")


def _flock(fh, op: int, what: str) -> None:
    deadline = time.monotonic() + _LOCK_WAIT_S
    while True:
        try:
            return fcntl.flock(fh, op | fcntl.LOCK_NB)
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"waited {_LOCK_WAIT_S} s for the {what} lock of the test run") from None
            time.sleep(0.05)


@pytest.fixture(autouse=True)
def _exclusive_tests(request, tmp_path_factory):
    """Under pytest-xdist a test marked `exclusive` runs alone: every test holds a shared lock, an exclusive
    one the exclusive lock. A turnstile taken first keeps a waiting exclusive test from starving."""
    if not _RUN_ID:
        yield
        return
    exclusive = request.node.get_closest_marker("exclusive") is not None
    with _run_lock(tmp_path_factory, "turnstile") as turn, _run_lock(tmp_path_factory, "main") as main:
        _flock(turn, fcntl.LOCK_EX, "turnstile")
        try:
            _flock(main, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH, "exclusive" if exclusive else "shared")
        finally:
            fcntl.flock(turn, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(main, fcntl.LOCK_UN)


@pytest.fixture
def sharding_env(monkeypatch):
    """No FSDP_* / ACCELERATE_* variable from outside, both libraries' states reset before and after, and
    os.environ restored whole afterwards (the plugins and the Accelerator set variables, as HF's do)."""
    saved = dict(os.environ)
    for k in list(os.environ):
        if k.startswith(("FSDP_", "ACCELERATE_")):
            monkeypatch.delenv(k)
    for m in ("accelerate", "accelerate_c"):
        reset_state(m)
    yield
    for m in ("accelerate", "accelerate_c"):
        reset_state(m)
    os.environ.clear()
    os.environ.update(saved)


def rewrite_listed(ckpt: str, name: str, content: "str | bytes | None" = None) -> None:
    """Replaces file `name` of checkpoint folder `ckpt` with `content` (None: keeps what a test already wrote there)
    and sets its size in checkpoint.json's file list, so that a loader meets the new content itself rather than
    the size check (checkpoint.json itself, or a name it does not list, has no size to set)."""
    path = os.path.join(ckpt, name)
    if content is not None:
        with open(path, "wb") as fh:
            fh.write(content.encode() if isinstance(content, str) else content)
    meta_path = os.path.join(ckpt, "checkpoint.json")
    if name == "checkpoint.json":
        return
    with open(meta_path) as fh:
        meta = json.load(fh)
    if isinstance(meta.get("files"), dict) and name in meta["files"]:
        meta["files"][name] = os.path.getsize(path)
        with open(meta_path, "w") as fh:
            json.dump(meta, fh)


def clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "RANK", "LOCAL_RANK", "WORLD_SIZE",
                                                                    "MASTER_", "LOCAL_WORLD_SIZE",
                                                                    "THP_MEM_ALLOC_ENABLE"))}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    # no default config file of the machine's (ours or HF's) may change what a test launches
    env["ACCELERATE_C_CONFIG_DIR"] = env["HF_HOME"] = _scratch("cfg")
    env["TMPDIR"] = _scratch("tmp")
    env.update(extra)
    return env


class Job:
    """A command started in its own session with stdout and stderr in files under `logdir` (a pipe nobody
    drains fills up and stalls the writer, and every rank inherits the launcher's). finish_all() waits."""

    def __init__(self, cmd: list, logdir: str, name: str, env: dict | None = None, cwd: str = ROOT) -> None:
        os.makedirs(logdir, exist_ok=True)
        self.cmd, self.name = [str(c) for c in cmd], name
        self.out_path, self.err_path = os.path.join(logdir, f"{name}.out"), os.path.join(logdir, f"{name}.err")
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env,
                                         cwd=cwd, start_new_session=True)
        self.pid = self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def output(self) -> tuple[str, str]:
        with open(self.out_path, errors="replace") as out, open(self.err_path, errors="replace") as err:
            return out.read(), err.read()

    def describe(self, tail: int = 4000) -> str:
        out, err = self.output()
        return (f"--- {self.name}: {' '.join(self.cmd)}\n--- exit code {self.proc.poll()}\n"
                f"--- stdout (last {tail} chars):\n{out[-tail:]}\n--- stderr (last {tail} chars):\n{err[-tail:]}")

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def kill_tree(self) -> None:
        """SIGKILL to this job and every descendant (ranks run in sessions of their own)."""
        kill_tree(self.pid)
        self.proc.wait()


def kill_tree(pid: int) -> None:
    try:
        root = psutil.Process(pid)
        procs = root.children(recursive=True) + [root]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=30)


def finish_all(jobs: list, timeout: float) -> list:
    """Waits for every job (one deadline for all); returns [(returncode, stdout, stderr)]. A job still running
    at the deadline fails the test: every job's tree is killed and every job's output shown."""
    deadline = time.monotonic() + timeout
    while any(j.poll() is None for j in jobs) and time.monotonic() < deadline:
        time.sleep(0.1)
    late = [j.name for j in jobs if j.poll() is None]
    if late:
        for j in jobs:
            j.kill_tree()
        pytest.fail(f"{', '.join(late)} still running after {timeout} s (killed)\n" + describe_all(jobs))
    return [(j.proc.returncode, *j.output()) for j in jobs]


def describe_all(jobs: list) -> str:
    return "\n".join(j.describe() for j in jobs)


def run_script(script: str, args: list, nproc: int = 1, launcher: str = "torchrun", timeout: float = 300,
               env: dict | None = None) -> subprocess.CompletedProcess:
    """Runs tests/scripts/<script> on nproc processes; returns the completed process (raises on failure)."""
    path = os.path.join(SCRIPTS, script)
    env = clean_env(**(env or {}))
    if nproc == 1:
        cmd = [sys.executable, path, *args]
    elif launcher == "torchrun":
        env["ACCELERATE_USE_CPU"] = "1"  # HF Accelerate's MULTI_CPU needs it
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={free_port()}", path, *args]
    else:
        cmd = [sys.executable, "-m", "accelerate_c", "launch", "--num_processes", str(nproc),
               "--main_process_port", "0", path, *args]
    with tempfile.TemporaryDirectory(prefix="run_script_") as logdir:
        job = Job(cmd, logdir, "run", env)
        (rc, out, err), = finish_all([job], timeout)
        if rc != 0:
            raise AssertionError(f"{' '.join(cmd)} failed ({rc}):\n{out[-3000:]}\n{err[-5000:]}")
    return subprocess.CompletedProcess(cmd, rc, out, err)


def alive(pid: int) -> bool:
    """True while process `pid` runs (a zombie waiting for its parent counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture
def run():
    return run_script
