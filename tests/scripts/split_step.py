# tests/scripts/split_step.py: trains small models under accelerate_c with several optimizer set-ups and
# records, per rank, each step's parameters checksum, the final parameters and (rank 0) the optimizer's
# state_dict, so tests/test_split_step.py can compare the split optimizer step with the unsplit one
# (ACCELERATE_C_SHARDED_STEP=0) bit for bit. Along the way it reloads the optimizer state mid-run and
# forces one step through torch's own optimizer (a step pre-hook), the two paths that move state around;
# adamw_local_sgd steps after every other backward under no_sync (per-rank gradients: no split).
# `--cases FILE` runs several set-ups (precision, ACCELERATE_C_SHARDED_STEP) in the same processes
# (tests/scripts/fold_cases.py).
# Not for: HF parity (parity_train.py).
import argparse
import os
import sys

import torch
import torch.nn as nn

from accelerate_c import Accelerator
from accelerate_c.utils import GradScalerKwargs, set_seed

import fold_cases


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(13, 37)
        self.b = nn.Linear(37, 29)
        self.c = nn.Linear(29, 5)
        self.unused = nn.Linear(3, 3)  # never in the graph: its grad stays None
        self.scale = nn.Parameter(torch.full((5,), 0.5), requires_grad=False)  # frozen, in the optimizer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))) * self.scale


def make_optimizer(name: str, model: Net, extra: torch.nn.Parameter) -> torch.optim.Optimizer:
    if name in ("adamw", "adamw_local_sgd"):
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if name == "adam_amsgrad_groups":
        rest = [p for n, p in model.named_parameters() if not n.startswith("a.")]
        return torch.optim.Adam([{"params": model.a.parameters(), "lr": 3e-3},
                                 {"params": rest, "weight_decay": 0.01}], lr=1e-2, amsgrad=True)
    if name == "sgd_nesterov":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05)
    if name == "adamw_head_only":  # fine-tuning a head: the split and the state cover its params only
        return torch.optim.AdamW(model.c.parameters(), lr=1e-2)
    if name == "adamw_outside_param":  # a parameter the model does not hold: stepped whole on every rank
        return torch.optim.AdamW(list(model.parameters()) + [extra], lr=1e-2)
    raise ValueError(name)


def main(argv: list) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--configs", default="adamw,adam_amsgrad_groups,sgd_nesterov,sgd,adamw_outside_param,"
                                         "adamw_local_sgd,adamw_head_only")
    ap.add_argument("--precision", default="no")
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args(argv)
    handlers = [GradScalerKwargs(init_scale=2.0 ** 20, growth_interval=2)] if args.precision == "fp16" else []
    acc = Accelerator(mixed_precision=args.precision, kwargs_handlers=handlers)
    os.makedirs(args.out, exist_ok=True)
    for name in args.configs.split(","):
        set_seed(0)
        model = Net()
        extra = nn.Parameter(torch.randn(7))
        opt = make_optimizer(name, model, extra)
        model, opt = acc.prepare(model, opt)
        sums, skipped = [], []
        for step in range(args.steps):
            g = torch.Generator().manual_seed(1000 * step + acc.process_index)
            x, y = torch.randn(6, 13, generator=g), torch.randn(6, 5, generator=g)
            loss = ((model(x) - y) ** 2).mean() + (extra ** 2).sum()
            if name.endswith("local_sgd") and step % 2:  # local SGD: each rank steps its own gradients
                with acc.no_sync(model):
                    acc.backward(loss)
            else:
                acc.backward(loss)
            if step == 6:  # torch's own step on every rank (the kernels decline optimizers with step hooks)
                h = opt.optimizer.register_step_pre_hook(lambda *a: None)
                opt.step()
                h.remove()
            else:
                opt.step()
            skipped.append(bool(opt.step_was_skipped))
            opt.zero_grad()
            if step == 3:  # a reload replaces every state tensor (the split step must adopt them again)
                opt.load_state_dict(opt.state_dict())
            sums.append(float(sum(p.detach().double().sum() for p in model.parameters())))
        inner = acc.unwrap_model(model)
        shard = acc.strategy.split_step(opt.optimizer)  # the bucketed strategy owns the split step
        rec = {"params": {k: v.clone() for k, v in inner.state_dict().items()}, "sums": sums, "skipped": skipped,
               "sharded": shard is not None, "split_numel": shard.total if shard is not None else 0}
        if acc.is_main_process:
            rec["optimizer"] = opt.state_dict()
        torch.save(rec, os.path.join(args.out, f"{name}.rank{acc.process_index}.pt"))
    acc.end_training()


if __name__ == "__main__":
    fold_cases.run(main, sys.argv[1:])
