# examples/hf_trainer.py: a transformers Trainer script that never imports Accelerate itself (Trainer does), unchanged
# under HF Accelerate and accelerate_c. A small Llama built from a config learns a toy next-token task made in the
# script; gradient accumulation, evaluation, save_steps and (with --resume) resume_from_checkpoint; per-step losses go
# to <output_dir>/losses.json.
#   HF:           torchrun --nproc_per_node 2 examples/hf_trainer.py --output_dir runs/hf   (ACCELERATE_USE_CPU=1 on CPU)
#   accelerate_c: python -m accelerate_c launch --as_accelerate --num_processes 2 examples/hf_trainer.py --output_dir runs/c
# Not for: benchmarking. Needs accelerate_c's ParallelismConfig (transformers' TrainingArguments imports it).
import argparse
import json
import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    """Sequences where each token is the previous one + 1 (mod vocab): learnable in a few steps."""

    def __init__(self, n: int, length: int, vocab: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (n, 1), generator=g)
        self.ids = (start + torch.arange(length)) % vocab

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Losses(TrainerCallback):
    def __init__(self) -> None:
        self.losses = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append((state.global_step, logs["loss"]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--max_steps", type=int, default=6)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config)
    targs = TrainingArguments(output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=4,
                              gradient_accumulation_steps=2, learning_rate=1e-3, logging_steps=1, save_steps=3,
                              eval_strategy="steps", eval_steps=3, per_device_eval_batch_size=4, bf16=args.bf16,
                              use_cpu=True, report_to=[], seed=0, dataloader_num_workers=0, save_only_model=False)
    record = Losses()
    trainer = Trainer(model=model, args=targs, train_dataset=Tokens(64, 16, 64, 1), eval_dataset=Tokens(16, 16, 64, 2),
                      callbacks=[record])
    trainer.train(resume_from_checkpoint=args.resume or None)
    if trainer.is_world_process_zero():
        import accelerate

        with open(os.path.join(args.output_dir, "losses.json"), "w") as fh:
            json.dump({"losses": record.losses, "accelerate": accelerate.__file__}, fh)


if __name__ == "__main__":
    main()
