# tests/test_split_step.py: the optimizer step split between the ranks of a host (ddp/split_step.py) gives
# bit for bit what every rank stepping everything gives (ACCELERATE_C_SHARDED_STEP=0): every step's
# parameters, the final parameters on every rank, the optimizer state_dict, skipped fp16 steps; over
# AdamW, Adam+amsgrad with param groups, SGD (nesterov momentum, plain), an optimizer holding a parameter
# outside the model (stepped whole, the rest split), an unused and a frozen parameter, a state reload, a
# step through torch's optimizer, local-SGD steps under no_sync (per-rank gradients, so those steps are
# not split), and an optimizer over the head only (the split and its state cover just those parameters).
# Each process count is one launch: its split and unsplit runs of every precision are cases of it
# (tests/scripts/fold_cases.py).
# Not for: N processes vs one process (test_parity.py covers that with the split step on).
import os

import pytest
import torch
from bitwise import same
from fold import Case, check_each, run_folded

CONFIGS = ["adamw", "adam_amsgrad_groups", "sgd_nesterov", "sgd", "adamw_outside_param", "adamw_local_sgd",
           "adamw_head_only"]


# nproc -> {precision: the optimizer set-ups run split and unsplit}
GROUPS = {2: {"no": CONFIGS, "fp16": ["adamw", "sgd_nesterov"]},
          3: {"no": ["adamw", "sgd_nesterov", "adamw_local_sgd"]}}


def _load(out, name, rank):
    return torch.load(os.path.join(out, f"{name}.rank{rank}.pt"), weights_only=False)


@pytest.mark.parametrize("nproc", sorted(GROUPS))
def test_split_step_equals_unsplit(tmp_path, nproc):
    """Every precision's split and unsplit runs of one process count in one launch (tests/scripts/fold_cases.py)."""
    cases = []
    for precision, configs in GROUPS[nproc].items():
        args = ["--precision", precision, "--configs", ",".join(configs)]
        cases.append(Case(f"{precision}_split", args))
        cases.append(Case(f"{precision}_whole", args, env={"ACCELERATE_C_SHARDED_STEP": "0"}))
    outs = run_folded("split_step.py", cases, tmp_path, nproc=nproc, launcher="accelerate_c")

    def check(precision):
        split, whole = outs[f"{precision}_split"], outs[f"{precision}_whole"]
        for name in GROUPS[nproc][precision]:
            for r in range(nproc):
                ref = _load(whole, name, r)  # ranks differ only under local SGD
                assert not ref["sharded"]
                got = _load(split, name, r)
                assert got["sharded"], name
                if name == "adamw_head_only":  # state slots and split cover the head's 29 x 5 + 5 params only
                    assert got["split_numel"] == 150, got["split_numel"]
                same(got["sums"], ref["sums"], f"{name} rank {r} per-step sums")
                same(got["params"], ref["params"], f"{name} rank {r} params")
                same(got["skipped"], ref["skipped"], f"{name} rank {r} skipped steps")
            ref = _load(whole, name, 0)
            same(_load(split, name, 0)["optimizer"], ref["optimizer"], f"{name} optimizer state_dict")
            if precision == "fp16":
                assert any(ref["skipped"]) and not all(ref["skipped"]), ref["skipped"]

    check_each(GROUPS[nproc], check)
