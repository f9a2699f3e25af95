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
from accelerate_c.checkpointing import load_state, save_state  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params-m", type=float, default=10.0, help="model size in millions of parameters")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
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
    for op in ("save", "load"):
        hf, ours = statistics.median(times[f"hf_{op}"]), statistics.median(times[f"ours_{op}"])
        print(f"{op}_state: ours {ours * 1e3:8.1f} ms   HF {hf * 1e3:8.1f} ms   ours/HF {ours / hf:5.2f}")


if __name__ == "__main__":
    main()
