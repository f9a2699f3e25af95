# shm.py: ShmGroup, collectives between the ranks of one host over POSIX shared memory (accelerate_c._C).
# Not for: ranks on several hosts (hierarchical.py), choosing a transport (group.py), or gradient bucketing
# (the DDP strategy builds on alloc() + all_reduce()/all_reduce_async()).
#
# Creation is collective over a torch.distributed process group whose ranks all live on this host: group
# rank 0 creates the segment (O_EXCL, 0600, unguessable name), the name travels by broadcast_object_list, the
# others attach, and the last one to attach unlinks the name, so nothing is left in /dev/shm even if a rank is
# SIGKILLed later; what a kill before that leaves is reclaimed (shm_segments.py). Every collective must be
# issued by every rank of the group in the same order (mismatches raise on every rank; a dead or late peer
# raises after the timeout, which defaults to the process group's timeout).
from __future__ import annotations

import queue
import threading
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from accelerate_c import _C
from accelerate_c.base import settings
from accelerate_c.base.process_local import ProcessLocal
from accelerate_c.comm.shm_memory import SharedRegions
from accelerate_c.comm.shm_segments import open_group

# "sum_div": the sum rounded to the dtype, then divided by the group size (torch's all_reduce(SUM); t /= n,
# which is what HF Accelerate's reduce(..., "mean") computes); "avg" divides the unrounded sum (DDP).
_OPS = {"sum": 0, "avg": 1, "mean": 1, "max": 2, "min": 3, "sum_div": 4}


def _op_code(op: Any) -> int:
    code = _OPS.get(op) if isinstance(op, str) else None
    if code is not None:
        return code
    if isinstance(op, int) and 0 <= op <= 4:  # already a code (0 sum, 1 avg, 2 max, 3 min, 4 sum_div)
        return op
    if isinstance(op, str):
        if op.lower() not in _OPS:
            raise ValueError(f"unknown reduction op {op!r} (sum, avg, max, min, sum_div)")
        return _OPS[op.lower()]
    names = {dist.ReduceOp.SUM: 0, dist.ReduceOp.AVG: 1, dist.ReduceOp.MAX: 2, dist.ReduceOp.MIN: 3}
    for k, v in names.items():
        if op == k:
            return v
    raise ValueError(f"unsupported reduction op {op!r} for the shm transport")


def pg_timeout(pg: Optional[dist.ProcessGroup]) -> float:
    """Seconds of the process group's timeout (torch's default when it cannot be read)."""
    try:
        g = pg if pg is not None else dist.distributed_c10d._get_default_group()
        return g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except Exception:
        t = dist.distributed_c10d.default_pg_timeout
        return t.total_seconds() if isinstance(t, timedelta) else 1800.0


def check_scatter_input(output: torch.Tensor, input: Optional[torch.Tensor], size: int, rank: int) -> torch.Tensor:
    """The scatter source's input, checked (size * output.numel() elements), contiguous, of output's dtype."""
    if input is None:
        raise ValueError(f"scatter: rank {rank} is the source and passed no input")
    if input.numel() != size * output.numel():
        raise ValueError(f"scatter: rank {rank}'s input has {input.numel()} elements, expected {size} x "
                         f"{output.numel()} (the group size times the output's)")
    if input.dtype != output.dtype:
        raise ValueError(f"scatter: rank {rank}'s input is {input.dtype}, its output {output.dtype}")
    return input.contiguous()


class Work:
    """Handle of an async collective: wait() blocks until it finished and re-raises its error."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: Optional[BaseException] = None

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: Optional[float] = None) -> bool:
        if not self._done.wait(timeout):
            return False
        if self._error is not None:
            raise self._error
        return True


class ShmWork:
    """Handle of a queued async collective on the group's C worker thread (holds its tensors alive)."""

    __slots__ = ("_h", "_ticket", "_tensor", "_done")

    def __init__(self, h: Any, ticket: int, tensor: torch.Tensor) -> None:
        self._h, self._ticket, self._tensor, self._done = h, ticket, tensor, False

    def is_completed(self) -> bool:
        return self._done or bool(_C.shm_done(self._h, self._ticket))

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Blocks (GIL released) until done; raises the collective's error. `timeout` is accepted for
        interface parity; the group's own timeout bounds the wait."""
        if not self._done:
            _C.shm_wait(self._h, self._ticket)
            self._done, self._tensor = True, None
        return True


class ShmGroup(ProcessLocal, SharedRegions):
    """Collectives among the ranks of `pg` (all on this host) through one shared-memory segment."""

    def __init__(self, pg: Optional[dist.ProcessGroup] = None, *, timeout: Optional[float] = None,
                 small_bytes: int = 0, chunk_bytes: int = 0, tag: Optional[str] = None) -> None:
        self.pg = pg
        init = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(pg) if init else 0
        self.size = dist.get_world_size(pg) if init else 1
        self.timeout = float(timeout) if timeout is not None else (pg_timeout(pg) if init else 1800.0)
        self._regions: list = []  # alloc()'s regions (shm_memory._Region), in registration order
        self._queue: Optional[queue.SimpleQueue] = None
        self._pending: list[Work] = []
        self._lock = threading.Lock()
        self._dependents: list[Callable[[], None]] = []  # closed before the segment (p2p channels over it)
        self._h, self.name = open_group(self, small_bytes, chunk_bytes, tag or settings.env_value("MASTER_PORT", "0"))

    # ---- collective plumbing over the bootstrap process group ------------------------------------------
    def _share(self, obj: Any) -> Any:
        if self.size == 1:
            return obj
        lst = [obj]
        dist.broadcast_object_list(lst, src=dist.get_global_rank(self.pg, 0) if self.pg is not None else 0,
                                   group=self.pg)
        return lst[0]

    def _gather(self, obj: Any) -> list:
        if self.size == 1:
            return [obj]
        out: list = [None] * self.size
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    # ---- async support: one worker thread runs queued ops in FIFO order (the C call drops the GIL) ----
    def submit(self, fn: Callable[[], None]) -> Work:
        """Runs fn() on the group's worker thread after every op queued before it; returns its Work."""
        w = Work()
        with self._lock:
            if self._queue is None:
                self._queue = queue.SimpleQueue()
                threading.Thread(target=self._worker, args=(self._queue,), daemon=True,
                                 name="accelerate_c-shm").start()
            self._pending.append(w)
        self._queue.put((fn, w))
        return w

    @staticmethod
    def _worker(q: queue.SimpleQueue) -> None:
        while True:
            item = q.get()
            if item is None:
                return
            fn, w = item
            try:
                fn()
            except BaseException as e:  # surfaced by Work.wait()
                w._error = e
            w._done.set()

    def synchronize(self) -> None:
        """Waits for every async op issued so far (re-raising the first error)."""
        with self._lock:
            pending, self._pending = self._pending, []
        for w in pending:
            w.wait()

    # ---- collectives -------------------------------------------------------------------------------------
    # Every synchronous op first waits for the async queue (`if self._pending`), then makes one C call: these
    # are the everyday calls (reduce/gather of a metric, wait_for_everyone), so no closures or extra layers.
    def all_reduce(self, tensor: torch.Tensor, op: Any = "sum") -> torch.Tensor:
        """In-place all-reduce of a CPU tensor (zero-copy when it lives in alloc() memory)."""
        code = _op_code(op)
        if self._pending:
            self.synchronize()
        if not tensor.is_contiguous():  # rare: reduce into a contiguous copy, then copy back
            tmp = tensor.contiguous()
            _C.shm_all_reduce(self._h, tmp, code)
            return tensor.copy_(tmp)
        _C.shm_all_reduce(self._h, tensor, code)
        return tensor

    def all_reduce_into(self, output: torch.Tensor, input: torch.Tensor, op: Any = "sum") -> torch.Tensor:
        """output = reduction over ranks of input (contiguous CPU tensors of one dtype and size, not
        overlapping); input is only read: no copy of it is made."""
        code = _op_code(op)
        if self._pending:
            self.synchronize()
        _C.shm_all_reduce_out(self._h, input, output, code)
        return output

    # raw ops: no ordering with the async queue (for callers already on the worker thread, e.g.
    # HierarchicalGroup's async path); everything else should use the public methods.
    def raw_all_reduce(self, tensor: torch.Tensor, op: Any = "sum") -> None:
        _C.shm_all_reduce(self._h, tensor, _op_code(op))

    def raw_all_reduce_into(self, output: torch.Tensor, input: torch.Tensor, op: Any = "sum") -> None:
        _C.shm_all_reduce_out(self._h, input, output, _op_code(op))

    def raw_broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        _C.shm_broadcast(self._h, tensor, src)

    def raw_scatter(self, output: torch.Tensor, input: Optional[torch.Tensor], src: int = 0) -> None:
        """`output` contiguous; `input` (on src) checked and contiguous."""
        _C.shm_scatter(self._h, input, output, src)

    def raw_all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        _C.shm_all_gather(self._h, input, output)

    def raw_reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: Any = "sum") -> None:
        _C.shm_reduce_scatter(self._h, input, output, _op_code(op))

    def all_reduce_async(self, tensor: torch.Tensor, op: Any = "sum") -> ShmWork:
        """Queues an in-place all-reduce on the group's C worker thread (no GIL, issue order) and returns at
        once; wait() on the result before touching `tensor`. Synchronous collectives on this group wait for
        the queue first. Submit from one thread only."""
        code = _op_code(op)
        if self._pending:
            self.synchronize()
        return ShmWork(self._h, _C.shm_all_reduce_start(self._h, tensor, code), tensor)

    def reduce_scatter_async(self, output: torch.Tensor, input: torch.Tensor, op: Any = "sum") -> ShmWork:
        """reduce_scatter queued on the C worker thread (after every op queued before it); wait() on the result
        before touching either tensor (contiguous CPU tensors)."""
        code = _op_code(op)
        if self._pending:
            self.synchronize()
        return ShmWork(self._h, _C.shm_reduce_scatter_start(self._h, input, output, code), (input, output))

    def all_gather_async(self, output: torch.Tensor, input: torch.Tensor) -> ShmWork:
        """all_gather queued on the C worker thread; wait() before touching either tensor."""
        if self._pending:
            self.synchronize()
        return ShmWork(self._h, _C.shm_all_gather_start(self._h, input, output), (input, output))

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: Any = "sum") -> torch.Tensor:
        """output = reduction over ranks of input[rank*n:(rank+1)*n] (n = output.numel())."""
        code = _op_code(op)
        if self._pending:
            self.synchronize()
        _C.shm_reduce_scatter(self._h, input, output, code)
        return output

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
        """output (size * input.numel() elements) = every rank's input in rank order."""
        if self._pending:
            self.synchronize()
        _C.shm_all_gather(self._h, input, output)
        return output

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """In-place broadcast from group rank `src`."""
        if self._pending:
            self.synchronize()
        if not tensor.is_contiguous():
            tmp = tensor.contiguous()
            _C.shm_broadcast(self._h, tmp, src)
            return tensor.copy_(tmp)
        _C.shm_broadcast(self._h, tensor, src)
        return tensor

    def scatter(self, output: torch.Tensor, input: Optional[torch.Tensor], src: int = 0) -> torch.Tensor:
        """output = block `rank` of src's input (size * output.numel() elements; read on src only, None
        elsewhere). Zero-copy for the peers when src's input lives in alloc() memory; src's own block is copied."""
        if self._pending:
            self.synchronize()
        inp = check_scatter_input(output, input, self.size, self.rank) if self.rank == src else None
        if not output.is_contiguous():
            tmp = output.contiguous()
            _C.shm_scatter(self._h, inp, tmp, src)
            return output.copy_(tmp)
        _C.shm_scatter(self._h, inp, output, src)
        return output

    def barrier(self) -> None:
        """Every rank of the group arrives before any leaves. The wait spins ~50 us, then sleeps on a futex
        (a rank waiting for a peer's long job costs no CPU); a dead peer or the timeout raises."""
        if self._pending:
            self.synchronize()
        _C.shm_barrier(self._h)

    def set_timeout(self, seconds: float) -> None:
        self.timeout = float(seconds)
        _C.shm_set_timeout(self._h, self.timeout)

    def on_close(self, fn: Callable[[], None]) -> None:
        """Runs fn() when the group closes, before its segment is unmapped (users of the C group handle)."""
        self._dependents.append(fn)

    def host_group(self) -> "ShmGroup":
        """The shared-memory group of this host's ranks: this group."""
        return self

    def close(self) -> None:
        """Waits for async work, then unmaps the control segment. Tensors from alloc() stay valid."""
        if getattr(self, "_h", None) is None:
            return
        try:
            self.synchronize()
        finally:
            for fn in reversed(self._dependents):
                fn()
            self._dependents.clear()
            if self._queue is not None:
                self._queue.put(None)
                self._queue = None
            _C.shm_group_close(self._h)
            self._h = None
            self._regions.clear()

    def __del__(self) -> None:  # best effort
        try:
            self.close()
        except Exception:
            pass
