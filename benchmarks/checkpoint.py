# benchmarks/checkpoint.py: save_state/load_state time of accelerate_c.checkpointing against HF Accelerate
# 1.15, both driven by the same HF `Accelerator` object (same model, AdamW state, scheduler), interleaved
# in one run, medians. Ours writes JSON + safetensors with fsync and an atomic rename; HF pickles and does
# not fsync, so ours does strictly more I/O work. Run: python benchmarks/checkpoint.py [--params-m 10]
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _results import append_results  # noqa: E402
from accelerate_c.checkpointing import load_state, save_state  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params-m", type=float, default=10.0, help="model size in millions of parameters")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="2M parameters, 1 rep, nothing recorded")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
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
