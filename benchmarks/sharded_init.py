# benchmarks/sharded_init.py: peak RSS per rank of sharded construction (issue 9). A ~1.1B-parameter fp32
# transformers LlamaForCausalLM (TinyLlama-1.1B's shape: hidden 2048, 22 layers, MLP 5632, 32 heads / 4 KV heads,
# vocabulary 32000, untied head) built under torch.device("meta") and prepared with AdamW on 2 processes
# (`accelerate_c launch`, gloo + shared memory) under FSDP FULL_SHARD (stage 3) with cpu_ram_efficient_loading,
# one unit per LlamaDecoderLayer (the root unit holds the embedding, the head and the final norm).
#   ours:  the meta model materialised unit by unit from rank 0 (sharding/construct.py);
#   eager: torch/transformers eager construction on each rank (what a user without sharded construction pays
#          before any sharding can start), the baseline.
# Peak RSS = VmHWM after the phase minus VmRSS just before the model is built, with the high-water mark reset
# (/proc/self/clear_refs "5") at that point: the bytes the phase added, not the interpreter, torch, transformers
# or the process group (ru_maxrss cannot be reset and would also hold earlier peaks). Shared-memory pages a rank
# touched (its shard) count in its RSS.
# Bound (the target): 4Ψ/N + one unit, Ψ the parameter count, N = 2, "one unit" the largest unit's bytes
# (here the root: embedding + head, larger than a layer): ours must be <= 1.15x of it.
# Memory: the eager baseline holds ~4.4 GB per rank, run after ours, never together. Run it once or twice.
# Not for: correctness (tests/test_sharded_construct.py) or step time (benchmarks/zero_step.py).
# --shape 500m: a ~507M-parameter Llama (hidden 1280, 24 layers), with issue 20's bound: <= 1.1x (4Ψ/N + the largest
# unit + 256 MiB).
# Run: python benchmarks/sharded_init.py [--quick] [--no-record] [--shape 1.1b|500m]
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from _results import append_results, reset_peak_rss, status_bytes  # noqa: E402

FULL = dict(hidden=2048, layers=22, inter=5632, heads=32, kv=4, vocab=32000)
MID = dict(hidden=1280, layers=24, inter=3584, heads=20, kv=4, vocab=32000)  # ~507M (issue 20's target)
QUICK = dict(hidden=256, layers=4, inter=688, heads=4, kv=2, vocab=2000)


def _config(shape: dict):
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=shape["hidden"], num_hidden_layers=shape["layers"],
                       intermediate_size=shape["inter"], num_attention_heads=shape["heads"],
                       num_key_value_heads=shape["kv"], vocab_size=shape["vocab"], tie_word_embeddings=False,
                       max_position_embeddings=2048)


def worker(args) -> None:
    import torch
    from transformers import LlamaForCausalLM
    from accelerate_c import Accelerator, FullyShardedDataParallelPlugin
    torch.set_num_threads(1)
    shape = _shape(args)
    plugin = FullyShardedDataParallelPlugin(sharding_strategy="FULL_SHARD", cpu_ram_efficient_loading=True,
                                            auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["LlamaDecoderLayer"])
    acc = Accelerator(cpu=True, fsdp_plugin=plugin)
    cfg = _config(shape)
    acc.wait_for_everyone()
    torch.manual_seed(0)
    out: dict = {"rank": acc.process_index}
    reset_peak_rss()
    rss0 = status_bytes("VmRSS")
    t0 = time.perf_counter()
    if args.worker == "eager":
        model = LlamaForCausalLM(cfg)
    else:
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model, opt = acc.prepare(model, opt)
        engine = acc.strategy.engines[0]
        out["units"] = len(engine.units)
        out["max_unit_bytes"] = 4 * max(u.padded for u in engine.units)
        out["layer_unit_bytes"] = 4 * max(u.padded for u in engine.units if u.name)
    out["seconds"] = time.perf_counter() - t0
    out["peak"] = status_bytes("VmHWM") - rss0
    out["rss0"] = rss0
    out["params"] = sum(p.numel() for p in acc.unwrap_model(model).parameters())
    with open(f"{args.out}.{acc.process_index}.json", "w") as f:
        json.dump(out, f)
    acc.wait_for_everyone()
    acc.end_training()


def _shape(args) -> dict:
    return QUICK if args.quick else MID if args.shape == "500m" else FULL


def launch(kind: str, args, tmp: str) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = os.path.join(tmp, kind)
    cmd = [sys.executable, "-m", "accelerate_c", "launch", "--cpu", "--num_processes", "2", "--main_process_port",
           "0", os.path.abspath(__file__), "--worker", kind, "--out", out, "--shape", args.shape] + \
        (["--quick"] if args.quick else [])
    p = subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=1200)
    if p.returncode != 0:
        raise SystemExit(f"{kind} run failed ({p.returncode}):\n{p.stdout[-4000:]}")
    return [json.load(open(f"{out}.{r}.json")) for r in range(2)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a small model: a smoke run (records nothing)")
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--shape", choices=("1.1b", "500m"), default="1.1b",
                    help="1.1b: TinyLlama's shape (issue 9's bound); 500m: ~507M params (issue 20's bound)")
    ap.add_argument("--worker", choices=("ours", "eager"))
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    with tempfile.TemporaryDirectory(prefix="sharded_init_") as tmp:
        ours = launch("ours", args, tmp)
        eager = launch("eager", args, tmp)
    psi, n = ours[0]["params"], 2
    unit = ours[0]["max_unit_bytes"]
    bound = 4 * psi / n + unit
    gb = 1e9
    lines = [f"model: LlamaForCausalLM {_shape(args)}, {psi / 1e9:.3f}B params fp32, "
             f"{ours[0]['units']} units (largest {unit / gb:.3f} GB: the root; a layer {ours[0]['layer_unit_bytes'] / gb:.3f} GB)",
             f"bound 4Ψ/N + one unit = {bound / gb:.3f} GB per rank (N={n}); peak RSS = VmHWM - VmRSS before the "
             "model is built (high-water mark reset there)"]
    for r in range(n):
        o, e = ours[r], eager[r]
        lines.append(f"  rank {r}: ours (meta + sharded construction, prepare) {o['peak'] / gb:6.3f} GB  "
                     f"{o['peak'] / bound:5.3f}x bound  ({o['seconds']:.1f} s) | "
                     f"eager construction {e['peak'] / gb:6.3f} GB  {e['peak'] / bound:5.3f}x bound  "
                     f"({e['seconds']:.1f} s) | ours / eager {o['peak'] / e['peak']:.3f}")
    worst = max(o["peak"] for o in ours)
    layer_bound = 4 * psi / n + ours[0]["layer_unit_bytes"]
    lines.append(f"worst rank: ours {worst / bound:.3f}x the bound (target <= 1.15x); "
                 f"{worst / layer_bound:.3f}x 4Ψ/N + one layer unit ({layer_bound / gb:.3f} GB)")
    bound20 = 4 * psi / n + unit + (256 << 20)
    lines.append(f"issue 20's bound: worst rank {worst / bound20:.3f}x (4Ψ/N + the largest unit + 256 MiB = "
                 f"{bound20 / gb:.3f} GB; target <= 1.1x)")
    text = "\n".join(lines)
    print(text)
    if not args.quick and not args.no_record:
        append_results(f"sharded_init.py: peak RSS per rank, sharded construction of a {psi / 1e9:.2f}B fp32 model",
                       ["```", text, "```"])


if __name__ == "__main__":
    main()
