# tests/conftest.py: shared helpers: run a script on N CPU processes (torch's elastic launcher for HF
# Accelerate, ours for accelerate_c), free ports, and a per-test timeout guard.
# Not for: test logic.
import os
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "scripts")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "RANK", "LOCAL_RANK", "WORLD_SIZE",
                                                                    "MASTER_", "LOCAL_WORLD_SIZE"))}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def run_script(script: str, args: list, nproc: int = 1, launcher: str = "torchrun", timeout: float = 240,
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
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


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
