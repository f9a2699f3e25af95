# tests/test_resume.py: a run interrupted after step k and resumed ends with bitwise-identical weights to
# the uninterrupted run (CPU), mid-epoch and at an epoch boundary, both ways a user resumes (HF's
# load_state + skip_first_batches, and the stateful dataloader), on 1 and 2 processes.
# Not for: the checkpoint format itself (test_checkpointing.py).
import os

import pytest
import torch
from safetensors.torch import load_file


# 10 steps per epoch: 7 = mid-epoch, 10 = epoch boundary, 13 = mid second epoch
CASES = [(n, s) for n in (1, 2) for s in (7, 10, 13) if not (n == 2 and s == 10)]


_FULL: dict = {}


def _full_run(run, tmp_path_factory, nproc, mode):
    """The uninterrupted run, once per (processes, mode)."""
    key = (nproc, mode)
    if key not in _FULL:
        out = tmp_path_factory.mktemp(f"full-{nproc}-{mode}")
        run("resume_train.py", ["--total", "16", "--mode", mode, "--ckpt", str(out / "unused"), "--out", str(out)],
            nproc=nproc, launcher="accelerate_c")
        _FULL[key] = out / "w.safetensors"
    return _FULL[key]


@pytest.mark.parametrize("nproc,stop_at", CASES)
@pytest.mark.parametrize("mode", ["hf", "stateful"])
def test_resume_is_bitwise_exact(tmp_path, tmp_path_factory, run, nproc, mode, stop_at):
    common = ["--total", "16", "--mode", mode, "--ckpt", str(tmp_path / "ckpt")]
    launcher = "accelerate_c"
    full = _full_run(run, tmp_path_factory, nproc, mode)
    run("resume_train.py", common + ["--out", str(tmp_path / "x"), "--stop_at", str(stop_at)], nproc=nproc,
        launcher=launcher)
    assert os.path.isdir(tmp_path / "ckpt")
    run("resume_train.py", common + ["--out", str(tmp_path / "resumed"), "--resume"], nproc=nproc, launcher=launcher)
    a = load_file(str(full))
    b = load_file(str(tmp_path / "resumed" / "w.safetensors"))
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs after resume at step {stop_at} ({mode}, {nproc} proc)"
