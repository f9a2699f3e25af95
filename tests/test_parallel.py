# test_parallel.py: the C kernels' thread pool (csrc/parallel.c): called from the main thread they run on the OpenMP
# pool torch loaded, from any other thread, a forked child or with openmp_pool off on threads of their own, and every
# kernel family (Adam with fp32 and 8-bit state, cast, pack) gives the same bits either way.
# Not for: the kernels' own correctness (test_optim*.py, test_ops_cast.py, test_shard_kernels.py) or speed
# (benchmarks/pack.py, benchmarks/optimizer.py).
import json
import sys

import pytest


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="libgomp (torch's Linux builds)")
@pytest.mark.parametrize("limit", [None, "1"])
def test_kernels_run_on_torchs_openmp_pool_from_the_main_thread_only(run, tmp_path, limit):
    """limit "1": OMP_THREAD_LIMIT=1 gives a team of one, which must still run every chunk."""
    out = tmp_path / "parallel.json"
    run("parallel_probe.py", [str(out)], env={} if limit is None else {"OMP_THREAD_LIMIT": limit}, timeout=240)
    r = json.loads(out.read_text())
    assert r["libgomp_loaded"], r  # torch's CPU wheels load their libgomp.so.1
    assert r["main"] == "openmp", r
    assert r["helper_thread"] == "threads" and r["forked_child"] == "threads" and r["off"] == "threads", r
    assert r["same_bits"], r
