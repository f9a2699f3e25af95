# benchmarks/convergence.py: the demo language model (examples/train_gpt.py, ~3.3M parameters, byte-level,
# Python stdlib source) trained 200 steps in fp32, bf16 and fp8 from the same seed and batches; reports the
# final loss (mean of the last 20 steps) of each and the gap to fp32 (target: within 3 %), and step times.
# On this CPU bf16/fp8 give no speed-up (no AVX512_BF16/AMX; fp8 matmuls run on dequantised values).
# Run: python benchmarks/convergence.py [--steps 200] [--quick] [--no-record]
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
from _results import append_results  # noqa: E402
import train_gpt  # noqa: E402

from accelerate_c import Accelerator  # noqa: E402
from accelerate_c.state import AcceleratorState, GradientState  # noqa: E402


def train(mp: str, steps: int, data: torch.Tensor, small: bool) -> tuple[float, float]:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = Accelerator(mixed_precision=mp)
    torch.manual_seed(0)
    model = train_gpt.GPT(block_size=128, **({"n_layer": 2, "n_embd": 64, "n_head": 2} if small else {}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    dl = torch.utils.data.DataLoader(train_gpt.Blocks(data, 128), batch_size=16, shuffle=True,
                                     generator=torch.Generator().manual_seed(0))
    model, opt, dl = acc.prepare(model, opt, dl)
    losses, it = [], iter(dl)
    t = time.perf_counter()
    for _ in range(steps):
        x, y = next(it)
        loss = model(x, y)
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return sum(losses[-20:]) / min(20, len(losses)), (time.perf_counter() - t) / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    steps = 30 if args.quick else args.steps
    data = train_gpt.load_corpus(2_000_000)
    res = {mp: train(mp, steps, data, args.quick) for mp in ("no", "bf16", "fp8")}
    base = res["no"][0]
    lines = ["| precision | final loss (last 20 steps) | gap to fp32 | step time |", "|---|---|---|---|"]
    for mp, (loss, dt) in res.items():
        lines.append(f"| {mp} | {loss:.4f} | {100 * (loss - base) / base:+.2f} % | {dt * 1e3:.0f} ms |")
    lines += ["", f"{steps} steps, batch 16 x 128 bytes, {torch.get_num_threads()} threads; target: bf16 and fp8 "
              "within 3 % of fp32."]
    print("\n".join(lines))
    if not args.no_record and not args.quick:
        append_results("convergence.py: demo GPT, fp32 vs bf16 vs fp8", lines)


if __name__ == "__main__":
    main()
