# tests/test_operations.py: single-process checks of accelerate_c.utils.operations against HF's, and one real
# 2-process gloo run (tests/_dist_worker.py) of the collectives, debug-mode checker, RNG sync and
# prepare_data_loader against HF Accelerate 1.15 run the same way. The run is shared by the tests below.
import json
import os
import sys
from collections import namedtuple

import pytest
import torch

import accelerate.utils.operations as hops
from accelerate_c.utils import operations as ops
from conftest import Job, describe_all, finish_all, free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def dist_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    port = free_port()
    jobs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1",
                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("ACCELERATE_DEBUG_MODE", None)
        jobs.append(Job([sys.executable, os.path.join(ROOT, "tests", "_dist_worker.py"), str(out)], str(out / "logs"),
                        f"rank{rank}", env))
    results = finish_all(jobs, 300)  # output in files, both shown on failure; a hang is killed at the guard
    assert all(rc == 0 for rc, _, _ in results), describe_all(jobs)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _assert_ok(results, name):
    for rank, res in enumerate(results):
        assert name in res, f"check {name} did not run on rank {rank}"
        assert res[name] == "ok", f"rank {rank}: {res[name]}"


@pytest.mark.parametrize("name", ["gather", "gather_object", "broadcast", "reduce", "pad_across_processes",
                                  "debug_mode", "copy_tensor_to_devices", "rng_sync", "reduce_vs_hf",
                                  "gather_vs_hf", "output_cache_reuse"])
def test_collectives_two_processes(dist_results, name):
    _assert_ok(dist_results, name)


def test_prepare_data_loader_two_processes_matches_hf(dist_results):
    names = [k for k in dist_results[0] if k.startswith("prepare_vs_hf_")]
    assert len(names) == 11
    for name in names + ["even_batches_sizes"]:
        _assert_ok(dist_results, name)


@pytest.mark.parametrize("mode", ["shard", "dispatch", "dispatch_split"])
def test_distributed_resume(dist_results, mode):
    _assert_ok(dist_results, f"distributed_resume_{mode}")


# ---- single process -------------------------------------------------------------------------------------
Point = namedtuple("Point", "x y")


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _sample():
    return {"a": torch.arange(6).view(3, 2), "b": [torch.ones(3, dtype=torch.float16), (torch.zeros(3, 1),)],
            "p": Point(torch.tensor([1, 2, 3]), "label"), "s": "text"}


def test_structure_helpers_match_hf():
    d = _sample()
    assert _same(ops.send_to_device(d, "cpu"), hops.send_to_device(d, "cpu"))
    assert _same(ops.send_to_device(d, "cpu", skip_keys="a"), hops.send_to_device(d, "cpu", skip_keys="a"))
    assert ops.find_batch_size(d) == hops.find_batch_size(d) == 3
    for bad in ([], {}, "x"):
        with pytest.raises((ValueError, TypeError)):
            ops.find_batch_size(bad)
    assert _same(ops.slice_tensors(d, slice(0, 2)), hops.slice_tensors(d, slice(0, 2)))
    t = {"a": d["a"], "b": d["b"]}
    assert _same(ops.concatenate([t, t]), hops.concatenate([t, t]))
    with pytest.raises(TypeError):
        ops.concatenate([d, d])  # strings cannot be concatenated (HF raises too)
    assert _same(ops.convert_to_fp32(d), hops.convert_to_fp32(d))
    s_ours, s_hf = ops.get_data_structure(d), hops.get_data_structure(d)
    assert s_ours["a"].shape == s_hf["a"].shape and s_ours["b"][0].dtype == s_hf["b"][0].dtype
    init = ops.initialize_tensors(s_ours)
    assert init["a"].shape == (3, 2) and init["b"][0].dtype == torch.float16 and init["s"] == "text"
    assert _same(ops.listify(d), hops.listify(d))
    assert _same(ops.recursively_apply(lambda t: t + 1, d), hops.recursively_apply(lambda t: t + 1, d))
    with pytest.raises(TypeError):
        ops.recursively_apply(lambda t: t, d, error_on_other_type=True)


def test_single_process_collectives_are_identity():
    from accelerate_c.state import PartialState

    if PartialState().num_processes != 1:
        pytest.skip("needs a single process")
    t = torch.arange(4.0)
    assert ops.gather(t) is t and ops.broadcast(t) is t
    assert ops.gather_object([1, 2]) == [1, 2]
    r = ops.reduce(t, "mean")
    assert _same(r, t) and r is not t
    assert ops.pad_across_processes(t) is t
