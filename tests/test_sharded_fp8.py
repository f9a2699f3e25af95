# tests/test_sharded_fp8.py: Accelerator(mixed_precision="fp8") under the sharded engine (FSDP plugin stages 2/3,
# DeepSpeed plugin stage 1) on 2 gloo processes (tests/scripts/sharded_train.py --fp8).
#  - Against the same math without communication (--emulate 2 --fp8: the same Linear layers converted, each rank's
#    chunk through a bf16 copy of the fp32 master with that rank's own scaling state): with fp32 reduction
#    (reduce_dtype float32) the runs agree to 1e-5 (they are the same operations); with the default bf16 reduction
#    to 5e-3 (see _TOL).
#  - Against the Accelerator's own fp8 run on ONE process on the same global batch (--one_process): the sharded
#    fp8 run is no further from the fp32 run than fp8 alone (one process) and the bf16 compute copy alone (that
#    mixed_precision="fp8" means under FSDP/DeepSpeed) put together, and fp8 really changed the numbers.
#  - Which layers became FP8Linear (every nn.Linear, the tied lm_head included), that their weights and biases
#    are bf16 views of the engine's unit buffers (stage 3: the storage gathered and freed), the scaling state
#    per rank (weight amax histories equal on every rank, input amax histories each rank's own), the bytes the
#    collectives move per step, and a save_state / load_state round trip (the same step twice, the same result;
#    under delayed scaling also the same amax histories: they are saved per rank).
#  - Activation checkpointing under delayed scaling (one process, torch's checkpoint with fp8's context_fn): the
#    recomputation quantises with the forward's scales, so gradients and amax histories equal the plain run's.
# The distributed runs are cases of one 2-rank launch, the references one process (tests/fold.py); the mlp case runs
# first and again last in the launch and must agree bit for bit (fp8 scaling state does not leak between cases).
# Not for: FP8Linear's numerics alone (test_precision.py) or the engine without fp8 (test_sharded_engine.py).
import json

import torch
from safetensors.torch import load_file

from fold import Case, Group, run_checks, run_group
from test_sharded_engine import same_bits

# Tolerance against the emulated ranks. With fp32 reduction the two runs do the same operations: exact but for
# summation order. With bf16 reduction the engine rounds the summed gradient to bf16 where the reference sums in
# fp32 (one bf16 ulp, 2^-8 relative); a bf16 ulp moved in an activation or weight can move its fp8 rounding by one
# E4M3 step (2^-3 relative) in the next steps. Measured: 1.1e-3 (weights), 1e-3 (losses) on these runs; fp8 vs
# fp32 differs by ~4e-2 (weights) on the same runs, so 5e-3 still catches an fp8 step gone wrong.
_TOL = {"fp32": 1e-5, "bf16": 5e-3}
LLAMA_LINEARS = ["lm_head"] + [f"model.layers.{i}.{m}" for i in range(2) for m in
                               ("mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", "self_attn.k_proj",
                                "self_attn.o_proj", "self_attn.q_proj", "self_attn.v_proj")]

CASES = [  # model, face, stage, extra args, reduce dtype
    ("llama", "fsdp", 3, ["--wrap", "llayer", "--reduce_fp32", "--resume_check"], "fp32"),
    ("llama", "ds", 1, ["--wrap", "llayer", "--reduce_fp32", "--fp8_recipe", "E4M3:delayed:4"], "fp32"),
    ("llama", "fsdp", 2, ["--wrap", "llayer", "--fp8_recipe", "HYBRID:delayed:3:most_recent", "--resume_check"],
     "bf16"),
    ("mlp", "fsdp", 3, ["--wrap", "size", "--fp8_recipe", "HYBRID:delayed:2"], "bf16"),
    # activation checkpointing per unit (the recomputation replays the forward's scales) and sharded construction
    # from the meta device (FP8Linear initialised by transformers' _init_weights as the Linear it replaced)
    ("llama", "fsdp", 3, ["--wrap", "llayer", "--reduce_fp32", "--ac", "--meta", "all",
                          "--fp8_recipe", "HYBRID:delayed:4"], "fp32"),
]
AGAIN = 3  # CASES[AGAIN] runs first and again last


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _results(out):
    return json.loads((out / "losses.json").read_text()), load_file(str(out / "weights.safetensors"))


def _id(c: tuple) -> str:
    return f"{c[0]}-{c[1]}-z{c[2]}-{c[4]}{'-ac-meta' if '--ac' in c[3] else ''}"


def test_fp8_sharded_on_two_ranks(tmp_path):
    """One launch: every CASES run checked by _check_emulated (test_fp8_sharded_matches_emulated_ranks), CASES[0]'s
    also by _check_one_process (test_fp8_sharded_against_one_process), CASES[AGAIN] run twice (first, last)."""
    group = Group(tmp_path, 2)
    base = ["--model", "llama", "--global_batch", "8", "--optim", "sgd", "--wrap", "llayer"]
    refs = {"one": group.ref(base + ["--one_process", "--fp8"]), "fp32": group.ref(base + ["--one_process"]),
            "bf16": group.ref(base + ["--emulate", "2", "--bf16"])}
    runs = []
    for c in [CASES[AGAIN]] + [c for i, c in enumerate(CASES) if i != AGAIN]:
        model, face, stage, extra, rdt = c
        args = ["--model", model, "--global_batch", "8", "--optim", "sgd", "--fp8"]
        ref = group.ref(args + [a for a in extra if a not in ("--reduce_fp32", "--resume_check", "--ac")] +
                        ["--emulate", "2"])  # (same math)
        case = group.add(Case(_id(c), args + extra + ["--face", face, "--stage", str(stage)]))
        runs.append((c, ref, case.out))
    again = group.add(Case(_id(CASES[AGAIN]) + "-again", group.cases[0].args[:-2]))
    run_group(group, timeout=180 + 60 * len(group.cases))
    checks = [(_id(c), _check_emulated, ref, got, *c[:4], c[4]) for c, ref, got in runs]
    checks.append(("one-process", _check_one_process, runs[1][2], refs))
    checks.append(("fold", same_bits, runs[0][2], again.out))
    run_checks(checks)


def _check_emulated(ref, got, model, face, stage, extra, rdt) -> None:
    """test_fp8_sharded_matches_emulated_ranks: losses and weights against the emulated ranks, the fp8 layers,
    their views, bytes per step, the per-rank scaling state and the resume round trip."""
    (la, wa), (lb, wb) = _results(ref), _results(got)
    tol = _TOL[rdt]
    assert len(la) == len(lb) == 5
    for i, (x, y) in enumerate(zip(la, lb)):
        assert abs(x - y) <= tol * max(1.0, abs(x)), f"step {i}: emulated {x} vs sharded {y} (tol {tol})"
    assert _max_diff(wa, wb) <= tol, f"weights differ by {_max_diff(wa, wb)} (tol {tol})"

    stats = [json.loads((got / f"stats{r}.json").read_text()) for r in range(2)]
    for r, s in enumerate(stats):
        # every nn.Linear became FP8Linear (the tied lm_head too); its weight and bias: bf16 views of the unit buffers
        expected = LLAMA_LINEARS if model == "llama" else [f"{i}.0" for i in range(24)]
        assert s["fp8_layers"] == sorted(expected), (r, s["fp8_layers"])
        for name, (dtype, *views) in s["fp8_views"].items():
            assert dtype == "torch.bfloat16" and views and all(views), (r, name, dtype, views)
        # bytes per optimizer step: all-gathers of the bf16 compute copy (twice under stage 3: forward and
        # backward), one reduce-scatter in the reduce dtype
        psi, rsize = s["padded"], 4 if rdt == "fp32" else 2
        assert s["reduce_dtype"] == ("torch.float32" if rdt == "fp32" else "torch.bfloat16")
        gathers = 2 if stage == 3 else 1
        assert s["bytes_per_step"] == [(2 * gathers + rsize) * psi] * 4, (s["bytes_per_step"], psi)
    # scaling state: per rank (each rank quantises its own activations and gradients, as torch's float8 and our
    # DDP do). The weight is the same full tensor on every rank, so its amax history is the same.
    h0, h1 = stats[0]["fp8_history"], stats[1]["fp8_history"]
    assert h0.keys() == h1.keys()
    delayed = "delayed" in " ".join(extra)
    for name in h0:
        x0, w0, g0 = h0[name]
        assert w0 == h1[name][1], (name, w0, h1[name][1])
        if delayed:
            length = int(extra[extra.index("--fp8_recipe") + 1].split(":")[2])
            assert len(x0) == len(w0) == len(g0) == length, (name, h0[name])
        else:
            assert x0 == w0 == g0 == [], (name, h0[name])  # current scaling keeps no history
    if delayed:  # the input amax is each rank's own (different data on each rank)
        assert any(h0[n][0] != h1[n][0] for n in h0), "every input amax history is the same on both ranks"
    if "--resume_check" in extra:
        for r in range(2):
            rec = json.loads((got / f"resume{r}.json").read_text())
            assert rec["losses"][0] == rec["losses"][1] and rec["same_weights"] and rec["same_fp8"], (r, rec)


def _check_one_process(got, refs: dict) -> None:
    """The reference the user knows: the same script on ONE process with mixed_precision="fp8" (fp32 weights, the
    whole global batch). Under FSDP/DeepSpeed, fp8 also means a bf16 compute copy (HF: FSDP's / DeepSpeed's bf16
    policy under fp8), so the sharded run's distance from the fp32 run is bounded by what each adds on its own:
    fp8 on one process (--one_process --fp8 vs --one_process) plus the bf16 copy alone (--emulate 2 --bf16 vs
    fp32). Weights (a max over 17k elements) get a factor 1.5 for errors that do not add up exactly; losses are
    single numbers whose fp8 rounding errors have random sign (one-process fp8: 2.4e-5 at step 0, 7.7e-4 at step
    1), so the max over 5 steps is a noisy scale: factor 3 (measured: 1.7x). fp8 must have changed the run."""
    one, fp32, bf16 = refs["one"], refs["fp32"], refs["bf16"]
    (l8, w8), (l32, w32), (lb, wb), (ls, ws) = _results(one), _results(fp32), _results(bf16), _results(got)

    def dist(la: list, wa: dict) -> tuple:
        return max(abs(a - b) for a, b in zip(la, l32)), _max_diff(wa, w32)

    fp8_l, fp8_w = dist(l8, w8)
    bf_l, bf_w = dist(lb, wb)
    shard_l, shard_w = dist(ls, ws)
    assert fp8_w > 1e-4 and fp8_l > 1e-5, "one-process fp8 did not change the run: nothing was quantised"
    assert shard_w <= 1.5 * (fp8_w + bf_w), ("weights", shard_w, fp8_w, bf_w)
    assert shard_l <= 3 * (fp8_l + bf_l), ("losses", shard_l, fp8_l, bf_l, ls, l8, lb, l32)


def test_fp8_recompute_replays_the_forward_scales():
    """One process: a checkpointed block of FP8Linear layers under delayed scaling gives the gradients and amax
    histories of the same block run without checkpointing (without the context_fn the recomputation quantises with
    the scale the forward just recorded, and records every amax twice)."""
    from torch.utils.checkpoint import checkpoint
    from accelerate_c.precision.fp8 import FP8Config, FP8Linear, convert_to_fp8, recompute_context_fn
    cfg = FP8Config(fp8_format="HYBRID", use_delayed_scaling=True, amax_history_len=4)

    def block():
        torch.manual_seed(0)
        return convert_to_fp8(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)), cfg)

    plain, ckpt = block(), block()
    assert isinstance(plain[0], FP8Linear) and isinstance(plain[0], torch.nn.Linear)
    assert recompute_context_fn(torch.nn.Tanh()) is None
    fn = recompute_context_fn(ckpt)
    for step in range(3):
        x = torch.randn(8, 16) * (step + 1)
        plain(x).square().sum().backward()
        checkpoint(ckpt, x, use_reentrant=False, context_fn=fn).square().sum().backward()
    for a, b in zip(plain.parameters(), ckpt.parameters()):
        assert torch.equal(a.grad, b.grad)
    for i in (0, 2):
        for st in ("x_state", "w_state", "g_state"):
            assert getattr(plain[i], st).history == getattr(ckpt[i], st).history, (i, st)
        assert len(plain[i].x_state.history) == 3
