# tests/test_ddp_semantics.py: torch DDP's semantics on real models (tests/scripts/ddp_semantics.py), checked
# against the single-process reference of the same ranks (--emulate N, the rules written out without any
# communication): models with buffers (BatchNorm running stats; a transformers BERT built from a config) train
# to the same losses, weights and per-rank buffers with broadcast_buffers on and off, on 2 and 3 processes, with
# gradient accumulation; and gradients read right after a synced backward already hold the average (including
# what a no_sync backward accumulated before it, for a parameter used only then), with no optimizer prepared,
# on both gradient-sync paths.
# Not for: HF comparisons (test_parity.py) or bucket layout (test_ddp_buckets.py).
import pytest
from safetensors.torch import load_file

from test_parity import _close  # noqa: F401  (shared tolerance helper)


def _run_pair(run, tmp_path, nproc, args, grad_sync="bucketed"):
    ref, got = tmp_path / "ref", tmp_path / "got"
    run("ddp_semantics.py", args + ["--emulate", str(nproc), "--out", str(ref)], nproc=1)
    run("ddp_semantics.py", args + ["--out", str(got)], nproc=nproc, launcher="accelerate_c",
        env={"ACCELERATE_C_GRAD_SYNC": grad_sync})
    return ref, got


def _same_files(ref, got, name, tol):
    a, b = load_file(str(ref / name)), load_file(str(got / name))
    assert a.keys() == b.keys(), (name, sorted(a), sorted(b))
    for k in a:
        if a[k].is_floating_point():
            diff = (a[k] - b[k]).abs().max().item() if a[k].numel() else 0.0
            assert diff <= tol, f"{name}:{k} differs by {diff}"
        else:
            assert (a[k] == b[k]).all(), f"{name}:{k} differs"


def _same_losses(ref, got, tol):
    import json
    la, lb = json.loads((ref / "losses.json").read_text()), json.loads((got / "losses.json").read_text())
    assert len(la) == len(lb) > 0
    for i, (x, y) in enumerate(zip(la, lb)):
        assert abs(x - y) <= tol * max(1.0, abs(x)), f"step {i}: {x} vs {y}"


@pytest.mark.parametrize("model,nproc,grad_accum,broadcast,grad_sync", [
    ("bn", 3, 2, 1, "bucketed"),
    ("bn", 2, 2, 0, "bucketed"),
    ("bn", 2, 2, 1, "reference"),
    ("bert", 3, 2, 1, "bucketed"),
])
def test_models_with_buffers_train_like_one_process(tmp_path, run, model, nproc, grad_accum, broadcast, grad_sync):
    args = ["--model", model, "--mode", "train", "--grad_accum", str(grad_accum), "--broadcast_buffers", str(broadcast),
            "--global_batch", str(4 * nproc)]
    ref, got = _run_pair(run, tmp_path, nproc, args, grad_sync)
    _same_losses(ref, got, 1e-5)
    _same_files(ref, got, "weights.safetensors", 1e-5)
    for r in range(nproc):
        if (ref / f"buffers{r}.safetensors").exists() or (got / f"buffers{r}.safetensors").exists():
            _same_files(ref, got, f"buffers{r}.safetensors", 1e-5)


@pytest.mark.parametrize("model,nproc,grad_sync", [
    ("bn", 3, "bucketed"), ("bn", 2, "reference"), ("bert", 2, "bucketed"),
])
def test_grads_are_averaged_when_backward_returns(tmp_path, run, model, nproc, grad_sync):
    args = ["--model", model, "--mode", "grads", "--global_batch", str(4 * nproc)]
    ref, got = _run_pair(run, tmp_path, nproc, args, grad_sync)
    _same_files(ref, got, "grads.safetensors", 1e-6)
    _same_files(ref, got, "weights.safetensors", 1e-6)
