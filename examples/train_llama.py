# examples/train_llama.py: a transformers Llama built from a config, trained as a plain HF-Accelerate script (the DDP
# loop, byte-level text of Python's standard library). The parallel layout comes from the launcher, not the code:
#   python -m accelerate_c launch --num_processes 2 examples/train_llama.py                       # DDP
#   python -m accelerate_c launch --num_processes 2 --parallelism_config_tp_size 2 examples/train_llama.py
#   python -m accelerate_c launch --num_processes 2 --use_megatron_lm --megatron_lm_tp_degree 2 \
#       --megatron_lm_sequence_parallelism true examples/train_llama.py                         # TP + SP
#   python -m accelerate_c launch --num_processes 4 --parallelism_config_dp_replicate_size 2 \
#       --parallelism_config_tp_size 2 examples/train_llama.py                                  # DDP x TP
#   python -m accelerate_c launch --num_processes 2 --parallelism_config_pp_size 2 examples/train_llama.py   # PP
#   python -m accelerate_c launch --num_processes 4 --parallelism_config_tp_size 2 \
#       --parallelism_config_pp_size 2 examples/train_llama.py                                  # TP x PP
#   python -m accelerate_c launch --num_processes 4 --use_megatron_lm --megatron_lm_tp_degree 2 \
#       --megatron_lm_pp_degree 2 --megatron_lm_sequence_parallelism true examples/train_llama.py  # TP + SP x PP
# It runs unchanged under HF Accelerate for the DDP line (`--impl accelerate`). Flags: --max_steps, --output_dir
# (save_model there at the end), --seq_len, --batch_size, --mixed_precision.
# Not for: benchmarking (benchmarks/tp_step.py) or every feature (examples/train_gpt.py).
from __future__ import annotations

import argparse
import glob
import os
import sysconfig

import torch


def byte_corpus(limit: int = 2_000_000) -> torch.Tensor:
    """Bytes of the standard library's sources (the same on every rank: sorted file order)."""
    out, total = [], 0
    for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))):
        with open(path, "rb") as f:
            data = f.read()
        out.append(data)
        total += len(data)
        if total >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(out)[:limit]), dtype=torch.uint8).long()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=["accelerate_c", "accelerate"], default="accelerate_c")
    ap.add_argument("--max_steps", type=int, default=30)
    ap.add_argument("--seq_len", type=int, default=64)
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--mixed_precision", default=None)
    ap.add_argument("--output_dir", default=None)
    args = ap.parse_args()
    if args.impl == "accelerate":
        from accelerate import Accelerator
        from accelerate.utils import set_seed
    else:
        from accelerate_c import Accelerator
        from accelerate_c.utils import set_seed
    from transformers import LlamaConfig, LlamaForCausalLM

    accelerator = Accelerator(mixed_precision=args.mixed_precision)
    set_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.seq_len)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = byte_corpus()
    n = (tokens.numel() - 1) // args.seq_len
    data = torch.utils.data.TensorDataset(tokens[:n * args.seq_len].view(n, args.seq_len))
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch_size, shuffle=True,
                                         generator=torch.Generator().manual_seed(0))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.train()
    step = 0
    while step < args.max_steps:
        for (ids,) in loader:
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step % 10 == 0 or step == args.max_steps:
                mean = accelerator.reduce(loss.detach(), reduction="mean").item()
                accelerator.print(f"step {step:4d}  loss {mean:.4f}")
            if step == args.max_steps:
                break
    if args.output_dir:
        accelerator.save_model(model, args.output_dir)
    accelerator.end_training()


if __name__ == "__main__":
    main()
