# tests/scripts/tp_load.py: loads a checkpoint that tests/scripts/tp_accel.py or pp_accel.py saved under a tensor- /
# pipeline-parallel layout (--ckpt) in another layout (--mode: single (one process), dp (DDP over 2 processes),
# shard_tp (tp=2 x dp_shard=2 under FSDP, 4 processes), pp (pp=2, 2 processes)) and compares every logical tensor
# BITWISE with the saving run's own gathered copy (--full: weights and Adam moments, full.safetensors): the weights
# through get_state_dict, the moments of the parameters the rank holds whole. --resave DIR saves the loaded state
# again (the test then loads it on one process: the moments' round trip through a sharded layout). --layers / --tied:
# the saving script's Llama (tp_accel: 2 layers; pp_accel: 4, tied in one mode). Writes "ok" or the traceback to
# --out/load_rank<r>.json.
# Not for: training parity (tp_accel.py).
import argparse
import json
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tp_util import llama_config  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--full", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--resave", default=None)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tied", action="store_true")
    args = ap.parse_args()
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    from accelerate_c import Accelerator
    from accelerate_c.utils import FullyShardedDataParallelPlugin, ParallelismConfig
    kw = {}
    if args.mode == "shard_tp":
        kw = dict(parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2),
                  fsdp_plugin=FullyShardedDataParallelPlugin(sharding_strategy="FULL_SHARD"))
    elif args.mode == "pp":
        kw = dict(parallelism_config=ParallelismConfig(pp_size=2))
    acc = Accelerator(**kw)
    torch.manual_seed(1)  # other initial weights: the load must replace every one
    model = LlamaForCausalLM(llama_config(num_hidden_layers=args.layers, tie_word_embeddings=args.tied))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    result = "ok"
    try:
        acc.load_state(args.ckpt)
        full = load_file(args.full)
        sd = acc.get_state_dict(model)
        if args.mode != "shard_tp" or acc.is_main_process:
            for k, v in sd.items():
                assert torch.equal(v, full[k]), f"weight {k} differs after the load"
        if args.mode != "shard_tp":
            inner = acc.unwrap_model(model)
            for k, p in inner.named_parameters():
                for key in ("exp_avg", "exp_avg_sq"):
                    got = opt.optimizer.state[p][key]
                    assert torch.equal(got, full[f"{k}/{key}"]), f"{k}/{key} differs after the load"
        if args.resave:
            acc.save_state(args.resave)
    except Exception:
        result = traceback.format_exc()
    with open(os.path.join(args.out, f"load_rank{acc.process_index}.json"), "w") as f:
        json.dump(result, f)
    acc.end_training()


if __name__ == "__main__":
    main()
