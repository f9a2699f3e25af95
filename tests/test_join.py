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
# The cases of one process count run folded: one launch of ours, one of HF's and one reference process per count
# (join_train.py --cases; tests/test_sharded_join.py checks that a folded case ends bitwise where it ends alone).
import json

import pytest
import torch
from safetensors.torch import load_file

from fold import Case, check_each, run_folded

# Each group runs in one launch of join_train.py --cases (and its references in one process): the cases of a
# process count share the processes, with the state reset between them (tests/scripts/fold_cases.py).
UNEVEN = [  # against the emulation of torch DDP's Join rules (--emulate --drop_unsynced)
    Case("2ranks", ["--steps_per_rank", "3,5", "--grad_accum", "1"], {"ACCELERATE_C_GRAD_SYNC": "bucketed"}),
    # rank 0 done first, rank 1 earlier still
    Case("3ranks-accum", ["--steps_per_rank", "6,2,4", "--grad_accum", "2"], {"ACCELERATE_C_GRAD_SYNC": "bucketed"}),
    Case("accum-reference", ["--steps_per_rank", "4,6", "--grad_accum", "2"], {"ACCELERATE_C_GRAD_SYNC": "reference"}),
    # (a rank running out mid-accumulation, its unsynced micro-batch dropped: the HF cases below)
    # the prepared DataLoader (even_batches=False): HF's accumulate syncs at a rank's own last batch, a count that is
    # not a multiple of grad_accum, while the others still accumulate (the lone sync is deferred: SyncAgreement)
    Case("loader-lonesync", ["--steps_per_rank", "4,3", "--grad_accum", "2", "--loader"],
         {"ACCELERATE_C_GRAD_SYNC": "bucketed"}),
    Case("loader-3ranks-lonesync-reference", ["--steps_per_rank", "4,4,3", "--grad_accum", "2", "--loader"],
         {"ACCELERATE_C_GRAD_SYNC": "reference"}),
    Case("loader-lonesync-clip-sched",
         ["--steps_per_rank", "5,4", "--grad_accum", "3", "--loader", "--clip", "0.3", "--sched"],
         {"ACCELERATE_C_GRAD_SYNC": "bucketed"}),
]
# Ranks running out mid-accumulation (no DataLoader): the weights HF Accelerate 1.15 gets from torch DDP's Join on
# the same loop (their unsynced micro-batches are dropped); join_train.py --hf under torchrun.
MIDACCUM_HF = [Case("hf-2ranks", ["--steps_per_rank", "3,6", "--grad_accum", "2"]),
               Case("hf-3ranks", ["--steps_per_rank", "5,2,3", "--grad_accum", "2"])]


def _nproc(case):
    return len(case.args[case.args.index("--steps_per_rank") + 1].split(","))


def _steps(case):
    return [int(s) for s in case.args[case.args.index("--steps_per_rank") + 1].split(",")]


def _same_states(a_dir, b_dir, nproc):
    for r in range(nproc):
        a, b = load_file(str(a_dir / f"state{r}.safetensors")), load_file(str(b_dir / f"state{r}.safetensors"))
        assert a.keys() == b.keys()
        for k in a:
            assert torch.allclose(a[k].double(), b[k].double(), atol=1e-5, rtol=0), (r, k, (a[k] - b[k]).abs().max())


@pytest.mark.parametrize("nproc", [2, 3], ids=["2ranks", "3ranks"])
def test_uneven_inputs_join_like_torch_ddp_and_hf(tmp_path, nproc):
    """Every case of UNEVEN on `nproc` ranks against the emulation, and the MIDACCUM_HF case of `nproc` ranks
    against HF Accelerate on torch DDP's Join: one emulation process, one launch of ours, one of HF's."""
    uneven = [c for c in UNEVEN if _nproc(c) == nproc]
    hf = [c for c in MIDACCUM_HF if _nproc(c) == nproc]
    refs = run_folded("join_train.py", [Case(c.name, c.args + ["--emulate", "--drop_unsynced"]) for c in uneven],
                      tmp_path / "ref")
    got = run_folded("join_train.py", uneven + hf, tmp_path / "got", nproc=nproc)
    hf_out = run_folded("join_train.py", [Case(c.name, c.args + ["--hf"]) for c in hf], tmp_path / "hf",
                        nproc=nproc, launcher="torchrun")

    def check_uneven(c):
        ref, mine = refs[c.name], got[c.name]
        _same_states(ref, mine, nproc)
        for r, n in enumerate(_steps(c)):
            la = json.loads((ref / f"losses{r}.json").read_text())
            lb = json.loads((mine / f"losses{r}.json").read_text())
            assert len(la) == len(lb) == n
            assert all(abs(x - y) <= 1e-5 * max(1.0, abs(x)) for x, y in zip(la, lb)), (r, la, lb)

    check_each(uneven, check_uneven)
    check_each(hf, lambda c: _same_states(hf_out[c.name], got[c.name], nproc))


def test_single_process_join_is_a_no_op():
    from accelerate_c import Accelerator
    acc = Accelerator(cpu=True)
    model = acc.prepare(torch.nn.Linear(2, 2))
    with acc.join_uneven_inputs([model], even_batches=False):
        model(torch.ones(1, 2)).sum().backward()
    assert model.weight.grad is not None
