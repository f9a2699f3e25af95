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
# under our stage-0 DDP join. What is refused fails with its error, on every rank, without hanging: two prepared
# models under the context, and under stage 3 a rank with no batch at all (it replays its last batch).
# An ignored (replicated) module with a rank out of inputs mid-accumulation: its accumulated gradient counts, as the
# units' do. fp16 (mixed_precision="fp16", loss scaling, BatchNorm kept in fp32) with an inf forced into one gradient
# element on one rank only (before the others join, after, accumulated by a rank that then runs out): every rank
# records the same skip decisions and scales as the one-process computation of the same uneven run (the step with
# the inf skipped everywhere, the scale halved), ends with the same scale and the same weights (fp16 tolerance).
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


CASES = [  # id, sharding, steps per rank, grad accumulation, extra args, environment
    ("z1-midaccum-sched", "ds:1", "3,6", 2, ["--sched"], {}),          # rank 0 runs out mid-accumulation
    ("z2-3ranks-dsclip", "ds:2", "6,2,4", 2, ["--ds_clip", "0.3"], {}),  # rank 0 done first, rank 1 earlier still
    ("fsdp2-midaccum-units-clip", "fsdp:2", "3,6", 2, ["--clip", "0.3", "--wrap", "size"], {}),
    ("fsdp3-midaccum-units-sched-torchcomm", "fsdp:3", "3,6", 2, ["--wrap", "size", "--sched", "--clip", "0.3"],
     {"ACCELERATE_C_COMM": "torch"}),
    ("z1-loader-lonesync", "ds:1", "4,3", 2, ["--loader"], {}),       # rank 1 syncs at its last batch alone
    ("fsdp2-loader-3ranks-clip", "fsdp:2", "3,3,2", 2, ["--loader", "--clip", "0.3"], {}),
    ("fsdp3-loader-lonesync-units-sched", "fsdp:3", "4,3", 2, ["--loader", "--wrap", "size", "--sched"], {}),
    ("z2-midaccum-ignored", "ds:2", "3,6", 2, ["--ignore"], {}),      # rank 0's accumulated replicated gradient
]


@pytest.mark.parametrize("sharding,steps,ga,extra,env", [pytest.param(*c[1:], id=c[0]) for c in CASES])
def test_sharded_join_uneven_inputs(tmp_path, run, sharding, steps, ga, extra, env):
    args = ["--steps_per_rank", steps, "--grad_accum", str(ga)] + extra
    run("join_train.py", args + ["--emulate", "--out", str(tmp_path / "ref")], nproc=1, timeout=120)
    nproc = len(steps.split(","))
    run("join_train.py", args + ["--sharding", sharding, "--out", str(tmp_path / "got")], nproc=nproc,
        launcher="accelerate_c", timeout=240, env=env)
    _compare(tmp_path / "ref", tmp_path / "got", nproc, [int(s) for s in steps.split(",")])


def test_sharded_join_matches_ddp_join(tmp_path, run):
    """ZeRO-3 with a unit per layer on 3 ranks against the same uneven run under our stage-0 DDP join (no rank runs out
    mid-accumulation: gradients our DDP join would drop) and against the emulation."""
    args = ["--steps_per_rank", "6,2,4", "--grad_accum", "2", "--clip", "0.3"]
    run("join_train.py", args + ["--emulate", "--out", str(tmp_path / "ref")], nproc=1, timeout=120)
    for name, extra in (("ddp", ["--sharding", "fsdp:0"]), ("z3", ["--sharding", "ds:3", "--wrap", "size"])):
        run("join_train.py", args + extra + ["--out", str(tmp_path / name)], nproc=3, launcher="accelerate_c",
            timeout=240)
    _compare(tmp_path / "ddp", tmp_path / "z3", 3, [6, 2, 4])
    _compare(tmp_path / "ref", tmp_path / "z3", 3, [6, 2, 4])


@pytest.mark.parametrize("sharding,steps,extra,message", [
    ("ds:2", "3,4", ["--second_model"], "takes exactly one prepared model"),
    ("fsdp:3", "0,3", [], "rank 0 ran out of inputs before running any forward"),
], ids=["two-models", "z3-rank-without-batches"])
def test_sharded_join_refuses_clearly(tmp_path, run, sharding, steps, extra, message):
    args = ["--steps_per_rank", steps, "--sharding", sharding, "--out", str(tmp_path)] + extra
    with pytest.raises(AssertionError, match=message):
        run("join_train.py", args, nproc=2, launcher="accelerate_c", timeout=120)


FP16_CASES = [  # id, sharding, steps per rank, grad accumulation, extra args (--inject T:R: micro-step T of rank R)
    ("fsdp2-overflow-carried", "fsdp:2", "3,6", 2, ["--inject", "2:0", "--clip", "0.3"]),  # rank 0's last micro-step
    ("z1-overflow-after-join", "ds:1", "3,6", 2, ["--inject", "4:1", "--clip", "0.3"]),  # rank 0 already joined
    ("fsdp3-overflow-units", "fsdp:3", "3,6", 2, ["--inject", "1:0", "--wrap", "size"]),
    ("z2-3ranks-overflow-dsclip", "ds:2", "6,2,4", 2, ["--inject", "5:0", "--ds_clip", "0.3"]),
]


@pytest.mark.parametrize("sharding,steps,ga,extra", [pytest.param(*c[1:], id=c[0]) for c in FP16_CASES])
def test_sharded_join_fp16_overflow_agreed(tmp_path, run, sharding, steps, ga, extra):
    args = ["--steps_per_rank", steps, "--grad_accum", str(ga), "--fp16", "--optim", "sgd"] + extra
    ref, got = tmp_path / "ref", tmp_path / "got"
    run("join_train.py", args + ["--emulate", "--out", str(ref)], nproc=1, timeout=120)
    nproc = len(steps.split(","))
    run("join_train.py", args + ["--sharding", sharding, "--out", str(got)], nproc=nproc, launcher="accelerate_c",
        timeout=240)
    finals, skips = set(), 0
    for r in range(nproc):
        a = json.loads((ref / f"record{r}.json").read_text())
        b = json.loads((got / f"record{r}.json").read_text())
        assert a == b, (r, a, b)
        finals.add(b["final_scale"])
        skips += sum(skip for skip, _ in b["steps"])
    assert len(finals) == 1, finals
    if "--inject" in extra:  # one step skipped (on every rank still training; a joined rank's scale halved too)
        assert skips >= 1 and finals == {512.0}, (skips, finals)
    else:
        assert skips == 0 and finals == {1024.0}, (skips, finals)
    # fp16 compute copies: rounded at 2**-11, the reference's per-rank gradients of loss / world, ours of loss
    _compare(ref, got, nproc, [int(s) for s in steps.split(",")], tol=1e-3)
