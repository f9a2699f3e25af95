# tests/test_p2p.py: the point-to-point channels of accelerate_c/comm/p2p.py between real spawned processes: messages
# of every size (empty, one chunk, many chunks through a ring smaller than the message) and dtype arrive intact and in
# order with receives posted ahead, both directions at once (no deadlock when both sides send more than a ring
# holds), over the shm rings and over torch's isend/irecv (the same results); a receive that expects another tag
# fails on both ranks naming the tags; an abort, and a peer that dies, end the peers' waits promptly with the reason
# (and the dead maker's segments are not left in /dev/shm).
# Not for: pipeline schedules (test_pipeline_*.py), collectives (test_shm.py).
import os
import time

import pytest
import torch
from test_shm import run

SMALL = {"nslots": 2, "slot_bytes": 256}  # rings far smaller than the messages: every message streams


def _transport(kind, ws):
    import accelerate_c.comm.group as grp
    chans = [(r, (r + 1) % ws) for r in range(ws)] + [((r + 1) % ws, r) for r in range(ws)]
    if kind == "shm":
        return grp.p2p_for_device(torch.device("cpu"), None, chans, **SMALL), chans
    return grp.p2p_for_device(torch.device("cpu"), None, chans, transport="torch"), chans


def _messages(seed):
    g = torch.Generator().manual_seed(seed)
    out = [torch.empty(0), torch.randn(3, generator=g), torch.randn(1000, 7, generator=g),
           torch.randint(0, 100, (333,), generator=g), torch.randn(64, generator=g).to(torch.bfloat16),
           torch.rand(517, generator=g) > 0.5]
    return out


def _exchange(rank, ws, kind):
    t, chans = _transport(kind, ws)
    nxt = chans.index((rank, (rank + 1) % ws))
    prv_in = chans.index(((rank - 1) % ws, rank))
    back_out = chans.index((rank, (rank - 1) % ws))
    back_in = chans.index(((rank + 1) % ws, rank))
    mine, theirs = _messages(rank), _messages((rank - 1) % ws)
    back_theirs = _messages(100 + (rank + 1) % ws)
    # receives posted ahead of the sends, in both directions; every message is larger than a ring
    bufs = [torch.empty_like(x) for x in theirs] + [torch.empty_like(x) for x in back_theirs]
    works = [t.recv(prv_in, b, 7 + i) for i, b in enumerate(bufs[:len(theirs)])]
    works += [t.recv(back_in, b, 70 + i) for i, b in enumerate(bufs[len(theirs):])]
    works += [t.send(nxt, x, 7 + i) for i, x in enumerate(mine)]
    works += [t.send(back_out, x, 70 + i) for i, x in enumerate(_messages(100 + rank))]
    for w in works:
        w.wait()
    for got, want in zip(bufs, theirs + back_theirs):
        assert torch.equal(got, want), (got, want)
    one = torch.tensor([float(rank + 1)])
    t.all_reduce(one)
    assert one.item() == ws * (ws + 1) / 2
    b = torch.tensor([rank * 1.0])
    t.broadcast(b, ws - 1)
    assert b.item() == ws - 1
    t.close()
    return t.name


@pytest.mark.parametrize("kind", ["shm", "torch"])
def test_exchange(kind):
    names = run(_exchange, 3, kind)
    assert set(names.values()) == {kind}


def _mismatch(rank, ws):
    t, chans = _transport("shm", ws)
    x = torch.arange(10.0)
    try:
        if rank == 0:
            t.send(chans.index((0, 1)), x, 5).wait()
            time.sleep(1.0)  # the receiver's failure aborts the group: a later wait here sees it
            t.recv(chans.index((1, 0)), torch.empty(3), 9).wait()
        else:
            t.recv(chans.index((0, 1)), torch.empty(10), 6).wait()
    except Exception as e:
        return str(e)
    return "no error"


def test_tag_mismatch():
    out = run(_mismatch, 2)
    assert "expected message tag 6 of 40 bytes" in out[1] and "got tag 5 of 40 bytes" in out[1], out[1]
    assert "aborted" in out[0] and "tag 6" in out[0], out[0]


def _abort(rank, ws, kind):
    t, chans = _transport(kind, ws)
    if rank == 0:
        time.sleep(0.5)
        t.abort("stage 0 raised ValueError('boom')")
        time.sleep(2.0)  # rank 0 hosts the store in this runner: keep it up while the peer reads the reason
        return "aborted"
    t0 = time.monotonic()
    try:
        t.recv(chans.index((0, 1)), torch.empty(4), 1).wait()
    except Exception as e:
        return f"{type(e).__name__}: {e} after {time.monotonic() - t0:.2f}"
    return "no error"


@pytest.mark.parametrize("kind", ["shm", "torch"])
def test_abort_stops_the_peer(kind):
    out = run(_abort, 2, kind, timeout=60)
    assert "boom" in out[1] and "RuntimeError" in out[1], out[1]
    assert float(out[1].rsplit(" ", 1)[1]) < 5.0, out[1]


def _dies(rank, ws, pidfile):
    t, chans = _transport("shm", ws)
    if rank == 0:
        with open(pidfile, "w") as fh:
            fh.write(str(os.getpid()))  # rank 0 made the segments: their names carry its pid
        time.sleep(0.3)
        os._exit(0)
    try:
        t.recv(chans.index((0, 1)), torch.empty(4), 1).wait()
    except Exception as e:
        return str(e)
    return "no error"


def test_dead_peer(tmp_path):
    pidfile = str(tmp_path / "pid")
    out = run(_dies, 2, pidfile, allow_missing=(0,), timeout=60)
    assert "peer rank 0" in out[1] and "died" in out[1], out[1]
    pid = open(pidfile).read()
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("accc-") and f"-{pid}-" in n]  # nothing left


class _Store:
    def __init__(self, value):
        self.value = value

    def check(self, keys):
        return self.value is not None

    def get(self, key):
        return self.value.encode()


class _ClosedWork:
    def wait(self):
        raise RuntimeError("Connection closed by peer [127.0.0.1]:1234")


@pytest.mark.parametrize("published", [True, False])
def test_a_peer_that_aborts_and_exits_is_reported_by_its_reason(published):
    # A peer publishes its abort and exits at once: the wait fails with gloo's "connection closed" before the poll's
    # rate-limited look at the abort key. The reason must win (it was the raw gloo error before the fix, which made
    # test_pipeline_parity's failing-stage case flaky under CI).
    from accelerate_c.comm.p2p import TorchP2P
    t = object.__new__(TorchP2P)
    t.rank, t.timeout, t._key = 1, 30.0, "k"
    t._store = _Store("rank 0 reported: pipeline rank 0 raised ValueError: boom" if published else None)
    t._next_check = time.monotonic() + 3600  # the poll has just looked: the next regular look is far away
    with pytest.raises(RuntimeError) as info:
        t._poll(_ClosedWork(), "recv of tag 1 from rank 0")
    if published:
        assert "aborted on rank 1: rank 0 reported: pipeline rank 0 raised ValueError: boom" in str(info.value)
        assert "Connection closed" in str(info.value.__cause__)
    else:
        assert str(info.value) == "Connection closed by peer [127.0.0.1]:1234"
