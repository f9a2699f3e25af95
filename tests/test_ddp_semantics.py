# tests/test_ddp_semantics.py: torch DDP's semantics on real models (tests/scripts/ddp_semantics.py), checked
# against the single-process reference of the same ranks (--emulate N, the rules written out without any
# communication): models with buffers (BatchNorm running stats; a transformers BERT built from a config) train
# to the same losses, weights and per-rank buffers with broadcast_buffers on and off, on 2 and 3 processes, with
# gradient accumulation; and gradients read right after a synced backward already hold the average (including
# what a no_sync backward accumulated before it, for a parameter used only then), with no optimizer prepared,
# on both gradient-sync paths.
# Each process count is one test: its references run in one process, its distributed cases in one launch
# (tests/scripts/fold_cases.py); the 2-process launch ends by repeating its first case, which must give the same
# bits (no state leaks from one case into the next).
# Not for: HF comparisons (test_parity.py) or bucket layout (test_ddp_buckets.py).
import json

import pytest
import torch
from fold import Case, check_each, run_folded
from safetensors.torch import load_file

# (model, mode, nproc, grad_accum, broadcast_buffers, grad_sync)
CASES = [
    ("bn", "train", 3, 2, 1, "bucketed"),
    ("bn", "train", 2, 2, 0, "bucketed"),
    ("bn", "train", 2, 2, 1, "reference"),
    ("bert", "train", 3, 2, 1, "bucketed"),
    ("bn", "grads", 3, 1, 1, "bucketed"),
    ("bn", "grads", 2, 1, 1, "reference"),
    ("bert", "grads", 2, 1, 1, "bucketed"),
]


def _name(model, mode, nproc, grad_accum, broadcast, grad_sync):
    return f"{model}_{mode}_ga{grad_accum}_bb{broadcast}_{grad_sync}"


def _args(model, mode, nproc, grad_accum, broadcast, grad_sync):
    args = ["--model", model, "--mode", mode, "--global_batch", str(4 * nproc)]
    if mode == "train":
        args += ["--grad_accum", str(grad_accum), "--broadcast_buffers", str(broadcast)]
    return args


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
    la, lb = json.loads((ref / "losses.json").read_text()), json.loads((got / "losses.json").read_text())
    assert len(la) == len(lb) > 0
    for i, (x, y) in enumerate(zip(la, lb)):
        assert abs(x - y) <= tol * max(1.0, abs(x)), f"step {i}: {x} vs {y}"


def _bitwise(a, b):
    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
    for p in a.iterdir():
        if p.suffix == ".safetensors":
            x, y = load_file(str(p)), load_file(str(b / p.name))
            assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), p.name
        else:
            assert p.read_bytes() == (b / p.name).read_bytes(), p.name


@pytest.mark.parametrize("nproc", [2, 3])
def test_like_one_process(tmp_path, nproc):
    """--mode train: losses, weights (1e-5) and every rank's buffers as the reference; --mode grads: the
    gradients after the synced backward and the weights after an unprepared step (1e-6)."""
    cases = {_name(*c): c for c in CASES if c[2] == nproc}
    run_folded("ddp_semantics.py", [Case(n, [*_args(*c), "--emulate", nproc]) for n, c in cases.items()],
               tmp_path / "ref")
    runs = [Case(n, _args(*c), env={"ACCELERATE_C_GRAD_SYNC": c[5]}) for n, c in cases.items()]
    first = runs[0].name
    if nproc == 2:  # the first case once more, after all the others
        runs.append(Case("again", runs[0].args, env=runs[0].env))
    run_folded("ddp_semantics.py", runs, tmp_path / "got", nproc=nproc, launcher="accelerate_c")

    def check(run):
        name = run.name
        if name == "again":
            return _bitwise(tmp_path / "got" / first, tmp_path / "got" / "again")
        ref, out = tmp_path / "ref" / name, tmp_path / "got" / name
        if cases[name][1] == "train":
            _same_losses(ref, out, 1e-5)
            _same_files(ref, out, "weights.safetensors", 1e-5)
            for r in range(nproc):
                if (ref / f"buffers{r}.safetensors").exists() or (out / f"buffers{r}.safetensors").exists():
                    _same_files(ref, out, f"buffers{r}.safetensors", 1e-5)
        else:
            _same_files(ref, out, "grads.safetensors", 1e-6)
            _same_files(ref, out, "weights.safetensors", 1e-6)

    check_each(runs, check)
