# test_universal_chain.py: universal checkpoints through the real strategies (issue 9): state trained and saved
# under DDP on 2 processes is loaded and re-saved under ZeRO-3 on 3 processes, then under FSDP SHARD_GRAD_OP on
# 2, then loaded on one process; the model (BatchNorm buffers, a frozen and a never-used layer) and the AdamW
# state by parameter name are bitwise those of the original checkpoint loaded on one process.
# Not for: the format's own cases (test_checkpoint_universal.py) or training equivalence (test_sharded_engine.py).
import os

import torch
from conftest import run_script
from safetensors.torch import load_file


def _run(tmp_path, nproc, *args):
    try:
        run_script("universal_chain.py", list(args), nproc=nproc, launcher="accelerate_c", timeout=240)
    except Exception as e:  # run_script's error carries the ranks' output
        raise AssertionError(f"universal_chain.py {args} on {nproc} processes failed: {e}") from None


def test_ddp2_zero3x3_fsdp2_one_process_bitwise(tmp_path):
    d = [str(tmp_path / f"ck{i}") for i in range(3)]
    _run(tmp_path, 2, "--save", d[0])
    _run(tmp_path, 3, "--face", "deepspeed", "--stage", "3", "--load", d[0], "--save", d[1])
    _run(tmp_path, 2, "--face", "fsdp", "--stage", "2", "--load", d[1], "--save", d[2])
    ref, got = str(tmp_path / "ref.safetensors"), str(tmp_path / "got.safetensors")
    _run(tmp_path, 1, "--load", d[0], "--dump", ref)
    _run(tmp_path, 1, "--load", d[2], "--dump", got)
    a, b = load_file(ref), load_file(got)
    assert set(a) == set(b) and any(k.startswith("optim/") and k.endswith("exp_avg_sq") for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k
