# tests/scripts/sync_sequence.py: the accumulation bookkeeping of one short run, under HF Accelerate or accelerate_c
# (--impl): per micro-step sync_gradients, accelerator.step and whether the optimizer really stepped, over two
# epochs of a loader whose length does not divide by the accumulation steps. Prints one JSON line.
# Used by tests/test_accelerator.py (GradientAccumulationPlugin options against HF 1.15).
import argparse
import importlib
import json

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--impl", default="accelerate_c")
    p.add_argument("--sync_with_dataloader", type=int, default=1)
    p.add_argument("--sync_each_batch", type=int, default=0)
    args = p.parse_args()
    mod = importlib.import_module(args.impl)
    utils = importlib.import_module(f"{args.impl}.utils")
    plugin = utils.GradientAccumulationPlugin(num_steps=3, sync_with_dataloader=bool(args.sync_with_dataloader),
                                              sync_each_batch=bool(args.sync_each_batch))
    acc = mod.Accelerator(cpu=True, gradient_accumulation_plugin=plugin)
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(5, 2)), batch_size=1)
    model, opt, loader = acc.prepare(model, opt, loader)
    seq = []
    for _epoch in range(2):
        for (x,) in loader:
            before = model.weight.detach().clone()
            with acc.accumulate(model):
                acc.backward(model(x).sum())
                opt.step()
                opt.zero_grad()
            seq.append([bool(acc.sync_gradients), int(acc.step), not torch.equal(before, model.weight.detach())])
    print(json.dumps(seq))


if __name__ == "__main__":
    main()
