# tests/scripts/construct_pretrained.py: HF's cpu_ram_efficient_loading pattern end to end. With the variables
# `accelerate launch --use_fsdp --fsdp_cpu_ram_efficient_loading true` sets, transformers (5.x) loads the checkpoint
# on every rank but initialises the keys it lacks on local rank 0 only, leaving them on the meta device elsewhere;
# prepare (FSDP FULL_SHARD, one unit per decoder layer) must give every rank rank 0's values. Writes, on rank 0, the gathered state dict
# after one AdamW step on the same batch everywhere (gathered.safetensors), and result.json: every rank's meta flag
# before prepare, the first loss, every rank's rotary inv_freq buffer. argv: <pretrained dir> <out>.
# Not for: training parity (sharded_train.py --meta).
import json
import os
import sys

import torch
from safetensors.torch import save_file

os.environ["ACCELERATE_USE_FSDP"] = "true"
os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "true"

from accelerate_c import Accelerator, FullyShardedDataParallelPlugin  # noqa: E402


def main() -> None:
    src, out = sys.argv[1], sys.argv[2]
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
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"meta_before_prepare": flags.tolist(), "loss": loss.item(), "inv_freq": invs.tolist()}, f)
        save_file({k: v.detach().clone().contiguous() for k, v in sd.items()}, os.path.join(out, "gathered.safetensors"))
    acc.wait_for_everyone()
    acc.end_training()


if __name__ == "__main__":
    main()
