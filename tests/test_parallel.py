# test_parallel.py: the C kernels' thread pool (csrc/parallel.c): called from the main thread they run on the OpenMP
# pool torch loaded (found even when torch loads after the extension), from any other thread, a child forked after the
# extension loaded (its kernels still run) or with openmp_pool off on threads of their own, and every
# kernel family (Adam with fp32 and 8-bit state, cast, pack) gives the same bits either way.
# Not for: the kernels' own correctness (test_optim*.py, test_ops_cast.py, test_shard_kernels.py) or speed
# (benchmarks/pack.py, benchmarks/optimizer.py).
import json
import subprocess
import sys

import pytest
from conftest import clean_env


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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="libgomp (torch's Linux builds)")
def test_the_pool_is_found_when_torch_loads_after_the_extension(tmp_path):
    """_C may load before torch (accelerate_c imports torch lazily): the first lookup then finds no libgomp, and a
    later call, once torch has loaded it, must still find the pool."""
    code = "from accelerate_c import _C; a = _C.parallel_backend(); import torch; print(a, _C.parallel_backend())"
    out = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["threads", "openmp"], out.stdout
