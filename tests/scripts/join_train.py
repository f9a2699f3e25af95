# tests/scripts/join_train.py: Accelerator.join_uneven_inputs on CPU processes: rank r trains --steps_per_rank[r]
# micro-steps (different per rank) of a BatchNorm model with gradient accumulation, inside the join context, then
# writes its final weights and buffers. With --emulate the single-process reference computes the same run with
# torch DDP's Join rules written out: gradients are summed over the ranks still active and divided by the initial
# world size, buffers are broadcast from the highest active rank at a forward after a synced one (ranks that are
# done receive it too), and at the end every rank takes the parameters and buffers of the highest rank among the
# last to finish. Used by tests/test_join.py.
import argparse
import json
import os

import torch
from safetensors.torch import save_file


def build() -> torch.nn.Module:
    torch.manual_seed(3)
    # no bias before BatchNorm: its gradient is rounding noise, which Adam would blow up to lr-sized steps
    return torch.nn.Sequential(torch.nn.Linear(5, 12, bias=False), torch.nn.BatchNorm1d(12), torch.nn.Tanh(), torch.nn.Linear(12, 1))


def data(t: int, r: int) -> tuple:
    g = torch.Generator().manual_seed(1000 * t + r)
    x = torch.randn(4, 5, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.01)


def save(out: str, r: int, model: torch.nn.Module, losses: list) -> None:
    os.makedirs(out, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, os.path.join(out, f"state{r}.safetensors"))
    with open(os.path.join(out, f"losses{r}.json"), "w") as f:
        json.dump(losses, f)


def emulate(steps: list, ga: int, out: str) -> None:
    world = len(steps)
    model = build()
    opt = optimizer(model)
    per_rank = [{k: v.clone() for k, v in model.named_buffers()} for _ in range(world)]
    losses: list = [[] for _ in range(world)]
    synced_prev = True
    for t in range(max(steps)):
        active = [r for r in range(world) if steps[r] > t]
        if synced_prev:
            src = max(active)
            per_rank = [{k: v.clone() for k, v in per_rank[src].items()} for _ in range(world)]
        for r in active:
            for k, b in model.named_buffers():
                b.copy_(per_rank[r][k])
            x, y = data(t, r)
            loss = torch.nn.functional.mse_loss(model(x), y)
            (loss / (ga * world)).backward()
            per_rank[r] = {k: v.clone() for k, v in model.named_buffers()}
            losses[r].append(loss.item())
        synced_prev = (t + 1) % ga == 0
        if synced_prev:
            opt.step()
            opt.zero_grad()
    src = max(r for r in range(world) if steps[r] == max(steps))
    for k, b in model.named_buffers():
        b.copy_(per_rank[src][k])
    for r in range(world):
        save(out, r, model, losses[r])


def distributed(steps: list, ga: int, out: str) -> None:
    from accelerate_c import Accelerator
    acc = Accelerator(cpu=True, gradient_accumulation_steps=ga)
    r = acc.process_index
    assert acc.num_processes == len(steps)
    model = build()
    model, opt = acc.prepare(model, optimizer(model))
    losses = []
    with acc.join_uneven_inputs([model, opt], even_batches=False):
        for t in range(steps[r]):
            x, y = data(t, r)
            with acc.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                acc.backward(loss)
                opt.step()
                opt.zero_grad()
            losses.append(loss.item())
    inner = acc.unwrap_model(model)
    flat = torch.cat([p.detach().reshape(-1) for p in inner.parameters()]).unsqueeze(0)
    every = acc.gather(flat)
    assert all(torch.equal(every[0], every[i]) for i in range(acc.num_processes)), "ranks ended with different weights"
    save(out, r, inner, losses)
    acc.wait_for_everyone()
    acc.end_training()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps_per_rank", required=True, help="comma-separated micro-steps of each rank")
    p.add_argument("--grad_accum", type=int, default=1)
    p.add_argument("--emulate", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    steps = [int(s) for s in args.steps_per_rank.split(",")]
    (emulate if args.emulate else distributed)(steps, args.grad_accum, args.out)


if __name__ == "__main__":
    main()
