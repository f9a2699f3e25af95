# benchmarks/_gpu_train.py: the training runs of benchmarks/gpu_check.py, each in its own process (so HF Accelerate,
# accelerate_c and the plain loop never share a process, and the two-process runs go through our launcher): one model
# (the demo GPT of examples/train_gpt.py, or a transformers Llama from a config), synthetic token batches fixed by the
# seed, torch.optim.AdamW(fused=True) as the user's optimizer, and per-step losses plus the mean step time written as
# JSON. Also runnable on the CPU (--device cpu) so the script's plumbing is checked where there is no GPU. training()
# is gpu_check.py's section that starts these runs and compares them.
# Not for: kernel checks (gpu_check.py) or anything the library itself needs.
#
#   python benchmarks/_gpu_train.py --lib {torch,ours,hf} --model {gpt,llama} --precision {bf16,fp8,no} --steps N
#       --out FILE [--device cuda|cpu] [--strategy ddp|zero3 --global_batch B]   (the last two under a launcher)
#       [--profile FILE]   (torch's profiler table of five more steps: where the host's time goes)
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from typing import Callable

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def build_model(name: str, tiny: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "gpt" and tiny:  # (the CPU check of this script's plumbing)
        spec = importlib.util.spec_from_file_location("_demo_gpt", os.path.join(ROOT, "examples", "train_gpt.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod.GPT(vocab=256, block_size=128, n_layer=2, n_head=2, n_embd=32)
    if name == "gpt":
        spec = importlib.util.spec_from_file_location("_demo_gpt", os.path.join(ROOT, "examples", "train_gpt.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)  # (imports accelerate_c: harmless beside HF's package)
        return mod.GPT(vocab=256, block_size=128, n_layer=6, n_head=8, n_embd=512)
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=6,
                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256)
    return LlamaForCausalLM(cfg)


def batches(model: str, steps: int, batch: int, seq: int = 128) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    vocab = 256 if model == "gpt" else 8192
    return [torch.randint(0, vocab, (batch, seq + 1), generator=g) for _ in range(steps)]


def loss_of(model_name: str, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    if model_name == "gpt":
        return model(x[:, :-1], x[:, 1:])
    return model(input_ids=x[:, :-1], labels=x[:, :-1]).loss


def run(args: argparse.Namespace) -> dict:
    dev = torch.device(args.device)
    model = build_model(args.model, args.tiny)
    data = batches(args.model, args.steps, args.global_batch)
    acc = None
    if args.lib == "torch":
        model = model.to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01, fused=dev.type == "cuda")
        low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.precision)
        auto = torch.autocast(dev.type, dtype=low) if low is not None else contextlib.nullcontext()
        scaler = torch.amp.GradScaler(dev.type) if args.precision == "fp16" else None
    else:
        if args.lib == "ours":
            import accelerate_c as lib
        else:
            import accelerate as lib
        kw: dict = {"mixed_precision": args.precision, "cpu": dev.type == "cpu"}
        handlers = []
        if args.strategy:  # two processes on one GPU: gloo on CUDA tensors (NCCL needs a GPU per rank)
            handlers.append(lib.utils.InitProcessGroupKwargs(backend="gloo"))
        if args.strategy == "zero3":
            kw["fsdp_plugin"] = lib.FullyShardedDataParallelPlugin(sharding_strategy="FULL_SHARD")
        acc = lib.Accelerator(kwargs_handlers=handlers, **kw)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01, fused=dev.type == "cuda")
        model, opt = acc.prepare(model, opt)
        dev = acc.device
        auto = contextlib.nullcontext()
        scaler = None
    rank, world = (acc.process_index, acc.num_processes) if acc is not None else (0, 1)
    first = 0
    if args.resume:  # the state saved after --save_at steps: continue from there (the batches before it skipped)
        acc.load_state(args.resume)
        first = args.save_at
    losses, skipped, t0, warm = [], [], 0.0, min(5, args.steps - first - 1)
    for i, x in enumerate(data[first:]):
        if i == warm:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        x = x.chunk(world)[rank].to(dev, non_blocking=True)
        with auto:
            loss = loss_of(args.model, model, x)
        if scaler is not None:  # the plain fp16 loop: torch's GradScaler
            before = scaler.get_scale()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            skipped.append(scaler.get_scale() < before)
        else:
            loss.backward() if acc is None else acc.backward(loss)
            opt.step()
            skipped.append(bool(acc.optimizer_step_was_skipped) if acc is not None else False)
        opt.zero_grad(set_to_none=True)
        d = loss.detach().float().reshape(1)
        losses.append(acc.gather(d).mean().reshape(1) if world > 1 else d)
        if args.save_at and not args.resume and first + i + 1 == args.save_at:
            acc.save_state(args.ckpt)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    step_s = (time.perf_counter() - t0) / max(1, args.steps - warm)
    if args.profile:  # five more steps under torch's profiler: where the host's time goes (self CPU time per op)
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        import cProfile
        import io
        import pstats

        def five() -> None:
            for x in data[:5]:
                x = x.chunk(world)[rank].to(dev, non_blocking=True)
                with auto:
                    loss = loss_of(args.model, model, x)
                loss.backward() if acc is None else acc.backward(loss)
                opt.step()
                opt.zero_grad(set_to_none=True)
            if dev.type == "cuda":
                torch.cuda.synchronize()

        with profile(activities=acts) as prof:
            five()
        py = cProfile.Profile()
        py.runcall(five)
        text = io.StringIO()
        pstats.Stats(py, stream=text).sort_stats("tottime").print_stats(25)
        with open(args.profile, "w") as fh:
            fh.write(f"{args.lib} {args.model} {args.precision}: step {step_s * 1e3:.2f} ms\n")
            fh.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
            fh.write("\n\nPython functions, five steps (cProfile, by own time):\n" + text.getvalue())
    return {"lib": args.lib, "model": args.model, "precision": args.precision, "strategy": args.strategy,
            "world": world, "rank": rank, "losses": torch.cat(losses).tolist(), "skipped": skipped, "step_s": step_s,
            "max_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else 0.0}


# ---- training ------------------------------------------------------------------------------------------------------

def _worker(args: list[str], out: str, timeout: float, launch: int = 0) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    script = os.path.abspath(__file__)
    cmd = ([sys.executable, "-m", "accelerate_c", "launch", "--num_processes", str(launch), script] if launch
           else [sys.executable, script]) + args + ["--out", out]
    p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if p.returncode:
        raise RuntimeError(f"{' '.join(args)} failed ({p.returncode}): {(p.stdout + p.stderr)[-1500:]}")
    files = [f"{out}.{r}.json" for r in range(launch)] if launch else [out]
    return [json.load(open(f)) for f in files]


def _burn(seconds: float) -> None:
    """Matrix products for `seconds`, so the GPU's clocks are up before the first timed run (they idle low)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = time.perf_counter()
    while time.perf_counter() - t < seconds:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()
    del a
    torch.cuda.empty_cache()


def training(quick: bool, tmp: str, say: Callable[[str], None], check: Callable[[str, bool, str], None],
             rounds: int = 1) -> None:
    """gpu_check.py's training section: every run in its own process, the figures through say / check. `rounds` > 1
    runs each library again (every other round in reverse order) and keeps its fastest run."""
    steps = 20 if quick else 40
    _burn(2.0)
    order = ("torch", "ours", "hf")
    for model in ("gpt", "llama"):
        recs: dict = {}
        for lib in [lib for r in range(rounds) for lib in (order if r % 2 == 0 else order[::-1])]:
            r = _worker(["--lib", lib, "--model", model, "--steps", str(steps)],
                        os.path.join(tmp, f"{model}_{lib}.json"), 300)[0]
            if lib not in recs or r["step_s"] < recs[lib]["step_s"]:
                recs[lib] = r
        base = recs["torch"]
        for lib in ("ours", "hf"):
            r = recs[lib]
            d = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], base["losses"]))
            say(f"  {model} bf16, {lib}: step {r['step_s'] * 1e3:.1f} ms vs plain autocast loop "
                f"{base['step_s'] * 1e3:.1f} ms ({r['step_s'] / base['step_s']:.3f}x; target ours <= 1.02x), "
                f"max rel loss diff {d:.1e}, peak {r['max_mem_gib']:.2f} GiB")
            if lib == "ours":
                check(f"{model} bf16 losses vs the plain loop", d <= 2e-2,
                      f"max rel diff {d:.1e} (bf16 tolerance 2e-2)")
        say(f"  {model}: ours / HF Accelerate step time {recs['ours']['step_s'] / recs['hf']['step_s']:.3f}x "
            "(target <= 1.0x)")
    n8 = 60 if quick else 200
    bf, f8 = (_worker(["--lib", "ours", "--model", "gpt", "--precision", p, "--steps", str(n8)],
                      os.path.join(tmp, f"fp8_{p}.json"), 300)[0] for p in ("bf16", "fp8"))
    lb, l8 = (sum(r["losses"][-10:]) / 10 for r in (bf, f8))
    check(f"fp8 vs bf16 after {n8} steps (demo GPT)", abs(l8 - lb) <= 0.01 * lb,
          f"mean of the last 10 losses {l8:.4f} vs {lb:.4f} ({abs(l8 - lb) / lb:.2%}; target 1%), step "
          f"{f8['step_s'] * 1e3:.1f} vs {bf['step_s'] * 1e3:.1f} ms")
    one = _worker(["--lib", "ours", "--model", "gpt", "--steps", "10", "--precision", "no"],
                  os.path.join(tmp, "one.json"), 300)[0]
    for strategy in ("ddp", "zero3"):
        try:
            two = _worker(["--lib", "ours", "--model", "gpt", "--steps", "10", "--precision", "no", "--strategy",
                           strategy], os.path.join(tmp, f"two_{strategy}"), 300, launch=2)
            d = max(abs(a - b) / abs(b) for a, b in zip(two[0]["losses"], one["losses"]))
            check(f"two processes on one GPU (gloo, CUDA tensors), {strategy} vs one process", d <= 1e-4,
                  f"max rel loss diff {d:.1e} over 10 steps, step {two[0]['step_s'] * 1e3:.1f} ms")
        except Exception as e:
            check(f"two processes on one GPU (gloo, CUDA tensors), {strategy}", False, str(e)[-600:])


def fp16_and_resume(quick: bool, tmp: str, say: Callable[[str], None],
                    check: Callable[[str, bool, str], None]) -> None:
    """gpu_check.py's fp16 and checkpoint section: fp16 (torch's GradScaler on CUDA) against the plain autocast +
    GradScaler loop, and save_state after 10 of 20 steps then load_state in a new process: the resumed steps must
    give the uninterrupted run's losses bit for bit (GradScaler, optimizer and RNG states on the device)."""
    common = ["--model", "gpt", "--precision", "fp16", "--steps", "20"]
    ref = _worker(["--lib", "torch", *common], os.path.join(tmp, "fp16_torch.json"), 300)[0]
    ckpt = os.path.join(tmp, "ckpt")
    whole = _worker(["--lib", "ours", *common, "--save_at", "10", "--ckpt", ckpt],
                    os.path.join(tmp, "fp16_ours.json"), 300)[0]
    d = max(abs(a - b) / abs(b) for a, b in zip(whole["losses"], ref["losses"]))
    check("fp16 (GradScaler) losses vs the plain autocast + GradScaler loop", d <= 2e-2 and
          whole["skipped"] == ref["skipped"], f"max rel diff {d:.1e} (tolerance 2e-2), skipped steps "
          f"{[i for i, s in enumerate(whole['skipped']) if s]} vs {[i for i, s in enumerate(ref['skipped']) if s]}")
    resumed = _worker(["--lib", "ours", *common, "--save_at", "10", "--resume", ckpt],
                      os.path.join(tmp, "fp16_resumed.json"), 300)[0]
    same = resumed["losses"] == whole["losses"][10:]
    check("save_state after 10 fp16 steps, load_state in a new process: steps 10..19 bit for bit", same,
          f"resumed {resumed['losses'][:3]} ... vs uninterrupted {whole['losses'][10:13]} ...")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--lib", choices=["torch", "ours", "hf"], required=True)
    p.add_argument("--model", choices=["gpt", "llama"], required=True)
    p.add_argument("--precision", choices=["bf16", "fp16", "fp8", "no"], default="bf16")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--global_batch", type=int, default=16)
    p.add_argument("--strategy", choices=["ddp", "zero3"], default=None)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", required=True)
    p.add_argument("--profile", default="", help="also write torch's profiler table of five steps to this file")
    p.add_argument("--tiny", action="store_true", help="a 2-layer, 32-wide GPT (checking the plumbing on a CPU)")
    p.add_argument("--save_at", type=int, default=0, help="ours/hf: save_state to --ckpt after this many steps")
    p.add_argument("--ckpt", default="", help="the checkpoint folder of --save_at")
    p.add_argument("--resume", default="", help="ours/hf: load_state from this folder and run steps save_at ..")
    args = p.parse_args()
    rec = run(args)
    out = args.out if rec["world"] == 1 else f"{args.out}.{rec['rank']}.json"
    with open(out, "w") as f:
        json.dump(rec, f)


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main()
