# tests/test_sharded_shardc.py: the sharded engine's mixed-precision dtypes on real gloo processes against the
# single-process loop (tests/scripts/sharded_train.py --emulate N; under bf16 the same bf16 compute copies, gradients
# summed in fp32): reduce_dtype float32 under param_dtype bf16 (FSDP2's MixedPrecisionPolicy(param_dtype=bf16,
# reduce_dtype=fp32); the DeepSpeed face through the config field) on stages 1-3; fp32 parameters reduced in bf16
# (MixedPrecisionPolicy(reduce_dtype=bf16): the shard gradient kept in bf16, cast for the step); FSDP1's buffer_dtype
# on a BatchNorm model whose BatchNorm computes in bf16 (--bn_low: _module_classes_to_ignore=()): buffers live in
# bf16, the full state dict gives them back in fp32. Within the existing bf16
# tolerances (2e-3; optimizer state 1e-3); the bytes counted per step show which dtype each collective moved (the
# reduce-scatter in the reduce dtype, the all-gather in the compute dtype). And the C paths (pack kernel, fused step
# writing the compute copy) against the torch copies + separate cast (ACCELERATE_C_SHARD_KERNELS=0) on the same
# run: losses and weights bit for bit.
# The distributed runs of one process count are cases of one launch (the C-path runs set ACCELERATE_C_SHARD_KERNELS
# per case: read at every call), the references one process (tests/fold.py).
# Not for: the kernels alone (tests/test_shard_kernels.py) or same-dtype runs (tests/test_sharded_engine.py).
import json

import pytest
from safetensors.torch import load_file

from fold import Case, Group, run_checks, run_group
from test_sharded_engine import _assemble, _close

CASES = [  # model, face, stage, nproc, extra args
    ("mlp", "ds", 1, 2, ["--wrap", "size", "--bf16", "--reduce_fp32", "--grad_accum", "2"]),
    ("mlp", "fsdp", 2, 2, ["--wrap", "size", "--bf16", "--reduce_fp32", "--grad_accum", "2", "--clip", "0.5"]),
    ("mlp", "fsdp", 3, 3, ["--wrap", "size", "--bf16", "--reduce_fp32", "--grad_accum", "2"]),
    ("mlp", "fsdp", 2, 2, ["--wrap", "size", "--reduce_bf16", "--grad_accum", "2"]),
    ("bnmp", "fsdp", 2, 2, ["--bf16", "--bn_low", "--buffer_bf16", "--reduce_fp32", "--optim", "sgd"]),
    ("bnmp", "fsdp", 3, 2, ["--bf16", "--bn_low", "--buffer_bf16", "--reduce_fp32", "--grad_accum", "2"]),
]


def _id(case: tuple) -> str:
    flags = "".join(f"-{a[2:]}" for a in case[4] if a in ("--reduce_fp32", "--reduce_bf16", "--buffer_bf16"))
    return f"{case[0]}-{case[1]}-z{case[2]}-n{case[3]}{flags}"


def _args(model, nproc, extra):
    return ["--model", model, "--global_batch", str(4 * nproc)] + extra


C_PATHS = [(3, ["--wrap", "size", "--reduce_fp32", "--grad_accum", "2"]), (1, ["--wrap", "size", "--optim", "sgd"])]


@pytest.mark.parametrize("nproc", [2, 3], ids=["n2", "n3"])
def test_shardc_on_ranks(tmp_path, nproc):
    """One launch per process count: test_mixed_dtypes_train_like_one_process's CASES and, on 2 processes,
    test_c_paths_equal_torch_copies_bitwise's runs (each stage with the C paths and without), failures named."""
    group, checks = Group(tmp_path, nproc), []
    for c in [c for c in CASES if c[3] == nproc]:
        model, face, stage, _, extra = c
        args = _args(model, nproc, extra)
        case = group.add(Case(_id(c), args + ["--face", face, "--stage", str(stage)]))
        checks.append((case.name, _check_mixed, group.ref(args + ["--emulate", str(nproc)]), case.out, model, face,
                       stage, nproc, extra))
    if nproc == 2:
        for stage, extra in C_PATHS:
            face = "ds" if stage == 1 else "fsdp"
            outs = {flag: group.add(Case(f"cpaths-z{stage}-k{flag}", _args("mlp", 2, ["--bf16"] + extra) +
                                         ["--face", face, "--stage", str(stage)],
                                         env={"ACCELERATE_C_SHARD_KERNELS": flag})).out for flag in ("1", "0")}
            checks.append((f"cpaths-z{stage}", _check_c_paths, outs))
    run_group(group, timeout=180 + 60 * len(group.cases))
    run_checks(checks)


def _check_mixed(ref, got, model, face, stage, nproc, extra) -> None:
    """test_mixed_dtypes_train_like_one_process: losses, weights, optimizer state, bytes per step, buffer dtypes."""
    reduce_fp32, reduce_bf16 = "--reduce_fp32" in extra, "--reduce_bf16" in extra
    # the existing bf16 tolerances: the reference's per-rank gradients are of loss / (accumulation * ranks), rounded
    # to bf16 before its fp32 sum, ours of loss / accumulation (averaged in the reduction)
    tol, otol = 2e-3, 1e-3
    la, lb = json.loads((ref / "losses.json").read_text()), json.loads((got / "losses.json").read_text())
    assert len(la) == len(lb) > 0
    for i, (x, y) in enumerate(zip(la, lb)):
        assert abs(x - y) <= tol * max(1.0, abs(x)), f"step {i}: {x} vs {y}"
    ref_w, got_w = load_file(str(ref / "weights.safetensors")), load_file(str(got / "weights.safetensors"))
    _close(ref_w, got_w, tol, "weights")
    shapes = {k: tuple(v.shape) for k, v in got_w.items()}
    pieces, _ = _assemble(got, nproc, shapes)
    _close(load_file(str(ref / "optim.safetensors")), {k: v for k, v in pieces.items() if "/" in k}, otol,
           "optimizer state")
    stats = [json.loads((got / f"stats{r}.json").read_text()) for r in range(nproc)]
    for s in stats:
        assert s["reduce_dtype"] == ("torch.float32" if reduce_fp32 else "torch.bfloat16"), s["reduce_dtype"]
        psi = s["padded"]
        ga = int(extra[extra.index("--grad_accum") + 1]) if "--grad_accum" in extra else 1
        rs = (4 if reduce_fp32 else 2) * psi   # one reduce-scatter of every unit in the reduce dtype
        ag = (4 if reduce_bf16 else 2) * psi   # one all-gather of the compute copy (fp32 under --reduce_bf16)
        expected = {1: rs + ag, 2: rs + ag, 3: rs + 2 * ga * ag}[stage]  # (one reduction per step: no_sync is local)
        assert s["bytes_per_step"] == [expected] * len(s["bytes_per_step"]), (s["bytes_per_step"], expected)
    if "--buffer_bf16" in extra:
        live = stats[0]["buffer_dtypes"]
        assert {k: v for k, v in live.items() if "running" in k} and all(
            v == "torch.bfloat16" for k, v in live.items() if "running" in k), live
        assert all(v == "torch.int64" for k, v in live.items() if "num_batches" in k), live
        for k, v in got_w.items():  # a full state dict holds the buffers in their original dtype, as FSDP1's
            if "running" in k:
                assert str(v.dtype) == "torch.float32", (k, v.dtype)


def _check_c_paths(outs: dict) -> None:
    """test_c_paths_equal_torch_copies_bitwise: the pack kernel and the fused step writing the compute copy against
    the torch copies and the separate master -> compute cast: the same run bit for bit (losses follow the compute
    copy, weights the masters)."""
    la, lb = (json.loads((outs[f] / "losses.json").read_text()) for f in ("1", "0"))
    assert la == lb
    wa, wb = (load_file(str(outs[f] / "weights.safetensors")) for f in ("1", "0"))
    assert wa.keys() == wb.keys()
    for k in wa:
        assert wa[k].dtype == wb[k].dtype and wa[k].view(-1).view(torch_int(wa[k])).equal(
            wb[k].view(-1).view(torch_int(wb[k]))), k


def torch_int(t):
    import torch
    return {4: torch.int32, 2: torch.int16, 8: torch.int64, 1: torch.uint8}[t.element_size()]
