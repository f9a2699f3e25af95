# tests/test_join.py: Accelerator.join_uneven_inputs on CPU processes (HF runs it on GPUs only): ranks that train
# different numbers of steps end with the weights and buffers of torch DDP's Join rules, computed without any
# communication by tests/scripts/join_train.py --emulate (rank 0 finishing first included: buffers then come from
# the highest active rank); gradient accumulation and the host-split optimizer step (suspended for the context)
# on the shared-memory path, and the reference path; a rank running out mid-accumulation (its unsynced micro-batches
# dropped, as torch's joined rank contributes zeros: join_train.py --drop_unsynced; HF 1.15 + torch DDP's Join gives
# those weights) and the prepared-DataLoader path where a rank wants to sync alone at its own last batch (torch DDP's
# Join fails there with a mismatched collective; here the sync is deferred to the others' next step and those
# micro-batches count: ddp_join.py SyncAgreement), with clipping and a scheduler. Mid-accumulation runs are also
# checked against HF Accelerate itself on torch DDP's Join (join_train.py --hf). Also the single-process no-op.
import json

import pytest
import torch
from safetensors.torch import load_file


@pytest.mark.parametrize("steps,ga,grad_sync,extra", [
    pytest.param("3,5", 1, "bucketed", [], id="2ranks"),
    pytest.param("6,2,4", 2, "bucketed", [], id="3ranks-accum"),   # rank 0 done first, rank 1 earlier still
    pytest.param("4,6", 2, "reference", [], id="accum-reference"),
    # (a rank running out mid-accumulation, its unsynced micro-batch dropped: test_midaccumulation_join_matches_hf)
    # the prepared DataLoader (even_batches=False): HF's accumulate syncs at a rank's own last batch, a count that is
    # not a multiple of grad_accum, while the others still accumulate (the lone sync is deferred: SyncAgreement)
    pytest.param("4,3", 2, "bucketed", ["--loader"], id="loader-lonesync"),
    pytest.param("4,4,3", 2, "reference", ["--loader"], id="loader-3ranks-lonesync-reference"),
    pytest.param("5,4", 3, "bucketed", ["--loader", "--clip", "0.3", "--sched"], id="loader-lonesync-clip-sched"),
])
def test_uneven_inputs_join_like_torch_ddp(tmp_path, run, steps, ga, grad_sync, extra):
    args = ["--steps_per_rank", steps, "--grad_accum", str(ga)] + extra
    run("join_train.py", args + ["--emulate", "--drop_unsynced", "--out", str(tmp_path / "ref")], nproc=1)
    nproc = len(steps.split(","))
    run("join_train.py", args + ["--out", str(tmp_path / "got")], nproc=nproc, launcher="accelerate_c",
        env={"ACCELERATE_C_GRAD_SYNC": grad_sync})
    for r in range(nproc):
        a, b = load_file(str(tmp_path / "ref" / f"state{r}.safetensors")), load_file(str(tmp_path / "got" / f"state{r}.safetensors"))
        assert a.keys() == b.keys()
        for k in a:
            assert torch.allclose(a[k].double(), b[k].double(), atol=1e-5, rtol=0), (r, k, (a[k] - b[k]).abs().max())
        la = json.loads((tmp_path / "ref" / f"losses{r}.json").read_text())
        lb = json.loads((tmp_path / "got" / f"losses{r}.json").read_text())
        assert len(la) == len(lb) == int(steps.split(",")[r])
        assert all(abs(x - y) <= 1e-5 * max(1.0, abs(x)) for x, y in zip(la, lb)), (r, la, lb)


@pytest.mark.parametrize("steps", ["3,6", "5,2,3"], ids=["2ranks", "3ranks"])
def test_midaccumulation_join_matches_hf_on_torch_ddp(tmp_path, run, steps):
    """Ranks running out mid-accumulation (no DataLoader): the weights HF Accelerate 1.15 gets from torch DDP's Join
    on the same loop (their unsynced micro-batches are dropped)."""
    args = ["--steps_per_rank", steps, "--grad_accum", "2"]
    nproc = len(steps.split(","))
    run("join_train.py", args + ["--hf", "--out", str(tmp_path / "hf")], nproc=nproc, launcher="torchrun")
    run("join_train.py", args + ["--out", str(tmp_path / "got")], nproc=nproc, launcher="accelerate_c")
    for r in range(nproc):
        a, b = load_file(str(tmp_path / "hf" / f"state{r}.safetensors")), load_file(str(tmp_path / "got" / f"state{r}.safetensors"))
        assert a.keys() == b.keys()
        for k in a:
            assert torch.allclose(a[k].double(), b[k].double(), atol=1e-5, rtol=0), (r, k, (a[k] - b[k]).abs().max())


def test_single_process_join_is_a_no_op():
    from accelerate_c import Accelerator
    acc = Accelerator(cpu=True)
    model = acc.prepare(torch.nn.Linear(2, 2))
    with acc.join_uneven_inputs([model], even_batches=False):
        model(torch.ones(1, 2)).sum().backward()
    assert model.weight.grad is not None
