# benchmarks/construct_bytes.py: bytes each rank copies in the broadcasts and scatters of stage-3 sharded
# construction (a count, not a time): a small LlamaForCausalLM built on the meta device and prepared under FSDP
# FULL_SHARD with cpu_ram_efficient_loading on N processes (`accelerate_c launch`, one host: shared memory).
# Per rank: "recv" = bytes the collectives wrote into this rank's tensors from another rank (broadcast: the whole
# tensor on every rank but the source; scatter: the rank's block), "send" = bytes the source copied out for the
# others (broadcast: the tensor once; scatter: the other ranks' blocks). Counted at ShmGroup.broadcast / scatter
# during accelerator.prepare, so the coalesced broadcast of buffers (the same before and after) is included.
# Before/after: run it with PYTHONPATH at an older checkout (its accelerate_c) and at this one.
# Not for: timing or memory (benchmarks/sharded_init.py), correctness (tests/test_sharded_construct.py).
# Run: python benchmarks/construct_bytes.py [--nproc 3]
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker(args: argparse.Namespace) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from accelerate_c import Accelerator, FullyShardedDataParallelPlugin
    from accelerate_c.comm.shm import ShmGroup
    torch.set_num_threads(1)
    count = {"recv": 0, "send": 0, "broadcasts": 0, "scatters": 0}
    orig_b, orig_s = ShmGroup.broadcast, getattr(ShmGroup, "scatter", None)

    def broadcast(self, t, src=0):
        n = t.numel() * t.element_size()
        count["send" if self.rank == src else "recv"] += n
        count["broadcasts"] += 1
        return orig_b(self, t, src)

    def scatter(self, out, inp, src=0):
        n = out.numel() * out.element_size()
        if self.rank == src:
            count["send"] += n * (self.size - 1)
        else:
            count["recv"] += n
        count["scatters"] += 1
        return orig_s(self, out, inp, src)

    plugin = FullyShardedDataParallelPlugin(sharding_strategy="FULL_SHARD", cpu_ram_efficient_loading=True,
                                            auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["LlamaDecoderLayer"])
    acc = Accelerator(cpu=True, fsdp_plugin=plugin)
    cfg = LlamaConfig(hidden_size=256, num_hidden_layers=4, intermediate_size=688, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=2000, tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ShmGroup.broadcast = broadcast
    if orig_s is not None:
        ShmGroup.scatter = scatter
    model, opt = acc.prepare(model, opt)
    ShmGroup.broadcast = orig_b
    if orig_s is not None:
        ShmGroup.scatter = orig_s
    engine = acc.strategy.engines[0]
    count["model_bytes"] = 4 * sum(u.padded for u in engine.units)
    count["rank"] = acc.process_index
    with open(f"{args.out}.{acc.process_index}.json", "w") as f:
        json.dump(count, f)
    acc.wait_for_everyone()
    acc.end_training()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=3)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "bytes")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env.setdefault("PYTHONPATH", ROOT)
        cmd = [sys.executable, "-m", "accelerate_c", "launch", "--cpu", "--num_processes", str(args.nproc),
               "--main_process_port", "0", os.path.abspath(__file__), "--worker", "--out", out]
        p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
        if p.returncode != 0:
            raise SystemExit(f"launch failed ({p.returncode}):\n{p.stdout[-4000:]}")
        for r in range(args.nproc):
            c = json.load(open(f"{out}.{r}.json"))
            print(f"rank {r}: recv {c['recv']:>10,d} B  send {c['send']:>10,d} B  broadcasts {c['broadcasts']:>3d}  "
                  f"scatters {c['scatters']:>3d}  (sharded units: {c['model_bytes']:,d} B)")


if __name__ == "__main__":
    main()
