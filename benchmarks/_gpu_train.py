# benchmarks/_gpu_train.py: the training runs of benchmarks/gpu_check.py, each in its own process (so HF Accelerate,
# accelerate_c and the plain loop never share a process, and the two-process runs go through our launcher): one model
# (the demo GPT of examples/train_gpt.py, or a transformers Llama from a config), synthetic token batches fixed by the
# seed, torch.optim.AdamW(fused=True) as the user's optimizer, and per-step losses plus the mean step time written as
# JSON. Also runnable on the CPU (--device cpu) so the script's plumbing is checked where there is no GPU.
# Not for: kernel checks (gpu_check.py) or anything the library itself needs.
#
#   python benchmarks/_gpu_train.py --lib {torch,ours,hf} --model {gpt,llama} --precision {bf16,fp8,no} --steps N
#       --out FILE [--device cuda|cpu] [--strategy ddp|zero3 --global_batch B]   (the last two under a launcher)
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def build_model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
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
    model = build_model(args.model)
    data = batches(args.model, args.steps, args.global_batch)
    acc = None
    if args.lib == "torch":
        model = model.to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01, fused=dev.type == "cuda")
        auto = (torch.autocast(dev.type, dtype=torch.bfloat16) if args.precision == "bf16"
                else contextlib.nullcontext())
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
    rank, world = (acc.process_index, acc.num_processes) if acc is not None else (0, 1)
    losses, t0, warm = [], 0.0, min(5, args.steps - 1)
    for i, x in enumerate(data):
        if i == warm:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        x = x.chunk(world)[rank].to(dev, non_blocking=True)
        with auto:
            loss = loss_of(args.model, model, x)
        if acc is None:
            loss.backward()
        else:
            acc.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        d = loss.detach().float().reshape(1)
        losses.append(acc.gather(d).mean().reshape(1) if world > 1 else d)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    step_s = (time.perf_counter() - t0) / max(1, args.steps - warm)
    return {"lib": args.lib, "model": args.model, "precision": args.precision, "strategy": args.strategy,
            "world": world, "rank": rank, "losses": torch.cat(losses).tolist(), "step_s": step_s,
            "max_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else 0.0}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--lib", choices=["torch", "ours", "hf"], required=True)
    p.add_argument("--model", choices=["gpt", "llama"], required=True)
    p.add_argument("--precision", choices=["bf16", "fp8", "no"], default="bf16")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--global_batch", type=int, default=16)
    p.add_argument("--strategy", choices=["ddp", "zero3"], default=None)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rec = run(args)
    out = args.out if rec["world"] == 1 else f"{args.out}.{rec['rank']}.json"
    with open(out, "w") as f:
        json.dump(rec, f)


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main()
