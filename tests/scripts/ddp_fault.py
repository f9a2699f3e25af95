# tests/scripts/ddp_fault.py: DDP training and Accelerator collectives that go wrong on purpose, for
# tests/test_ddp_failures.py. Modes:
#   train            train a small model with the Accelerator (bucketed DDP over accelerate_c.comm) for
#                    --steps steps (0 = until --max_seconds); --kill_rank SIGKILLs itself at --kill_step;
#                    after --ready_step steps every rank writes ready<rank> (the test may kill one then).
#   reduce_dead      rank 1 SIGKILLs itself; rank 0 then calls accelerator.reduce and gather and records
#                    the errors (run without our launcher, which would stop rank 0 at once).
#   mismatch         accelerator.reduce / gather of tensors of different sizes on the two ranks (a fresh
#                    comm group for each, as a failed group stays unusable).
# Every rank writes info<rank>.json to --out: pid, MASTER_PORT, the comm group's class and shm segment
# name, the modes of its mapped accc- segments, and the errors seen (mode-dependent).
# Not for: parity checks (parity_train.py).
import argparse
import json
import os
import signal
import time
from datetime import timedelta

import torch

from accelerate_c import Accelerator, InitProcessGroupKwargs


def group_info() -> dict:
    from accelerate_c.comm import get_group
    grp = get_group()
    inner = getattr(grp, "inner", grp)
    shm = getattr(inner, "shm", inner)  # HierarchicalGroup keeps its host's ShmGroup in .shm
    return {"group": type(inner).__name__, "shm_name": getattr(shm, "name", None)}


def mapped_modes() -> dict:
    """st_mode & 0o777 of every mapped /dev/shm/accc-* segment of this process (they are unlinked already,
    so /proc/self/map_files is the only way to stat them); {} when the kernel does not allow it."""
    out = {}
    with open("/proc/self/maps") as fh:
        for line in fh:
            parts = line.split(None, 5)
            if len(parts) == 6 and "/dev/shm/accc-" in parts[5]:
                try:
                    out[parts[5].strip()] = os.stat(f"/proc/self/map_files/{parts[0]}").st_mode & 0o777
                except OSError:
                    pass
    return out


def write(out: str, rank: int, info: dict) -> None:
    tmp = os.path.join(out, f".info{rank}.json")
    with open(tmp, "w") as fh:
        json.dump(info, fh)
    os.replace(tmp, os.path.join(out, f"info{rank}.json"))


def train(args: argparse.Namespace, acc: Accelerator, info: dict) -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    y = x.sum(1, keepdim=True)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = acc.prepare(model, opt)
    rank = acc.process_index
    info.update(group_info())
    write(args.out, rank, info)
    start, step = time.monotonic(), 0
    while args.steps == 0 or step < args.steps:
        if time.monotonic() - start > args.max_seconds:
            raise SystemExit(f"rank {rank}: still training after {args.max_seconds} s (nobody stopped it)")
        if rank == args.kill_rank and step == args.kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        xb = x[(step * 8) % 64:(step * 8) % 64 + 8]
        loss = torch.nn.functional.mse_loss(model(xb), y[(step * 8) % 64:(step * 8) % 64 + 8])
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        step += 1
        if step == args.ready_step:
            open(os.path.join(args.out, f"ready{rank}"), "w").close()
    info["modes"] = mapped_modes()
    info["steps"] = step
    write(args.out, rank, info)
    acc.wait_for_everyone()
    acc.end_training()


def reduce_dead(args: argparse.Namespace, acc: Accelerator, info: dict) -> None:
    rank = acc.process_index
    acc.reduce(torch.ones(4))  # the group works (and is created) while both ranks live
    info.update(group_info())
    write(args.out, rank, info)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)
    for name, fn in (("reduce", lambda: acc.reduce(torch.ones(1000))), ("gather", lambda: acc.gather(torch.ones(3)))):
        t0 = time.monotonic()
        try:
            fn()
            info[name] = None
        except Exception as e:  # noqa: BLE001 - recorded for the test
            info[name] = [type(e).__name__, str(e), time.monotonic() - t0]
    write(args.out, rank, info)
    os._exit(0)  # the process group cannot be shut down cleanly with a dead peer


def mismatch(args: argparse.Namespace, acc: Accelerator, info: dict) -> None:
    from accelerate_c.comm import release_groups
    rank = acc.process_index
    info.update(group_info())
    for name, fn in (("reduce", lambda: acc.reduce(torch.ones(10 + rank))),
                     ("gather", lambda: acc.gather(torch.ones(5 + 2 * rank)))):
        t0 = time.monotonic()
        try:
            res = fn()
            info[name] = ["no error", res.tolist(), time.monotonic() - t0]
        except Exception as e:  # noqa: BLE001 - recorded for the test
            info[name] = [type(e).__name__, str(e), time.monotonic() - t0]
        write(args.out, rank, info)
        release_groups()  # a failed group stays unusable: the next op gets a fresh one
    acc.wait_for_everyone()  # the process group itself still works
    os._exit(0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", default="train", choices=["train", "reduce_dead", "mismatch"])
    p.add_argument("--out", required=True)
    p.add_argument("--timeout", type=float, default=20.0, help="process group (and comm) timeout, seconds")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--max_seconds", type=float, default=60.0)
    p.add_argument("--kill_rank", type=int, default=-1)
    p.add_argument("--kill_step", type=int, default=-1)
    p.add_argument("--ready_step", type=int, default=-1)
    args = p.parse_args()
    acc = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=args.timeout))])
    info = {"pid": os.getpid(), "master_port": os.environ.get("MASTER_PORT"), "rank": acc.process_index}
    {"train": train, "reduce_dead": reduce_dead, "mismatch": mismatch}[args.mode](args, acc, info)


if __name__ == "__main__":
    main()
