# tests/scripts/join_train.py: Accelerator.join_uneven_inputs on CPU processes: rank r trains --steps_per_rank[r]
# micro-steps (different per rank) of a BatchNorm model with gradient accumulation, inside the join context, then
# writes its final weights and buffers. With --emulate the single-process reference computes the same run with
# torch DDP's Join rules written out: gradients are summed over the ranks still active and divided by the initial
# world size, buffers are broadcast from the highest active rank at a forward after a synced one (ranks that are
# done receive it too), and at the end every rank takes the parameters and buffers of the highest rank among the
# last to finish. Used by tests/test_join.py.
# Options for the sharded engine (tests/test_sharded_join.py): --sharding FACE:STAGE runs under a DeepSpeedPlugin
# ("ds") or an FSDP plugin ("fsdp") of that stage (0: our DDP), --wrap size puts each layer in its own unit, --clip /
# --ds_clip clip at each synced step (accelerator.clip_grad_norm_ / DeepSpeed's gradient_clipping), --sched steps a
# LambdaLR scheduler (the lr changes every step), --loader reads the batches from a prepared DataLoader with
# even_batches=False (rank r gets every world-th batch, so --steps_per_rank must be that round robin) and then, as
# HF's accumulate, a rank syncs at its own last batch. The reference's rules for those runs: a step happens when
# every rank still training syncs (a rank that syncs alone mid-accumulation keeps its gradients for the next one),
# gradients a rank accumulated before it ran out are counted in the next step, and the rank out of inputs keeps
# stepping the model with the others (its shard must stay current), so every rank ends with the same weights.
# --hf runs the same loop under HF Accelerate (torch DDP, torch's Join; launch with torchrun).
# --drop_unsynced gives our stage-0 DDP join's (torch DDP's) rule instead: a rank that runs out mid-accumulation
# has the micro-batches it accumulated unsynced dropped, unless its last batch wanted a sync the others deferred.
# --fp16: mixed_precision="fp16" (an fp16 compute copy, BatchNorm in fp32, loss scaling: torch's GradScaler through
# the FSDP face, DeepSpeed's fp16 block through the DeepSpeed face, both starting at 1024, halving on an overflow,
# hysteresis 1 and no growth within the run); --inject T:R puts an inf into one gradient element of rank R at
# micro-step T. Each rank writes record<r>.json: (skipped, scale) after each of its synced steps and its scale after
# the join. The reference's rules: the same fp16 copies (sharded_train.compute_copy), gradients unscaled in fp32, a
# step with a non-finite gradient skipped (the gradients still zeroed) and the scale halved.
# --cases FILE: several runs one after another in the same processes (tests/scripts/fold_cases.py).
import argparse
import json
import os
import sys

import torch
from safetensors.torch import save_file

import fold_cases


def build() -> torch.nn.Module:
    torch.manual_seed(3)
    # no bias before BatchNorm: its gradient is rounding noise, which Adam would blow up to lr-sized steps
    return torch.nn.Sequential(torch.nn.Linear(5, 12, bias=False), torch.nn.BatchNorm1d(12), torch.nn.Tanh(), torch.nn.Linear(12, 1))


def data(t: int, r: int) -> tuple:
    g = torch.Generator().manual_seed(1000 * t + r)
    x = torch.randn(4, 5, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def optimizer(model: torch.nn.Module, kind: str = "adamw") -> torch.optim.Optimizer:
    # sgd: with --fp16, where AdamW would turn the fp16 rounding of a near-zero gradient into an lr-sized step
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.01)


def save(out: str, r: int, model: torch.nn.Module, losses: list, sd: dict | None = None) -> None:
    os.makedirs(out, exist_ok=True)
    sd = model.state_dict() if sd is None else sd
    save_file({k: v.detach().contiguous() for k, v in sd.items()}, os.path.join(out, f"state{r}.safetensors"))
    with open(os.path.join(out, f"losses{r}.json"), "w") as f:
        json.dump(losses, f)


def scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1.0 + 0.3 * k))


def synced(t: int, ga: int, steps: list, loader: bool) -> bool:
    """Whether micro-step t steps: every rank still training syncs (with a dataloader, also at its last batch)."""
    return all((t + 1) % ga == 0 or (loader and t == steps[r] - 1) for r in range(len(steps)) if steps[r] > t)


INIT_SCALE = 1024.0


def injected(args: argparse.Namespace) -> tuple:
    """--inject T:R -> (T, R); (-1, -1) without."""
    if not args.inject:
        return -1, -1
    t, r = args.inject.split(":")
    return int(t), int(r)


def emulate(steps: list, ga: int, out: str, args: argparse.Namespace) -> None:
    world = len(steps)
    model = build()
    opt = optimizer(model, args.optim)
    sched = scheduler(opt) if args.sched else None
    per_rank = [{k: v.clone() for k, v in model.named_buffers()} for _ in range(world)]
    losses: list = [[] for _ in range(world)]
    unsynced = [[torch.zeros_like(p) for p in model.parameters()] for _ in range(world)]  # since the last step
    records: list = [[] for _ in range(world)]
    scale, inject = INIT_SCALE, injected(args)
    synced_prev = True
    if args.fp16:
        from types import SimpleNamespace
        from sharded_train import compute_copy
        mp = SimpleNamespace(bf16=False, fp16=True, bn_low=False, buffer_bf16=False)
    for t in range(max(steps)):
        active = [r for r in range(world) if steps[r] > t]
        if synced_prev:
            src = max(active)
            per_rank = [{k: v.clone() for k, v in per_rank[src].items()} for _ in range(world)]
        for r in active:
            for k, b in model.named_buffers():
                b.copy_(per_rank[r][k])
            x, y = data(t, r)
            before = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]
            if args.fp16:  # the fp16 copy's gradients, unscaled in fp32
                copy = compute_copy(model, mp)
                loss = torch.nn.functional.mse_loss(copy(x.half()), y)
                (loss * scale / (ga * world)).backward()
                for p, q in zip(model.parameters(), copy.parameters()):
                    g = q.grad.float() / scale
                    p.grad = g if p.grad is None else p.grad + g
                if (t, r) == inject:
                    model[3].weight.grad.view(-1)[-1] = float("inf")
                per_rank[r] = {k: v.clone() for k, v in copy.named_buffers()}
            else:
                loss = torch.nn.functional.mse_loss(model(x), y)
                (loss / (ga * world)).backward()
                per_rank[r] = {k: v.clone() for k, v in model.named_buffers()}
            for u, p, b in zip(unsynced[r], model.parameters(), before):
                u += p.grad - b
            losses[r].append(loss.item())
        synced_prev = synced(t, ga, steps, args.loader)
        for r in active:  # torch DDP's joined rank contributes zeros: what it accumulated unsynced is dropped
            deferred = args.loader and t == steps[r] - 1  # its lone sync at its last batch waits: it counts
            if args.drop_unsynced and t == steps[r] - 1 and not synced_prev and not deferred:
                for u, p in zip(unsynced[r], model.parameters()):
                    p.grad -= u
        if synced_prev:
            finite = all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
            if finite and (args.clip or args.ds_clip):
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip or args.ds_clip)
            if finite:
                opt.step()
            else:
                scale /= 2
            opt.zero_grad()
            unsynced = [[torch.zeros_like(p) for p in model.parameters()] for _ in range(world)]
            for r in active:
                if (t + 1) % ga == 0 or (args.loader and t == steps[r] - 1):
                    records[r].append([not finite, scale])
            for _ in range(world if sched is not None else 0):  # HF's AcceleratedScheduler: once per process
                sched.step()
    src = max(r for r in range(world) if steps[r] == max(steps))
    for k, b in model.named_buffers():
        b.copy_(per_rank[src][k])
    for r in range(world):
        save(out, r, model, losses[r])
        if args.fp16:
            with open(os.path.join(out, f"record{r}.json"), "w") as f:
                json.dump({"steps": records[r], "final_scale": scale}, f)


def plugins(args: argparse.Namespace, ga: int, world: int) -> dict:
    if not args.sharding:
        return {}
    from accelerate_c import DeepSpeedPlugin, FullyShardedDataParallelPlugin
    face, stage = args.sharding.split(":")
    if face == "fsdp":
        name = {0: "NO_SHARD", 2: "SHARD_GRAD_OP", 3: "FULL_SHARD"}[int(stage)]
        return {"fsdp_plugin": FullyShardedDataParallelPlugin(sharding_strategy=name)}
    ds = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": ga,
          "zero_optimization": {"stage": int(stage)}}
    if args.ds_clip:
        ds["gradient_clipping"] = args.ds_clip
    if args.fp16:  # 2**10, halved at each overflow (hysteresis 1), no growth within the run
        ds["fp16"] = {"enabled": True, "initial_scale_power": 10, "hysteresis": 1, "loss_scale_window": 1000}
    return {"deepspeed_plugin": DeepSpeedPlugin(hf_ds_config=ds)}


def loader_dataset(steps: list) -> torch.utils.data.TensorDataset:
    """Batch i of 4 samples is data(i // world, i % world): dealt round robin, rank r's t-th batch is data(t, r)."""
    world = len(steps)
    xs, ys = zip(*(data(i // world, i % world) for i in range(sum(steps))))
    return torch.utils.data.TensorDataset(torch.cat(xs), torch.cat(ys))


def distributed(steps: list, ga: int, out: str, args: argparse.Namespace) -> None:
    if args.hf:  # HF Accelerate itself, on torch DDP + torch's Join
        from accelerate import Accelerator
    else:
        from accelerate_c import Accelerator
    mp: dict = {}
    if args.fp16:
        from accelerate_c.utils import GradScalerKwargs
        mp = {"mixed_precision": "fp16",
              "kwargs_handlers": [GradScalerKwargs(init_scale=INIT_SCALE, growth_interval=1000)]}
    acc = Accelerator(cpu=True, gradient_accumulation_steps=ga, **mp, **plugins(args, ga, len(steps)))
    r = acc.process_index
    assert acc.num_processes == len(steps)
    if args.sharding:
        import dataclasses
        stage = int(args.sharding.split(":")[1])
        assert acc.strategy.name == ("sharded" if stage else acc.strategy.name), acc.strategy.name
        if args.wrap == "size":  # each Linear and the BatchNorm a unit of its own, the root takes the rest
            acc.strategy.config = dataclasses.replace(acc.strategy.config, auto_wrap_policy="size_based_wrap",
                                                      min_num_params=20)
        if args.ignore:  # the last Linear kept out of the units (replicated, averaged as DDP's): the same math
            acc.strategy.config = dataclasses.replace(acc.strategy.config, ignored_modules=("3",))
    model = build()
    inject, current = injected(args), {"t": -1}
    if r == inject[1]:
        def hook(g: torch.Tensor) -> torch.Tensor:
            if current["t"] == inject[0]:
                g = g.clone()
                g.view(-1)[-1] = float("inf")
            return g
        model[3].weight.register_hook(hook)
    objs = [model, optimizer(model, args.optim)]
    if args.sched:
        objs.append(scheduler(objs[1]))
    if args.loader:
        objs.append(torch.utils.data.DataLoader(loader_dataset(steps), batch_size=4, shuffle=False))
    if args.second_model:  # a second prepared model among the joinables (refused under stages 1-3)
        objs.append(build())
    model, opt, *rest = acc.prepare(*objs)
    joinables = [model, opt] + ([rest.pop()] if args.second_model else [])
    if args.hf:
        # HF enters torch's Join on GPUs only (multi_device); opened for this CPU run (gloo runs torch's Join), after
        # prepare, which reads it too. torch's Join takes only Joinables: the DDP model.
        type(acc).multi_device = property(lambda self: self.use_distributed)
        joinables = [model]
    sched = rest[0] if args.sched else None
    batches = rest[-1] if args.loader else (data(t, r) for t in range(steps[r]))
    losses, records = [], []
    with acc.join_uneven_inputs(joinables, even_batches=False):
        for t, (x, y) in enumerate(batches):
            current["t"] = t
            ex, ey = data(t, r)
            assert torch.equal(x, ex) and torch.equal(y, ey), f"rank {r}: batch {t} is not the one expected"
            with acc.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                acc.backward(loss)
                if acc.sync_gradients and args.clip:
                    acc.clip_grad_norm_(model.parameters(), args.clip)
                opt.step()
                if sched is not None:
                    sched.step()
                opt.zero_grad()
                if args.fp16 and acc.sync_gradients:
                    records.append([bool(acc.optimizer_step_was_skipped), float(acc.scaler.get_scale())])
            losses.append(loss.item())
    if args.fp16:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"record{r}.json"), "w") as f:
            json.dump({"steps": records, "final_scale": float(acc.scaler.get_scale())}, f)
    if args.sharding:  # full fp32 weights on every rank, gathered unit by unit (collective)
        sd = acc.strategy.gather_state_dict(model, rank0_only=False)
        flat = torch.cat([v.reshape(-1).float() for v in sd.values()]).unsqueeze(0)
        every = acc.gather(flat)
        assert all(torch.equal(every[0], every[i]) for i in range(acc.num_processes)), "ranks ended with different weights"
        save(out, r, None, losses, sd)
        acc.wait_for_everyone()
        acc.end_training()
        return
    inner = acc.unwrap_model(model)
    flat = torch.cat([p.detach().reshape(-1) for p in inner.parameters()]).unsqueeze(0)
    every = acc.gather(flat)
    assert all(torch.equal(every[0], every[i]) for i in range(acc.num_processes)), "ranks ended with different weights"
    save(out, r, inner, losses)
    acc.wait_for_everyone()
    acc.end_training()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--steps_per_rank", required=True, help="comma-separated micro-steps of each rank")
    p.add_argument("--grad_accum", type=int, default=1)
    p.add_argument("--emulate", action="store_true")
    p.add_argument("--out", required=True)
    p.add_argument("--sharding", default="", help="FACE:STAGE, e.g. ds:1, fsdp:3 (fsdp:0 is our DDP)")
    p.add_argument("--wrap", choices=("no", "size"), default="no")
    p.add_argument("--clip", type=float, default=0.0, help="accelerator.clip_grad_norm_ at each synced step")
    p.add_argument("--ds_clip", type=float, default=0.0, help="DeepSpeed's gradient_clipping")
    p.add_argument("--sched", action="store_true", help="a LambdaLR scheduler stepped after each step")
    p.add_argument("--loader", action="store_true", help="a prepared DataLoader (even_batches=False)")
    p.add_argument("--optim", choices=("adamw", "sgd"), default="adamw")
    p.add_argument("--ignore", action="store_true", help="ignored_modules: the last Linear (replicated)")
    p.add_argument("--fp16", action="store_true", help="mixed_precision fp16 (loss scaling)")
    p.add_argument("--inject", default="", help="T:R: an inf in one gradient element of rank R at micro-step T")
    p.add_argument("--second_model", action="store_true", help="join a second prepared model too")
    p.add_argument("--hf", action="store_true", help="run HF Accelerate (torch DDP and torch's Join) instead")
    p.add_argument("--drop_unsynced", action="store_true", help="--emulate with torch DDP's rule (stage 0): a rank "
                   "that runs out mid-accumulation has its unsynced micro-batches dropped (a deferred lone sync "
                   "at its last batch still counts)")
    return p


def run(args: argparse.Namespace) -> None:
    steps = [int(s) for s in args.steps_per_rank.split(",")]
    if args.loader:
        world = len(steps)
        assert steps == [len(range(r, sum(steps), world)) for r in range(world)], "--loader deals batches round robin"
    if args.emulate:
        emulate(steps, args.grad_accum, args.out, args)
    else:
        distributed(steps, args.grad_accum, args.out, args)


def main() -> None:
    torch.set_num_threads(1)
    fold_cases.run(lambda argv: run(parser().parse_args(argv)), sys.argv[1:])  # --cases FILE: fold_cases.py


if __name__ == "__main__":
    main()
