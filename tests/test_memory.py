# tests/test_memory.py: what a prepared run holds after sharding (issue 20), on 2 real gloo processes
# (tests/scripts/memory_probe.py): no original parameter storage survives prepare (DDP, ZeRO-2, ZeRO-3; torch's
# StorageWeakRef sees C++ references too); the split DDP step keeps only its own slice of the optimizer state
# resident (half at 2 ranks), a state_dict() fills in the peers' slices (the same state on every rank, no
# parameter's left at zero) and the next step gives those pages back, and its shared regions are the parameters,
# the gradient buckets and the state slots (4 x the parameter bytes under Adam, no second copy); the sharded engine's gradient
# staging is two windows of ACCELERATE_C_SHARD_STAGING_MB, not two units, and its shard gradient holds no memory
# after a zero_grad (as FSDP2's freed gradients); the optimizer state of one step's call is one huge-page mapping;
# after Accelerator() on CPU, large temporaries leave nothing in the C heap (runtime/memory.py tune_cpu_heap,
# tests/scripts/heap_probe.py). The PSS figures themselves are
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
        # the heap policy (runtime/memory.py tune_cpu_heap) is asked for by stage 3 only; this script builds its
        # model (4 MiB weights) before Accelerator(), so torch has read its huge-page switch already and the policy
        # stays off (False: decided, not taken); that it takes where the model comes after: test_large_cpu_tensors_*
        assert r["thp_env"] == ("1" if kind == "z3" else None), r
        assert r["policy"] is (False if kind == "z3" else None), r
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
    from memory_probe_util import mapping_rss, range_rss
    buf = PageBuffer(3 << 20, torch.float32)  # 12 MiB
    t = buf.tensor
    assert t.numel() == 3 << 20 and not t.any()
    t.fill_(1.5)
    assert mapping_rss([t.data_ptr()]) >= t.numel() * 4
    assert range_rss(t.data_ptr(), t.numel() * 4) == t.numel() * 4
    buf.zero_()
    assert mapping_rss([t.data_ptr()]) == 0 and range_rss(t.data_ptr(), t.numel() * 4) == 0 and not t.any()
    t[7] = 2.0  # written again: memory again, the rest still zeros
    assert t.sum().item() == 2.0
    assert PageBuffer(0).tensor.numel() == 0


def test_optimizer_state_of_one_call_is_one_huge_page_mapping():
    """The optimizer states created together (fp32, 8-bit and bf16) come zeroed from one mapping marked for
    transparent huge pages (the step streams them: small pages cost it a TLB miss per 4 KiB; and long-lived state
    kept out of the C heap cannot pin the step's freed temporaries there); a strided parameter's fp32 state is
    zeros_like's, in the parameter's memory format."""
    from accelerate_c.optim import lowbit
    sys.path.insert(0, SCRIPTS)
    from memory_probe_util import mapping_of
    cl = torch.zeros(4, 8, 16, 16).to(memory_format=torch.channels_last)
    ps = [torch.zeros(1024, 1030), torch.zeros(999, 771), torch.zeros(4096), torch.zeros(10), cl]
    states = lowbit.new_states([(ps[0], "8bit"), (ps[1], "bfloat16"), (ps[2], "8bit"), (ps[3], "float32"),
                                (ps[4], "float32")])
    mapped = [t for st in states[:4] for t in st.values()]
    assert [t.dtype for t in states[0].values()] == [torch.uint8, torch.uint8, torch.float32, torch.float32]
    assert states[0]["exp_avg"].shape == ps[0].shape and states[0]["exp_avg_absmax"].numel() == -(-1024 * 1030 // 256)
    assert states[1]["exp_avg_sq"].dtype == torch.bfloat16 and states[1]["exp_avg_sq"].shape == ps[1].shape
    assert list(states[3]) == ["exp_avg", "exp_avg_sq"] and states[3]["exp_avg"].dtype == torch.float32
    assert all(t.is_contiguous() and not t.any() and t.data_ptr() % 64 == 0 for t in mapped)
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in mapped)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # disjoint
    start, end, flags = mapping_of(mapped[0].data_ptr())
    assert all(start <= t.data_ptr() < end for t in mapped)
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        if "[never]" not in f.read():
            assert "hg" in flags, flags  # MADV_HUGEPAGE
    strided = states[4]["exp_avg"]
    assert strided.is_contiguous(memory_format=torch.channels_last) and not strided.is_contiguous()
    assert not start <= strided.data_ptr() < end and not strided.any()
    mapped[0].fill_(3)  # views of one buffer, written independently
    assert not mapped[1].any()


def test_heap_mmap_threshold_refuses_bad_sizes():
    from accelerate_c import _C
    if _C.heap_mmap_threshold(1 << 40) is None:
        pytest.skip("not glibc: nothing to tune")
    assert _C.heap_mmap_threshold(1 << 40) is False  # above glibc's limit: refused, nothing changed
    with pytest.raises(OverflowError):
        _C.heap_mmap_threshold(-1)
    with pytest.raises(TypeError):
        _C.heap_mmap_threshold("4 MiB")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap")
@pytest.mark.parametrize("mode", ["on", "off", "auto", "on-late"])
def test_large_cpu_tensors_stay_out_of_the_heap(run, tmp_path, mode):
    """With ACCELERATE_C_LARGE_TENSOR_PAGES=on, after Accelerator() on CPU a step's large temporaries (here 16 MiB
    tensors made and freed in turn, between small long-lived blocks) leave nothing resident in the C heap; off (and
    auto on one process: only ZeRO-3 / FULL_SHARD asks for it), glibc's default (its mmap threshold raised to
    16 MiB by the first free) keeps them in a heap that grows and holds them. on-late: torch made a large tensor
    before Accelerator(), so it no longer marks them for huge pages: the threshold is left alone too (mapped blocks
    would fault in 4 KiB at a time)."""
    out = tmp_path / "heap.json"
    run("heap_probe.py", [str(out), "late" if mode == "on-late" else "early"],
        env={"ACCELERATE_C_LARGE_TENSOR_PAGES": mode.split("-")[0]}, timeout=120)
    r = json.loads(out.read_text())
    if r["libc"] != "glibc":
        pytest.skip("not glibc: nothing to tune")
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        thp = "[never]" not in f.read()
    if mode == "on" and thp:
        assert r["thp_env"] == "1" and r["policy"] is True, r
        assert r["heap_growth"] < (4 << 20) and r["rss_growth"] < (8 << 20), r
    else:
        assert r["policy"] is (None if mode in ("off", "auto") else False), r
        assert r["thp_env"] == (None if mode in ("off", "auto") else "1"), r
        assert r["heap_growth"] >= (12 << 20), r  # what the policy prevents (the test would pass without it else)
