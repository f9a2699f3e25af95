# tests/scripts/views_walk.py: every tensor user code can reach from a prepared model and optimizer, read at every
# point of a training loop, under whatever strategy the launcher gives (plain DDP is the reference). The model is
# real model code: a transformers GPT-2 built from a config (wrapped per GPT2Block under FSDP's transformer policy),
# a BatchNorm (buffers), a frozen Linear and a Linear the forward never uses. The loop accumulates 2 micro-batches
# per step (no_sync, then a synced backward) and steps AdamW and a scheduler twice: first clipping with
# accelerator.clip_grad_norm_ and zeroing with optimizer.zero_grad(), then clipping with torch's own
# clip_grad_norm_ on the module's parameters (it writes into the .grad user code sees) and zeroing with the module's
# zero_grad(). Then two synced backwards with no zero_grad between them (they must add up) and a step. Then
# load_state_dict on the unwrapped module halves the head's weights and an eval forward (its output recorded) must
# use them.
# At each point it reads, from the wrapped and the unwrapped model: every parameter (value, `.numpy()`), its `.grad`,
# every buffer, `state_dict()`; and every optimizer state tensor and `optimizer.state_dict()` tensor. Each read
# checks that no tensor has a shape larger than its storage (the raw metadata too, before anything is gathered) and
# records a digest (shape, dtype, sum, |sum|) per name, or None for a missing gradient; the optimizer's tensors are
# only checked (sharded strategies hold shards of them). Writes <out>/walk<rank>.json (with the strategy the run got:
# "setup"). --cases FILE: several runs one after another in the same processes (fold_cases.py; "after end_training"
# is then read with the default process group still up in every case but the last).
# Not for: timing, or the strategies' numerics beyond what user code reads.
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2Model

from accelerate_c import Accelerator
import fold_cases


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gpt = GPT2Model(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
        self.bn = torch.nn.BatchNorm1d(32)
        self.frozen = torch.nn.Linear(32, 32)
        self.frozen.requires_grad_(False)
        self.unused = torch.nn.Linear(32, 4)
        self.head = torch.nn.Linear(32, 1)

    def forward(self, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.gpt(ids).last_hidden_state.mean(1)
        return F.mse_loss(self.head(self.frozen(self.bn(torch.tanh(h)))).squeeze(-1), y)


def raw_ok(t: torch.Tensor) -> bool:
    """The tensor's own metadata (as C code sees it, no __torch_function__): its extent fits in its storage."""
    with torch._C.DisableTorchFunctionSubclass():
        if t.numel() == 0:
            return True
        if type(t).__name__ == "PendingGrad":  # (a wrapper without storage: only ever read through its ops)
            return True
        need = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1
        return need * t.element_size() <= t.untyped_storage().nbytes()


class Walk:
    def __init__(self) -> None:
        self.points: dict = {}
        self.bad: list = []

    def check(self, where: str, t: torch.Tensor) -> None:
        if not raw_ok(t):
            self.bad.append(f"{where}: shape {tuple(t.shape)} over a {t.untyped_storage().nbytes()}-byte storage")
        d = t.detach()
        if not raw_ok(d):  # (what a read materialized)
            self.bad.append(f"{where}: detached shape {tuple(d.shape)} over {d.untyped_storage().nbytes()} bytes")

    def digest(self, where: str, t) -> list | None:
        if t is None:
            return None
        self.check(where, t)
        v = t.detach().double()
        s, a = float(v.sum()), float(v.abs().sum())
        if t.dtype == torch.float32 and abs(float(np.asarray(t.detach().numpy(), dtype=np.float64).sum()) - s) > \
                1e-6 * (a + 1.0):
            self.bad.append(f"{where}: .numpy() disagrees with the tensor")
        return [list(t.shape), str(t.dtype).replace("torch.", ""), s, a]

    def read(self, point: str, model, unwrapped, optimizer) -> None:
        rec = {}
        for tag, m in (("wrapped", model), ("module", unwrapped)):
            for n, p in m.named_parameters():
                n = n.removeprefix("module.")
                rec[f"{tag}.param.{n}"] = self.digest(f"{point} {tag} param {n}", p)
                rec[f"{tag}.grad.{n}"] = self.digest(f"{point} {tag} grad {n}", p.grad)
            for n, b in m.named_buffers():
                rec[f"{tag}.buffer.{n.removeprefix('module.')}"] = self.digest(f"{point} {tag} buffer {n}", b)
            for n, t in m.state_dict().items():
                rec[f"{tag}.state_dict.{n.removeprefix('module.')}"] = self.digest(f"{point} {tag} state_dict {n}", t)
        if optimizer is not None:
            inner = getattr(optimizer, "optimizer", optimizer)
            for k, st in enumerate(inner.state.values()):
                for key, t in st.items():
                    if isinstance(t, torch.Tensor):
                        self.check(f"{point} optimizer.state[{k}][{key}]", t)
                        t.detach().clone()
            for k, st in optimizer.state_dict()["state"].items():
                for key, t in st.items():
                    if isinstance(t, torch.Tensor):
                        self.check(f"{point} optimizer.state_dict()[{k}][{key}]", t)
        self.points[point] = rec


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    return ap


def run(args: argparse.Namespace) -> None:
    acc = Accelerator(gradient_accumulation_steps=2)
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, 64, (8,), generator=g), torch.randn((), generator=g)) for _ in range(32)]
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    model, optimizer, scheduler, loader = acc.prepare(model, optimizer, scheduler, loader)
    unwrapped = acc.unwrap_model(model)
    walk = Walk()
    cfg = getattr(acc.strategy, "config", None)
    setup = {"strategy": type(acc.strategy).__name__, "stage": getattr(acc.strategy, "stage", None),
             "distributed_type": str(acc.distributed_type), "mixed_precision": acc.mixed_precision,
             **{k: str(getattr(cfg, k)) for k in ("grad_sync", "transport", "sharded_step", "face") if hasattr(cfg, k)}}
    walk.read("after prepare", model, unwrapped, optimizer)
    for it, (ids, y) in enumerate(loader):
        with acc.accumulate(model):
            loss = model(ids, y)
            walk.read(f"it{it} between forward and backward", model, unwrapped, optimizer)
            acc.backward(loss)
            walk.read(f"it{it} after backward", model, unwrapped, optimizer)
            if acc.sync_gradients and it < 2:
                acc.clip_grad_norm_(model.parameters(), 1.0)
            elif acc.sync_gradients:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            optimizer.step()
            scheduler.step()
            walk.read(f"it{it} after step", model, unwrapped, optimizer)
            if it < 2:
                optimizer.zero_grad()
            elif acc.sync_gradients:
                model.zero_grad()
            walk.read(f"it{it} after zero_grad", model, unwrapped, optimizer)
    for k in range(2):  # two synced backwards with no zero_grad between them, then a step
        rows = data[4 * (2 * acc.process_index + k):4 * (2 * acc.process_index + k) + 4]
        acc.backward(model(torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])))
    walk.read("after two synced backwards", model, unwrapped, optimizer)
    acc.clip_grad_norm_(model.parameters(), 1.0)  # (so that the DeepSpeed face's own clipping at 1.0 changes nothing)
    optimizer.step()
    optimizer.zero_grad()
    walk.read("after their step", model, unwrapped, optimizer)
    sd = {k: v * 0.5 for k, v in unwrapped.state_dict().items() if k.startswith("head.")}
    unwrapped.load_state_dict(sd, strict=False)
    walk.read("after load_state_dict", model, unwrapped, optimizer)
    model.eval()
    with torch.no_grad():
        out = model(ids, y)
    walk.read("after an eval forward", model, unwrapped, optimizer)
    walk.points["after an eval forward"]["output"] = walk.digest("eval output", out)
    unwrapped = acc.unwrap_model(model).cpu()
    walk.read("after unwrap_model().cpu()", model, unwrapped, optimizer)
    acc.free_memory()
    walk.read("after free_memory", model, unwrapped, None)
    acc.end_training()  # (a case before the last of a --cases run keeps the default process group)
    walk.read("after end_training", model, unwrapped, None)
    rank = int(os.environ.get("RANK", "0"))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"walk{rank}.json"), "w") as f:
        json.dump({"setup": setup, "points": walk.points, "bad": walk.bad}, f)


def main() -> None:
    fold_cases.run(lambda argv: run(parser().parse_args(argv)), sys.argv[1:])  # --cases FILE: fold_cases.py
    os._exit(0)  # (the results are written; see docs/testing.md on gloo teardown)


if __name__ == "__main__":
    main()
