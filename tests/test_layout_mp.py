# tests/test_layout_mp.py: the parallel layout on 4 real gloo CPU processes, launched once by
# `python -m accelerate_c launch --use_parallelism_config --parallelism_config_dp_shard_size 2
# --parallelism_config_tp_size 2` (tests/scripts/layout_mp.py runs several Accelerators in that one job; see its
# header). Checked here against hand-written tables (the rank order: tp innermost), HF's own DeviceMesh and data
# sharding (HF's ParallelismConfig.build_device_mesh, prepare_data_loader, BatchSamplerShard, built in the ranks)
# and the single-process training reference (HSDP).
# Not for: the faces' validation and the launcher's flags (test_parallelism_config.py).
import json
import os
import sys

import pytest

from conftest import ROOT, SCRIPTS, Job, clean_env, finish_all, free_port

N = 4
SAMPLES = list(range(22))
# rank order (pp, dp_replicate, dp_shard, cp, tp), tp innermost: for a 2 x 2 layout the TP groups are neighbours
TP_GROUPS = {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}
DP_GROUPS = {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}
# what data-parallel rank 0 / 1 reads: batches 0, 2, 4, 6 / 1, 3, 5, 7 of batch_size 3 (even_batches pads the last)
SHARDED = {0: [[0, 1, 2], [6, 7, 8], [12, 13, 14], [18, 19, 20]], 1: [[3, 4, 5], [9, 10, 11], [15, 16, 17], [21, 0, 1]]}
DISPATCHED = {0: [[0, 1, 2], [6, 7, 8], [12, 13, 14], [18, 19]], 1: [[3, 4, 5], [9, 10, 11], [15, 16, 17], [20, 21]]}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("layout_mp")
    cmd = [sys.executable, "-m", "accelerate_c", "launch", "--num_processes", str(N), "--main_process_port",
           str(free_port()), "--use_parallelism_config", "--parallelism_config_dp_shard_size", "2",
           "--parallelism_config_tp_size", "2", os.path.join(SCRIPTS, "layout_mp.py"), str(out)]
    job = Job(cmd, str(out / "logs"), "layout_mp", clean_env(), cwd=ROOT)
    (rc, stdout, stderr), = finish_all([job], 300)
    assert rc == 0, f"{' '.join(cmd)} failed ({rc}):\n{stdout[-3000:]}\n{stderr[-6000:]}"
    return [json.load(open(out / f"rank{r}.json")) for r in range(N)]


def test_env_layout_mesh_and_groups(ranks):
    """The launcher's flags reach every rank's ParallelismConfig; the layout's coordinates, its groups (each
    collective involves exactly its members) and the DeviceMesh equal HF's for the same config."""
    for r, res in enumerate(ranks):
        e = res["env"]
        assert e["sizes"] == [1, 2, 2, 1]
        assert e["layout"]["coords"] == {"pp": 0, "dp_replicate": 0, "dp_shard": r // 2, "cp": 0, "tp": r % 2}
        assert e["ranks"] == [r % 2, 0, r // 2]  # tensor_parallel_rank, data_parallel_rank, data_parallel_shard_rank
        assert e["mesh"] == e["hf_mesh"], (e["mesh"], e["hf_mesh"])
        assert e["mesh"]["names"] == ["dp_shard", "tp"] and e["mesh"]["mesh"] == [[0, 1], [2, 3]]
        g = e["groups"]
        assert g["tp"]["ranks"] == TP_GROUPS[r] and g["dp"]["ranks"] == DP_GROUPS[r] == g["dp_shard"]["ranks"]
        for name, grp in g.items():
            expect = float(sum(m + 1 for m in grp["ranks"]))
            assert grp["sum"] == expect and grp["gathered"] == [float(m) for m in grp["ranks"]], (name, grp)
            assert grp["index"] == grp["ranks"].index(r)
            assert grp["solo"] == (len(grp["ranks"]) == 1)
            assert grp["pg_sum"] == (None if len(grp["ranks"]) == 1 else expect), (name, grp)


def test_data_is_sharded_over_data_parallel_ranks_only(ranks):
    """Every rank of a TP group reads the same batches; the data-parallel ranks read what HF's loader (HF's mesh)
    and HF's BatchSamplerShard over dp_size give them; dispatching gives each dp rank its slice."""
    for r, res in enumerate(ranks):
        dp = r // 2
        assert res["env"]["seen"] == res["env"]["hf_seen"] == SHARDED[dp]
        t = res["dr_tp"]
        assert t["seen"] == [b for b in t["hf_seen"]] == SHARDED[dp]
        assert t["dispatched"] == DISPATCHED[dp]
        assert res["trivial"]["seen"] == res["trivial"]["hf_seen"]


def test_collectives_keep_hf_meaning(ranks):
    """gather_for_metrics gives every sample once (the TP copies dropped, the padding of the last batch too);
    gather, reduce, num_processes and process_index stay over every process, as in HF."""
    for r, res in enumerate(ranks):
        t = res["dr_tp"]
        assert t["gathered"] == SAMPLES and res["trivial"]["gathered"] == SAMPLES
        assert t["reduce_sum"] == 6.0 and t["num_processes"] == 4 and t["process_index"] == r
        assert t["gather_len"] == 8
        assert t["objects"] == ["r0", "r1"]


def test_relaxed_dp_replicate_with_tp_and_the_engine_seam(ranks):
    """ParallelismConfig(dp_replicate_size=2, tp_size=2), refused by HF, gives DDP groups over the TP slices;
    prepare(model) hands the model to the TP engine at the one seam (a model without a TP plan: its error)."""
    for r, res in enumerate(ranks):
        t = res["dr_tp"]
        assert t["layout"]["degrees"] == {"pp": 1, "dp_replicate": 2, "dp_shard": 1, "cp": 1, "tp": 2}
        assert t["groups"]["dp_replicate"]["ranks"] == DP_GROUPS[r] and t["groups"]["tp"]["ranks"] == TP_GROUPS[r]
        assert t["groups"]["dp_shard"]["solo"]
        assert t["refusal"].startswith("tensor parallelism: Linear has no tensor-parallel plan"), t["refusal"]


def test_hsdp_over_the_layout_equals_one_process(ranks):
    """FSDP + ParallelismConfig(dp_replicate_size=2, dp_shard_size=2): shards over dp_shard, replicas over
    dp_replicate (HF's HSDP); 3 SGD steps give the single-process weights."""
    for r, res in enumerate(ranks):
        h = res["hsdp"]
        assert (h["replicas"], h["replica"], h["shard_size"], h["distributed_type"]) == (2, r // 2, 2, "FSDP")
        assert h["max_diff"] <= 1e-6


def test_megatron_and_trivial_layouts(ranks):
    for r, res in enumerate(ranks):
        m = res["megatron"]
        assert m["layout"]["degrees"] == {"pp": 1, "dp_replicate": 2, "dp_shard": 1, "cp": 1, "tp": 2}
        assert m["layout"]["sequence_parallel"] and m["layout"]["source"] == "megatron_lm"
        assert m["mesh"] and m["tp_rank"] == r % 2 and m["clip"] == 1.0 and m["distributed_type"] == "MULTI_CPU"
        assert m["refusal"].startswith("tensor parallelism: Linear has no tensor-parallel plan"), m["refusal"]
        t = res["trivial"]
        assert t["layout"]["degrees"] == {"pp": 1, "dp_replicate": 4, "dp_shard": 1, "cp": 1, "tp": 1} and t["mesh"]
