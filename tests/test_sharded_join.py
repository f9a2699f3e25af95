# tests/test_sharded_join.py: Accelerator.join_uneven_inputs under the sharded engine (ZeRO 1/2/3 through the
# DeepSpeedPlugin and FSDP plugin faces) on real gloo processes, ranks training different numbers of micro-steps of
# tests/scripts/join_train.py's BatchNorm model: final weights and buffers (every rank's) and every rank's losses
# within 1e-5 of the single-process computation of the join's rules (join_train.py --emulate: gradients summed over
# the ranks still training and divided by the initial world size, buffers by DDP's broadcast rule from the highest
# training rank, a rank out of inputs keeps stepping its shard), on 2 and 3 processes, with gradient accumulation
# (a rank running out mid-accumulation included), accelerator.clip_grad_norm_ and DeepSpeed's gradient_clipping, an
# lr scheduler (the rank out of inputs steps with the others' lr), one unit or one unit per layer (stage 3's
# gathers, prefetches and frees replayed), and the prepared DataLoader path with even_batches=False (a rank that
# syncs at its own last batch while the others accumulate). One run is also checked against the same uneven run
# under our stage-0 DDP join.
# Not for: stage 0's join itself (tests/test_join.py).
import json

import pytest
import torch
from safetensors.torch import load_file


def _compare(ref, got, nproc, steps, tol=1e-5):
    for r in range(nproc):
        a = load_file(str(ref / f"state{r}.safetensors"))
        b = load_file(str(got / f"state{r}.safetensors"))
        assert a.keys() == b.keys(), (r, sorted(set(a) ^ set(b)))
        for k in a:
            assert torch.allclose(a[k].double(), b[k].double(), atol=tol, rtol=0), (r, k, (a[k] - b[k]).abs().max())
        la = json.loads((ref / f"losses{r}.json").read_text())
        lb = json.loads((got / f"losses{r}.json").read_text())
        assert len(la) == len(lb) == steps[r], (r, la, lb)
        assert all(abs(x - y) <= tol * max(1.0, abs(x)) for x, y in zip(la, lb)), (r, la, lb)


CASES = [  # sharding, steps per rank, grad accumulation, extra args
    ("ds:1", "3,5", 1, ["--clip", "0.3"]),
    ("ds:1", "3,6", 2, ["--sched"]),                          # rank 0 runs out mid-accumulation
    ("ds:2", "6,2,4", 2, ["--ds_clip", "0.3"]),               # rank 0 done first, rank 1 earlier still
    ("fsdp:2", "3,6", 2, ["--clip", "0.3", "--wrap", "size"]),
    ("ds:3", "6,2,4", 2, ["--wrap", "size", "--clip", "0.3"]),
    ("fsdp:3", "3,5", 1, ["--sched"]),
    ("fsdp:3", "3,6", 2, ["--wrap", "size", "--ds_clip", "0"]),
    ("ds:1", "4,3", 2, ["--loader"]),                          # rank 1 syncs at its last batch alone
    ("fsdp:2", "3,3,2", 2, ["--loader", "--clip", "0.3"]),
    ("fsdp:3", "4,3", 2, ["--loader", "--wrap", "size", "--sched"]),
]


@pytest.mark.parametrize("sharding,steps,ga,extra", CASES)
def test_sharded_join_uneven_inputs(tmp_path, run, sharding, steps, ga, extra):
    args = ["--steps_per_rank", steps, "--grad_accum", str(ga)] + extra
    run("join_train.py", args + ["--emulate", "--out", str(tmp_path / "ref")], nproc=1, timeout=120)
    nproc = len(steps.split(","))
    run("join_train.py", args + ["--sharding", sharding, "--out", str(tmp_path / "got")], nproc=nproc,
        launcher="accelerate_c", timeout=240)
    _compare(tmp_path / "ref", tmp_path / "got", nproc, [int(s) for s in steps.split(",")])


def test_sharded_join_matches_ddp_join(tmp_path, run):
    """The same uneven run (no rank out mid-accumulation: what our DDP join drops) under ZeRO-3 and stage 0."""
    args = ["--steps_per_rank", "6,2,4", "--grad_accum", "2", "--clip", "0.3"]
    for name, sharding in (("ddp", "fsdp:0"), ("z3", "ds:3")):
        run("join_train.py", args + ["--sharding", sharding, "--out", str(tmp_path / name)], nproc=3,
            launcher="accelerate_c", timeout=240)
    _compare(tmp_path / "ddp", tmp_path / "z3", 3, [6, 2, 4])
