# tests/test_resume.py: a run interrupted after step k and resumed ends with bitwise-identical weights to
# the uninterrupted run (CPU), mid-epoch and at an epoch boundary, both ways a user resumes (HF's
# load_state + skip_first_batches, and the stateful dataloader), on 1 and 2 processes. One run saves at every stop
# and trains on (ending bitwise where the uninterrupted run ends); each stop is resumed in fresh processes.
# Not for: the checkpoint format itself (test_checkpointing.py).
import os

import pytest
import torch
from safetensors.torch import load_file


# 10 steps per epoch: 7 = mid-epoch, 10 = epoch boundary, 13 = mid second epoch
STOPS = {1: (7, 10, 13), 2: (7, 13)}


@pytest.mark.parametrize("nproc", [1, 2])
@pytest.mark.parametrize("mode", ["hf", "stateful"])
def test_resume_is_bitwise_exact(tmp_path, run, nproc, mode):
    """The uninterrupted run; the same run saving its state after each step of STOPS (and training on: it must end
    where the first did, saving changes nothing); then, in fresh processes, a resume from each of those states."""
    common = ["--total", "16", "--mode", mode]
    stops = STOPS[nproc]
    run("resume_train.py", common + ["--ckpt", str(tmp_path / "unused"), "--out", str(tmp_path / "full")],
        nproc=nproc, launcher="accelerate_c")
    run("resume_train.py", common + ["--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "saving"),
                                     "--save_at", ",".join(map(str, stops))], nproc=nproc, launcher="accelerate_c")
    a = load_file(str(tmp_path / "full" / "w.safetensors"))
    saved = load_file(str(tmp_path / "saving" / "w.safetensors"))
    for k in a:
        assert torch.equal(a[k], saved[k]), f"{k}: saving state changed the run ({mode}, {nproc} proc)"
    for stop_at in stops:
        ckpt = tmp_path / "ckpt" / f"step{stop_at}"
        assert os.path.isdir(ckpt)
        run("resume_train.py", common + ["--ckpt", str(ckpt), "--out", str(tmp_path / f"resumed{stop_at}"),
                                         "--resume"], nproc=nproc, launcher="accelerate_c")
        b = load_file(str(tmp_path / f"resumed{stop_at}" / "w.safetensors"))
        for k in a:
            assert torch.equal(a[k], b[k]), f"{k} differs after resume at step {stop_at} ({mode}, {nproc} proc)"
