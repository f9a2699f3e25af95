# tests/test_split_step.py: the optimizer step split between the ranks of a host (ddp/split_step.py) gives
# bit for bit what every rank stepping everything gives (ACCELERATE_C_SHARDED_STEP=0): every step's
# parameters, the final parameters on every rank, the optimizer state_dict, skipped fp16 steps; over
# AdamW, Adam+amsgrad with param groups, SGD (nesterov momentum, plain), an optimizer holding a parameter
# outside the model (stepped whole, the rest split), an unused and a frozen parameter, a state reload, a
# step through torch's optimizer, local-SGD steps under no_sync (per-rank gradients, so those steps are
# not split), and an optimizer over the head only (the split and its state cover just those parameters).
# Not for: N processes vs one process (test_parity.py covers that with the split step on).
import os

import pytest
import torch
from bitwise import same

CONFIGS = ["adamw", "adam_amsgrad_groups", "sgd_nesterov", "sgd", "adamw_outside_param", "adamw_local_sgd",
           "adamw_head_only"]


def _load(out, name, rank):
    return torch.load(os.path.join(out, f"{name}.rank{rank}.pt"), weights_only=False)


@pytest.mark.parametrize("nproc,precision,configs", [
    (2, "no", CONFIGS), (3, "no", ["adamw", "sgd_nesterov", "adamw_local_sgd"]), (2, "fp16", ["adamw", "sgd_nesterov"]),
])
def test_split_step_equals_unsplit(tmp_path, run, nproc, precision, configs):
    args = ["--precision", precision, "--configs", ",".join(configs)]
    run("split_step.py", args + ["--out", str(tmp_path / "split")], nproc=nproc, launcher="accelerate_c")
    run("split_step.py", args + ["--out", str(tmp_path / "whole")], nproc=nproc, launcher="accelerate_c",
        env={"ACCELERATE_C_SHARDED_STEP": "0"})
    for name in configs:
        for r in range(nproc):
            ref = _load(tmp_path / "whole", name, r)  # ranks differ only under local SGD
            assert not ref["sharded"]
            got = _load(tmp_path / "split", name, r)
            assert got["sharded"], name
            if name == "adamw_head_only":  # state slots and split cover the head's 29 x 5 + 5 params only
                assert got["split_numel"] == 150, got["split_numel"]
            same(got["sums"], ref["sums"], f"{name} rank {r} per-step sums")
            same(got["params"], ref["params"], f"{name} rank {r} params")
            same(got["skipped"], ref["skipped"], f"{name} rank {r} skipped steps")
        ref = _load(tmp_path / "whole", name, 0)
        same(_load(tmp_path / "split", name, 0)["optimizer"], ref["optimizer"], f"{name} optimizer state_dict")
        if precision == "fp16":
            assert any(ref["skipped"]) and not all(ref["skipped"]), ref["skipped"]

