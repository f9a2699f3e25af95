# test_shm.py: the shared-memory transport (accelerate_c.comm) against torch.distributed (gloo) in real
# spawned processes: every collective, dtype and op on odd sizes through the small, staged (chunked) and
# zero-copy paths; the hierarchical path with fake host ids; failure cases (SIGKILLed peer, late peer,
# mismatched calls), segment permissions and cleanup of /dev/shm.
# Not for: timing (benchmarks/allreduce.py).
import glob
import multiprocessing as mp
import os
import signal
import time
import traceback

import pytest
import torch
from conftest import free_port
from simd_levels import LEVELS, simd

from accelerate_c import _C

SMALL, CHUNK = 4096, 16384  # tiny buffers so that modest sizes exercise every path


def _entry(fn, rank, ws, port, q, env, args):
    try:
        os.environ.update(env or {})
        os.environ["MASTER_PORT"] = str(port)
        import datetime

        import torch.distributed as dist
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ws,
                                timeout=datetime.timedelta(seconds=30))
        res = fn(rank, ws, *args)
        q.put((rank, "ok", res))
    except BaseException:
        q.put((rank, "err", traceback.format_exc()))
    q.close()
    q.join_thread()  # the result is flushed; skip the slow interpreter/gloo teardown
    os._exit(0)


def run(fn, ws, *args, envs=None, timeout=300, allow_missing=()):
    """Runs fn(rank, ws, *args) on ws spawned gloo ranks; returns {rank: result}. Raises on a worker error."""
    ctx = mp.get_context("fork")  # the parent has torch imported already: no re-import per rank
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, ws, port, q, envs[r] if envs else None, args)) for r in range(ws)]
    for p in procs:
        p.start()
    out, deadline = {}, time.monotonic() + timeout  # a hang guard
    try:
        while len(out) < ws - len(allow_missing) and time.monotonic() < deadline:
            try:
                r, kind, res = q.get(timeout=0.5)
            except Exception:
                continue
            if kind == "err":
                raise AssertionError(f"rank {r} failed:\n{res}")
            out[r] = res
        assert len(out) >= ws - len(allow_missing), f"timed out; finished ranks: {sorted(out)}"
    finally:
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
    return out


# ---- workers (module level) -------------------------------------------------------------------

def _ref_all_reduce(x, op, ws):
    import torch.distributed as dist
    if x.dtype in (torch.bfloat16, torch.float16):
        y = x.double()
    else:
        y = x.clone()
    if op == "avg":
        dist.all_reduce(y)
        y = y / ws
    else:
        dist.all_reduce(y, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
    return y.to(x.dtype) if x.dtype in (torch.bfloat16, torch.float16) else y


def _close(a, b, dtype):
    if not dtype.is_floating_point:
        return torch.equal(a, b)
    tol = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10, torch.float32: 1e-5, torch.float64: 1e-12}[dtype]
    if dtype == torch.float32:
        return torch.allclose(a.double(), b.double(), rtol=tol, atol=1e-3)
    return torch.allclose(a.double(), b.double(), rtol=tol, atol=tol)


def _same_everywhere(t):
    import torch.distributed as dist
    raw = t.contiguous().view(torch.uint8) if t.numel() else t.new_empty(0).view(torch.uint8)
    lst = [torch.empty_like(raw) for _ in range(dist.get_world_size())]
    dist.all_gather(lst, raw)
    return all(torch.equal(lst[0], x) for x in lst)


def _check_scatter(g, dist, x, n, dtype, srcs):
    """g.scatter of x (n * ws elements, each rank's own) from every src in srcs vs gloo's scatter."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    for src in srcs:
        out, ref = torch.full((n,), -7).to(dtype), torch.empty(n, dtype=dtype)
        g.scatter(out, x if rank == src else None, src)
        if n:
            dist.scatter(ref, list(x.split(n)) if rank == src else None, src=src)
            assert torch.equal(out, ref), ("scatter", dtype, n, src)


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.int64]


def _w_collectives(rank, ws):
    import torch.distributed as dist

    from accelerate_c.comm import ShmGroup
    g = ShmGroup(timeout=20, small_bytes=SMALL, chunk_bytes=CHUNK)
    gen = torch.Generator().manual_seed(1234 + rank)
    sizes = [0, 1, 7, 1001, SMALL // 2 + 3, 3 * CHUNK // 4 + 5]  # last ones: staged, several chunks
    if ws > 2:
        sizes = [0, 1, 1001, 3 * CHUNK // 4 + 5]
    checked = 0
    for dtype in DTYPES:
        for n in sizes:
            for op in ("sum", "avg", "max", "min"):
                if op == "avg" and not dtype.is_floating_point:
                    continue
                x = (torch.randn(n, generator=gen) * 50).to(dtype)
                ours = g.all_reduce(x.clone(), op)
                ref = _ref_all_reduce(x, op, ws)
                assert _close(ours, ref, dtype), (dtype, n, op, (ours.double() - ref.double()).abs().max())
                assert _same_everywhere(ours), (dtype, n, op)
                checked += 1
            # reduce_scatter / all_gather / broadcast
            x = (torch.randn(n * ws, generator=gen) * 50).to(dtype)
            out = torch.empty(n, dtype=dtype)
            g.reduce_scatter(out, x, "sum")
            ref = _ref_all_reduce(x, "sum", ws)[rank * n:(rank + 1) * n]
            assert _close(out, ref, dtype), ("reduce_scatter", dtype, n)
            y = (torch.randn(n, generator=gen) * 50).to(dtype)
            gath = torch.empty(n * ws, dtype=dtype)
            g.all_gather(gath, y)
            lst = [torch.empty(n, dtype=dtype) for _ in range(ws)]
            dist.all_gather(lst, y)
            assert torch.equal(gath, torch.cat(lst)), ("all_gather", dtype, n)
            b1, b2 = y.clone(), y.clone()
            g.broadcast(b1, ws - 1)
            dist.broadcast(b2, ws - 1)
            assert torch.equal(b1, b2), ("broadcast", dtype, n)
            _check_scatter(g, dist, x, n, dtype, (ws - 1, 0))
            checked += 4
    # every SIMD level gives the same bits on the reduction kernels
    x = (torch.randn(3000, generator=gen) * 50)
    results = {}
    for lvl in LEVELS:
        with simd(lvl):
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                results.setdefault(dtype, []).append(g.all_reduce(x.to(dtype, copy=True), "sum"))
    for dtype, rs in results.items():
        assert all(torch.equal(rs[0], r) for r in rs), dtype
    # zero-copy: tensors living in the segment, whole and sliced, every op
    buf = g.alloc(40000, torch.float32)
    assert buf.numel() == 40000 and bool((buf == 0).all())
    base = torch.randn(40000, generator=gen)
    buf.copy_(base)
    g.all_reduce(buf[13:30013], "sum")
    ref = base.clone()
    ref[13:30013] = _ref_all_reduce(base[13:30013].contiguous(), "sum", ws)
    assert torch.allclose(buf, ref, rtol=1e-6, atol=1e-6)
    for op in ("max", "avg"):
        buf.copy_(base)
        g.all_reduce(buf, op)
        assert torch.allclose(buf, _ref_all_reduce(base, op, ws), rtol=1e-6, atol=1e-6)
    buf.copy_(base)
    outr = torch.empty(40000 // ws if 40000 % ws == 0 else 0)
    if 40000 % ws == 0:
        g.reduce_scatter(outr, buf, "sum")
        assert torch.allclose(outr, _ref_all_reduce(base, "sum", ws)[rank * outr.numel():(rank + 1) * outr.numel()])
    gath = torch.empty(40000 * ws)
    g.all_gather(gath, buf)
    lst = [torch.empty(40000) for _ in range(ws)]
    dist.all_gather(lst, base)
    assert torch.equal(gath, torch.cat(lst))
    g.broadcast(buf, 0)
    b2 = base.clone()
    dist.broadcast(b2, 0)
    assert torch.equal(buf, b2)
    for src in (ws - 1, 0):  # scatter from the segment: the peers read src's part (src's own block copied)
        out = torch.empty(9000)
        g.scatter(out, buf[13:13 + 9000 * ws] if rank == src else None, src)
        assert torch.equal(out, b2[13 + 9000 * rank:13 + 9000 * (rank + 1)]), src
    hb = g.alloc(5000, torch.bfloat16)
    hb.copy_(base[:5000].to(torch.bfloat16))
    g.all_reduce(hb)
    assert _close(hb, _ref_all_reduce(base[:5000].to(torch.bfloat16), "sum", ws), torch.bfloat16)
    # async: several queued all-reduces on slices of one buffer (DDP-bucket style), then wait
    buf.copy_(base)
    works = [g.all_reduce_async(buf[i * 10000:(i + 1) * 10000]) for i in range(4)]
    for w in works:
        assert w.wait(timeout=20)
    assert torch.allclose(buf, _ref_all_reduce(base, "sum", ws), rtol=1e-6, atol=1e-6)
    # a synchronous op right after queued async ones runs after them (same order on every rank)
    buf.copy_(base)
    other = torch.full((10,), float(rank))
    w1 = g.all_reduce_async(buf[:20000])
    g.all_reduce(other, "max")
    w2 = g.all_reduce_async(buf[20000:])
    assert w1.is_completed() and w2.wait()
    assert torch.equal(other, torch.full((10,), float(ws - 1)))
    assert torch.allclose(buf, _ref_all_reduce(base, "sum", ws), rtol=1e-6, atol=1e-6)
    # non-contiguous tensors go through a contiguous copy
    m = torch.randn(6, 5, generator=gen)
    ref = _ref_all_reduce(m.t().contiguous(), "sum", ws)
    mt = m.t()
    g.all_reduce(mt)
    assert torch.allclose(mt, ref) and torch.allclose(m, ref.t())
    g.barrier()
    g.close()
    return checked


@pytest.mark.parametrize("ws", [2, 3])
def test_collectives_match_gloo(ws):
    res = run(_w_collectives, ws)
    assert all(v > 100 for v in res.values())


def _w_staged_many_chunks(rank, ws):
    """Back-to-back staged all_reduces spanning many chunks, with short last chunks and mixed dtypes/ops and
    other staged collectives in between, issued without any gloo call in between (a gloo call would act as
    a barrier and hide a staging-reuse race); then every result is checked against gloo and across ranks."""
    from accelerate_c.comm import ShmGroup
    g = ShmGroup(timeout=20, small_bytes=SMALL, chunk_bytes=CHUNK)
    gen = torch.Generator().manual_seed(99 + rank)
    plan = [(torch.float32, 10 * CHUNK // 4 + 13, "sum"), (torch.float64, CHUNK // 8, "sum"),
            (torch.float32, 3 * CHUNK // 8 + 1, "max"), (torch.bfloat16, 7 * CHUNK // 2 - 3, "sum"),
            (torch.int64, 5 * CHUNK // 8 + 7, "min"), (torch.float16, 2 * CHUNK + 1, "avg"),
            (torch.float32, 31 * CHUNK // 4, "sum")]
    ins, outs, scat = [], [], []
    for i, (dtype, n, op) in enumerate(plan * 3):
        x = (torch.randn(n, generator=gen) * 50).to(dtype)
        ins.append(x)
        outs.append(g.all_reduce(x.clone(), op))
        if i % 4 == 1:  # another staged op in between shifts the staging-buffer parity
            y = torch.randn(CHUNK // 2 + 5, generator=gen)
            gath = torch.empty(y.numel() * ws)
            g.all_gather(gath, y)
            outs.append((gath, y))
        if i % 3 == 2:  # a staged scatter of several chunks (src varies), no gloo call in between
            src, m = i % ws, 3 * CHUNK // 4 + 1 + i
            z = torch.randn(m * ws, generator=gen)
            sc = torch.empty(m)
            g.scatter(sc, z if rank == src else None, src)
            scat.append((src, m, z, sc))
    k = 0
    import torch.distributed as dist
    for i, (dtype, n, op) in enumerate(plan * 3):
        ref = _ref_all_reduce(ins[i], op, ws)
        assert _close(outs[k], ref, dtype), (i, dtype, n, op)
        assert _same_everywhere(outs[k]), (i, dtype, n, op)
        k += 1
        if i % 4 == 1:
            gath, y = outs[k]
            lst = [torch.empty_like(y) for _ in range(ws)]
            dist.all_gather(lst, y)
            assert torch.equal(gath, torch.cat(lst)), i
            k += 1
    for src, m, z, sc in scat:
        ref = torch.empty(m)
        dist.scatter(ref, list(z.split(m)) if rank == src else None, src=src)
        assert torch.equal(sc, ref), ("scatter", src, m)
    g.close()
    return len(plan) * 3


@pytest.mark.parametrize("ws", [2, 3])
def test_staged_all_reduce_many_chunks(ws):
    res = run(_w_staged_many_chunks, ws)
    assert all(v == 21 for v in res.values())


def _w_async_activations(rank, ws):
    """reduce_scatter_async / all_gather_async (the tensor-parallel activation collectives) queued behind and between
    all_reduce_async on the C worker thread, through the small, staged and zero-copy paths, then a synchronous op:
    every result equals gloo's; the same calls on TorchGroup (the process-group path) too."""
    import torch.distributed as dist

    from accelerate_c.comm import ShmGroup, TorchGroup
    g = ShmGroup(timeout=20, small_bytes=SMALL, chunk_bytes=CHUNK)
    gen = torch.Generator().manual_seed(7 + rank)
    seg = g.alloc(3 * CHUNK * ws, torch.float32)
    checked = 0
    for grp in (g, TorchGroup()):
        for dtype in (torch.float32, torch.bfloat16) if grp is g else (torch.float32,):  # (gloo rounds bf16 per hop)
            for n in (1, 333, SMALL // 8 + 5, 3 * CHUNK // 4 + 5):
                x = (torch.randn(n * ws, generator=gen) * 50).to(dtype)
                y = (torch.randn(n, generator=gen) * 50).to(dtype)
                z = (torch.randn(n + 3, generator=gen) * 50).to(dtype)
                rs, ag, zr = torch.empty(n, dtype=dtype), torch.empty(n * ws, dtype=dtype), z.clone()
                w0 = grp.all_reduce_async(zr)
                w1 = grp.reduce_scatter_async(rs, x)
                w2 = grp.all_gather_async(ag, y)
                w2.wait(), w1.wait(), w0.wait()
                assert _close(rs, _ref_all_reduce(x, "sum", ws)[rank * n:(rank + 1) * n], dtype), (dtype, n)
                lst = [torch.empty(n, dtype=dtype) for _ in range(ws)]
                dist.all_gather(lst, y)
                assert torch.equal(ag, torch.cat(lst)), (dtype, n)
                assert _close(zr, _ref_all_reduce(z, "sum", ws), dtype), (dtype, n)
                checked += 1
        if grp is g:  # zero-copy: the reduce-scatter's input and the gather's input in the segment
            base = torch.randn(seg.numel(), generator=gen)
            seg.copy_(base)
            out, gath = torch.empty(seg.numel() // ws), torch.empty(CHUNK * ws)
            w1, w2 = g.reduce_scatter_async(out, seg), g.all_gather_async(gath, seg[:CHUNK])
            w1.wait(), w2.wait()
            ref = _ref_all_reduce(base, "sum", ws)[rank * out.numel():(rank + 1) * out.numel()]
            assert _close(out, ref, torch.float32)
            lst = [torch.empty(CHUNK) for _ in range(ws)]
            dist.all_gather(lst, base[:CHUNK].contiguous())
            assert torch.equal(gath, torch.cat(lst))
            m = torch.full((4,), float(rank))
            w = g.reduce_scatter_async(torch.empty(CHUNK), seg[:CHUNK * ws])
            g.all_reduce(m, "max")  # a synchronous op after a queued one runs after it
            assert w.is_completed() and torch.equal(m, torch.full((4,), float(ws - 1)))
    g.close()
    return checked


@pytest.mark.parametrize("ws", [2, 3])
def test_async_activation_collectives_match_gloo(ws):
    res = run(_w_async_activations, ws)
    assert all(v == 12 for v in res.values())


def _w_hier(rank, ws):
    import torch.distributed as dist

    from accelerate_c.comm import HierarchicalGroup, get_group
    g = get_group(timeout=20)
    assert isinstance(g.inner, HierarchicalGroup), type(g)
    gen = torch.Generator().manual_seed(99 + rank)
    for dtype in (torch.float32, torch.int64, torch.bfloat16):
        for n in (1, 1001, 40000):
            for op in ("sum", "max", "avg"):
                if op == "avg" and not dtype.is_floating_point:
                    continue
                x = (torch.randn(n, generator=gen) * 50).to(dtype)
                ours = g.all_reduce(x.clone(), op)
                ref = _ref_all_reduce(x, op, ws)
                if dtype == torch.bfloat16:  # rounded once per level (host, then across hosts)
                    assert torch.allclose(ours.float(), ref.float(), rtol=2 ** -6, atol=1.0), (n, op)
                else:
                    assert _close(ours, ref, dtype), (dtype, n, op)
    x = torch.randn(1001, generator=gen)
    for src in range(ws):
        a, b = x.clone(), x.clone()
        g.broadcast(a, src)
        dist.broadcast(b, src)
        assert torch.equal(a, b), src
    big = torch.randn(9001 * ws, generator=gen)
    for src in range(ws):  # hosts A, B interleaved: the slabs regroup the blocks by host
        out = torch.empty(9001)
        g.scatter(out, big if rank == src else None, src)
        ref = torch.empty(9001)
        dist.scatter(ref, list(big.split(9001)) if rank == src else None, src=src)
        assert torch.equal(out, ref), ("scatter", src)
    gath = torch.empty(1001 * ws)
    g.all_gather(gath, x)
    lst = [torch.empty(1001) for _ in range(ws)]
    dist.all_gather(lst, x)
    assert torch.equal(gath, torch.cat(lst))
    y = torch.randn(8 * ws, generator=gen)
    out = torch.empty(8)
    g.reduce_scatter(out, y)
    assert torch.allclose(out, _ref_all_reduce(y, "sum", ws)[rank * 8:(rank + 1) * 8])
    w = g.all_reduce_async(x)
    w.wait(timeout=20)
    v = torch.randn(1001, generator=gen)  # the async activation collectives (on the local group's worker thread)
    ag, rs = torch.empty(1001 * ws), torch.empty(8)
    w1, w2 = g.all_gather_async(ag, v), g.reduce_scatter_async(rs, y)
    w1.wait(timeout=20), w2.wait(timeout=20)
    dist.all_gather(lst, v)
    assert torch.equal(ag, torch.cat(lst)) and torch.allclose(rs, out)
    b = g.alloc(50000)  # in-segment buffer through the hierarchical path
    src = torch.randn(50000, generator=gen)
    b.copy_(src)
    g.all_reduce(b)
    assert torch.allclose(b, _ref_all_reduce(src, "sum", ws), rtol=1e-5, atol=1e-4)
    g.barrier()
    from accelerate_c.comm import release_groups
    release_groups()
    return True


def test_hierarchical_two_fake_hosts():
    envs = [{"ACCELERATE_C_HOST_ID": h} for h in ("hostA", "hostB", "hostA", "hostB")]
    assert len(run(_w_hier, 4, envs=envs)) == 4


def _w_kill(rank, ws, tag):
    from accelerate_c.comm import ShmGroup
    g = ShmGroup(timeout=10, tag=tag)
    x = torch.ones(1000)
    g.all_reduce(x)
    if rank == ws - 1:
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    try:  # the staged path: peers wait for the dead rank; rank 1 goes through the async queue
        if rank == 1:
            g.all_reduce_async(torch.ones(100000)).wait()
        else:
            g.all_reduce(torch.ones(100000))
    except Exception as e:
        return (type(e).__name__, str(e))
    raise AssertionError("all_reduce with a dead peer did not raise")


def test_killed_peer_raises_and_leaves_nothing():
    tag = f"t{free_port()}"
    ws = 3
    res = run(_w_kill, ws, tag, allow_missing=(ws - 1,))
    for r in range(ws - 1):
        name, msg = res[r]
        assert "all_reduce" in msg and f"rank(s) {ws - 1}" in msg, msg
        # found by the liveness check ("died"), not by waiting out the 10 s timeout ("timed out")
        assert "died" in msg and "timed out" not in msg, msg
    assert glob.glob(f"/dev/shm/accc-{tag}-*") == []


def _w_mismatch(rank, ws):
    from accelerate_c.comm import ShmGroup, TorchGroup, get_group, release_groups
    grp = get_group(timeout=10)  # one host: pure shm
    assert isinstance(grp.inner, ShmGroup), type(grp)
    assert torch.equal(grp.all_reduce(torch.ones(3)), torch.full((3,), 2.0))
    release_groups()
    os.environ["ACCELERATE_C_COMM"] = "torch"
    grp = get_group()
    assert isinstance(grp, TorchGroup) and torch.equal(grp.all_reduce(torch.ones(3), "avg"), torch.ones(3))
    sc = torch.empty(2, 3)  # TorchGroup.scatter (gloo), a non-contiguous output, src 1
    grp.scatter(sc.t(), torch.arange(12.0).view(2, 3, 2) if rank == 1 else None, 1)
    assert torch.equal(sc.t(), torch.arange(6.0 * rank, 6.0 * rank + 6).view(3, 2)), sc
    release_groups()
    del os.environ["ACCELERATE_C_COMM"]
    out = {}
    g = ShmGroup(timeout=10)
    try:
        g.all_reduce(torch.ones(10 + rank))
    except RuntimeError as e:
        out["size"] = str(e)
    g.close()
    g = ShmGroup(timeout=10)
    try:
        g.all_reduce(torch.ones(10, dtype=torch.float32 if rank == 0 else torch.float64))
    except RuntimeError as e:
        out["dtype"] = str(e)
    g.close()
    g = ShmGroup(timeout=10)
    try:  # rank 0 scatters while rank 1 broadcasts
        if rank == 0:
            g.scatter(torch.empty(5), torch.ones(10), 0)
        else:
            g.broadcast(torch.empty(5), 0)
    except RuntimeError as e:
        out["scatter"] = str(e)
    g.close()
    g = ShmGroup(timeout=10)
    g.set_timeout(0.5)  # after creation: attaching is not what this checks
    flag = f"/tmp/accc-test-late-{os.environ['MASTER_PORT']}"
    if rank == 1:  # late for sure: only once rank 0 has given up waiting for it (no sleep that may be too short)
        deadline = time.monotonic() + 60  # a guard against a hang, not a timing check
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.01)
    try:
        g.all_reduce(torch.ones(10))
    except Exception as e:
        out["late"] = (rank, type(e).__name__, str(e))
    if rank == 0:
        open(flag, "w").close()
    else:
        os.unlink(flag)
    g.close()
    return out


def test_mismatch_and_timeout_are_clear_errors():
    res = run(_w_mismatch, 2)
    for r in (0, 1):
        assert "mismatched" in res[r]["size"] and "count=10" in res[r]["size"] and "count=11" in res[r]["size"]
        assert "mismatched" in res[r]["dtype"] and "float64" in res[r]["dtype"]
        assert "mismatched" in res[r]["scatter"] and "scatter(count=20" in res[r]["scatter"] \
            and "broadcast(count=20" in res[r]["scatter"], res[r]["scatter"]
    rank0 = res[0]["late"]
    assert rank0[1] == "TimeoutError" and "all_reduce" in rank0[2] and "rank(s) 1" in rank0[2], rank0
    assert "late" in res[1] and "timed out" in res[1]["late"][2]  # the late rank learns why the group died


def test_segment_permissions_and_unlink_on_timeout():
    name = f"/accc-test-{os.getpid()}-{free_port()}"
    h = _C.shm_group_open(name, True, 0, 2, 0, 0, 0.3)
    try:
        st = os.stat("/dev/shm" + name)
        assert st.st_mode & 0o777 == 0o600
        with pytest.raises(TimeoutError, match=r"rank\(s\) 1"):
            _C.shm_group_wait_attached(h)
        assert not os.path.exists("/dev/shm" + name)
    finally:
        _C.shm_group_close(h)
    h2 = _C.shm_group_open(name, True, 0, 2, 0, 0, 1.0)
    with pytest.raises(OSError):  # O_EXCL: a second creator of the same name fails
        _C.shm_group_open(name, True, 0, 2, 0, 0, 1.0)
    _C.shm_group_close(h2)
    assert not os.path.exists("/dev/shm" + name)  # closed before everyone attached: unlinked
    h1 = _C.shm_group_open(name, True, 0, 1, 0, 0, 1.0)
    assert not os.path.exists("/dev/shm" + name)  # all (one) ranks attached: unlinked at once
    _C.shm_group_close(h1)
    fd = _C.shm_region_fd(name + "r", True, 8192)
    try:
        assert os.fstat(fd).st_mode & 0o777 == 0o600
    finally:
        os.close(fd)
        _C.shm_unlink(name + "r")


def test_single_process_group():
    from accelerate_c.comm import ShmGroup
    g = ShmGroup(timeout=5)
    x = torch.arange(10.0)
    assert torch.equal(g.all_reduce(x.clone(), "avg"), x)
    b = g.alloc(100)
    b.fill_(2)
    g.all_reduce(b)
    assert bool((b == 2).all())
    g.close()


def test_region_larger_than_dev_shm_is_a_clear_error():
    """A region /dev/shm cannot hold fails at alloc() (posix_fallocate: ENOSPC) with a message naming
    /dev/shm, instead of a SIGBUS at the first touch of a missing page later; nothing is left behind and
    the group stays usable."""
    from accelerate_c.comm import ShmGroup
    st = os.statvfs("/dev/shm")
    too_big = st.f_blocks * st.f_frsize + (1 << 30)
    before = set(os.listdir("/dev/shm"))
    g = ShmGroup(timeout=5)
    with pytest.raises(RuntimeError, match=r"no room for \d+ bytes in /dev/shm"):
        g.alloc(too_big // 4, torch.float32)
    b = g.alloc(1000)
    b.fill_(3)
    assert float(g.all_reduce(b).sum()) == 3000.0
    g.close()
    # (this process's segments only: other test workers may be creating theirs meanwhile)
    assert not {n for n in set(os.listdir("/dev/shm")) - before if n.startswith("accc-") and f"-{os.getpid()}-" in n}
