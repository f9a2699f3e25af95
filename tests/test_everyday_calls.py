# test_everyday_calls.py: the transport under the everyday calls, in real forked gloo ranks (test_shm's
# harness): the out-of-place all-reduce behind accelerator.reduce against gloo (bit-exact at 2 ranks) with
# the input untouched; comm.outbuf's result blocks; wait_for_everyone on the shared-memory barrier: the
# ordering main_process_first / local_main_process_first promise (one host and two fake hosts), a waiter
# sleeping rather than spinning, a dead peer raising instead of hanging, ACCELERATE_C_COMM=torch keeping
# dist.barrier, a group rebuilt after the process group is re-created.
# Not for: timing (benchmarks/everyday.py); HF-level reduce/gather parity (test_operations.py).
import os
import signal
import time

import pytest
import torch
from simd_levels import LEVELS, simd

from conftest import free_port
from test_shm import CHUNK, DTYPES, SMALL, _close, _ref_all_reduce, _same_everywhere, run


# ---- out-of-place all_reduce (all_reduce_into), the transport of accelerator.reduce ------------------------

def _hf_style(x, op, ws):
    """What HF's reduce computes with gloo: a clone, all_reduce (SUM / MAX / MIN), then `/= ws` for sum_div."""
    import torch.distributed as dist
    y = x.clone()
    dist.all_reduce(y, op={"sum": dist.ReduceOp.SUM, "sum_div": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                           "min": dist.ReduceOp.MIN}[op])
    if op == "sum_div":
        y /= ws
    return y


def _bits(t):
    return t.contiguous().view(torch.uint8) if t.numel() else t.new_empty(0).view(torch.uint8)


def _w_reduce_into(rank, ws):
    from accelerate_c.comm import ShmGroup
    g = ShmGroup(timeout=20, small_bytes=SMALL, chunk_bytes=CHUNK)
    gen = torch.Generator().manual_seed(4321 + rank)
    checked = 0
    for dtype in DTYPES:
        esz = torch.empty((), dtype=dtype).element_size()
        # around the small-buffer limit, one chunk, and several chunks with a short last one
        sizes = [0, 1, 7, SMALL // esz - 1, SMALL // esz, SMALL // esz + 1, CHUNK // esz - 1, CHUNK // esz,
                 CHUNK // esz + 1, 3 * CHUNK // esz + 5]
        for n in sizes:
            for op in ("sum", "sum_div", "avg", "max", "min"):
                if op in ("avg", "sum_div") and not dtype.is_floating_point:
                    continue
                x = (torch.randn(n, generator=gen) * 50).to(dtype)
                keep = x.clone()
                out = torch.full((n,), 7, dtype=dtype)
                assert g.all_reduce_into(out, x, op) is out
                assert torch.equal(_bits(x), _bits(keep)), ("input changed", dtype, n, op)
                if ws == 2 and op != "avg":  # two ranks: one addition (and one division): HF's exact bits
                    ref = _hf_style(x, op, ws)
                    assert torch.equal(_bits(out), _bits(ref)), (dtype, n, op, (out.double() - ref.double()).abs().max())
                else:  # more ranks: gloo rounds half-precision sums per addition, we round once
                    ref = _ref_all_reduce(x, "sum" if op == "sum_div" else op, ws)
                    assert _close(out, ref / ws if op == "sum_div" else ref, dtype), (dtype, n, op)
                assert _same_everywhere(out), (dtype, n, op)
                checked += 1
    # every SIMD level gives the same bits for sum_div (one-pass 2-source kernel and the block kernel)
    x = torch.randn(3000, generator=gen) * 50
    results = {}
    for lvl in LEVELS:
        with simd(lvl):
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                out = torch.empty(3000, dtype=dtype)
                results.setdefault(dtype, []).append(g.all_reduce_into(out, x.to(dtype), "sum_div"))
    for dtype, rs in results.items():
        assert all(torch.equal(rs[0], r) for r in rs), dtype
    # sum_div rounds the sum first, as HF's `/=` after the all-reduce: an fp16 sum that overflows stays inf
    h = torch.full((3,), 40000.0, dtype=torch.float16)
    out = torch.empty_like(h)
    g.all_reduce_into(out, h, "sum_div")
    assert bool(out.isinf().all()) and torch.equal(out, _hf_style(h, "sum_div", ws)), out
    # 0-d tensors, and inputs living in a registered region (zero-copy path: the parts are only read)
    x = torch.tensor(float(rank) + 0.5)
    out = torch.empty(())
    g.all_reduce_into(out, x, "sum_div")
    assert out.shape == () and torch.equal(out, _hf_style(x, "sum_div", ws))
    buf = g.alloc(9000)
    base = torch.randn(9000, generator=gen)
    buf.copy_(base)
    g.barrier()  # every rank filled its part
    peers_before = [p.clone() for p in g.parts(buf)]
    out = torch.empty(9000)
    g.all_reduce_into(out, buf, "sum")
    assert torch.equal(buf, base) and all(torch.equal(a, b) for a, b in zip(g.parts(buf), peers_before))
    assert torch.allclose(out, _ref_all_reduce(base, "sum", ws), rtol=1e-6, atol=1e-5) and _same_everywhere(out)
    # in place through the same call (output is input), and bad arguments are clear errors on every rank
    y = torch.randn(5000, generator=gen)
    ref = _hf_style(y, "max", ws)
    g.all_reduce_into(y, y, "max")
    assert torch.equal(y, ref)
    errors = []
    for bad in (lambda: g.all_reduce_into(torch.empty(10), torch.empty(11)),
                lambda: g.all_reduce_into(torch.empty(10, dtype=torch.float64), torch.empty(10)),
                lambda: (lambda z: g.all_reduce_into(z[1:11], z[:10]))(torch.empty(20)),
                lambda: g.all_reduce_into(torch.empty(10, dtype=torch.int32), torch.ones(10, dtype=torch.int32),
                                          "sum_div")):
        try:
            bad()
            errors.append(None)
        except (ValueError, TypeError) as e:
            errors.append(str(e))
    assert errors[0] and "11 elements" in errors[0] and "output 10" in errors[0], errors
    assert errors[1] and "dtype" in errors[1], errors
    assert errors[2] and "overlaps" in errors[2], errors
    assert errors[3] and "not supported" in errors[3], errors
    g.barrier()  # the group is still in step after argument errors (they are raised before any arrival)
    g.close()
    return checked


@pytest.mark.parametrize("ws", [2, 3])
def test_all_reduce_into_matches_gloo_and_leaves_input(ws):
    res = run(_w_reduce_into, ws)
    assert all(v > 200 for v in res.values()), res


def test_output_cache_blocks(monkeypatch):
    """comm.outbuf: results of >= 1 MiB reuse the block of a dropped result (never one still referenced, even
    through a view), are ordinary non-view tensors whose storage cannot grow, and at most the limit of free
    blocks is kept; below 1 MiB or with the cache off they are plain torch.empty tensors."""
    import gc

    from accelerate_c.comm import outbuf
    monkeypatch.setattr(outbuf, "_free", {})
    monkeypatch.setattr(outbuf, "_limit", 8 << 20)
    small = outbuf.empty((100, 10), torch.float32)
    assert small.shape == (100, 10) and small.untyped_storage().resizable()
    a = outbuf.empty((512, 1024), torch.float32)  # 2 MiB
    assert a.shape == (512, 1024) and a.dtype == torch.float32 and a.is_contiguous() and a._base is None
    a.fill_(1.5)
    b = outbuf.empty((512, 1024), torch.float32)
    assert b.data_ptr() != a.data_ptr()
    b.fill_(2.5)
    assert bool((a == 1.5).all())
    with pytest.raises(RuntimeError, match="not resizable"):
        a.resize_(1024, 1024)
    pa = a.data_ptr()
    del a
    gc.collect()
    assert outbuf.held_bytes() >= 2 << 20
    c = outbuf.empty((1 << 19,), torch.float32)  # the same bytes in another shape: a's block
    assert c.data_ptr() == pa and c.shape == (1 << 19,)
    keep = c[3:7]
    del c
    d = outbuf.empty((1 << 19,), torch.float32)  # c's block is still referenced by `keep`
    assert d.data_ptr() not in (pa, b.data_ptr())
    d.fill_(9)
    keep.fill_(4)
    assert bool((d == 9).all())
    e = outbuf.empty_like(torch.empty(3 << 18, dtype=torch.bfloat16))  # 1.5 MiB: from the cache
    assert e.dtype == torch.bfloat16 and e.shape == (3 << 18,) and not e.untyped_storage().resizable()
    del b, d, e, keep
    blocks = [outbuf.empty((1 << 20,), torch.float64) for _ in range(4)]  # 4 x 8 MiB
    del blocks
    gc.collect()
    assert 0 < outbuf.held_bytes() <= 8 << 20  # the limit holds: older blocks were let go
    monkeypatch.setattr(outbuf, "_limit", 0)
    off = outbuf.empty((1 << 20,), torch.float32)
    assert off.untyped_storage().resizable()  # cache off: plain torch.empty


def test_output_cache_limit_env_is_checked(monkeypatch):
    from accelerate_c.comm import outbuf
    monkeypatch.setattr(outbuf, "_limit", None)
    monkeypatch.setenv("ACCELERATE_C_OUTPUT_CACHE_MB", "lots")
    with pytest.raises(ValueError, match="ACCELERATE_C_OUTPUT_CACHE_MB='lots'"):
        outbuf.limit_bytes()
    monkeypatch.setenv("ACCELERATE_C_OUTPUT_CACHE_MB", "16")
    assert outbuf.limit_bytes() == 16 << 20


# ---- wait_for_everyone on the shared-memory barrier ------------------------------------------------------

def _state(rank, ws, local_ranks=None):
    """PartialState of a harness rank (the process group already exists), with its local rank set."""
    hosts = local_ranks.count(0) if local_ranks else 1
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(ws), LOCAL_RANK=str(local_ranks[rank] if local_ranks else rank),
                      LOCAL_WORLD_SIZE=str(ws // hosts))
    from accelerate_c.state import AcceleratorState, PartialState
    AcceleratorState._reset_state(reset_partial_state=True)  # the forked rank may inherit the parent's state
    return PartialState()


def _w_goes_first(rank, ws, path, local, local_ranks):
    """Inside main_process_first (or the local one) the first process(es) work ~1.5 s, then log; the others log
    on entry. Returns the CPU seconds this rank's thread spent in the context (waiting included)."""
    st = _state(rank, ws, local_ranks)
    st.wait_for_everyone()  # the group exists before the measured wait
    first = st.is_local_main_process if local else st.is_main_process
    cpu0 = time.thread_time()
    with (st.local_main_process_first() if local else st.main_process_first()):
        if first:
            time.sleep(1.5)
            line = f"first {rank}\n"
        else:
            line = f"after {rank}\n"
        with open(path, "a") as f:
            f.write(line)
    return first, time.thread_time() - cpu0


def _check_goes_first(tmp_path, ws, local, envs=None, local_ranks=None):
    path = str(tmp_path / "order.log")
    res = run(_w_goes_first, ws, path, local, local_ranks, envs=envs, timeout=120)
    lines = open(path).read().split()
    kinds = lines[0::2]
    n_first = sum(1 for f, _ in res.values() if f)
    assert kinds == ["first"] * n_first + ["after"] * (ws - n_first), lines  # every first process finished first
    for r, (first, cpu) in res.items():
        # It waited ~1.5 s for the first process(es). Asleep on the futex its thread uses ~1 ms of CPU; spinning,
        # it would use its whole share of a core (still > 0.1 s on this 2-core box at a load of 10). CPU time,
        # not wall time: a busy box can only make a spinner look better, never a sleeper worse.
        if not first:
            assert cpu < 0.05, (r, cpu)


def test_main_process_first_orders_and_waiters_sleep(tmp_path):
    _check_goes_first(tmp_path, 3, local=False)


def test_local_main_process_first_two_fake_hosts(tmp_path):
    """Two hosts (hierarchical group): each host's local main works first, then everyone else enters."""
    envs = [{"ACCELERATE_C_HOST_ID": h} for h in ("hostA", "hostB", "hostA", "hostB")]
    _check_goes_first(tmp_path, 4, local=True, envs=envs, local_ranks=[0, 0, 1, 1])


def test_main_process_first_two_fake_hosts(tmp_path):
    envs = [{"ACCELERATE_C_HOST_ID": h} for h in ("hostA", "hostB", "hostA", "hostB")]
    _check_goes_first(tmp_path, 4, local=False, envs=envs, local_ranks=[0, 0, 1, 1])


def _w_barrier_kill(rank, ws):
    st = _state(rank, ws)
    st.wait_for_everyone()
    if rank == ws - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        st.wait_for_everyone()
    except RuntimeError as e:
        return str(e)
    raise AssertionError("wait_for_everyone with a dead peer did not raise")


def test_dead_peer_during_wait_for_everyone_raises():
    ws = 3
    res = run(_w_barrier_kill, ws, allow_missing=(ws - 1,), timeout=60)
    for r in range(ws - 1):
        assert "barrier" in res[r] and f"rank(s) {ws - 1}" in res[r] and "died" in res[r], res[r]


def _w_torch_and_rebuild(rank, ws, port2):
    import datetime

    import torch.distributed as dist

    from accelerate_c.comm import ShmGroup, TorchGroup, get_group, release_groups
    from accelerate_c.state import AcceleratorState
    calls = []
    real = dist.barrier
    dist.barrier = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    st = _state(rank, ws)
    os.environ["ACCELERATE_C_COMM"] = "torch"
    st.wait_for_everyone()
    assert isinstance(get_group(), TorchGroup) and len(calls) == 1, calls
    release_groups()
    del os.environ["ACCELERATE_C_COMM"]
    st.wait_for_everyone()
    AcceleratorState(cpu=True).wait_for_everyone()
    g1 = get_group()
    assert isinstance(g1.inner, ShmGroup) and len(calls) == 1, calls  # the shm barrier: no dist.barrier
    dist.barrier = real
    dist.destroy_process_group()  # a new process group: the cached shm group must not be reused
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port2}", rank=rank, world_size=ws,
                            timeout=datetime.timedelta(seconds=30))
    st.wait_for_everyone()
    g2 = get_group()
    assert g2 is not g1 and isinstance(g2.inner, ShmGroup) and g1.inner._h is None
    assert torch.equal(g2.all_reduce(torch.ones(3)), torch.full((3,), float(ws)))
    release_groups()
    return True


def test_comm_torch_keeps_dist_barrier_and_group_follows_process_group():
    assert all(run(_w_torch_and_rebuild, 2, free_port()).values())
