# tests/scripts/universal_chain.py: one link of the universal-checkpoint chain (tests/test_universal_chain.py).
# Builds ddp_semantics' BNNet (BatchNorm buffers) + AdamW under the strategy named by --face/--stage, then either
# trains 3 steps from scratch (--load omitted) or loads --load, and saves its state to --save. With --dump (one
# process) it writes the loaded model state dict and the optimizer state by parameter name to a safetensors file.
import argparse

import torch
from safetensors.torch import save_file

from ddp_semantics import BNNet, batch, chunk, loss_of

p = argparse.ArgumentParser()
p.add_argument("--face", default="ddp", choices=["ddp", "fsdp", "deepspeed"])
p.add_argument("--stage", type=int, default=0)
p.add_argument("--load")
p.add_argument("--save")
p.add_argument("--dump")
a = p.parse_args()

import accelerate_c
from accelerate_c.utils.sharding_plugins import FullyShardedDataParallelPlugin
from accelerate_c.utils.deepspeed_plugin import DeepSpeedPlugin

kw = {}
if a.face == "fsdp":
    kw["fsdp_plugin"] = FullyShardedDataParallelPlugin(
        sharding_strategy={0: "NO_SHARD", 2: "SHARD_GRAD_OP", 3: "FULL_SHARD"}[a.stage])
elif a.face == "deepspeed":
    kw["deepspeed_plugin"] = DeepSpeedPlugin(hf_ds_config={"train_micro_batch_size_per_gpu": 4,
                                                           "zero_optimization": {"stage": a.stage}})
acc = accelerate_c.Accelerator(cpu=True, **kw)
torch.manual_seed(0)
model = BNNet()
opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
model, opt = acc.prepare(model, opt)
if a.load:
    acc.load_state(a.load)
else:
    for step in range(3):  # micro-steps 0 and 2 use the aux head, 1 does not
        x, y = batch("bn", step, 4 * acc.num_processes)
        r, n = acc.process_index, acc.num_processes
        acc.backward(loss_of("bn", model, chunk(x, r, n), chunk(y, r, n), step))
        opt.step()
        opt.zero_grad()
if a.save:
    acc.save_state(a.save)
if a.dump:
    sd = {f"model/{k}": v.detach().clone().contiguous() for k, v in acc.get_state_dict(model).items()}
    names = {id(p): n for n, p in acc.unwrap_model(model).named_parameters()}
    params = [q for g in opt.optimizer.param_groups for q in g["params"]]
    for q in params:
        for key, v in opt.optimizer.state.get(q, {}).items():
            if isinstance(v, torch.Tensor):
                sd[f"optim/{names[id(q)]}/{key}"] = v.detach().clone().reshape(-1).contiguous()
    save_file(sd, a.dump)
acc.end_training()
