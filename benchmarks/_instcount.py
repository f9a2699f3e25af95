# benchmarks/_instcount.py: dynamic instruction counts of the Adam kernels (torch's fused fp32 AdamW and ours with
# fp32, bf16 and 8-bit state), per element, on the host's own SIMD path. These VMs expose no hardware counters, so a
# worker process is single-stepped under ptrace (Linux x86-64): it stops itself with SIGSTOP around each kernel
# call, the tracer counts the instructions between the two stops, and the count per element is the difference
# between two sizes (the fixed cost of the call cancels). The kernel call is the one the optimizer's step makes,
# recorded during a warm step and replayed with one thread. ~45k steps/s here: a few seconds per kernel.
# Not for: timing (optimizer.py) or correctness (tests/test_optim*.py).
from __future__ import annotations

import ctypes
import os
import select
import signal
import subprocess
import sys
import time
from typing import Callable

KINDS = {"torch AdamW(fused=True) fp32": "torch", "accelerate_c AdamW fp32 state": "fp32",
         "accelerate_c AdamW bf16 state": "bf16", "accelerate_c AdamW 8-bit state": "8bit"}
PTRACE_CONT, PTRACE_SINGLESTEP, PTRACE_SEIZE = 7, 9, 0x4206


class TraceError(RuntimeError):
    """Counting is not possible here (no ptrace, worker failed, deadline passed); the message says why."""


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    libc.ptrace.restype = ctypes.c_long
    return libc


def trace_regions(argv: list[str], n_regions: int, timeout: float = 300.0) -> list[int]:
    """Runs `argv` (a worker speaking this module's protocol: it prints one line, waits for one byte on stdin, then
    brackets each region with two SIGSTOPs to itself) and returns the instructions its main thread executed in each
    of `n_regions` regions. Raises TraceError with the reason when it cannot."""
    if sys.platform != "linux" or os.uname().machine != "x86_64":
        raise TraceError(f"needs Linux on x86-64 (this is {sys.platform} {os.uname().machine})")
    libc = _libc()
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + timeout
    counts: list[int] = []
    try:
        if not select.select([proc.stdout], [], [], timeout)[0]:
            raise TraceError(f"worker did not start within {timeout:.0f} s")
        if proc.stdout.readline().strip() != b"ready":
            raise TraceError(f"worker did not start: {proc.communicate(timeout=30)[1].decode()[-2000:]}")
        if libc.ptrace(PTRACE_SEIZE, proc.pid, None, None) != 0:
            raise TraceError(f"ptrace(PTRACE_SEIZE) refused: {os.strerror(ctypes.get_errno())}")
        proc.stdin.write(b"g")
        proc.stdin.flush()
        stepping = False
        while len(counts) < n_regions or stepping:
            st = _wait(proc.pid, deadline, polling=not stepping)
            if os.WIFEXITED(st) or os.WIFSIGNALED(st):
                raise TraceError(f"worker ended after {len(counts)} of {n_regions} regions: "
                                 f"{proc.stderr.read().decode()[-2000:]}")
            sig = os.WSTOPSIG(st)
            if sig == signal.SIGSTOP:  # a marker: suppress it, start or end a region
                stepping = not stepping
                if stepping:
                    counts.append(0)
            elif stepping and sig == signal.SIGTRAP:
                counts[-1] += 1
                sig = 0
            if stepping and counts[-1] % 65536 == 0 and time.monotonic() > deadline:
                raise TraceError(f"deadline of {timeout:.0f} s passed in region {len(counts)}")
            inject = 0 if sig in (0, signal.SIGSTOP) else sig
            libc.ptrace(PTRACE_SINGLESTEP if stepping else PTRACE_CONT, proc.pid, None, ctypes.c_void_p(inject))
        return counts
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        for f in (proc.stdin, proc.stdout, proc.stderr):
            f.close()


def _wait(pid: int, deadline: float, polling: bool) -> int:
    """waitpid with a deadline: a running (not single-stepped) worker is polled so a hang cannot block us."""
    while True:
        got, st = os.waitpid(pid, os.WNOHANG if polling else 0)
        if got:
            return st
        if time.monotonic() > deadline:
            raise TraceError("deadline passed while the worker ran")
        time.sleep(0.002)


def per_element(kinds: list[str], sizes: tuple[int, ...] = (4096, 12288), timeout: float = 300.0) -> dict[str, list[int]]:
    """Instruction counts of each kind's kernel call (KINDS' values) at each size, on one thread: {kind: [count at
    sizes[0], ...]}. Per element: (last - first) / (sizes[-1] - sizes[0]). Raises TraceError when it cannot count."""
    sizes = (sizes[0], *sizes)  # each kind's first region runs a few hundred more (first-call paths): not reported
    argv = [sys.executable, os.path.abspath(__file__), "--worker", ",".join(kinds), ",".join(map(str, sizes))]
    counts = trace_regions(argv, len(kinds) * len(sizes), timeout)
    return {k: counts[i * len(sizes) + 1:(i + 1) * len(sizes)] for i, k in enumerate(kinds)}


# ---- the worker (a fresh interpreter: one thread, nothing forked from a process with a thread pool) -------------

def _replayer(kind: str, n: int) -> Callable[[], object]:
    """The kernel call of one warm step of `kind` on one n-element parameter, as a no-argument callable."""
    import torch

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from accelerate_c import optim as aopt
    from accelerate_c.optim import _fused

    p = torch.nn.Parameter(torch.randn(n) * 0.02)
    p.grad = torch.randn(n) * 1e-3
    kw = dict(lr=1e-4, weight_decay=0.01)
    if kind == "torch":
        opt, owner, name = torch.optim.AdamW([p], fused=True, **kw), torch, "_fused_adamw_"
    else:
        opt = aopt.AdamW([p], state_dtype={"fp32": None, "bf16": torch.bfloat16, "8bit": "8bit"}[kind], **kw)
        owner, name = _fused._C, "adam_step"
    opt.step()
    calls: list = []
    real = getattr(owner, name)
    if kind == "torch":
        setattr(owner, name, lambda *a, **k: (calls.append((a, k)), real(*a, **k))[1])
    else:
        class Rec:  # _fused's _C, with adam_step recorded
            def __getattr__(self, attr):
                return getattr(owner, attr)

            def adam_step(self, *a, **k):
                calls.append((a, k))
                return real(*a, **k)
        _fused._C = Rec()
    try:
        opt.step()
    finally:
        if kind == "torch":
            setattr(owner, name, real)
        else:
            _fused._C = owner
    if len(calls) != 1:
        raise RuntimeError(f"{kind}: expected one kernel call in a step, saw {len(calls)}")
    a, k = calls[0]
    return lambda: real(*a, **k)


def _worker(kinds: list[str], sizes: list[int]) -> None:
    import torch

    torch.set_num_threads(1)
    calls = [_replayer(k, n) for k in kinds for n in sizes]
    for c in calls:  # warm: first-call paths (lazy tables, page faults) stay out of the count
        c()
    print("ready", flush=True)
    sys.stdin.read(1)
    me = os.getpid()
    for c in calls:
        os.kill(me, signal.SIGSTOP)
        c()
        os.kill(me, signal.SIGSTOP)


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "--worker":
    _worker(sys.argv[2].split(","), [int(s) for s in sys.argv[3].split(",")])
