# allreduce.py: benchmark of accelerate_c's shared-memory all_reduce against torch.distributed (gloo), fp32,
# 2 local processes (one thread each), side by side in the same run: our copy-in path on ordinary tensors,
# our zero-copy path on tensors from ShmGroup.alloc(), and gloo. Prints median latency (us), algorithm
# bandwidth (GB/s), the ratio vs gloo, and the zero-copy all_reduce_async().wait() round trip; by default appends a results block to benchmarks/RESULTS.md.
# Not for: correctness (tests/test_shm.py).
# Run: python benchmarks/allreduce.py [--quick] [--nprocs N] [--no-record]
import argparse
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from _results import append_results, median_time  # noqa: E402

SIZES = [4 << 10, 64 << 10, 1 << 20, 25 << 20, 64 << 20]
QUICK_SIZES = [4 << 10, 1 << 20]


def _reps(nbytes: int, quick: bool) -> int:
    r = 300 if nbytes <= 64 << 10 else 40 if nbytes <= 1 << 20 else 20 if nbytes <= 32 << 20 else 12
    return max(3, r // 5) if quick else r


def _median_us(fn, reps: int) -> float:
    return median_time(fn, reps, warmup=2) * 1e6


def worker(rank: int, ws: int, port: int, sizes: list, quick: bool, q) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ws)
    from accelerate_c.comm import ShmGroup
    g = ShmGroup(timeout=120)
    rows = []
    for nbytes in sizes:
        n = nbytes // 4
        reps = _reps(nbytes, quick)
        x = torch.ones(n)
        y = torch.ones(n)
        z = g.alloc(n)
        z.fill_(1)
        res = {}
        for _ in range(2):  # interleave twice, keep the best median of each (noisy shared box)
            dist.barrier()
            t = _median_us(lambda: dist.all_reduce(x), reps)
            res["gloo"] = min(res.get("gloo", 1e18), t)
            dist.barrier()
            t = _median_us(lambda: g.all_reduce(y), reps)
            res["copy"] = min(res.get("copy", 1e18), t)
            dist.barrier()
            t = _median_us(lambda: g.all_reduce(z), reps)
            res["zero"] = min(res.get("zero", 1e18), t)
            dist.barrier()
            t = _median_us(lambda: g.all_reduce_async(z).wait(), reps)  # + the C worker-thread hand-off
            res["async"] = min(res.get("async", 1e18), t)
        rows.append((nbytes, res["gloo"], res["copy"], res["zero"], res["async"]))
    if rank == 0:
        q.put(rows)
    g.close()
    dist.destroy_process_group()


def fmt_size(b: int) -> str:
    return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"


def table(rows: list) -> str:
    lines = ["| size | gloo us | gloo GB/s | shm copy-in us | GB/s | x gloo | shm zero-copy us | GB/s | x gloo "
             "| zero-copy async+wait us |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for nbytes, tg, tc, tz, ta in rows:
        bw = lambda t: nbytes / t / 1e3  # bytes/us -> GB/s
        lines.append(f"| {fmt_size(nbytes)} | {tg:.1f} | {bw(tg):.2f} | {tc:.1f} | {bw(tc):.2f} | {tg / tc:.1f}x | "
                     f"{tz:.1f} | {bw(tz):.2f} | {tg / tz:.1f}x | {ta:.1f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 sizes, few reps, no RESULTS.md")
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--no-record", action="store_true")
    a = ap.parse_args()
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    sizes = QUICK_SIZES if a.quick else SIZES
    procs = [ctx.Process(target=worker, args=(r, a.nprocs, port, sizes, a.quick, q)) for r in range(a.nprocs)]
    for p in procs:
        p.start()
    rows = q.get()
    for p in procs:
        p.join()
    out = table(rows)
    print(f"all_reduce fp32, {a.nprocs} processes x 1 thread, median latency; algbw = bytes / time")
    print(out)
    if not a.quick and not a.no_record:
        append_results("all_reduce (shm vs gloo), benchmarks/allreduce.py",
                       [f"all_reduce fp32, {a.nprocs} processes x 1 thread, median latency, torch {torch.__version__}",
                        "", out])


if __name__ == "__main__":
    main()
