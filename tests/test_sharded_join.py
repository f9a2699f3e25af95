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
# The cases of one process count run in one launch (join_train.py --cases, the state reset between cases) and their
# references in one process; one folded case is also run alone and must end bitwise the same (weights, losses).
# Not for: stage 0's join itself (tests/test_join.py).
import json

import pytest
import torch
from safetensors.torch import load_file

from fold import Case, check_each, run_folded


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


def _case(name, sharding, steps, ga, extra, env=None, kind="fp32"):
    return Case(name, ["--steps_per_rank", steps, "--grad_accum", str(ga)] + extra, env, sharding=sharding,
                steps=[int(s) for s in steps.split(",")], kind=kind)


CASES = [  # against the emulation (--emulate): id, sharding, steps per rank, grad accumulation, extra args, env
    _case("z1-midaccum-sched", "ds:1", "3,6", 2, ["--sched"]),          # rank 0 runs out mid-accumulation
    _case("z2-3ranks-dsclip", "ds:2", "6,2,4", 2, ["--ds_clip", "0.3"]),  # rank 0 done first, rank 1 earlier still
    _case("fsdp2-midaccum-units-clip", "fsdp:2", "3,6", 2, ["--clip", "0.3", "--wrap", "size"]),
    _case("fsdp3-midaccum-units-sched-torchcomm", "fsdp:3", "3,6", 2, ["--wrap", "size", "--sched", "--clip", "0.3"],
          {"ACCELERATE_C_COMM": "torch"}),
    _case("z1-loader-lonesync", "ds:1", "4,3", 2, ["--loader"]),       # rank 1 syncs at its last batch alone
    _case("fsdp2-loader-3ranks-clip", "fsdp:2", "3,3,2", 2, ["--loader", "--clip", "0.3"]),
    _case("z2-midaccum-ignored", "ds:2", "3,6", 2, ["--ignore"]),      # rank 0's accumulated replicated gradient
    # ZeRO-3 with a unit per layer on 3 ranks against the same uneven run under our stage-0 DDP join (no rank runs
    # out mid-accumulation: gradients our DDP join would drop) as well as against the emulation
    _case("z3-3ranks-units-clip", "ds:3", "6,2,4", 2, ["--clip", "0.3", "--wrap", "size"]),
    _case("ddp-3ranks-clip", "fsdp:0", "6,2,4", 2, ["--clip", "0.3"], kind="ddp"),
    # fp16 with --inject T:R (an inf at micro-step T of rank R): every rank's skips and scales as the reference's
    # (at rank 0's last micro-step; then after rank 0 joined)
    _case("fsdp2-overflow-carried", "fsdp:2", "3,6", 2, ["--inject", "2:0", "--clip", "0.3"], kind="fp16"),
    _case("z1-overflow-after-join", "ds:1", "3,6", 2, ["--inject", "4:1", "--clip", "0.3"], kind="fp16"),
    _case("fsdp3-overflow-units", "fsdp:3", "3,6", 2, ["--inject", "1:0", "--wrap", "size"], kind="fp16"),
    _case("z2-3ranks-overflow-dsclip", "ds:2", "6,2,4", 2, ["--inject", "5:0", "--ds_clip", "0.3"], kind="fp16"),
    # last of its launch, after the torch transport, fp16 and the other faces: also run alone (must match bitwise)
    _case("fsdp3-loader-lonesync-units-sched", "fsdp:3", "4,3", 2, ["--loader", "--wrap", "size", "--sched"]),
]
FOLD_CHECK = "fsdp3-loader-lonesync-units-sched"
for c in CASES:
    if c.info["kind"] == "fp16":
        c.args += ["--fp16", "--optim", "sgd"]


def _ours(c):
    return Case(c.name, c.args + ["--sharding", c.info["sharding"]], c.env)


def _check_fp16(c, ref, got):
    finals, skips = set(), 0
    for r in range(len(c.info["steps"])):
        a = json.loads((ref / f"record{r}.json").read_text())
        b = json.loads((got / f"record{r}.json").read_text())
        assert a == b, (r, a, b)
        finals.add(b["final_scale"])
        skips += sum(skip for skip, _ in b["steps"])
    assert len(finals) == 1, finals
    if "--inject" in c.args:  # one step skipped (on every rank still training; a joined rank's scale halved too)
        assert skips >= 1 and finals == {512.0}, (skips, finals)
    else:
        assert skips == 0 and finals == {1024.0}, (skips, finals)
    # fp16 compute copies: rounded at 2**-11, the reference's per-rank gradients of loss / world, ours of loss
    _compare(ref, got, len(c.info["steps"]), c.info["steps"], tol=1e-3)


@pytest.mark.parametrize("nproc", [2, 3], ids=["2ranks", "3ranks"])
def test_sharded_join_uneven_inputs(tmp_path, run, nproc):
    """Every case on `nproc` ranks in one launch, their emulations in one process; on 3 ranks ZeRO-3 also against
    our stage-0 DDP join; on 2 ranks FOLD_CHECK also alone, bitwise equal to its folded run."""
    cases = [c for c in CASES if len(c.info["steps"]) == nproc]
    emulated = [c for c in cases if c.info["kind"] != "ddp"]
    refs = run_folded("join_train.py", [Case(c.name, c.args + ["--emulate"]) for c in emulated],
                      tmp_path / "ref", per_case_s=30)
    got = run_folded("join_train.py", [_ours(c) for c in cases], tmp_path / "got", nproc=nproc,
                     timeout=240, per_case_s=60)

    def check(c):
        if c.info["kind"] == "fp16":
            _check_fp16(c, refs[c.name], got[c.name])
        else:
            _compare(refs[c.name], got[c.name], nproc, c.info["steps"])
        if c.name == "z3-3ranks-units-clip":
            _compare(got["ddp-3ranks-clip"], got[c.name], nproc, c.info["steps"])

    check_each(emulated, check)
    if nproc == 2:  # the fold is honest: the same case alone (the plain command line) ends bitwise the same
        alone, c = tmp_path / "alone", next(c for c in CASES if c.name == FOLD_CHECK)
        run("join_train.py", _ours(c).args + ["--out", str(alone)], nproc=nproc, launcher="accelerate_c",
            timeout=240)
        for r in range(nproc):
            a = load_file(str(alone / f"state{r}.safetensors"))
            b = load_file(str(got[c.name] / f"state{r}.safetensors"))
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (r, FOLD_CHECK)
            la, lb = (json.loads((d / f"losses{r}.json").read_text()) for d in (alone, got[c.name]))
            assert la == lb, (r, FOLD_CHECK, la, lb)


@pytest.mark.parametrize("sharding,steps,extra,message", [
    ("ds:2", "3,4", ["--second_model"], "takes exactly one prepared model"),
    ("fsdp:3", "0,3", [], "rank 0 ran out of inputs before running any forward"),
], ids=["two-models", "z3-rank-without-batches"])
def test_sharded_join_refuses_clearly(tmp_path, run, sharding, steps, extra, message):
    args = ["--steps_per_rank", steps, "--sharding", sharding, "--out", str(tmp_path)] + extra
    with pytest.raises(AssertionError, match=message):
        run("join_train.py", args, nproc=2, launcher="accelerate_c", timeout=120)
