# tests/scripts/ddp_semantics.py: torch-DDP semantics of accelerate_c's data parallelism on real models, and the
# single-process reference they are checked against (tests/test_ddp_semantics.py).
#   --model bn:   an MLP with two BatchNorm1d layers (running stats = buffers), a sometimes-unused and a frozen layer
#   --model bert: transformers' BertForSequenceClassification built from a config (buffers: position/token type ids)
# Launched on N processes, each rank trains on its slice of every global batch. With --emulate N on one process the
# same run is computed without communication: per-rank buffers are kept apart and follow torch DDP's rule
# (broadcast_buffers: rank 0's buffers are copied to every rank at the start of a forward when the previous forward
# was a synced one), gradients are the average over ranks of each rank's accumulated gradient.
#   --mode train: prepared optimizer, gradient accumulation; writes per-step losses, final weights, per-rank buffers
#   --mode grads: no prepared optimizer: a no_sync backward then a synced one; writes the gradients read right after
#                 the synced backward (every rank must hold the average), then steps an unprepared torch optimizer
# Output in --out: losses.json, weights.safetensors, grads.safetensors, buffers<rank>.safetensors (rank 0 writes
# the shared files; with --emulate the reference writes them all). `--cases FILE` runs several configurations in the
# same processes (tests/scripts/fold_cases.py).
# BNNet, batch, chunk, loss_of are imported by tests/scripts/sharded_train.py and universal_chain.py.
import argparse
import json
import os
import sys

import torch
from safetensors.torch import save_file

import fold_cases

STEPS = 6


class BNNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                        torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh())
        self.head = torch.nn.Linear(16, 1)
        self.aux = torch.nn.Linear(16, 1)     # used on even micro-steps only
        self.frozen = torch.nn.Linear(16, 1)  # requires_grad False
        self.frozen.requires_grad_(False)
        self.never = torch.nn.Linear(3, 3)    # never used: its grad stays None

    def forward(self, x: torch.Tensor, use_aux: bool) -> torch.Tensor:
        h = self.body(x)
        out = self.head(h) + self.frozen(h)
        return out + self.aux(h) if use_aux else out


def build(kind: str) -> torch.nn.Module:
    torch.manual_seed(1)
    if kind == "bn":
        return BNNet()
    from transformers import BertConfig, BertForSequenceClassification
    cfg = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=48,
                     max_position_embeddings=32, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(cfg)


def batch(kind: str, step: int, global_batch: int) -> tuple:
    g = torch.Generator().manual_seed(100 + step)
    if kind == "bn":
        x = torch.randn(global_batch, 6, generator=g)
        return x, (x[:, :1] * 2 - x[:, 1:2]).tanh()
    ids = torch.randint(0, 64, (global_batch, 10), generator=g)
    return ids, torch.randint(0, 3, (global_batch,), generator=g)


def loss_of(kind: str, model: torch.nn.Module, xb: torch.Tensor, yb: torch.Tensor, micro: int) -> torch.Tensor:
    if kind == "bn":
        return torch.nn.functional.mse_loss(model(xb, use_aux=micro % 2 == 0), yb)
    return model(input_ids=xb, labels=yb).loss


def chunk(t: torch.Tensor, r: int, n: int) -> torch.Tensor:
    per = t.shape[0] // n
    return t[r * per:(r + 1) * per]


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05, momentum=0.9)


def emulate(args: argparse.Namespace) -> None:
    """The reference: one process, no communication, torch DDP's rules written out."""
    n, kind = args.emulate, args.model
    model = build(kind)
    model.train()
    names = [name for name, _ in model.named_buffers()]
    per_rank = [{k: v.clone() for k, v in model.named_buffers()} for _ in range(n)]

    def load(r: int) -> None:
        for name, b in model.named_buffers():
            b.copy_(per_rank[r][name])

    def store(r: int) -> None:
        per_rank[r] = {k: v.clone() for k, v in model.named_buffers()}

    opt = make_optimizer(model) if args.mode == "train" else None
    micro_steps = STEPS * args.grad_accum if args.mode == "train" else 2
    synced_prev, losses = True, []
    grads_after = {}
    for m in range(micro_steps):
        sync = (m + 1) % args.grad_accum == 0 if args.mode == "train" else m == 1
        if args.broadcast_buffers and synced_prev:
            for r in range(1, n):
                per_rank[r] = {k: v.clone() for k, v in per_rank[0].items()}
        xb, yb = batch(kind, m, args.global_batch)
        total = 0.0
        for r in range(n):
            load(r)
            loss = loss_of(kind, model, chunk(xb, r, n), chunk(yb, r, n), m)
            (loss / (args.grad_accum * n)).backward()  # the average over ranks of each rank's scaled loss
            store(r)
            total += loss.item() / n
        losses.append(total)
        synced_prev = sync
        if sync and args.mode == "train":
            opt.step()
            opt.zero_grad()
        if sync and args.mode == "grads":
            grads_after = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
            make_optimizer(model).step()
    load(0)  # the weights file holds rank 0's buffers, as the distributed run's rank 0 writes
    write(args, losses, model, grads_after, per_rank if names else [])


def distributed(args: argparse.Namespace) -> None:
    from accelerate_c import Accelerator, DistributedDataParallelKwargs
    ddp = DistributedDataParallelKwargs(broadcast_buffers=bool(args.broadcast_buffers))
    grad_accum = args.grad_accum if args.mode == "train" else 1
    acc = Accelerator(cpu=True, gradient_accumulation_steps=grad_accum, kwargs_handlers=[ddp])
    n, r, kind = acc.num_processes, acc.process_index, args.model
    model = build(kind)
    losses, grads_after = [], {}
    if args.mode == "train":
        model, opt = acc.prepare(model, make_optimizer(model))
        for m in range(STEPS * grad_accum):
            xb, yb = batch(kind, m, args.global_batch)
            with acc.accumulate(model):
                loss = loss_of(kind, model, chunk(xb, r, n), chunk(yb, r, n), m)
                acc.backward(loss)
                opt.step()
                opt.zero_grad()
            losses.append(acc.reduce(loss.detach(), reduction="mean").item())
    else:
        model = acc.prepare(model)  # no optimizer at all
        inner = acc.unwrap_model(model)
        for m in range(2):
            xb, yb = batch(kind, m, args.global_batch)
            ctx = acc.no_sync(model) if m == 0 else torch.enable_grad()
            with ctx:
                loss = loss_of(kind, model, chunk(xb, r, n), chunk(yb, r, n), m)
                if m == 0:
                    loss.backward()  # a plain backward under no_sync: accumulates locally
                else:
                    acc.backward(loss)  # the synced pass: .grad must hold the average when it returns
            losses.append(acc.reduce(loss.detach(), reduction="mean").item())
        # read right after backward, as clip_grad_norm_ or gradient-norm logging would
        grads_after = {k: p.grad.clone() for k, p in inner.named_parameters() if p.grad is not None}
        make_optimizer(inner).step()  # an unprepared optimizer
        flat = torch.cat([g.reshape(-1) for g in grads_after.values()]).unsqueeze(0)
        every = acc.gather(flat)
        assert all(torch.equal(every[0], every[i]) for i in range(n)), "ranks hold different gradients"
    inner = acc.unwrap_model(model)
    buffers = {k: v.clone() for k, v in inner.named_buffers()}
    if buffers:
        os.makedirs(args.out, exist_ok=True)
        save_file({k: v.contiguous() for k, v in buffers.items()}, os.path.join(args.out, f"buffers{r}.safetensors"))
    if acc.is_main_process:
        write(args, losses, inner, grads_after, [])
    acc.wait_for_everyone()
    acc.end_training()


def write(args: argparse.Namespace, losses: list, model: torch.nn.Module, grads: dict, per_rank: list) -> None:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "losses.json"), "w") as f:
        json.dump(losses, f)
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()},
              os.path.join(args.out, "weights.safetensors"))
    if grads:
        save_file({k: v.contiguous() for k, v in grads.items()}, os.path.join(args.out, "grads.safetensors"))
    for r, bufs in enumerate(per_rank):
        save_file({k: v.contiguous() for k, v in bufs.items()}, os.path.join(args.out, f"buffers{r}.safetensors"))


def main(argv: list) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=("bn", "bert"), default="bn")
    p.add_argument("--mode", choices=("train", "grads"), default="train")
    p.add_argument("--global_batch", type=int, default=12)
    p.add_argument("--grad_accum", type=int, default=1)
    p.add_argument("--broadcast_buffers", type=int, default=1)
    p.add_argument("--emulate", type=int, default=0, help="the single-process reference of N ranks")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    (emulate if args.emulate else distributed)(args)


if __name__ == "__main__":
    fold_cases.run(main, sys.argv[1:])
