# tests/test_parity.py: N-process training equals single-process training with the same global batch
# (per-step loss and final weights within 1e-6, >= 10 steps, with and without accumulation, an unused
# parameter), and accelerate_c equals HF Accelerate 1.15 on the same script and seed, on 1 and 2 processes.
# Not for: unit behaviour (test_accelerator.py).
import json
import os

import pytest
import torch
from safetensors.torch import load_file


def _load(out):
    with open(os.path.join(out, "losses.json")) as f:
        data = json.load(f)
    return data["losses"], load_file(os.path.join(out, "weights.safetensors"))


def _close(a, b, tol=1e-6):
    la, wa = a
    lb, wb = b
    assert len(la) == len(lb) and len(la) >= 10
    for i, (x, y) in enumerate(zip(la, lb)):
        assert abs(x - y) <= tol * max(1.0, abs(x)), f"step {i}: loss {x} vs {y}"
    for k in wa:
        diff = (wa[k] - wb[k]).abs().max().item()
        assert diff <= tol, f"{k}: max diff {diff}"


@pytest.mark.parametrize("nproc,grad_accum,extra,grad_sync", [  # (the reference path: on the accumulating cases)
    (2, 2, [], "bucketed"), (2, 2, [], "reference"), (2, 1, ["--unused_param", "--optimizer", "sgd"], "bucketed"),
    (3, 2, ["--unused_param"], "bucketed"), (3, 2, ["--unused_param"], "reference"),
])
def test_nproc_equals_single(tmp_path, run, nproc, grad_accum, extra, grad_sync):
    gb = 12 if nproc == 3 else 8
    args = ["--global_batch", str(gb), "--grad_accum", str(grad_accum), "--no_scheduler", *extra]
    run("parity_train.py", args + ["--out", str(tmp_path / "single")], nproc=1)
    run("parity_train.py", args + ["--out", str(tmp_path / "multi")], nproc=nproc, launcher="accelerate_c",
        env={"ACCELERATE_C_GRAD_SYNC": grad_sync})
    _close(_load(tmp_path / "single"), _load(tmp_path / "multi"))


@pytest.mark.parametrize("nproc,grad_accum,shuffle", [(1, 1, True), (1, 2, False), (2, 1, True), (2, 2, False)])
def test_same_losses_as_hf_accelerate(tmp_path, run, nproc, grad_accum, shuffle):
    args = ["--grad_accum", str(grad_accum)] + (["--shuffle"] if shuffle else [])
    run("parity_train.py", args + ["--impl", "accelerate", "--out", str(tmp_path / "hf")], nproc=nproc)
    run("parity_train.py", args + ["--impl", "accelerate_c", "--out", str(tmp_path / "ours")], nproc=nproc)
    _close(_load(tmp_path / "hf"), _load(tmp_path / "ours"), tol=1e-5)


@pytest.mark.parametrize("grad_sync", ["bucketed"])  # (the reference path's hook: test_bf16_comm_hook_shm_equals_gloo)
def test_fp16_comm_hook_as_hf(tmp_path, run, grad_sync):
    """DistributedDataParallelKwargs(comm_hook=FP16): gradients reduced in fp16 as torch DDP's fp16_compress_hook
    under HF (cast, divide by the world size, sum, cast back): same losses and weights; and not the plain run."""
    args = ["--comm_hook", "fp16", "--grad_accum", "2"]
    run("parity_train.py", args + ["--impl", "accelerate", "--out", str(tmp_path / "hf")], nproc=2)
    run("parity_train.py", args + ["--impl", "accelerate_c", "--out", str(tmp_path / "ours")], nproc=2,
        launcher="accelerate_c", env={"ACCELERATE_C_GRAD_SYNC": grad_sync})
    _close(_load(tmp_path / "hf"), _load(tmp_path / "ours"), tol=1e-5)
    run("parity_train.py", ["--grad_accum", "2", "--out", str(tmp_path / "plain")], nproc=2, launcher="accelerate_c")
    plain, ours = _load(tmp_path / "plain")[1], _load(tmp_path / "ours")[1]
    assert any(not torch.equal(plain[k], ours[k]) for k in plain)


def test_bf16_comm_hook_shm_equals_gloo(tmp_path, run):
    """comm_hook=BF16 (torch's bf16 hook needs NCCL, so HF cannot run it on CPU): the shared-memory bucketed path
    reduces in bf16 exactly as the reference path's gloo all-reduce of the same bf16 tensors."""
    args = ["--comm_hook", "bf16", "--grad_accum", "2"]
    for sync in ("bucketed", "reference"):
        run("parity_train.py", args + ["--out", str(tmp_path / sync)], nproc=2, launcher="accelerate_c",
            env={"ACCELERATE_C_GRAD_SYNC": sync})
    _close(_load(tmp_path / "reference"), _load(tmp_path / "bucketed"), tol=1e-6)
    run("parity_train.py", ["--grad_accum", "2", "--out", str(tmp_path / "plain")], nproc=2, launcher="accelerate_c")
    plain, ours = _load(tmp_path / "plain")[1], _load(tmp_path / "bucketed")[1]
    assert any(not torch.equal(plain[k], ours[k]) for k in plain)


def test_power_sgd_is_a_clear_error(tmp_path, run):
    with pytest.raises(AssertionError, match="PowerSGD is not supported"):
        run("parity_train.py", ["--comm_hook", "power_sgd", "--out", str(tmp_path / "x")], nproc=2,
            launcher="accelerate_c")
