# benchmarks/overhead.py: single-process step time of a small model under accelerate_c, HF Accelerate 1.15
# and a plain PyTorch loop, interleaved in one run (medians); and the time of `import accelerate_c`
# against `import accelerate` and `import torch` in fresh interpreters.
# Targets (issue 2): step overhead <= 2 % over the plain loop; import within 10 % of `import torch`.
# Run: python benchmarks/overhead.py [--quick] [--no-record]
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _results import append_results  # noqa: E402


def make(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 512),
                                torch.nn.GELU(), torch.nn.Linear(512, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    return model, opt, x, y


def plain_steps(n: int, state) -> float:
    model, opt, x, y = state
    t = time.perf_counter()
    for _ in range(n):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return (time.perf_counter() - t) / n


def accel_steps(n: int, state) -> float:
    acc, model, opt, x, y = state
    t = time.perf_counter()
    for _ in range(n):
        with acc.accumulate(model):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
    return (time.perf_counter() - t) / n


def prepared(mod_name: str, fused: bool = True):
    mod = __import__(mod_name)
    # fused=False: the wrapper alone, the user's torch AdamW runs its own step (the strategy's config is read
    # when the Accelerator is built)
    with mod.utils.patch_environment(**({} if fused else {"ACCELERATE_C_FUSED_OPTIMIZER": "0"})):
        acc = mod.Accelerator(cpu=True)
    model, opt, x, y = make()
    model, opt = acc.prepare(model, opt)
    return acc, model, opt, x, y


def import_time(stmt: str, reps: int) -> float:
    times = []
    for _ in range(reps):
        out = subprocess.run([sys.executable, "-c", f"import time; t=time.perf_counter(); {stmt}; print(time.perf_counter()-t)"],
                             capture_output=True, text=True, check=True)
        times.append(float(out.stdout.strip().splitlines()[-1]))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    steps, rounds, ireps = (20, 3, 3) if args.quick else (100, 9, 9)
    plain = (make(),)
    ours, hf = prepared("accelerate_c"), prepared("accelerate")
    ours_unfused = prepared("accelerate_c", fused=False)
    res: dict[str, list[float]] = {"plain": [], "accelerate_c": [], "accelerate_c, fused optimizer off": [],
                                   "accelerate": []}
    for _ in range(rounds):  # interleave so machine noise hits all alike
        res["plain"].append(plain_steps(steps, plain[0]))
        res["accelerate_c"].append(accel_steps(steps, ours))
        res["accelerate_c, fused optimizer off"].append(accel_steps(steps, ours_unfused))
        res["accelerate"].append(accel_steps(steps, hf))
    med = {k: statistics.median(v) * 1e3 for k, v in res.items()}
    imp = {s: import_time(s, ireps) for s in ("import torch", "import accelerate_c", "import accelerate")}
    lines = ["| what | time | vs plain / vs torch |", "|---|---|---|"]
    for k in res:
        lines.append(f"| step, {k} | {med[k]:.3f} ms | {med[k] / med['plain']:.3f}x |")
    for s, t in imp.items():
        lines.append(f"| `{s}` | {t * 1e3:.0f} ms | {t / imp['import torch']:.3f}x |")
    over_ours = (med["accelerate_c"] / med["plain"] - 1) * 100
    over_hf = (med["accelerate"] / med["plain"] - 1) * 100
    over_wrap = (med["accelerate_c, fused optimizer off"] / med["plain"] - 1) * 100
    lines.append("")
    lines.append(f"Step overhead over the plain loop: accelerate_c {over_ours:+.1f} % (wrapper alone, torch's "
                 f"optimizer step: {over_wrap:+.1f} %), HF Accelerate {over_hf:+.1f} % "
                 f"(target <= 2 %); import accelerate_c / import torch = {imp['import accelerate_c'] / imp['import torch']:.3f} "
                 "(target <= 1.10). Model: 3-layer MLP 256-512-512-10, batch 64, AdamW, 1 thread.")
    print("\n".join(lines))
    if not args.no_record and not args.quick:
        append_results("overhead.py: single-process step overhead and import time", lines)


if __name__ == "__main__":
    main()
