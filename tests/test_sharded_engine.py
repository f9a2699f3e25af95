# tests/test_sharded_engine.py: the sharded engine (ZeRO 1/2/3 through DeepSpeedPlugin and FSDP plugin faces) on
# real gloo processes against the single-process loop on the same global batch (tests/scripts/sharded_train.py
# --emulate N): losses and final weights within 1e-5, on 2 and 3 processes, with gradient accumulation, clipping
# (accelerator.clip_grad_norm_ and DeepSpeed's gradient_clipping), an unused and a never-used parameter, BatchNorm
# buffers, a tiny transformers GPT-2 (tied weights, a frozen embedding), an ignored module, a bf16 compute copy
# (param_dtype) against a reference with the same bf16 copies (2e-3), activation checkpointing per unit, two
# optimizers over one model (each zero_grad zeroes only its own gradients). Each run also checks
# that the model_slices / optimizer_layout of every rank put together give back exactly the gathered weights and
# the reference's optimizer state, that the bytes counted per step equal 2Ψ (Z1/Z2) or 3Ψ (Z3) (stage 3 gathers
# per micro-batch, every stage reduces once per step: no_sync accumulates locally) as
# stated in docs/sharding.md, and on a many-unit model that the measured per-rank model-state bytes are within 5 %
# of the ZeRO formulas.
# NO_SHARD (stage 0) is our DDP: its run checks only losses and weights. The last "loss" is an eval-mode loss
# under no_grad after training.
# The cases of one process count run in one launch one after another (tests/fold.py, scripts/sharded_cases.py), their
# references in one process beside it; one case runs first and again last in its launch and must come out bit for
# bit the same (nothing of a case leaks into the next).
# Not for: the unit/layout arithmetic alone (test_sharded_units.py).
import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import free_port
from fold import Case, Group, launch_cmd, run_checks, run_group


def _close(a, b, tol, what, wider=None):
    """Every tensor of a within tol of b's (wider: {name: a larger tolerance} for named tensors)."""
    assert a.keys() == b.keys(), (what, sorted(set(a) ^ set(b)))
    for k in a:
        diff = (a[k].float() - b[k].float()).abs().max().item() if a[k].numel() else 0.0
        assert diff <= (wider or {}).get(k, tol), f"{what}: {k} differs by {diff}"


def _assemble(got, nproc, shapes):
    """Logical tensors put together from every rank's slices ("<name>@<start>" 1-D pieces)."""
    out, filled = {}, {}
    for r in range(nproc):
        for key, piece in load_file(str(got / f"slices{r}.safetensors")).items():
            name, start = key.rsplit("@", 1)
            shape = shapes[name.split("/")[0]]
            t = out.setdefault(name, torch.full((int(torch.Size(shape).numel()),), float("nan")))
            s = int(start)
            assert torch.isnan(t[s:s + piece.numel()]).all(), f"{key}: two ranks wrote the same elements"
            t[s:s + piece.numel()] = piece
            filled[name] = filled.get(name, 0) + piece.numel()
    return {k: v.view(shapes[k.split("/")[0]]) for k, v in out.items()}, filled


CASES = [  # model, face, stage, nproc, extra args
    ("bn", "fsdp", 0, 2, ["--optim", "sgd", "--grad_accum", "2", "--clip", "0.5"]),
    ("bn", "ds", 1, 2, ["--optim", "sgd", "--grad_accum", "2", "--clip", "0.5"]),
    ("bn", "ds", 2, 3, ["--optim", "sgd", "--ds_clip", "0.5", "--ignore", "head"]),
    ("bn", "fsdp", 3, 2, ["--optim", "sgd", "--grad_accum", "2", "--clip", "0.5", "--two_opt"]),
    ("bn", "ds", 2, 2, ["--optim", "sgd", "--two_opt"]),
    ("gpt2", "ds", 1, 2, ["--wrap", "layer", "--clip", "1.0"]),
    ("gpt2", "fsdp", 3, 3, ["--wrap", "layer", "--grad_accum", "2", "--ac"]),
    ("mlp", "ds", 1, 2, ["--wrap", "size"]),
    ("mlp", "fsdp", 2, 2, ["--wrap", "size"]),
    ("mlp", "ds", 3, 2, ["--wrap", "size", "--gather16"]),
    ("mlp", "fsdp", 3, 2, ["--wrap", "size", "--no_reshard"]),
    ("mlp", "ds", 1, 2, ["--wrap", "size", "--bf16"]),
    ("mlp", "fsdp", 3, 2, ["--wrap", "size", "--bf16", "--grad_accum", "2"]),
]


TINY_WINDOWS = {"ACCELERATE_C_SHARD_STAGING_MB": "0.001"}
WINDOWED = {"bn-ds-z2-n3", "gpt2-fsdp-z3-n3-ac", "mlp-fsdp-z3-n2-bf16"}
# the fold's proof: this case runs first in its launch (nothing ran before it in the processes) and again last
# (after every other case, with and without staging windows); both runs must agree bit for bit
AGAIN = "mlp-fsdp-z3-n2-bf16"


def _id(case: tuple) -> str:
    flags = "".join(f"-{a[2:]}" for a in case[4] if a in ("--bf16", "--no_reshard", "--two_opt", "--ac"))
    return f"{case[0]}-{case[1]}-z{case[2]}-n{case[3]}{flags}"


def add_case(group: Group, name: str, model: str, face: str, stage: int, extra: list, ref_args, env=None) -> tuple:
    """One case of a group: the distributed run and its reference (ref_args(args): the reference's arguments);
    returns what check_cases needs."""
    args = ["--model", model, "--global_batch", str(4 * group.nproc)] + extra
    ref = group.ref(ref_args(args) + ["--emulate", str(group.nproc)])
    case = group.add(Case(name, args + ["--face", face, "--stage", str(stage)], env=dict(env or {})))
    return (name, ref, case.out, model, stage, group.nproc, extra)


def check_cases(checks: list, check=None) -> None:
    """Every case checked (`check`: _check's signature), each failure named by its case; fails if any did."""
    run_checks([(c[0], check or _check, *c[1:]) for c in checks])


def same_bits(a, b) -> None:
    """Two runs' losses, weights, per-rank slices and stats are identical (a case alone and folded after others)."""
    assert json.loads((a / "losses.json").read_text()) == json.loads((b / "losses.json").read_text())
    for f in sorted(p.name for p in a.iterdir() if p.suffix in (".safetensors", ".json")):
        if f.endswith(".safetensors"):
            x, y = load_file(str(a / f)), load_file(str(b / f))
            assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), f
        elif not f.startswith("statedict"):  # (its "peak" counts allocations, not results)
            assert json.loads((a / f).read_text()) == json.loads((b / f).read_text()), f


GROUPS = {n: [c for c in CASES if c[3] == n] for n in (2, 3)}


@pytest.mark.parametrize("nproc", sorted(GROUPS), ids=[f"n{n}" for n in sorted(GROUPS)])
def test_stage_trains_like_one_process(tmp_path, nproc):
    """Every case of one process count in one launch (some with staging windows of ~1 KiB: every unit is
    reduce-scattered in many pieces, placement.py), each against its reference."""
    group = Group(tmp_path, nproc)
    cases = sorted(GROUPS[nproc], key=lambda c: _id(c) != AGAIN)  # AGAIN first
    checks = [add_case(group, _id(c), *c[:3], c[4], _ref_args, TINY_WINDOWS if _id(c) in WINDOWED else None)
              for c in cases]
    again = [c for c in cases if _id(c) == AGAIN]
    if again:
        checks.append(add_case(group, AGAIN + "-again", *again[0][:3], again[0][4], _ref_args, TINY_WINDOWS))
    run_group(group, timeout=120 + 60 * len(cases))
    check_cases(checks)
    if again:
        same_bits(group.root / "got" / AGAIN, group.root / "got" / (AGAIN + "-again"))


def _ref_args(args: list) -> list:
    """The one-process reference's arguments: without the flags that change how, not what, is computed; a sharded
    construction's reference builds on meta and initialises as rank 0 does (the same for both modes)."""
    out = [a for a in args if a not in ("--ignore", "head", "--ac", "--no_reshard", "--hybrid", "--gather16",
                                        "--seed_per_rank", "--construct_flag")]
    if "--meta" in out:
        out[out.index("--meta") + 1] = "all"
    return out


HYBRID = [["--wrap", "layer", "--grad_accum", "2", "--hybrid"],
          # sharded construction (world rank 0 holds the real model, the other host's ranks a meta one) and a bf16
          # compute copy reduced in fp32 (FSDP2's MixedPrecisionPolicy) across both levels of the hierarchy
          ["--wrap", "layer", "--grad_accum", "2", "--hybrid", "--meta", "rank0_real", "--construct_flag", "--bf16",
           "--reduce_fp32"]]


def test_hybrid_shard_across_hosts(tmp_path):
    """HYBRID_SHARD on two "machines" (two launchers on loopback, 2 ranks each): sharded within a host over shared
    memory, each shard gradient averaged across the hosts; every host holds all shards, the first writes them.
    Both cases (fp32; construct-bf16-reduce_fp32, with staging windows as above) in one pair of launches."""
    group = Group(tmp_path, 4)
    checks = []
    for name, extra in zip(("fp32", "construct-bf16-reduce_fp32"), HYBRID):
        args = ["--model", "gpt2", "--global_batch", "16"] + extra
        ref = group.ref(_ref_args(args) + ["--emulate", "4"])
        case = group.add(Case(name, args + ["--face", "fsdp", "--stage", "3"],
                              env=TINY_WINDOWS if "--bf16" in extra else {}))
        checks.append((name, ref, case.out, "gpt2", 3, 4, extra))
    port, cases = str(free_port()), tmp_path / "cases.json"
    launches = [(f"machine{m}", launch_cmd(4, cases, "-q", "--cpu", "--num_machines", "2", "--machine_rank", m,
                                           "--main_process_ip", "127.0.0.1", "--main_process_port", port))
                for m in ("0", "1")]
    run_group(group, timeout=300, env={"ACCELERATE_C_RDZV_TIMEOUT": "60"}, launches=launches)
    check_cases(checks, lambda *a: _check(*a, shard_ranks=2))


def _check_get_state_dict(got, nproc, nkeys):
    """accelerator.get_state_dict by HF 1.15's rules (statedict<r>.json of sharded_train.py): FSDP face: the fp32
    dict on rank 0, {} elsewhere; DeepSpeed ZeRO-3: on rank 0, None elsewhere, and HF's ValueError without
    stage3_gather_16bit_weights_on_model_save; ZeRO 1/2: on every rank in the engine's dtype. Rank 0's dict is the
    fp32 weights cast to that dtype; a rank that does not keep the dict allocates at most one unit while gathering."""
    for r in range(nproc):
        rec = json.loads((got / f"statedict{r}.json").read_text())
        ds, z3 = rec["face"] == "ds", rec["stage"] == 3
        if ds and z3 and not rec["gather16"]:
            assert "stage3_gather_16bit_weights_on_model_save" in (rec["error"] or ""), rec
            continue
        assert rec["error"] is None, rec
        keeps = r == 0 or (ds and not z3)
        if not keeps:
            assert rec["kind"] == ("none" if ds else "dict") and rec["keys"] == 0, rec
            assert rec["peak"] <= rec["unit_bytes"], rec  # before: the whole model (padded_bytes) on every rank
            continue
        assert rec["kind"] == "dict" and rec["keys"] == nkeys and rec["devices"] == ["cpu"], rec
        assert len(rec["dtypes"]) == 1 and (rec["dtypes"][0] == "torch.float32" or ds), rec
        if r == 0:
            assert rec["equal"], rec


def _check(ref, got, model, stage, nproc, extra, shard_ranks=None, otol=None, wider=None):
    bf16 = "--bf16" in extra
    tol = 2e-3 if bf16 else 1e-5  # bf16: gradients reduced in bf16 against the reference's fp32 sums
    la, lb = json.loads((ref / "losses.json").read_text()), json.loads((got / "losses.json").read_text())
    assert len(la) == len(lb) > 0
    for i, (x, y) in enumerate(zip(la, lb)):
        assert abs(x - y) <= tol * max(1.0, abs(x)), f"step {i}: {x} vs {y}"
    ref_w, got_w = load_file(str(ref / "weights.safetensors")), load_file(str(got / "weights.safetensors"))
    _close(ref_w, got_w, tol, "weights", wider)

    _check_get_state_dict(got, nproc, len(got_w))
    if stage == 0:
        return
    # the checkpoint contract: every rank's slices put together are the logical tensors, exactly
    shapes = {k: tuple(v.shape) for k, v in got_w.items()}
    pieces, filled = _assemble(got, nproc, shapes)
    for name, t in pieces.items():
        if "/" not in name and not (model == "bn" and ("running_" in name or "num_batches" in name)):
            # (BatchNorm statistics are per rank between forwards: the gathered file holds rank 0's)
            assert filled[name] == t.numel(), f"{name}: slices cover {filled[name]} of {t.numel()} elements"
            assert torch.equal(t, got_w[name].to(t.dtype)), f"model_slices of {name} differ from the gathered weights"
    ref_opt = load_file(str(ref / "optim.safetensors"))
    opt_pieces = {k: v for k, v in pieces.items() if "/" in k}
    assert set(opt_pieces) == set(ref_opt), sorted(set(opt_pieces) ^ set(ref_opt))
    _close(ref_opt, opt_pieces, otol or (1e-3 if bf16 else 1e-5), "optimizer state by optimizer_layout")

    stats = [json.loads((got / f"stats{r}.json").read_text()) for r in range(nproc)]
    psi = stats[0]["padded"]  # padded trainable elements
    ga = int(extra[extra.index("--grad_accum") + 1]) if "--grad_accum" in extra else 1
    esize = 2 if bf16 else 4  # the all-gathers move the compute dtype, the reductions the reduce dtype
    resize = 4 if "--reduce_fp32" in extra else esize
    for s in stats:  # counted bytes: one reduction per optimizer step (no_sync accumulates locally, every stage),
        if "--two_opt" not in extra:  # stage 3 gathers twice every micro-batch (per optimizer step: two optimizers
            # split the window); stage 3 kept gathered from forward to backward (--no_reshard): one gather per
            # micro-batch, else two
            gathers = (ga if "--no_reshard" in extra else 2 * ga) if stage == 3 else 1
            expected = (gathers * esize + resize) * psi
            if shard_ranks:  # HYBRID_SHARD: plus each reduced shard all-reduced across the hosts
                expected += resize * psi // shard_ranks
            assert s["bytes_per_step"] == [expected] * len(s["bytes_per_step"]), (s["bytes_per_step"], expected)
        if model != "mlp" or "--no_reshard" in extra:  # (all units gathered at once between forward and backward)
            continue
        # the ZeRO formulas, on a model of 24 equal units (Z3: plus one unit)
        unit = esize * s["max_unit_padded"]
        formula = ({1: 4 * psi + 12 * psi / nproc, 2: 2 * psi + 14 * psi / nproc, 3: 16 * psi / nproc + unit}
                   if bf16 else
                   {1: 8 * psi + 8 * psi / nproc, 2: 4 * psi + 12 * psi / nproc, 3: 16 * psi / nproc + unit})[stage]
        assert abs(s["model_state_bytes"] - formula) <= 0.05 * formula, (stage, s["model_state_bytes"], formula)
