# tests/scripts/parallel_probe.py: where acc_parallel_for runs its chunks (test_parallel.py): the OpenMP pool torch
# loaded (main thread), threads of its own (a helper thread, a forked child, openmp_pool=False), and the same bits
# from every kernel family either way. Writes JSON to argv[1].
import json
import os
import signal
import sys
import threading
import time

import torch

from accelerate_c import _C
from accelerate_c import optim as aopt


def kernels(seed: int) -> list:
    """An Adam step (fp32 and 8-bit state), a cast and a pack, each big enough to split over 2 threads."""
    g = torch.Generator().manual_seed(seed)
    n = 1 << 22
    p, grad = torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-2
    m, v = torch.zeros(n), torch.zeros(n)
    aopt.adamw_flat_(p, grad, m, v, 1, 1e-3, num_threads=2)
    q = torch.randn(n, generator=g)
    qm, qv = torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    am, av = torch.zeros(n // 256), torch.zeros(n // 256)
    aopt.adamw_flat_(q, grad, qm, qv, 1, 1e-3, exp_avg_absmax=am, exp_avg_sq_absmax=av, num_threads=2)
    src = torch.randn(1 << 23, generator=g)
    bf = torch.empty(src.numel(), dtype=torch.bfloat16)
    _C.cast(src, bf, None, None, 2)
    parts = [torch.randn(1 << 21, generator=g) for _ in range(3)]
    packed = torch.empty(3 * (1 << 21) + 5)
    _C.pack(packed, parts, [0, 1 << 21, 2 << 21], 2)
    return [p, m, v, q, qm, qv, am, av, bf, packed]


def main() -> None:
    out = {"libgomp_loaded": any("libgomp" in line for line in open("/proc/self/maps")),
           "main": _C.parallel_backend()}
    seen: list = []
    t = threading.Thread(target=lambda: seen.append(_C.parallel_backend()))
    t.start()
    t.join(60)
    out["helper_thread"] = seen[0] if seen else None
    torch.randn(1 << 22).sum()  # torch's pool has run a region: a child forked now inherits it without its threads
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # its multi-threaded kernels must run (on threads of their own) rather than wait for them
        src = torch.randn(1 << 23)
        _C.cast(src, torch.empty(src.numel(), dtype=torch.bfloat16), None, None, 2)
        os.write(w, _C.parallel_backend().encode())
        os._exit(0)
    deadline = time.monotonic() + 60
    while not os.waitpid(pid, os.WNOHANG)[0]:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.write(w, b"hung")
            break
        time.sleep(0.05)
    out["forked_child"] = os.read(r, 64).decode()
    pool = kernels(3)
    _C.set_options(openmp_pool=False)
    out["off"] = _C.parallel_backend()
    own = kernels(3)
    _C.set_options(openmp_pool=True)
    out["same_bits"] = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                           for a, b in zip(pool, own))
    with open(sys.argv[1], "w") as fh:
        json.dump(out, fh)


if __name__ == "__main__":
    main()
