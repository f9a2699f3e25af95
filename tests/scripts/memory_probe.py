# tests/scripts/memory_probe.py: what a prepared run holds, for tests/test_memory.py. On N processes (our
# launcher), a BatchNorm MLP with one big layer, AdamW, under <kind> (ddp: our bucketed DDP with the split
# step; z2 / z3: DeepSpeedPlugin(zero_stage)), then writes <out>/rank<r>.json:
#   expired: for every original parameter storage (taken before prepare), whether it was freed after prepare
#            (torch's StorageWeakRef: no tensor anywhere, C++ included, holds it);
#   state_rss: ddp only, the resident bytes of this process's mappings of the split step's state regions (its own
#            part and any peer pages it read), after two steps, after optimizer.state_dict() and after a third
#            step, with the state's full size and the state_dict's tensors (equal on every rank, checked by the
#            test against each other), and the bytes of this rank's parts of every shared region;
#   staging: z2 / z3, the bytes of the engine's staging windows and the biggest unit's padded bytes;
#   gshard_rss: z2 / z3, the resident bytes of the shard gradient's mapping after zero_grad, after a backward and
#            after the next zero_grad (base/pages.py gives its pages back at every full zero_grad).
# Not for: timing or the PSS figures (benchmarks/memory.py).
import gc
import json
import os
import sys

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from accelerate_c import Accelerator, DeepSpeedPlugin
from memory_probe_util import mapping_rss, range_rss

kind, out = sys.argv[1], sys.argv[2]


torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.BatchNorm1d(1024), torch.nn.ReLU(),
                            torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 8))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
refs = [StorageWeakRef(p.untyped_storage()) for p in model.parameters()]
plugin = None
if kind.startswith("z"):
    plugin = DeepSpeedPlugin(hf_ds_config={"train_micro_batch_size_per_gpu": 8,
                                           "zero_optimization": {"stage": int(kind[1])}})
acc = Accelerator(deepspeed_plugin=plugin)
model, opt = acc.prepare(model, opt)
gc.collect()
from accelerate_c.runtime import memory  # noqa: E402
res = {"expired": [r.expired() for r in refs], "thp_env": os.environ.get("THP_MEM_ALLOC_ENABLE"),
       "policy": memory._tuned}
g = torch.Generator().manual_seed(acc.process_index)


def step() -> None:
    x = torch.randn(8, 64, generator=g)
    loss = model(x).pow(2).mean()
    acc.backward(loss)
    opt.step()
    opt.zero_grad()


step()
step()
if kind == "ddp":
    (_, split), = acc.strategy._split_steps.values()
    ptrs = [f.data_ptr() for f in split.flats.values()]
    full = sum(f.numel() * f.element_size() for f in split.flats.values())
    rss = [mapping_rss(ptrs)]
    sd = opt.state_dict()
    rss.append(mapping_rss(ptrs))
    torch.save(sd, os.path.join(out, f"state{acc.process_index}.pt"))
    del sd
    step()
    rss.append(mapping_rss(ptrs))
    # every shared region of the host group (this rank's part): the parameters, the gradient buckets and the
    # state slots themselves, nothing copied beside them
    parts = sum(r.part for r in split.shards.shm._regions)
    res.update(state_rss=rss, state_bytes=full, region_part_bytes=parts,
               n_regions=len(split.shards.shm._regions),
               param_bytes=sum(p.numel() * 4 for p in acc.unwrap_model(model).parameters()))
else:
    e, = acc.strategy.engines
    ptr, nbytes = e.gshard.data_ptr(), e.gshard.numel() * e.gshard.element_size()
    gshard_rss = [range_rss(ptr, nbytes)]  # after zero_grad: given back
    loss = model(torch.randn(8, 64, generator=g)).pow(2).mean()
    acc.backward(loss)
    gshard_rss.append(range_rss(ptr, nbytes))  # written by the backward's reduce-scatters
    opt.step()
    opt.zero_grad()
    gshard_rss.append(range_rss(ptr, nbytes))
    res.update(gshard_rss=gshard_rss, gshard_bytes=nbytes)
    res.update(staging=sum(s.numel() * s.element_size() for s in e.staging),
               biggest=max(u.padded for u in e.units) * 4)
with open(os.path.join(out, f"rank{acc.process_index}.json"), "w") as f:
    json.dump(res, f)
acc.wait_for_everyone()
acc.end_training()
