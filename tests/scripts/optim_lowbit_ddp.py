# tests/scripts/optim_lowbit_ddp.py: trains a small model under accelerate_c DDP with accelerate_c.optim.AdamW
# holding 8-bit and bf16 state, with gradient clipping and a mid-run state reload; records per
# rank the final parameters, the optimizer state_dict, each param's state layout, whether the split optimizer
# step (ddp/split_step.py) took the optimizer and its cuts in the 8-bit params, for tests/test_optim_lowbit.py.
# `--cases FILE` runs it split and unsplit (ACCELERATE_C_SHARDED_STEP=0) in the same processes
# (tests/scripts/fold_cases.py).
# Not for: the fp32 split step (tests/scripts/split_step.py).
import argparse
import os
import sys

import torch
import torch.nn as nn

from accelerate_c import Accelerator
from accelerate_c.optim import AdamW, lowbit
from accelerate_c.utils import set_seed

import fold_cases


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(40, 128)  # 5120 weights: 8-bit
        self.b = nn.Linear(128, 33)  # 4224 weights: 8-bit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def main(argv: list) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    acc = Accelerator()
    os.makedirs(args.out, exist_ok=True)
    for name in ("8bit", "bfloat16"):
        set_seed(0)
        net = Net()
        model, opt = acc.prepare(net, AdamW(net.parameters(), lr=1e-2, weight_decay=0.1, state_dtype=name,
                                            min_8bit_size=4096))
        for step in range(6):
            g = torch.Generator().manual_seed(100 * step + acc.process_index)
            x, y = torch.randn(6, 40, generator=g), torch.randn(6, 33, generator=g)
            acc.backward(((model(x) - y) ** 2).mean())
            acc.clip_grad_norm_(model.parameters(), 0.3)
            opt.step()
            opt.zero_grad()
            if step == 2:
                opt.load_state_dict(opt.state_dict())
        inner = opt.optimizer
        shard = acc.strategy.split_step(inner)  # the bucketed strategy owns the split step
        rec = {"cuts": [shard.cuts[id(p)] for p in (net.a.weight, net.b.weight)] if shard is not None else None,
               "params": {k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()},
               "optimizer": opt.state_dict(), "sharded": shard is not None,
               "layouts": [lowbit.layout_of(inner.state[p]) for g in inner.param_groups
                           for p in g["params"]]}
        torch.save(rec, os.path.join(args.out, f"{name}.rank{acc.process_index}.pt"))
    acc.end_training()


if __name__ == "__main__":
    fold_cases.run(main, sys.argv[1:])
