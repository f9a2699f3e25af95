# accelerate_c/comm/p2p.py: point-to-point channels between the ranks of a process group, for pipeline stages: a
# fixed list of directed channels (channel i: src -> dst, group ranks), each a FIFO of tagged messages. Two
# transports with one interface, chosen in comm/group.py (p2p_for_device):
#   ShmP2P: every rank on this host: a single-producer/single-consumer ring per channel in a shared region of the
#     group's ShmGroup (csrc/shm/shm_p2p.c: a C progress thread per process moves the bytes without the GIL, so sends
#     overlap compute and receives posted ahead land while the caller computes; errors and aborts are the group's);
#   TorchP2P: torch.distributed isend/irecv on the process group (across hosts, other devices, ACCELERATE_C_COMM=
#     torch); waits poll, and an abort is a key in the default store that peers check while they wait.
# Interface: send(channel, tensor, tag) / recv(channel, tensor, tag) -> a work with wait() (the tensor, contiguous,
# must stay untouched until then); broadcast(tensor, src) and all_reduce(tensor) (sum) over the same group, which an
# abort also interrupts; abort(message): every peer's pending and later waits raise naming it; close().
# Not for: which channels a pipeline needs or what the messages mean (pipeline/runtime.py).
from __future__ import annotations

import threading
import time
import uuid
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from accelerate_c import _C
from accelerate_c.base.process_local import ProcessLocal
from accelerate_c.comm.shm import ShmGroup, pg_timeout

BELL_BYTES = 4096


def _bytes(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError("p2p: tensors must be contiguous")
    return t.detach().reshape(-1).view(torch.uint8)


class ShmWork:
    __slots__ = ("_h", "_ticket", "_tensor")

    def __init__(self, h: Any, ticket: int, tensor: torch.Tensor) -> None:
        self._h, self._ticket, self._tensor = h, ticket, tensor

    def is_completed(self) -> bool:
        return self._tensor is None or bool(_C.p2p_done(self._h, self._ticket))

    def wait(self) -> None:
        if self._tensor is not None:
            _C.p2p_wait(self._h, self._ticket)
            self._tensor = None


class ShmP2P(ProcessLocal):
    """Channels between the ranks of `group` (a ShmGroup); collective: every rank passes the same channel list."""

    name = "shm"

    def __init__(self, group: ShmGroup, channels: Sequence[tuple], *, nslots: int = 4,
                 slot_bytes: int = 1 << 20) -> None:
        self.group, self.channels = group, [tuple(c) for c in channels]
        self.rank, self.size = group.rank, group.size
        ring = _C.p2p_ring_bytes(nslots, slot_bytes)
        offsets, used = [], [BELL_BYTES] * group.size
        for src, dst in self.channels:
            if not (0 <= src < group.size and 0 <= dst < group.size and src != dst):
                raise ValueError(f"p2p channel {src} -> {dst} is not between two ranks of a group of {group.size}")
            offsets.append(used[dst])
            used[dst] += ring
        part = max(used)
        mine = group.alloc(part, torch.uint8)  # collective: zeroed, every rank's part mapped by every rank
        self._region, part_bytes = group.region_of(mine)
        self._h = _C.p2p_open(group._h, self._region, part_bytes,
                              [(s, d, o) for (s, d), o in zip(self.channels, offsets)], nslots, slot_bytes)
        group.on_close(self.close)

    def send(self, channel: int, tensor: torch.Tensor, tag: int) -> ShmWork:
        return ShmWork(self._h, _C.p2p_post(self._h, channel, True, _bytes(tensor), tag), tensor)

    def recv(self, channel: int, tensor: torch.Tensor, tag: int) -> ShmWork:
        return ShmWork(self._h, _C.p2p_post(self._h, channel, False, _bytes(tensor), tag), tensor)

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        return self.group.broadcast(tensor, src)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(tensor, "sum")

    def abort(self, message: str) -> None:
        if self._h is not None:
            _C.p2p_abort(self._h, message)

    def close(self) -> None:
        h, self._h = getattr(self, "_h", None), None
        if h is not None:
            _C.p2p_close(h)


class TorchWork:
    __slots__ = ("_work", "_owner", "_what")

    def __init__(self, work: Any, owner: "TorchP2P", what: str) -> None:
        self._work, self._owner, self._what = work, owner, what

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()

    def wait(self) -> None:
        if self._work is not None:
            self._owner._poll(self._work, self._what)
            self._work = None


class TorchP2P(ProcessLocal):
    """Channels over torch.distributed on `pg` (see the header); collective: every rank passes the same list."""

    name = "torch"

    def __init__(self, pg: Optional[dist.ProcessGroup], channels: Sequence[tuple], *,
                 timeout: Optional[float] = None) -> None:
        self.pg, self.channels = pg, [tuple(c) for c in channels]
        self.rank, self.size = dist.get_rank(pg), dist.get_world_size(pg)
        self.timeout = float(timeout) if timeout is not None else pg_timeout(pg)
        try:
            self._store = dist.distributed_c10d._get_default_store()
        except Exception:  # no store to publish an abort on: waits end at the timeout
            self._store = None
        box = [uuid.uuid4().hex if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=self._global(0), group=pg)
        self._key, self._next_check = f"accelerate_c/p2p_abort/{box[0]}", 0.0

    def _global(self, r: int) -> int:
        return dist.get_global_rank(self.pg, r) if self.pg is not None else r

    def _aborted(self, force: bool = False) -> Optional[str]:
        now = time.monotonic()
        if self._store is None or (now < self._next_check and not force):
            return None
        self._next_check = now + 0.1
        try:
            if self._store.check([self._key]):
                return self._store.get(self._key).decode(errors="replace")
        except Exception as e:  # the store's host (rank 0 or the launcher) is gone: so is the job
            return f"the rendezvous store is unreachable ({type(e).__name__}: {e})"
        return None

    def _poll(self, work: Any, what: str) -> None:
        """Waits for `work` on a helper thread (gloo's works report completion only through wait()) while this one
        watches the abort key and the deadline."""
        done, err = threading.Event(), []

        def waiter() -> None:
            try:
                work.wait()
            except BaseException as e:  # re-raised below
                err.append(e)
            done.set()

        threading.Thread(target=waiter, daemon=True, name="accelerate_c-p2p-wait").start()
        start = time.monotonic()
        while not done.wait(0.02):
            msg = self._aborted()
            if msg is not None:
                raise RuntimeError(f"p2p {what} aborted on rank {self.rank}: {msg}")
            if time.monotonic() - start > self.timeout:
                raise TimeoutError(f"p2p {what} on rank {self.rank}: timed out after {self.timeout:.1f} s")
        if err:
            # A peer that aborted may have exited right after publishing why, closing its connections: the wait
            # fails with the transport's "connection closed" before the poll above saw the key. The reason wins.
            msg = self._aborted(force=True)
            if msg is not None:
                raise RuntimeError(f"p2p {what} aborted on rank {self.rank}: {msg}") from err[0]
            raise err[0]

    def send(self, channel: int, tensor: torch.Tensor, tag: int) -> TorchWork:
        src, dst = self.channels[channel]
        w = dist.isend(tensor.detach(), dst=self._global(dst), group=self.pg, tag=channel)
        return TorchWork(w, self, f"send of tag {tag} to rank {dst}")

    def recv(self, channel: int, tensor: torch.Tensor, tag: int) -> TorchWork:
        src, dst = self.channels[channel]
        w = dist.irecv(tensor, src=self._global(src), group=self.pg, tag=channel)
        return TorchWork(w, self, f"recv of tag {tag} from rank {src}")

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        self._poll(dist.broadcast(tensor, src=self._global(src), group=self.pg, async_op=True), "broadcast")
        return tensor

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self._poll(dist.all_reduce(tensor, group=self.pg, async_op=True), "all_reduce")
        return tensor

    def abort(self, message: str) -> None:
        if self._store is not None:  # the first abort's message stays (a peer failing because of it adds nothing)
            self._store.compare_set(self._key, "", f"rank {self.rank} reported: {message}")

    def close(self) -> None:
        pass
