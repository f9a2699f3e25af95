# benchmarks/checkpoint.py: checkpoint save/load speed, medians of interleaved rounds in one run.
# Default: universal checkpoints against torch.distributed.checkpoint (DCP) on the GPT-2-small (124M) parameter
# list of benchmarks/optimizer.py with AdamW state (exp_avg, exp_avg_sq, step): 2 gloo processes save (ours:
# save_state, every rank writes the tensors it owns; DCP: dcp.save of {model, optim} state dicts, which dedups the
# replicated tensors across ranks), then 1 and 3 processes load what 2 saved (ours: load_state; DCP: dcp.load +
# optimizer.load_state_dict). Both fsync (DCP's FileSystemWriter sync_files=True). Ours also writes RNG, step and
# data position files. Run: python benchmarks/checkpoint.py [--quick] [--reps 3]
# --vs-hf: the single-process comparison with HF Accelerate 1.15's save_state/load_state (10M params; HF pickles
# and does not fsync). Not for: correctness (tests/test_checkpoint*.py).
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from _results import append_results  # noqa: E402
from accelerate_c.checkpointing import load_state, save_state  # noqa: E402
from accelerate_c.utils.dataclasses import ProjectConfiguration  # noqa: E402


class BenchAccelerator:
    """What accelerate_c.checkpointing reads from an Accelerator: one model, one optimizer, no strategy (the
    default layout: whole tensors, owners spread over the ranks by size)."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, world: int) -> None:
        import torch.distributed as dist
        self._models, self._optimizers, self._schedulers, self._dataloaders, self._custom_objects = \
            [model], [opt], [], [], []
        self.scaler, self.step = None, 10
        self.process_index, self.num_processes = rank, world
        self.project_configuration = ProjectConfiguration()
        self._save_model_state_pre_hook, self._load_model_state_pre_hook = {}, {}
        self.wait_for_everyone = dist.barrier if world > 1 else (lambda: None)

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    def unwrap_model(self, model: torch.nn.Module, keep_torch_compile: bool = True) -> torch.nn.Module:
        return model


def build(fill: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """GPT-2-small parameters and AdamW state: seeded random values (fill) or zeros (a loader's fresh state)."""
    from optimizer import gpt2_shapes
    model = torch.nn.Module()
    gen = torch.Generator().manual_seed(0)

    def make(shape: tuple) -> torch.Tensor:
        return torch.randn(shape, generator=gen) if fill else torch.zeros(shape)
    for i, shape in enumerate(gpt2_shapes()):
        model.register_parameter(f"p{i}", torch.nn.Parameter(make(shape)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        opt.state[p] = {"step": torch.tensor(10.0 if fill else 0.0), "exp_avg": make(p.shape),
                        "exp_avg_sq": make(p.shape).abs()}
    return model, opt


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    rank, world = args.rank, args.world
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=world)
    model, opt = build(fill=args.phase == "save")
    acc = BenchAccelerator(model, opt, rank, world)
    times: dict[str, list[float]] = {"ours": [], "dcp": []}

    def timed(fn) -> float:
        dist.barrier()
        t = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t

    def dcp_state() -> dict:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    for r in range(args.reps + 1):  # round 0: warm-up
        if args.phase == "save":
            last = r == args.reps
            ours, theirs = (os.path.join(args.root, f"{k}{'' if last else r}") for k in ("ours", "dcp"))
            t_ours = timed(lambda: save_state(acc, ours))
            t_dcp = timed(lambda: dcp.save(dcp_state(), checkpoint_id=theirs))
            dist.barrier()
            if rank == 0 and not last:
                shutil.rmtree(ours)
                shutil.rmtree(theirs)
        else:
            t_ours = timed(lambda: load_state(acc, os.path.join(args.root, "ours")))

            def dcp_load() -> None:
                sd = dcp_state()
                dcp.load(sd, checkpoint_id=os.path.join(args.root, "dcp"))
                opt.load_state_dict(sd["optim"])
            t_dcp = timed(dcp_load)
        if r:
            times["ours"].append(t_ours)
            times["dcp"].append(t_dcp)
    if args.phase == "load":  # both restored the saved values (checked on the first and last tensors)
        want_model, want_opt = build(fill=True)
        for name in ("p0", f"p{len(list(model.parameters())) - 1}"):
            p, q = getattr(model, name), getattr(want_model, name)
            assert torch.equal(p, q) and torch.equal(opt.state[p]["exp_avg_sq"], want_opt.state[q]["exp_avg_sq"])
    if rank == 0:
        with open(os.path.join(args.root, f"times-{args.phase}-{world}.json"), "w") as f:
            json.dump(times, f)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # no interpreter teardown: it can race torch's gloo worker threads


def launch(args: argparse.Namespace, phase: str, world: int) -> dict:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", "--phase", phase,
                               "--rank", str(r), "--world", str(world), "--port", str(port), "--root", args.root,
                               "--reps", str(args.reps)], env=env) for r in range(world)]
    for p in procs:
        if p.wait(timeout=3600) != 0:
            for q in procs:
                q.kill()
            raise SystemExit(f"{phase} with {world} processes failed (exit {p.returncode})")
    with open(os.path.join(args.root, f"times-{phase}-{world}.json")) as f:
        return json.load(f)


def universal(args: argparse.Namespace) -> None:
    while os.path.exists("/tmp/me/QUIET"):  # someone is measuring: wait
        time.sleep(10)
    args.root = tempfile.mkdtemp(prefix="ckpt_bench_")
    try:
        results = [("save_state, 2 processes", launch(args, "save", 2))]
        for world in (1, 3):
            results.append((f"load_state of the 2-process checkpoint, {world} process{'es' if world > 1 else ''}",
                            launch(args, "load", world)))
    finally:
        shutil.rmtree(args.root, ignore_errors=True)
    from optimizer import gpt2_shapes
    n = sum(torch.Size(s).numel() for s in gpt2_shapes())
    lines = [f"GPT-2-small parameter list ({n / 1e6:.1f}M params, {len(gpt2_shapes())} tensors) + AdamW state "
             f"({n * 12 / 1e9:.2f} GB), gloo, {args.reps} rounds, medians", "",
             "| op | ours | DCP | DCP/ours (speed-up) |", "|---|---|---|---|"]
    for title, t in results:
        ours, theirs = statistics.median(t["ours"]), statistics.median(t["dcp"])
        lines.append(f"| {title} | {ours * 1e3:.0f} ms | {theirs * 1e3:.0f} ms | {theirs / ours:.2f}x |")
        print(f"rounds, {title}: ours {[round(x * 1e3) for x in t['ours']]} ms, DCP {[round(x * 1e3) for x in t['dcp']]} ms")
    print("\n".join(lines))
    if not args.quick and not args.no_record:
        append_results("checkpoint.py: universal checkpoints vs torch.distributed.checkpoint", lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vs-hf", action="store_true", help="one process, ours vs HF Accelerate's save/load_state")
    ap.add_argument("--params-m", type=float, default=10.0, help="--vs-hf: model size in millions of parameters")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="1 round, nothing recorded (--vs-hf: 2M parameters)")
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--phase", choices=("save", "load"), help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
    elif args.vs_hf:
        vs_hf(args)
    else:
        if args.quick:
            args.reps = 1
        universal(args)


def vs_hf(args: argparse.Namespace) -> None:
    """--vs-hf: one process, our save_state/load_state against HF Accelerate's on the same HF Accelerator."""
    if args.quick:
        args.params_m, args.reps = 2.0, 1
    from accelerate import Accelerator
    width = 1024
    layers = max(1, int(args.params_m * 1e6 / (width * width + width)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    acc = Accelerator(cpu=True)
    model, opt, sched = acc.prepare(model, opt, sched)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    root = tempfile.mkdtemp(prefix="ckpt_bench_")
    times: dict[str, list[float]] = {k: [] for k in ("hf_save", "ours_save", "hf_load", "ours_load")}
    try:
        for r in range(args.reps + 1):  # first round is warm-up
            for name, fn in (("hf_save", lambda: acc.save_state(os.path.join(root, "hf"))),
                             ("ours_save", lambda: save_state(acc, os.path.join(root, "ours"))),
                             ("hf_load", lambda: acc.load_state(os.path.join(root, "hf"))),
                             ("ours_load", lambda: load_state(acc, os.path.join(root, "ours")))):
                t = time.perf_counter()
                fn()
                if r:
                    times[name].append(time.perf_counter() - t)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    n = sum(p.numel() for p in model.parameters())
    print(f"model {n / 1e6:.1f}M params ({layers} x Linear({width},{width})), AdamW state, {args.reps} reps")
    lines = [f"model {n / 1e6:.1f}M params ({layers} x Linear({width},{width})), AdamW state, {args.reps} reps", "",
             "| op | ours | HF | ours/HF |", "|---|---|---|---|"]
    for op in ("save", "load"):
        hf, ours = statistics.median(times[f"hf_{op}"]), statistics.median(times[f"ours_{op}"])
        lines.append(f"| {op}_state | {ours * 1e3:.1f} ms | {hf * 1e3:.1f} ms | {ours / hf:.2f} |")
    lines += ["", "Ours fsyncs every file and renames atomically; HF pickles and does not fsync."]
    print("\n".join(lines))
    if not args.quick and not args.no_record:
        append_results("checkpoint.py: save_state/load_state vs HF Accelerate", lines)


if __name__ == "__main__":
    main()
