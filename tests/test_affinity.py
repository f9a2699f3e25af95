# tests/test_affinity.py: `launch --enable_cpu_affinity` (accelerate_c/runtime/affinity.py). The flag was accepted and
# then ignored (found while measuring the tensor-parallel step): now each rank of a CPU launch runs on its own share
# of the cores, disjoint and covering what the launcher could use, while a launch without the flag leaves every rank
# on all of them. Also the kernel's cpulist parser (fuzzed with malformed lists), the split of the cores between local
# ranks, and a GPU rank taking its GPU's NUMA CPUs within the usable ones.
# Not for: thread counts (test_launch.py checks OMP_NUM_THREADS).
import json
import os
import random
import textwrap

import pytest
import torch

from accelerate_c.runtime import affinity
from test_launch import cli, finish

SCRIPT = textwrap.dedent("""
    import json, os, sys
    from accelerate_c import PartialState
    state = PartialState()
    with open(os.path.join(sys.argv[1], "rank%d.json" % state.process_index), "w") as fh:
        json.dump({"cpus": sorted(os.sched_getaffinity(0)), "local": state.local_process_index}, fh)
    state.destroy_process_group()
""")


def test_cpulist_parser_and_its_bad_input():
    assert affinity.parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert affinity.parse_cpu_list("5") == [5] and affinity.parse_cpu_list("") == []
    for bad in ("a", "1-", "-1", "3-1", "1,,x", "0-2-4", "1.5", "0x2", "0-99999999999", "70000"):
        with pytest.raises(ValueError, match="is not a CPU number or range"):
            affinity.parse_cpu_list(bad)
    rng = random.Random(0)
    for _ in range(200):  # random garbage: a list of CPUs or a ValueError, at once (a range such as 0-99999999
        #                   was expanded element by element: 15-33 s for this loop before MAX_CPU)
        text = "".join(rng.choice("0123456789-,x ") for _ in range(rng.randrange(12)))
        try:
            assert all(isinstance(c, int) and c >= 0 for c in affinity.parse_cpu_list(text))
        except ValueError:
            pass


@pytest.mark.parametrize("ncpu", [1, 2, 3, 5, 8, 64])
def test_shares_are_disjoint_and_cover_the_cores(ncpu):
    usable = list(range(100, 100 + ncpu))
    for k in range(1, 10):
        shares = [affinity.share_of(usable, i, k) for i in range(k)]
        assert all(shares), (ncpu, k, shares)
        if k <= ncpu:
            flat = [c for s in shares for c in s]
            assert sorted(flat) == usable and len(set(flat)) == ncpu, (ncpu, k, shares)
            assert max(map(len, shares)) - min(map(len, shares)) <= 1
        else:  # more ranks than cores: one core each, round robin
            assert [s[0] for s in shares] == [usable[i % ncpu] for i in range(k)]


def test_a_gpu_rank_takes_its_numa_node_within_the_usable_cpus(monkeypatch):
    monkeypatch.setattr(affinity, "gpu_local_cpus", lambda index: [2, 3, 4, 5] if index == 1 else None)
    cuda1, cuda0 = torch.device("cuda", 1), torch.device("cuda", 0)
    assert affinity.cpus_for(cuda1, 1, 2, [0, 1, 2, 3]) == [2, 3]
    assert affinity.cpus_for(cuda0, 0, 2, [0, 1, 2, 3]) == [0, 1]  # no NUMA information: the rank's share
    assert affinity.cpus_for(cuda1, 1, 2, [0, 1]) == [1]  # its node outside the usable CPUs: the share too


def test_launch_with_and_without_the_flag(tmp_path):
    script = tmp_path / "aff.py"
    script.write_text(SCRIPT)
    jobs, outs = [], []
    for name, flags in (("bound", ["--enable_cpu_affinity"]), ("free", [])):
        out = tmp_path / name
        out.mkdir()
        outs.append(out)
        jobs.append(cli(["launch", "--cpu", "--num_processes", "2", "--main_process_port", "0", *flags, str(script),
                         str(out)], tmp_path, name=name))
    usable = sorted(os.sched_getaffinity(0))
    for job, out in zip(jobs, outs):
        rc, so, se = finish(job)
        assert rc == 0, so + se
    bound = [json.load(open(outs[0] / f"rank{r}.json"))["cpus"] for r in range(2)]
    free = [json.load(open(outs[1] / f"rank{r}.json"))["cpus"] for r in range(2)]
    assert bound == [affinity.share_of(usable, r, 2) for r in range(2)], (bound, usable)
    if len(usable) >= 2:
        assert not set(bound[0]) & set(bound[1]) and sorted(bound[0] + bound[1]) == usable
    assert free == [usable, usable], free
