# examples/train_gpt.py: the main job (`make demo`): a small GPT-style byte-level language model trained on
# the source text of Python's standard library, written as an ordinary HF-Accelerate script with
# `from accelerate_c import Accelerator`. Run: python -m accelerate_c launch --num_processes 2 examples/train_gpt.py
# Flags: --max_steps, --resume (continue from the last checkpoint in --project_dir), --overwrite (start
# fresh over an earlier run's checkpoints; without either, existing checkpoints are an error), --mixed_precision.
# Not for: benchmarking (benchmarks/) or showing every feature.
from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import sysconfig
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from accelerate_c import Accelerator, DataLoaderConfiguration, ProjectConfiguration
from accelerate_c.utils import set_seed


# ---- model: a decoder-only transformer (B = batch, T = sequence, C = channels, V = vocab = 256 bytes) ----
class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.fc, self.fc_out = nn.Linear(n_embd, 4 * n_embd), nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int = 256, block_size: int = 128, n_layer: int = 4, n_head: int = 4, n_embd: int = 256) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, n_embd), nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f, self.head = nn.LayerNorm(n_embd), nn.Linear(n_embd, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1))


# ---- data: non-overlapping blocks of the standard library's source bytes ----
def load_corpus(max_bytes: int) -> torch.Tensor:
    root, chunks, total = sysconfig.get_paths()["stdlib"], [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "test", "__pycache__"))
        for name in sorted(filenames):
            if name.endswith(".py") and total < max_bytes:
                with open(os.path.join(dirpath, name), "rb") as f:
                    data = f.read()
                chunks.append(data)
                total += len(data)
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).long()


class Blocks(torch.utils.data.Dataset):
    def __init__(self, data: torch.Tensor, block_size: int) -> None:
        self.data, self.block_size = data, block_size

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = i * self.block_size
        return self.data[s:s + self.block_size], self.data[s + 1:s + 1 + self.block_size]


class TrainState:
    """Step counter saved with the checkpoint (registered for checkpointing)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, sd: dict) -> None:
        self.step = int(sd["step"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--max_steps", type=int, default=160)
    p.add_argument("--batch_size", type=int, default=16, help="per process")
    p.add_argument("--block_size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--corpus_bytes", type=int, default=4_000_000)
    p.add_argument("--checkpoint_every", type=int, default=40)
    p.add_argument("--project_dir", default="demo_runs/gpt")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--overwrite", action="store_true", help="start fresh, deleting the checkpoints of an earlier run")
    p.add_argument("--mixed_precision", default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    accelerator = Accelerator(
        mixed_precision=args.mixed_precision,
        project_config=ProjectConfiguration(project_dir=args.project_dir, automatic_checkpoint_naming=True, total_limit=3),
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    set_seed(args.seed)
    data = load_corpus(args.corpus_bytes)
    loader = torch.utils.data.DataLoader(Blocks(data, args.block_size), batch_size=args.batch_size, shuffle=True, drop_last=True)
    model = GPT(block_size=args.block_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, args.max_steps * accelerator.num_processes)))))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    train_state = TrainState()
    accelerator.register_for_checkpointing(train_state)
    n_params = sum(p.numel() for p in accelerator.unwrap_model(model).parameters())
    accelerator.print(f"GPT: {n_params / 1e6:.2f}M parameters, {len(data) / 1e6:.1f} MB of text, "
                      f"{accelerator.num_processes} process(es), {accelerator.mixed_precision} precision")

    ckpt_root = os.path.join(args.project_dir, "checkpoints")
    earlier = os.path.isdir(ckpt_root) and bool(os.listdir(ckpt_root))
    if earlier and not args.resume:  # decide now, not at the first save 40 steps in
        if not args.overwrite:
            accelerator.print(f"error: {ckpt_root} holds checkpoints of an earlier run; pass --resume to continue "
                              "it or --overwrite to start fresh")
            sys.exit(2)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            shutil.rmtree(ckpt_root)
        accelerator.wait_for_everyone()
    if args.resume:
        if earlier:
            accelerator.load_state()  # the latest checkpoint; the stateful loader resumes mid-epoch
            accelerator.print(f"resumed at step {train_state.step}")
        else:
            accelerator.print("no checkpoint to resume from; starting fresh")

    from tqdm.auto import tqdm
    bar = tqdm(total=args.max_steps, initial=train_state.step, disable=not accelerator.is_local_main_process)
    tokens_per_step = args.batch_size * args.block_size * accelerator.num_processes
    t0, steps_timed, loss_avg = time.perf_counter(), 0, None
    model.train()
    while train_state.step < args.max_steps:
        for x, y in loader:
            loss = model(x, y)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            train_state.step += 1
            steps_timed += 1
            loss_val = accelerator.reduce(loss.detach(), reduction="mean").item()
            loss_avg = loss_val if loss_avg is None else 0.9 * loss_avg + 0.1 * loss_val
            tok_s = steps_timed * tokens_per_step / (time.perf_counter() - t0)
            bar.set_postfix(loss=f"{loss_avg:.3f}", tok_s=f"{tok_s:,.0f}")
            bar.update(1)
            if train_state.step % args.checkpoint_every == 0 or train_state.step == args.max_steps:
                path = accelerator.save_state()
                accelerator.print(f"\nstep {train_state.step}: loss {loss_val:.4f}, {tok_s:,.0f} tokens/s, saved {path}")
            if train_state.step >= args.max_steps:
                break
    bar.close()
    accelerator.print(f"done: {train_state.step} steps, final loss {loss_avg:.4f}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
