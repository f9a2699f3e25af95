# everyday.py: the calls a training script makes every step or epoch, on 2 local CPU processes (one thread
# each), accelerate_c against HF Accelerate 1.15 in the same processes and the same run (rounds interleaved,
# medians): wait_for_everyone, reduce and gather of a 4 KiB tensor, reduce of 25 and 64 MiB. For the 4 KiB
# calls the raw transport call on the same tensor (the shm group's C call, output preallocated) is timed too:
# "ours - transport" is the Python around it. The 25/64 MiB reduce is also timed with comm.outbuf's cache off
# (a fresh output tensor each call, page faults included), to show what the cache buys.
# HF side: accelerate.utils.wait_for_everyone / reduce / gather, which HF's Accelerator methods call as is.
# Not for: correctness (tests/test_everyday_calls.py, tests/test_operations.py).
# Run: python benchmarks/everyday.py [--quick] [--no-record]
from __future__ import annotations

import argparse
import os
import queue
import socket
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from _results import append_results  # noqa: E402


def _per_call(fn, reps: int, batch: int) -> float:
    """Median over `reps` batches of (time of `batch` back-to-back calls) / batch. Each call is a collective
    both ranks make, so a batch's time is the throughput both see; timing single calls instead would credit
    whichever rank arrives last with a wait-free call."""
    for _ in range(max(2, batch // 10)):
        fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(batch):
            fn()
        out.append((time.perf_counter() - t) / batch)
    return statistics.median(out)


def worker(rank: int, port: int, quick: bool, q) -> None:
    try:
        _worker(rank, port, quick, q)
    except BaseException:
        import traceback
        q.put(("error", rank, traceback.format_exc()))
        os._exit(1)


def _worker(rank: int, port: int, quick: bool, q) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    import torch.distributed as dist

    import accelerate_c
    from accelerate.state import PartialState as HFPartialState
    from accelerate.utils import gather as hf_gather
    from accelerate.utils import reduce as hf_reduce
    from accelerate.utils import wait_for_everyone as hf_wait
    from accelerate_c.comm import get_group, outbuf

    acc = accelerate_c.Accelerator(cpu=True)
    HFPartialState(cpu=True)
    acc.wait_for_everyone()  # creates the shm group
    shm = get_group().inner  # the ShmGroup: its raw_* methods are one C call each
    small = torch.randn(1024)  # 4 KiB
    small_out, gathered = torch.empty(1024), torch.empty(2048)
    rounds = 2 if quick else 5
    b_small = 100 if quick else 200  # calls per timed batch (HF's: a quarter, each is ~100x slower)
    cases = [  # (call, who, fn, batches, calls per batch)
        ("barrier", "ours", acc.wait_for_everyone, 7, b_small),
        ("barrier", "hf", hf_wait, 7, b_small // 4),
        ("barrier", "transport", shm.barrier, 7, b_small),
        ("reduce 4 KiB", "ours", lambda: acc.reduce(small, "sum"), 7, b_small),
        ("reduce 4 KiB", "hf", lambda: hf_reduce(small, "sum"), 7, b_small // 4),
        ("reduce 4 KiB", "transport", lambda: shm.raw_all_reduce_into(small_out, small, "sum"), 7, b_small),
        ("gather 4 KiB", "ours", lambda: acc.gather(small), 7, b_small),
        ("gather 4 KiB", "hf", lambda: hf_gather(small), 7, b_small // 4),
        ("gather 4 KiB", "transport", lambda: shm.raw_all_gather(gathered, small), 7, b_small),
    ]
    for mb in ([25] if quick else [25, 64]):
        big = torch.randn(mb << 18)
        n_big = 3 if quick else 7
        cases += [(f"reduce {mb} MiB", "ours", lambda big=big: acc.reduce(big, "sum"), n_big, 1),
                  (f"reduce {mb} MiB", "ours, no output cache", lambda big=big: acc.reduce(big, "sum"), n_big, 1),
                  (f"reduce {mb} MiB", "hf", lambda big=big: hf_reduce(big, "sum"), n_big, 1)]
    limit = outbuf.limit_bytes()
    per_round: dict = {}
    for _ in range(rounds):
        for op, who, fn, reps, batch in cases:
            outbuf._limit = 0 if who == "ours, no output cache" else limit  # the cache off for that row only
            dist.barrier()
            per_round.setdefault((op, who), []).append(_per_call(fn, reps, batch))
    outbuf._limit = limit
    if rank == 0:
        q.put(("ok", rank, {k: statistics.median(v) for k, v in per_round.items()}))
    dist.barrier()


def fmt(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} us" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


def table(res: dict) -> str:
    ops = list(dict.fromkeys(op for op, _ in res))
    lines = ["| call | accelerate_c | HF Accelerate 1.15 | HF / ours | transport | ours - transport | ours, no output cache |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for op in ops:
        ours, hf = res[(op, "ours")], res[(op, "hf")]
        tr = res.get((op, "transport"))
        nocache = res.get((op, "ours, no output cache"))
        lines.append(f"| {op} | {fmt(ours)} | {fmt(hf)} | {hf / ours:.1f}x | {fmt(tr) if tr else '-'} | "
                     f"{fmt(ours - tr) if tr else '-'} | "
                     f"{f'{fmt(nocache)} ({hf / nocache:.1f}x)' if nocache else '-'} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smoke run: fewer reps, 25 MiB only, no RESULTS.md")
    ap.add_argument("--no-record", action="store_true")
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, port, a.quick, q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        kind, rank, res = q.get(timeout=1800)
    except queue.Empty:
        kind, rank, res = "error", -1, "no result within 30 minutes"
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
            p.join()
    if kind != "ok":
        sys.exit(f"everyday.py: rank {rank} failed:\n{res}")
    out = table(res)
    head = (f"2 processes x 1 thread, torch {torch.__version__}; time per call = median over {2 if a.quick else 5} "
            "interleaved rounds of the median of batches of back-to-back calls (4 KiB: 200 per batch, HF 50; "
            "MiB: 1); reduce is sum; HF = accelerate.utils.wait_for_everyone/reduce/gather (what HF's Accelerator "
            "methods call); transport = the shm group's raw C call on the same tensor, output preallocated")
    print(head)
    print(out)
    if not a.quick and not a.no_record:
        append_results("everyday calls (accelerate_c vs HF Accelerate), benchmarks/everyday.py", [head, "", out])


if __name__ == "__main__":
    main()
