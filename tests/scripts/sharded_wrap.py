# tests/scripts/sharded_wrap.py: the FSDP face's auto-wrap settings through a real prepare on the sharded engine,
# with a tiny transformers GPT-2 (its _no_split_modules is ["GPT2Block"]):
#   --policy env:     the plugin built from the launcher's variables (--use_fsdp --fsdp_auto_wrap_policy
#                     TRANSFORMER_BASED_WRAP without class names: they come from model._no_split_modules)
#   --policy partial: FullyShardedDataParallelPlugin(auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
#                     transformer_layer_cls={GPT2Block}))
#   --policy user:    a user function (module, recurse, nonwrapped_numel) wrapping every nn.Linear-like Conv1D
#   --policy none:    NO_WRAP (the reference: one unit, the same math)
# Writes record<r>.json: the engine's unit names and the losses of a few steps. --cases FILE: several runs one
# after another in the same processes (fold_cases.py).
# Not for: the unit arithmetic (test_sharded_units.py).
import argparse
import functools
import json
import os
import sys

import torch

import fold_cases


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--policy", choices=("env", "partial", "user", "none"), required=True)
    p.add_argument("--out", required=True)
    return p


def run(args: argparse.Namespace) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    from accelerate_c import Accelerator, FullyShardedDataParallelPlugin
    if args.policy == "env":
        plugin = None  # from FSDP_* variables (the launcher's flags)
    elif args.policy == "partial":
        plugin = FullyShardedDataParallelPlugin(
            auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={GPT2Block}))
    elif args.policy == "user":
        def conv1d(module: torch.nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
            return recurse or type(module).__name__ == "Conv1D"
        plugin = FullyShardedDataParallelPlugin(auto_wrap_policy=conv1d)
    else:
        plugin = FullyShardedDataParallelPlugin(auto_wrap_policy="NO_WRAP")
    acc = Accelerator(cpu=True, fsdp_plugin=plugin)
    assert acc.strategy.name == "sharded", acc.strategy.name
    assert acc.gradient_state.is_xla_gradients_synced is True  # FSDP's gradients are always reduced (HF's answer)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    losses = []
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 64, (4, 8), generator=g)
        per = 4 // acc.num_processes
        mine = ids[acc.process_index * per:(acc.process_index + 1) * per]
        loss = model(input_ids=mine, labels=mine).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(acc.reduce(loss.detach(), reduction="mean").item())
    units = [u.name for u in acc.strategy.engines[0].units]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"record{acc.process_index}.json"), "w") as f:
        json.dump({"units": units, "losses": losses}, f)
    acc.end_training()


def main() -> None:
    torch.set_num_threads(1)
    fold_cases.run(lambda argv: run(parser().parse_args(argv)), sys.argv[1:])  # --cases FILE: fold_cases.py


if __name__ == "__main__":
    main()
