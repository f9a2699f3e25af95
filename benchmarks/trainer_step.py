# benchmarks/trainer_step.py: transformers' Trainer step time on 2 CPU processes, the same script under HF Accelerate
# 1.15 (torchrun) and under accelerate_c (`launch --as_accelerate`: Trainer's `import accelerate` served by
# accelerate_c), issue 23's setup: GPT-2 from a config (4 layers, width 256, vocab 4096), 128 tokens, batch 4 per
# process, bf16, gradient accumulation 2. Each run times its optimizer steps (a TrainerCallback, rank 0, steps after
# the warm-up); the two libraries alternate for --rounds rounds; medians and the ratio are printed and appended to
# RESULTS.md. Target: accelerate_c <= 0.9x HF's. Two floor rows run the same model, batch, bf16 autocast,
# accumulation, gradient clipping and AdamW as a plain torch loop in two processes at once (no Trainer, no library, no
# communication): the model's own compute under the same contention, once on torch's bf16 kernels (HF's floor) and
# once on accelerate_c's CPU bf16 kernels (precision/cpu_bf16.py, installed where the CPU has no native bf16
# matmuls, as our Accelerator does: our floor). On such a CPU most of the difference between HF and us is those
# kernels; the second floor shows what the Trainer and the library add on top of them.
# Run: python benchmarks/trainer_step.py [--steps N] [--rounds R] [--quick] [--no-record]
# Not for: correctness (tests/test_hf_trainer.py).
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from _results import append_results, private_tmp  # noqa: E402
from ddp_step import free_port  # noqa: E402


def _model():
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=4096, n_positions=128))


def _native() -> bool:
    from accelerate_c.precision.policy import cpu_has_native_bf16

    return cpu_has_native_bf16()


def floor_worker(args) -> None:
    """The Trainer's step without the Trainer: autocast bf16 forward, backward of loss / 2 twice, clip to norm 1.0,
    AdamW, zero_grad; one process, no communication."""
    import torch

    if args.floor == "fast":
        from accelerate_c.precision import cpu_bf16

        if not _native():
            cpu_bf16.install()
    model = _model().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 4096, (4, 128), generator=torch.Generator().manual_seed(0))
    t = [time.perf_counter()]
    for _ in range(args.steps):
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            (loss / 2).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t.append(time.perf_counter())
    dt = [b - a for a, b in zip(t, t[1:])][args.warmup:]
    with open(args.out, "w") as f:
        json.dump({"step": statistics.median(dt), "accelerate": "none"}, f)


def worker(args) -> None:
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Data(torch.utils.data.Dataset):
        def __init__(self, n: int) -> None:
            self.ids = torch.randint(0, 4096, (n, 128), generator=torch.Generator().manual_seed(0))

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.t: list[float] = []

        def on_step_end(self, a, state, control, **kw):
            self.t.append(time.perf_counter())

    model = _model()
    targs = TrainingArguments(output_dir=args.out + ".run", max_steps=args.steps, per_device_train_batch_size=4,
                              gradient_accumulation_steps=2, learning_rate=1e-4, bf16=True, use_cpu=True,
                              report_to=[], logging_steps=1000, save_strategy="no", seed=0,
                              dataloader_num_workers=0)
    clock = Clock()
    trainer = Trainer(model=model, args=targs, train_dataset=Data(4 * 2 * 2 * (args.steps + 1)), callbacks=[clock])
    trainer.train()
    if trainer.is_world_process_zero():
        import accelerate
        dt = [b - a for a, b in zip(clock.t, clock.t[1:])][args.warmup:]
        with open(args.out, "w") as f:
            json.dump({"step": statistics.median(dt), "accelerate": accelerate.__file__}, f)


def launch(impl: str, args, out: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", ACCELERATE_USE_CPU="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    def script(dest: str) -> list:
        return [os.path.abspath(__file__), "--worker", "--out", dest, "--steps", str(args.steps), "--warmup",
                str(args.warmup)]

    if impl in ("floor", "floor_fast"):  # two independent processes at once; rank 0's figure
        kernels = "fast" if impl == "floor_fast" else "torch"
        procs = [subprocess.Popen([sys.executable, *script(out + str(r)), "--floor", kernels], env=env, cwd=ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
        for p in procs:
            text, _ = p.communicate(timeout=3600)
            if p.returncode != 0:
                raise RuntimeError(f"floor run failed ({p.returncode}):\n{text[-3000:]}")
        with open(out + "0") as f:
            return json.load(f)
    if impl == "hf":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), *script(out)]
    else:
        cmd = [sys.executable, "-m", "accelerate_c", "launch", "--as_accelerate", "--num_processes", "2",
               "--main_process_port", "0", *script(out)]
    with private_tmp(env) as env:  # torchrun (HF's side, and under our launcher) leaves a torchelastic_* folder
        p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if p.returncode != 0:
        raise RuntimeError(f"{impl} run failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser(description="transformers Trainer step time: accelerate_c vs HF Accelerate")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--floor", choices=("torch", "fast"), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="1 round of 5 steps (1 warm-up), nothing recorded")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    if args.worker:
        return floor_worker(args) if args.floor else worker(args)
    if args.quick:
        args.rounds, args.steps, args.warmup = 1, 5, 1
    times: dict[str, list[float]] = {"hf": [], "ours": [], "floor": [], "floor_fast": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for impl in times:
                res = launch(impl, args, os.path.join(tmp, f"{impl}{r}.json"))
                expect = {"ours": "accelerate_c", "hf": os.sep + "accelerate" + os.sep}.get(impl, "none")
                assert expect in res["accelerate"], (impl, res["accelerate"])  # the library that really ran
                times[impl].append(res["step"])
    hf, ours, floor, fast = (statistics.median(times[k]) for k in ("hf", "ours", "floor", "floor_fast"))
    import torch

    lines = ["transformers Trainer, GPT-2 from a config (4 layers, width 256, vocab 4096), 128 tokens, batch 4 per "
             f"process, bf16, gradient accumulation 2, 2 CPU processes x 1 thread; {args.steps} steps ({args.warmup} "
             f"warm-up), {args.rounds} alternating rounds, median s per optimizer step; CPU capability "
             f"{torch.backends.cpu.get_cpu_capability()}, native bf16 matmuls: {_native()}", "",
             "| run | s/step | vs HF |", "|---|---|---|",
             f"| HF Accelerate 1.15 | {hf:.3f} | 1.00 |",
             f"| accelerate_c (--as_accelerate) | {ours:.3f} | {ours / hf:.2f} |",
             f"| floor: plain torch loop, same compute, no Trainer or library; torch's bf16 kernels | {floor:.3f} | "
             f"{floor / hf:.2f} |",
             f"| floor: the same loop on accelerate_c's CPU bf16 kernels (installed: {not _native()}) | {fast:.3f} | "
             f"{fast / hf:.2f} |", "",
             "- per-round: " + "; ".join(f"{k} {[round(x, 3) for x in v]}" for k, v in times.items()),
             f"- accelerate_c's Trainer step / its floor (the second): {ours / fast:.2f}",
             "- target: accelerate_c <= 0.9x HF's"]
    print("\n".join(lines))
    if not args.no_record and not args.quick:
        append_results("transformers Trainer step time (benchmarks/trainer_step.py)", lines)


if __name__ == "__main__":
    main()
