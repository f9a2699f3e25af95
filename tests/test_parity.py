# tests/test_parity.py: N-process training equals single-process training with the same global batch
# (per-step loss and final weights within 1e-6, >= 10 steps, with and without accumulation, an unused
# parameter, on both gradient-sync paths), and accelerate_c equals HF Accelerate 1.15 on the same script and
# seed, on 1 and 2 processes (torchrun for both), with LocalSGD, with DDP's fp16 and PowerSGD comm hooks too (PowerSGD compressing
# from its third step; batched, with the fp16 wrapper, in its uncompressed phase only: torch 2.13's batched hook
# fails an assertion once it compresses, under HF too); the bf16 hook reduces alike on both sync paths;
# PowerSGD on the reference sync path is a clear error.
# Each launch group (script, nproc, launcher, impl) runs its configurations in one launch
# (tests/scripts/fold_cases.py); test_two_processes also runs one case alone and must get the same bits as
# that case folded after the others (no state leaks from one case into the next).
# Not for: unit behaviour (test_accelerator.py).
import json
import os

import torch
from safetensors.torch import load_file

from conftest import run_script
from fold import Case, check_each, run_folded

NO_SCHED = ("--no_scheduler",)
# nproc-vs-one-process configurations: (global batch, grad accum, extra args); keyed by the reference's name
REF = {"gb8_ga2": ("--global_batch", 8, "--grad_accum", 2, *NO_SCHED),
       "gb8_ga1_unused_sgd": ("--global_batch", 8, "--grad_accum", 1, *NO_SCHED, "--unused_param",
                              "--optimizer", "sgd"),
       "gb12_ga2_unused": ("--global_batch", 12, "--grad_accum", 2, *NO_SCHED, "--unused_param")}
# ours-vs-HF configurations: (grad accum, shuffle; LocalSGD averaging every 3 steps, inside accumulation)
HF_ARGS = {"ga1_shuffle": ("--grad_accum", 1, "--shuffle"), "ga2": ("--grad_accum", 2),
           "local_sgd3": ("--grad_accum", 2, "--local_sgd", 3)}
FP16 = ("--comm_hook", "fp16", "--grad_accum", 2)
BF16 = ("--comm_hook", "bf16", "--grad_accum", 2)
PLAIN = ("--grad_accum", 2)
_PSGD_STATE = '{"matrix_approximation_rank": 1, "start_powerSGD_iter": 3}'
PSGD = {"power_sgd": ("--comm_hook", "power_sgd", "--comm_state", _PSGD_STATE, "--grad_accum", 2),
        "batched_power_sgd_fp16": ("--comm_hook", "batched_power_sgd", "--comm_wrapper", "fp16", "--grad_accum", 2)}


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


def _bitwise(a, b):
    (la, wa), (lb, wb) = a, b
    assert la == lb, f"losses {la} vs {lb}"
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def _sync(name):
    return {"ACCELERATE_C_GRAD_SYNC": name}


def test_two_processes(tmp_path):
    """2 processes under our launcher vs one process (both sync paths), the comm hooks (fp16 and PowerSGD as HF, bf16
    on both paths, none equals the plain run), PowerSGD refused on the reference path; HF vs ours under torchrun;
    one case alone = folded."""
    refs = run_folded("parity_train.py", [Case(k, REF[k]) for k in ("gb8_ga2", "gb8_ga1_unused_sgd")], tmp_path / "ref")
    ours = run_folded("parity_train.py", [
        Case("gb8_ga2_bucketed", REF["gb8_ga2"], env=_sync("bucketed")),
        Case("gb8_ga2_reference", REF["gb8_ga2"], env=_sync("reference")),
        Case("power_sgd_reference", PSGD["power_sgd"], env=_sync("reference"), expect_error=True),
        *(Case(k, a) for k, a in PSGD.items()),
        Case("gb8_ga1_unused_sgd_bucketed", REF["gb8_ga1_unused_sgd"], env=_sync("bucketed")),
        Case("fp16_bucketed", FP16, env=_sync("bucketed")),
        Case("bf16_bucketed", BF16, env=_sync("bucketed")),
        Case("bf16_reference", BF16, env=_sync("reference")),
        Case("plain", PLAIN),  # (the default sync path: bucketed)
    ], tmp_path / "ours", nproc=2, launcher="accelerate_c")
    hf = run_folded("parity_train.py", [*(Case(k, [*a, "--impl", "accelerate"]) for k, a in HF_ARGS.items()),
                                        Case("fp16", [*FP16, "--impl", "accelerate"]),
                                        *(Case(k, [*a, "--impl", "accelerate"]) for k, a in PSGD.items())],
                    tmp_path / "hf", nproc=2,
                    launcher="torchrun")
    ours_torchrun = run_folded("parity_train.py", [Case(k, a) for k, a in HF_ARGS.items()], tmp_path / "ours_tr",
                               nproc=2, launcher="torchrun")
    alone = tmp_path / "plain_alone"  # the last case of the fold, run on its own
    run_script("parity_train.py", [*map(str, PLAIN), "--out", str(alone)], nproc=2, launcher="accelerate_c")

    def check(name):
        if name.rsplit("_", 1)[0] in refs:  # <reference>_<sync path>
            _close(_load(refs[name.rsplit("_", 1)[0]]), _load(ours[name]))
        elif name == "power_sgd_reference":
            for r in range(2):
                path = os.path.join(ours[name], f"error{r}.txt")
                assert os.path.exists(path), f"rank {r} did not refuse comm_hook=power_sgd on the reference sync"
                with open(path) as fh:
                    assert "runs on the bucketed gradient sync" in fh.read()
        elif name in PSGD:  # torch's PowerSGD hook on our buckets = on torch DDP's under HF; not the plain run
            _close(_load(hf[name]), _load(ours[name]), tol=1e-5)
            _differs(ours["plain"], ours[name])
        elif name == "fp16":  # reduced in fp16 as torch DDP's fp16_compress_hook under HF; and not the plain run
            _close(_load(hf["fp16"]), _load(ours["fp16_bucketed"]), tol=1e-5)
            _differs(ours["plain"], ours["fp16_bucketed"])
        elif name == "bf16":  # torch's bf16 hook needs NCCL (HF cannot run it on CPU): shm = gloo, not the plain run
            _close(_load(ours["bf16_reference"]), _load(ours["bf16_bucketed"]), tol=1e-6)
            _differs(ours["plain"], ours["bf16_bucketed"])
        elif name in HF_ARGS:
            _close(_load(hf[name]), _load(ours_torchrun[name]), tol=1e-5)
            if name == "local_sgd3":  # the ranks trained apart between averages: not the synchronised run
                _differs(ours_torchrun["ga2"], ours_torchrun[name])
        else:  # "alone"
            _bitwise(_load(alone), _load(ours["plain"]))

    check_each(["gb8_ga2_bucketed", "gb8_ga2_reference", "gb8_ga1_unused_sgd_bucketed", "power_sgd_reference", *PSGD,
                "fp16", "bf16",
                *HF_ARGS, "alone"], check)


def _differs(plain, hooked):
    a, b = _load(plain)[1], _load(hooked)[1]
    assert any(not torch.equal(a[k], b[k]) for k in a), "the hooked run's weights equal the plain run's"


def test_three_processes_equal_one(tmp_path):
    """3 processes (a model with an unused parameter, accumulation) vs one process, on both sync paths."""
    refs = run_folded("parity_train.py", [Case("gb12_ga2_unused", REF["gb12_ga2_unused"])], tmp_path / "ref")
    ours = run_folded("parity_train.py", [Case(s, REF["gb12_ga2_unused"], env=_sync(s)) for s in ("bucketed", "reference")],
                      tmp_path / "ours", nproc=3, launcher="accelerate_c")
    check_each(["bucketed", "reference"], lambda s: _close(_load(refs["gb12_ga2_unused"]), _load(ours[s])))


def test_one_process_same_losses_as_hf_accelerate(tmp_path):
    hf = run_folded("parity_train.py", [Case(k, [*a, "--impl", "accelerate"]) for k, a in HF_ARGS.items()], tmp_path / "hf")
    ours = run_folded("parity_train.py", [Case(k, a) for k, a in HF_ARGS.items()], tmp_path / "ours")
    check_each(HF_ARGS, lambda k: _close(_load(hf[k]), _load(ours[k]), tol=1e-5))
