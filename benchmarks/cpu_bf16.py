# benchmarks/cpu_bf16.py: bf16 training on a CPU without native bf16 matmuls, where accelerate_c's CPU bf16 kernels
# (precision/cpu_bf16.py) replace torch's: a transformers Llama from a config (attention through
# scaled_dot_product_attention, transformers' default) trained with Accelerator(mixed_precision="bf16") on long
# sequences, where attention's share of the step is large. Runs, each in a process of its own (the replacement is
# process-wide), in interleaved rounds: fp32; bf16 on our kernels; bf16 on our kernels except attention, which stays
# torch's bf16 kernel (the state before attention was replaced); bf16 on our kernels with
# ACCELERATE_C_LARGE_TENSOR_PAGES=on (the fp32 temporaries the kernels free go back to the system at once instead of
# staying in glibc's heap). Prints median s/step, the ratios, the loss after the last step, the process's PSS growth
# after a forward and its peak RSS growth over the steps (VmHWM, reset after prepare). torch's bf16 matmuls here
# are tens of times slower than fp32 (benchmarks/trainer_step.py measures them): not run.
# Run: python benchmarks/cpu_bf16.py [--tokens 1024] [--steps 4] [--rounds 3] [--quick] [--no-record]
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _results import append_results, reset_peak_rss, status_bytes  # noqa: E402

RUNS = ("fp32", "bf16", "bf16_torch_attention", "bf16_pages")
RUN_ENV = {"bf16_pages": {"ACCELERATE_C_LARGE_TENSOR_PAGES": "on"}}


def worker(args) -> None:
    import time

    import psutil
    import torch

    torch.set_num_threads(2)
    from accelerate_c.precision import cpu_bf16
    if args.run == "bf16_torch_attention":  # before Accelerator() installs them: every kernel but attention's
        cpu_bf16.KERNELS = tuple(k for k in cpu_bf16.KERNELS if k[0] != "scaled_dot_product_attention")
    from transformers import LlamaConfig, LlamaForCausalLM

    from accelerate_c import Accelerator
    acc = Accelerator(mixed_precision="no" if args.run == "fp32" else "bf16", cpu=True)
    from accelerate_c.runtime import memory
    pages = memory.tune_cpu_heap(False)  # the policy's state, as Accelerator() left it
    proc = psutil.Process()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=2048,
                                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
                                         max_position_embeddings=max(2048, args.tokens)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = acc.prepare(model, opt)
    ids = torch.randint(0, 8192, (2, args.tokens), generator=torch.Generator().manual_seed(1))
    base = proc.memory_full_info().pss
    reset_peak_rss()  # the peak is measured from here
    rss0 = status_bytes("VmRSS")
    times, grown = [], 0
    for i in range(args.warmup + args.steps):
        t = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        grown = max(grown, proc.memory_full_info().pss - base)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        if i >= args.warmup:
            times.append(time.perf_counter() - t)
    with open(args.out, "w") as f:
        json.dump({"step": statistics.median(times), "loss": loss.item(), "pss_mib": grown / 2**20,
                   "peak_mib": (status_bytes("VmHWM") - rss0) / 2**20,
                   "installed": cpu_bf16.installed(), "native": torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                   "pages": pages}, f)


def main() -> None:
    ap = argparse.ArgumentParser(description="bf16 training on a CPU without native bf16: our kernels vs torch's")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--run", choices=RUNS, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="1 round of 2 steps at 256 tokens, nothing recorded")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.quick:
        args.rounds, args.steps, args.tokens = 1, 2, 256
    res: dict[str, list[dict]] = {r: [] for r in RUNS}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "OMP_"))}
    with tempfile.TemporaryDirectory(prefix="bench_tmp_") as tmp:
        for rnd in range(args.rounds):
            for run in RUNS:
                out = os.path.join(tmp, f"{run}{rnd}.json")
                cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--run", run, "--out", out,
                       "--tokens", str(args.tokens), "--steps", str(args.steps), "--warmup", str(args.warmup)]
                p = subprocess.run(cmd, env=dict(env, TMPDIR=tmp, **RUN_ENV.get(run, {})), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, timeout=1800)
                if p.returncode != 0:
                    raise SystemExit(f"{run} failed ({p.returncode}):\n{p.stdout[-4000:]}")
                with open(out) as f:
                    res[run].append(json.load(f))
    step = {r: statistics.median(x["step"] for x in res[r]) for r in RUNS}
    pss = {r: statistics.median(x["pss_mib"] for x in res[r]) for r in RUNS}
    peak = {r: statistics.median(x["peak_mib"] for x in res[r]) for r in RUNS}
    first = res["bf16"][0]
    lines = [f"transformers Llama from a config (4 layers, width 512, 8 heads, vocab 8192; attention through "
             f"scaled_dot_product_attention), batch 2 x {args.tokens} tokens, AdamW, 1 process x 2 threads, "
             f"{args.steps} timed steps after {args.warmup}, {args.rounds} interleaved rounds, medians; native bf16 "
             f"matmuls: {first['native']}, our CPU bf16 kernels installed: {first['installed']}", "",
             "| run | s/step | vs bf16 with torch's attention | vs fp32 | loss after the last step | PSS growth "
             "after a forward, MiB | peak RSS growth over the steps, MiB |", "|---|---|---|---|---|---|---|"]
    names = {"fp32": "fp32", "bf16": "bf16, our kernels (attention included)",
             "bf16_torch_attention": "bf16, our kernels but torch's bf16 attention (baseline)",
             "bf16_pages": "bf16, our kernels, ACCELERATE_C_LARGE_TENSOR_PAGES=on (policy on: "
                           f"{res['bf16_pages'][0]['pages']})"}
    for r in RUNS:
        lines.append(f"| {names[r]} | {step[r]:.3f} | {step[r] / step['bf16_torch_attention']:.2f} | "
                     f"{step[r] / step['fp32']:.2f} | {res[r][-1]['loss']:.4f} | {pss[r]:.0f} | {peak[r]:.0f} |")
    lines += ["", "- per-round s/step: " + "; ".join(f"{r} {[round(x['step'], 3) for x in res[r]]}" for r in RUNS)]
    print("\n".join(lines))
    if not args.no_record and not args.quick:
        append_results("bf16 on a CPU without native bf16: attention on our kernels (benchmarks/cpu_bf16.py)", lines)


if __name__ == "__main__":
    main()
