# tests/scripts/construct_checks.py: sharded construction's edges on real ranks, run as cases of sharded_cases.py
# (tests/test_sharded_construct.py): each writes <out>/result<r>.json on every rank.
#  - pretrained(src, out): HF's cpu_ram_efficient_loading pattern end to end. With the variables `accelerate launch
#    --use_fsdp --fsdp_cpu_ram_efficient_loading true` sets (the case's env), transformers (5.x) loads the checkpoint
#    on every rank but initialises the keys it lacks on local rank 0 only, leaving them on the meta device elsewhere;
#    prepare (FSDP FULL_SHARD, one unit per decoder layer) must give every rank rank 0's values. Rank 0 also writes
#    the gathered state dict after one AdamW step on the same batch everywhere (gathered.safetensors); result0.json:
#    every rank's meta flag before prepare, the first loss, every rank's rotary inv_freq buffer.
#  - evalmode(out): prepare_model(evaluation_mode=True) of a meta model seeded per rank: the state-dict keys that
#    differ from rank 0's materialisation.
#  - noinit(out): a meta model with a module that has no reset_parameters: the ValueError prepare raised here.
# Not for: training parity (sharded_train.py --meta).
import json
import os

import torch
from safetensors.torch import save_file


def _write(acc, out: str, rec: dict) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"result{acc.process_index}.json"), "w") as f:
        json.dump(rec, f)


def pretrained(src: str, out: str) -> None:
    from accelerate_c import Accelerator, FullyShardedDataParallelPlugin
    plugin = FullyShardedDataParallelPlugin(sharding_strategy="FULL_SHARD", cpu_ram_efficient_loading=True,
                                            auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["LlamaDecoderLayer"])
    acc = Accelerator(cpu=True, fsdp_plugin=plugin)
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)  # keys missing from the checkpoint are initialised (on rank 0) from this seed
    model = LlamaForCausalLM.from_pretrained(src)
    meta = any(p.is_meta for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    flags = acc.gather_for_metrics(torch.tensor([float(meta)]))
    ids = torch.arange(16).view(2, 8) % 64  # the same batch on every rank: the averaged gradient is one process's
    loss = model(input_ids=ids, labels=ids).loss  # a forward on the constructed shards
    acc.backward(loss)
    opt.step()
    sd = acc.get_state_dict(model)
    inv = acc.unwrap_model(model).model.rotary_emb.inv_freq  # a non-persistent buffer: rank 0's on every rank
    invs = acc.gather_for_metrics(inv.detach().clone()[None])
    if acc.is_main_process:
        _write(acc, out, {"meta_before_prepare": flags.tolist(), "loss": loss.item(), "inv_freq": invs.tolist()})
        save_file({k: v.detach().clone().contiguous() for k, v in sd.items()},
                  os.path.join(out, "gathered.safetensors"))
    acc.wait_for_everyone()
    acc.end_training()


def evalmode(out: str) -> None:
    from accelerate_c import Accelerator, FullyShardedDataParallelPlugin
    from accelerate_c.sharding.materialize import materialize_model
    acc = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(cpu_ram_efficient_loading=True))

    def make() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 2))
    with torch.device("meta"):
        model, ref = make(), make()
    torch.manual_seed(1)
    materialize_model(ref)
    torch.manual_seed(1 + acc.process_index)
    model = acc.prepare_model(model, evaluation_mode=True)
    inner = acc.unwrap_model(model)
    _write(acc, out, {"differs": [k for k, v in ref.state_dict().items() if not torch.equal(v, inner.state_dict()[k])]})
    acc.wait_for_everyone()
    acc.end_training()


class NoInit(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(4))


def noinit(out: str) -> None:
    from accelerate_c import Accelerator, FullyShardedDataParallelPlugin
    acc = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(cpu_ram_efficient_loading=True))
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), NoInit())
    error = None
    try:
        acc.prepare(model)
    except ValueError as e:
        error = str(e)
    _write(acc, out, {"error": error})
    acc.wait_for_everyone()
    acc.end_training()
