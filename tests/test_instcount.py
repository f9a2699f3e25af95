# test_instcount.py: benchmarks/_instcount.py, the ptrace instruction counter behind optimizer.py --lowbit's
# instructions per element: counts of a deterministic kernel are exactly linear in its size, the 8-bit kernel's per
# element count is above the fp32 one's (it does that update and more), a worker that fails is a TraceError naming
# why, and a worker that never reaches its regions cannot outlive the deadline.
# Not for: the kernels' bits (test_optim.py, test_optim_lowbit.py) or timing.
import os
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import _instcount  # noqa: E402


def counts_or_skip(kinds, sizes):
    try:
        return _instcount.per_element(kinds, sizes, timeout=240)
    except _instcount.TraceError as e:
        if "PTRACE_SEIZE" in str(e) or "needs Linux" in str(e):  # the host forbids tracing: nothing to count here
            pytest.skip(str(e))
        raise


def test_counts_are_linear_in_size_and_rank_the_kernels():
    sizes = (4096, 8192, 12288)  # 8-bit state starts at 4096 elements (smaller tensors keep fp32 state)
    got = counts_or_skip(["fp32", "8bit"], sizes)
    per = {}
    for kind, c in got.items():
        steps = [b - a for a, b in zip(c, c[1:])]
        assert all(s > 0 for s in steps), (kind, c)
        # the same call, 4096 more elements each time: the kernels are branch-free per element, and the rest of the
        # call (argument parsing, the tails) is the same but for a few hundred instructions (each size is its own
        # tensor: the alignment prologues differ)
        assert abs(steps[1] - steps[0]) <= 0.02 * steps[0] + 400, (kind, c)
        per[kind] = (c[-1] - c[0]) / (sizes[-1] - sizes[0])
    assert 0.5 < per["fp32"] < 40, per
    assert per["8bit"] > per["fp32"] + 1, per


def test_a_failing_worker_is_a_clear_error():
    with pytest.raises(_instcount.TraceError, match="worker"):
        _instcount.per_element(["no-such-kind"], (256, 512), timeout=120)


def test_a_worker_that_never_stops_cannot_outlast_the_deadline():
    argv = [sys.executable, "-c", "import sys, time; print('ready', flush=True); sys.stdin.read(1); time.sleep(60)"]
    t = time.monotonic()
    with pytest.raises(_instcount.TraceError) as e:
        _instcount.trace_regions(argv, 1, timeout=3)
    if "PTRACE_SEIZE" in str(e.value):
        pytest.skip(str(e.value))
    assert "deadline" in str(e.value)
    assert time.monotonic() - t < 30
