# tests/test_memory.py: what a prepared run holds after sharding (issue 20), on 2 real gloo processes
# (tests/scripts/memory_probe.py): no original parameter storage survives prepare (DDP, ZeRO-2, ZeRO-3; torch's
# StorageWeakRef sees C++ references too); the split DDP step keeps only its own slice of the optimizer state
# resident (half at 2 ranks), a state_dict() fills in the peers' slices (the same state on every rank, no
# parameter's left at zero) and the next step gives those pages back, and its shared regions are the parameters,
# the gradient buckets and the state slots (4 x the parameter bytes under Adam, no second copy); the sharded engine's gradient
# staging is two windows of ACCELERATE_C_SHARD_STAGING_MB, not two units, and its shard gradient holds no memory
# after a zero_grad (as FSDP2's freed gradients). The PSS figures themselves are
# benchmarks/memory.py's (docs/sharding.md).
# Not for: the windows' arithmetic (test_sharded_engine.py runs cases with ~1 KiB windows).
import json
import sys

import pytest
import torch

from conftest import SCRIPTS

PAGE_SLACK = 64 << 10


@pytest.mark.parametrize("kind", ["ddp", "z3"])
def test_what_a_prepared_run_holds(run, tmp_path, kind):
    run("memory_probe.py", [kind, str(tmp_path)], nproc=2, launcher="accelerate_c", timeout=180,
        env={"ACCELERATE_C_SHARD_STAGING_MB": "1"})
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in ranks:
        assert all(r["expired"]), r["expired"]  # every original parameter storage was freed
    if kind == "ddp":
        for r in ranks:
            after_steps, after_state_dict, after_next_step = r["state_rss"]
            half = r["state_bytes"] / 2
            assert after_steps <= half + PAGE_SLACK, r
            assert after_state_dict >= r["state_bytes"], r  # the peers' slices were read in
            assert after_next_step <= half + PAGE_SLACK, r
            # parameters + gradients + state slots (Adam: 2 per parameter), each region rounded to pages: the
            # transport keeps no second copy of the gradients
            assert r["region_part_bytes"] <= 4 * r["param_bytes"] + r["n_regions"] * 4096, r
        sd0, sd1 = (torch.load(tmp_path / f"state{q}.pt") for q in (0, 1))
        assert sd0["state"].keys() == sd1["state"].keys() and sd0["state"]
        for k in sd0["state"]:
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(sd0["state"][k][key], sd1["state"][k][key]), (k, key)
            assert (sd0["state"][k]["exp_avg_sq"] != 0).any(), k  # (a slice left unread would be zeros)
    else:
        for r in ranks:
            assert r["staging"] <= 2 * (1 << 20) < r["biggest"], r
            freed, written, freed_again = r["gshard_rss"]
            assert freed == 0 and freed_again == 0 and written >= r["gshard_bytes"] // 2, r


def test_a_page_buffer_gives_its_pages_back_and_reads_zeros():
    from accelerate_c.base.pages import PageBuffer
    sys.path.insert(0, SCRIPTS)
    from memory_probe_util import mapping_rss
    buf = PageBuffer(3 << 20, torch.float32)  # 12 MiB
    t = buf.tensor
    assert t.numel() == 3 << 20 and not t.any()
    t.fill_(1.5)
    assert mapping_rss([t.data_ptr()]) >= t.numel() * 4
    buf.zero_()
    assert mapping_rss([t.data_ptr()]) == 0 and not t.any()
    t[7] = 2.0  # written again: memory again, the rest still zeros
    assert t.sum().item() == 2.0
    assert PageBuffer(0).tensor.numel() == 0


def test_low_precision_state_of_one_call_is_one_huge_page_mapping():
    """The 8-bit and bf16 optimizer states created together come zeroed from one mapping marked for transparent huge
    pages (the step streams them: small pages cost it a TLB miss per 4 KiB); fp32 state stays torch's."""
    from accelerate_c.optim import lowbit
    sys.path.insert(0, SCRIPTS)
    from memory_probe_util import mapping_of
    ps = [torch.zeros(1024, 1030), torch.zeros(999, 771), torch.zeros(4096), torch.zeros(10)]
    states = lowbit.new_states([(ps[0], "8bit"), (ps[1], "bfloat16"), (ps[2], "8bit"), (ps[3], "float32")])
    low = [t for st in states[:3] for t in st.values()]
    assert [t.dtype for t in states[0].values()] == [torch.uint8, torch.uint8, torch.float32, torch.float32]
    assert states[0]["exp_avg"].shape == ps[0].shape and states[0]["exp_avg_absmax"].numel() == -(-1024 * 1030 // 256)
    assert states[1]["exp_avg_sq"].dtype == torch.bfloat16 and states[1]["exp_avg_sq"].shape == ps[1].shape
    assert all(t.is_contiguous() and not t.any() and t.data_ptr() % 64 == 0 for t in low)
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in low)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # disjoint
    start, end, flags = mapping_of(low[0].data_ptr())
    assert all(start <= t.data_ptr() < end for t in low)
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        if "[never]" not in f.read():
            assert "hg" in flags, flags  # MADV_HUGEPAGE
    fp32 = states[3]["exp_avg"]
    assert fp32.dtype == torch.float32 and not start <= fp32.data_ptr() < end
    low[0].fill_(3)  # views of one buffer, written independently
    assert not low[1].any()
