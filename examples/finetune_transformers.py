# examples/finetune_transformers.py: fine-tuning a transformers causal language model, written as an ordinary
# HF Accelerate script: bf16 autocast, gradient accumulation (accumulate()), gradient clipping, a linear warmup
# schedule, TensorBoard tracking, checkpoints every --checkpoint_every optimizer steps and exact resume
# (--resume_from_checkpoint DIR|latest: load_state, then skip the batches the interrupted epoch already used, the
# HF example way). The model is a local pretrained folder (--model_dir, transformers' save_pretrained layout) or a
# GPT-2 built from a config (no Hub); the data are byte-level tokens of Python's standard library source.
#   python -m accelerate_c launch --num_processes 2 examples/finetune_transformers.py --output_dir runs/ft
# --impl accelerate runs the very same script on HF Accelerate 1.15 (for comparisons: tests/test_example_finetune.py
# checks both give the same per-step losses). Per-step losses also go to <output_dir>/losses.json.
# Not for: benchmarking (benchmarks/) or the demo job (train_gpt.py).
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import re

import torch

from train_gpt import load_corpus  # the demo's corpus reader (examples/ is on sys.path when run as a script)


class Blocks(torch.utils.data.Dataset):
    """Non-overlapping blocks of tokens; the model shifts labels itself."""

    def __init__(self, tokens: torch.Tensor, block: int) -> None:
        self.tokens, self.block = tokens, block

    def __len__(self) -> int:
        return len(self.tokens) // self.block

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tokens[i * self.block:(i + 1) * self.block]


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel
    if args.model_dir:
        return AutoModelForCausalLM.from_pretrained(args.model_dir, local_files_only=True)
    torch.manual_seed(args.seed)
    cfg = GPT2Config(vocab_size=256, n_positions=args.block_size, n_embd=args.n_embd, n_layer=args.n_layer,
                     n_head=args.n_head, resid_pdrop=args.dropout, embd_pdrop=args.dropout, attn_pdrop=args.dropout,
                     bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def latest_checkpoint(output_dir: str) -> str | None:
    steps = [int(m.group(1)) for d in os.listdir(output_dir) if (m := re.fullmatch(r"step_(\d+)", d))] \
        if os.path.isdir(output_dir) else []
    return os.path.join(output_dir, f"step_{max(steps)}") if steps else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--impl", default="accelerate_c", choices=("accelerate_c", "accelerate"))
    p.add_argument("--model_dir", default=None, help="a local pretrained model folder (default: GPT-2 from a config)")
    p.add_argument("--n_layer", type=int, default=4)
    p.add_argument("--n_head", type=int, default=4)
    p.add_argument("--n_embd", type=int, default=128)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--block_size", type=int, default=128)
    p.add_argument("--batch_size", type=int, default=8, help="per process")
    p.add_argument("--grad_accum", type=int, default=2)
    p.add_argument("--mixed_precision", default="bf16")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup_steps", type=int, default=10)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max_steps", type=int, default=100, help="optimizer steps (the schedule's length too)")
    p.add_argument("--stop_after", type=int, default=None, help="end the run after this many steps (an interruption)")
    p.add_argument("--corpus_bytes", type=int, default=2_000_000)
    p.add_argument("--checkpoint_every", type=int, default=25)
    p.add_argument("--output_dir", default="runs/finetune")
    p.add_argument("--resume_from_checkpoint", default=None, help="a step_N folder, or 'latest'")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    acc_mod = importlib.import_module(args.impl)
    utils = importlib.import_module(f"{args.impl}.utils")
    accelerator = acc_mod.Accelerator(mixed_precision=args.mixed_precision, gradient_accumulation_steps=args.grad_accum,
                                      log_with="tensorboard", project_dir=args.output_dir)
    utils.set_seed(args.seed)

    tokens = load_corpus(args.corpus_bytes)
    n_eval = len(tokens) // 20
    train = Blocks(tokens[:-n_eval], args.block_size)
    evals = Blocks(tokens[-n_eval:], args.block_size)
    train_loader = torch.utils.data.DataLoader(train, batch_size=args.batch_size, shuffle=True)
    eval_loader = torch.utils.data.DataLoader(evals, batch_size=args.batch_size)

    from transformers import get_linear_schedule_with_warmup
    model = build_model(args)
    decay = [p_ for n, p_ in model.named_parameters() if p_.ndim >= 2]
    no_decay = [p_ for n, p_ in model.named_parameters() if p_.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr)
    scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup_steps, args.max_steps)
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler)
    accelerator.init_trackers("finetune", config={k: v for k, v in vars(args).items() if v is not None})

    completed, start_epoch, skip = 0, 0, 0
    losses_path = os.path.join(args.output_dir, "losses.json")
    losses: list[float] = []
    if args.resume_from_checkpoint:
        path = latest_checkpoint(args.output_dir) if args.resume_from_checkpoint == "latest" else args.resume_from_checkpoint
        if path is None:
            raise SystemExit(f"--resume_from_checkpoint latest: no step_N checkpoint in {args.output_dir}")
        accelerator.load_state(path)
        completed = int(os.path.basename(path).split("_")[1])
        consumed = completed * args.grad_accum  # micro-batches this process already trained on
        start_epoch, skip = divmod(consumed, len(train_loader))
        with open(losses_path) as f:
            losses = json.load(f)[:completed]
        accelerator.print(f"resumed from {path}: step {completed}, epoch {start_epoch}, skipping {skip} batches")

    stop = min(args.max_steps, args.stop_after or args.max_steps)
    for epoch in range(start_epoch, args.epochs):
        model.train()
        train_loader.set_epoch(epoch)
        loader = accelerator.skip_first_batches(train_loader, skip) if (epoch == start_epoch and skip) else train_loader
        running = 0.0
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(input_ids=batch, labels=batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            running += loss.detach().float() / args.grad_accum
            if accelerator.sync_gradients:
                completed += 1
                step_loss = accelerator.reduce(running, reduction="mean").item()
                running = 0.0
                losses.append(step_loss)
                accelerator.log({"train_loss": step_loss, "lr": scheduler.get_last_lr()[0]}, step=completed)
                if completed % args.checkpoint_every == 0:
                    accelerator.save_state(os.path.join(args.output_dir, f"step_{completed}"))
                    if accelerator.is_main_process:
                        with open(losses_path, "w") as f:
                            json.dump(losses, f)
                if completed >= stop:
                    break
        if completed >= stop:
            break

    model.eval()
    total, count = 0.0, 0
    for batch in eval_loader:
        with torch.no_grad():
            loss = model(input_ids=batch, labels=batch).loss
        gathered = accelerator.gather_for_metrics(loss.detach().float().reshape(1))
        total, count = total + gathered.sum().item(), count + gathered.numel()
    eval_loss = total / max(count, 1)
    accelerator.log({"eval_loss": eval_loss}, step=completed)
    accelerator.print(f"step {completed}: train loss {losses[-1]:.4f}, eval loss {eval_loss:.4f} "
                      f"(perplexity {math.exp(eval_loss):.2f})")
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
        with open(losses_path, "w") as f:
            json.dump(losses, f)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
