# tests/scripts/kill_points.py: SIGKILLs at named points of start-up and save (ACCELERATE_C_KILL_AT,
# accelerate_c/base/killpoints.py), for tests/test_leaks.py. The parent imports torch and accelerate_c once, then
# per run forks two ranks (gloo on a fresh port; stdout/stderr in <out>/<run>.rank<r>.log) that build an
# Accelerator (bucketed DDP over shared memory: a group segment and alloc() regions), train a tiny model, call
# save_state twice into one folder (a first save, then one over it) and save_model. The parent plays torch's
# agent: once a rank is SIGKILLed it sends SIGTERM to the other. Every wait has a deadline.
#   --mode cleanup  every scenario in its own folders, in an order drawn from --seed; after each: what it must
#                   have left is there, then the documented `cleanup` (its function, in this process) leaves
#                   nothing of it in /dev/shm, $TMPDIR or its folders, and a complete checkpoint where one was.
#   --mode next     a chain of runs in shared folders with no cleanup: each run removes what the one before left.
# Writes <out>/report.json: per run its spec, the ranks' exit statuses, what was found, and the problems seen.
# Not for: anything but tests/test_leaks.py.
import argparse
import json
import os
import random
import signal
import socket
import sys
import time
import traceback

import torch
import torch._dynamo  # noqa: F401 - torch's optimizers import it (2-3 s): once here, not in every rank

from accelerate_c import Accelerator
from accelerate_c.base import leftovers
from accelerate_c.checkpointing import atomic, interrupted
from accelerate_c.commands import cleanup

DEADLINE_S = 90
TMP, ASIDE, MODEL_TMP = "save_state temp folder", "checkpoint set aside", "save_model temp file"
# kill spec, no renameat2 (the two-rename fallback), what the run must leave, a complete checkpoint after cleanup
SCENARIOS = [
    ("shm.group.created", False, {"shm"}, False),
    ("shm.group.before_attach@1", False, set(), False),
    ("shm.group.attached@1", False, set(), False),
    ("shm.group.ready@0", False, set(), False),
    ("shm.region.created", False, {"shm"}, False),
    ("shm.region.before_attach@1", False, set(), False),
    ("shm.region.before_unlink", False, {"shm"}, False),
    ("save.tmp_created", False, {TMP}, False),
    ("save.mid_piece@0", False, {TMP}, False),
    ("save.mid_piece@1", False, {TMP}, False),
    ("save.before_commit", False, {TMP}, False),
    ("save.before_rename", False, {TMP}, False),
    ("save.before_exchange", False, {TMP}, True),
    ("save.after_exchange", False, {TMP}, True),
    ("save.between_renames", True, {TMP, ASIDE}, True),
    ("save.old_left", True, {ASIDE}, True),
    ("save_model.tmp_written", False, {MODEL_TMP}, True),
]
CHAIN = [("shm.region.before_unlink", {"shm"}), ("save.before_commit", {TMP}), ("save_model.tmp_written", {MODEL_TMP}),
         (None, set())]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job(ckpt: str, export: str, fallback: bool, seed: int) -> None:
    if fallback:
        atomic._exchange = lambda a, b: False  # as where renameat2 is missing
    acc = Accelerator(cpu=True)
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    for _ in range(2):
        acc.backward(model(torch.ones(2, 8)).sum())
        opt.step()
        opt.zero_grad()
        acc.save_state(ckpt)
    acc.save_model(model, export)
    acc.wait_for_everyone()
    torch.distributed.destroy_process_group()


def fork_rank(rank: int, env: dict, log: str, args: tuple) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.environ.update(env)
        os.environ["RANK"] = os.environ["LOCAL_RANK"] = str(rank)
        job(*args)
        code = 0
    except BaseException:  # noqa: BLE001 - shown in the log; the exit status says it failed
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_job(name: str, spec, dirs: tuple, fallback: bool, seed: int, out: str) -> dict:
    """Both ranks of one run, to their end; {"port", "status": {rank: how it ended}, "logs"}."""
    port = free_port()
    env = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    if spec:
        env["ACCELERATE_C_KILL_AT"] = spec
    logs = [os.path.join(out, f"{name}.rank{r}.log") for r in (0, 1)]
    pids = {fork_rank(r, env, logs[r], (*dirs, fallback, seed)): r for r in (0, 1)}
    status, stopped, deadline = {}, False, time.monotonic() + DEADLINE_S
    while len(status) < 2:
        pid, st = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if time.monotonic() > deadline:
                for p, r in pids.items():
                    if r not in status:
                        os.kill(p, signal.SIGKILL)
                        status[r] = "hung (killed by the harness)"
                        os.waitpid(p, 0)
            time.sleep(0.01)
            continue
        status[pids[pid]] = (f"killed by signal {signal.Signals(os.WTERMSIG(st)).name}" if os.WIFSIGNALED(st)
                             else f"exit {os.WEXITSTATUS(st)}")
        if not stopped and os.WIFSIGNALED(st):  # like torch's agent: the other ranks are stopped
            stopped = True
            for p, r in pids.items():
                if r not in status:
                    os.kill(p, signal.SIGTERM)
    return {"port": port, "status": status, "logs": logs}


def found(port: int, root: str, tmpdir: str) -> dict:
    shm = sorted(n for n in os.listdir(leftovers.SHM_DIR) if n.startswith(f"accc-{port}-"))
    return {"shm": shm, "saves": sorted((i.what, os.path.relpath(i.path, root)) for i in interrupted.find(root)),
            "tmpdir": sorted(os.listdir(tmpdir))}


def kinds(f: dict) -> set:
    return ({"shm"} if f["shm"] else set()) | {what for what, _ in f["saves"]} | ({"tmpdir"} if f["tmpdir"] else set())


def check_victim(spec: str, status: dict) -> list:
    point_rank = spec.split("@")[1] if "@" in spec else None
    killed = [r for r, s in status.items() if s == "killed by signal SIGKILL"]
    if len(killed) != 1 or (point_rank is not None and killed != [int(point_rank)]):
        return [f"the point was not reached as asked: ranks ended {status}"]
    return []


def run_cleanup(root: str) -> None:
    args = argparse.Namespace(checkpoints=[root], temp_dir=None, dry_run=False)
    cleanup.cleanup_command(args)


def cleanup_mode(out: str, seed: int) -> list:
    tmpdir, runs = os.environ["TMPDIR"], []
    order = list(SCENARIOS)
    random.Random(seed).shuffle(order)
    for i, (spec, fallback, must, complete) in enumerate(order):
        name = f"{i:02d}-{spec.replace('@', '-at-')}"
        root = os.path.join(out, name)
        os.makedirs(root)
        r = run_job(name, spec, (os.path.join(root, "ckpt"), os.path.join(root, "export")), fallback, seed, out)
        r.update(spec=spec, problems=check_victim(spec, r["status"]), before=found(r["port"], root, tmpdir))
        if not must <= kinds(r["before"]):
            r["problems"].append(f"expected {sorted(must)} to be left, found {r['before']}")
        run_cleanup(root)
        r["after"] = found(r["port"], root, tmpdir)
        if kinds(r["after"]):
            r["problems"].append(f"left after cleanup: {r['after']}")
        if complete and not os.path.isfile(os.path.join(root, "ckpt", "checkpoint.json")):
            r["problems"].append("no complete checkpoint after cleanup")
        runs.append(r)
    return runs


def next_mode(out: str, seed: int) -> list:
    """Each run must leave what CHAIN says, and nothing else: the previous run's leftovers are gone (its
    segments by its port, its save leftovers because none of another kind is found)."""
    tmpdir, runs, prev = os.environ["TMPDIR"], [], None
    root = os.path.join(out, "chain")
    os.makedirs(root)
    for i, (spec, must) in enumerate(CHAIN):
        name = f"chain{i}-{spec or 'clean'}"
        r = run_job(name, spec, (os.path.join(root, "ckpt"), os.path.join(root, "export")), False, seed, out)
        r.update(spec=spec, problems=check_victim(spec, r["status"]) if spec else [])
        if not spec and set(r["status"].values()) != {"exit 0"}:
            r["problems"].append(f"the clean run failed: {r['status']}")
        r["found"] = found(r["port"], root, tmpdir)
        if kinds(r["found"]) - {"shm"} != must - {"shm"} or ("shm" in must and not r["found"]["shm"]):
            r["problems"].append(f"expected exactly {sorted(must)} to be left, found {r['found']}")
        if prev is not None and found(prev["port"], root, tmpdir)["shm"]:
            r["problems"].append(f"the previous run's segments are still there: {found(prev['port'], root, tmpdir)}")
        prev = r
        runs.append(r)
    return runs


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--mode", choices=["cleanup", "next"], nargs="+", required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    runs = []
    for mode in args.mode:
        runs += (cleanup_mode if mode == "cleanup" else next_mode)(args.out, args.seed)
        with open(os.path.join(args.out, "report.json"), "w") as fh:  # after each mode: what ran so far
            json.dump(runs, fh, indent=1)


if __name__ == "__main__":
    main()
