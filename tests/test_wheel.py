# tests/test_wheel.py: the package as users get it. Builds the wheel from a copy of the source tree, installs it
# into a fresh virtual environment that has only torch (2.13.0, the CPU build on this disk) and what the wheel's
# metadata pulls in, then, outside the checkout: imports every module of the installed package and runs a
# 2-process `python -m accelerate_c launch` that trains, saves its state and loads it back; and the
# ACCELERATE_C_AS_ACCELERATE switch through the .pth hook the wheel installs.
# (The editable install of the Makefile hid a wheel without accelerate_c.optim/.comm/.checkpointing/.data.)
# Not for: behaviour tests (they run against the checkout).
import os
import shutil
import subprocess
import sys

from conftest import ROOT, clean_env

TRAIN = """
import os, sys
import torch
from accelerate_c import Accelerator
acc = Accelerator(cpu=True)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
opt = torch.optim.AdamW(model.parameters(), lr=0.01)
data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
model, opt, loader = acc.prepare(model, opt, torch.utils.data.DataLoader(data, batch_size=4))
for x, y in loader:
    acc.backward(torch.nn.functional.mse_loss(model(x), y))
    opt.step()
    opt.zero_grad()
out = acc.save_state(sys.argv[1])
before = [p.detach().clone() for p in model.parameters()]
with torch.no_grad():
    for p in model.parameters():
        p.add_(1.0)
acc.load_state(sys.argv[1])
assert all(torch.equal(a, p) for a, p in zip(before, model.parameters())), "load_state did not restore the weights"
acc.wait_for_everyone()
# a file per rank: lines the ranks print share the launcher's stdout with other processes' stderr (torch's C++
# logging writes a line in several pieces), so a printed line may not start a line of the output
with open(os.path.join(os.path.dirname(sys.argv[1]), f"trained_{acc.process_index}"), "w") as fh:
    fh.write(f"TRAINED {acc.process_index} {acc.num_processes} {os.path.dirname(sys.modules['accelerate_c'].__file__)}")
acc.end_training()
"""

IMPORT_ALL = """
import importlib, pkgutil, accelerate_c
names = [m.name for m in pkgutil.walk_packages(accelerate_c.__path__, "accelerate_c.")]
for n in names:
    importlib.import_module(n)
print("IMPORTED", len(names), accelerate_c.__file__)
"""

SWITCH = """
import importlib.metadata, accelerate
from accelerate import Accelerator
print("SWITCH", accelerate.__file__, accelerate.__version__, importlib.metadata.version("accelerate"))
"""


def _run(cmd, log, cwd, env, timeout):
    with open(log, "w") as fh:
        proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout)
    text = open(log).read()
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{text[-6000:]}"
    return text


def test_wheel_installs_and_runs_outside_the_checkout(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info",
                                                                "__pycache__", "*.so", ".pytest_cache", "runs"))
    # CPU-only wheel: the CUDA extension's build is tested by test_cuda_ext (nvcc adds ~25 s here)
    env = {k: v for k, v in clean_env(ACCELERATE_C_CUDA_BUILD="0").items() if k != "PYTHONPATH"}
    wheels = tmp_path / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(src)],
         tmp_path / "build.log", tmp_path, env, 600)
    (wheel,) = list(wheels.glob("accelerate_c-*.whl"))

    venv = tmp_path / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    _run([base, "-m", "venv", str(venv)], tmp_path / "venv.log", tmp_path, env, 300)
    py = str(venv / "bin" / "python")
    # torch first, pinned (a bare requirement would resolve a multi-GB CUDA build); then the wheel and its metadata;
    # no byte-compiling at install (torch's thousands of files: ~12 s here), what runs compiles what it imports
    install = [py, "-m", "pip", "install", "-q", "--no-compile"]
    _run(install + ["torch==2.13.0"], tmp_path / "torch.log", tmp_path, env, 900)
    _run(install + [str(wheel)], tmp_path / "install.log", tmp_path, env, 900)

    work = tmp_path / "work"
    work.mkdir()
    out = _run([py, "-c", IMPORT_ALL], tmp_path / "import.log", work, env, 300)
    assert "IMPORTED" in out and str(venv) in out, out  # the installed copy, not the checkout
    # the switch's start-up hook came with the wheel: `import accelerate` is the installed accelerate_c and the
    # distribution "accelerate" reports 1.15.0 (this venv has no HF Accelerate at all)
    out = _run([py, "-c", SWITCH], tmp_path / "switch.log", work, dict(env, ACCELERATE_C_AS_ACCELERATE="1"), 300)
    assert f"SWITCH {venv}" in out and "site-packages/accelerate_c/__init__.py 1.15.0 1.15.0" in out, out

    (work / "train.py").write_text(TRAIN)
    launch_env = dict(env, OMP_NUM_THREADS="1")
    out = _run([py, "-m", "accelerate_c", "launch", "-q", "--cpu", "--num_processes", "2", "train.py",
                str(work / "ckpt")], tmp_path / "launch.log", work, launch_env, 600)
    trained = [(work / f"trained_{r}").read_text() if (work / f"trained_{r}").exists() else None for r in range(2)]
    assert trained == [f"TRAINED {r} 2 {venv}/lib/python{sys.version_info.major}.{sys.version_info.minor}/site-packages/"
                       f"accelerate_c" for r in range(2)], (trained, out)
    assert os.path.isdir(work / "ckpt") and os.listdir(work / "ckpt"), out
