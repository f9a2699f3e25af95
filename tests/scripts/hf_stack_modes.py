# tests/scripts/hf_stack_modes.py: the HF stack beyond the plain Trainer, one small run per mode, for
# tests/test_hf_trainer.py (run under HF Accelerate or, through hf_stack_run.py --ours, accelerate_c):
#   trainer: transformers' Trainer, gradient accumulation 2, evaluation every 2 steps
#   lora: a PEFT LoRA adapter on a Llama from a config, trained by transformers' Trainer; records the losses and the
#         files of the saved checkpoint (only the adapter must be there)
#   sft:  TRL's SFTTrainer on a small in-memory dataset (datasets.Dataset.from_dict) of text made here
#   fsdp: Trainer with fsdp="full_shard" + fsdp_config (our sharded engine under accelerate_c), checkpoints every 2
#   fsdp_resume: the fsdp run again from its step-2 checkpoint (resume_from_checkpoint), losses to fsdp/resumed.json
#   compile: Trainer with torch_compile=True (backend aot_eager: dynamo and AOTAutograd without inductor's C++ build),
#            gradient accumulation 2; records the keys of the saved model (no torch.compile prefix may leak into them)
#            and how many graphs dynamo compiled
# `trainer,lora,sft` runs them in the same processes (one launch). Per-step losses go to <out>/<mode>/losses.json (main
# process). Not for: benchmarking.
import json
import os
import shutil
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments


class Losses(TrainerCallback):
    def __init__(self) -> None:
        self.losses = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append((state.global_step, logs["loss"]))


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))


def _tokens(n: int) -> list:
    g = torch.Generator().manual_seed(1)
    start = torch.randint(0, 128, (n, 1), generator=g)
    return ((start + torch.arange(16)) % 128).tolist()


def _tokenizer():
    """A word-level tokenizer over "t0".."t126" (+ "<pad>" as 127), built in memory (no Hub)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(127)} | {"<pad>": 127}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<pad>", unk_token="<pad>")


def trainer_is_main() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def run(mode: str, out: str) -> None:
    common = dict(output_dir=out, max_steps=4, per_device_train_batch_size=4, gradient_accumulation_steps=1,
                  learning_rate=1e-3, logging_steps=1, save_steps=4, use_cpu=True, report_to=[], seed=0,
                  dataloader_num_workers=0)
    record = Losses()
    data = [{"input_ids": t, "labels": t} for t in _tokens(32)]
    if mode == "trainer":
        from transformers import Trainer

        args = TrainingArguments(**dict(common, gradient_accumulation_steps=2), eval_strategy="steps", eval_steps=2,
                                 per_device_eval_batch_size=4)
        trainer = Trainer(model=_model(), args=args, train_dataset=data, eval_dataset=data[:8], callbacks=[record])
    elif mode == "compile":
        from transformers import Trainer

        args = TrainingArguments(**dict(common, gradient_accumulation_steps=2), torch_compile=True,
                                 torch_compile_backend="aot_eager")
        trainer = Trainer(model=_model(), args=args, train_dataset=data, callbacks=[record])
    elif mode == "lora":
        from peft import LoraConfig, get_peft_model
        from transformers import Trainer

        model = get_peft_model(_model(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                   lora_dropout=0.0))
        trainer = Trainer(model=model, args=TrainingArguments(**common), train_dataset=data, callbacks=[record])
    elif mode == "sft":
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer

        data = Dataset.from_dict({"text": [" ".join(f"t{i}" for i in t) for t in _tokens(32)]})
        trainer = SFTTrainer(model=_model(), args=SFTConfig(**common, max_length=16, packing=False), train_dataset=data,
                             processing_class=_tokenizer(), callbacks=[record])
    elif mode in ("fsdp", "fsdp_resume"):
        from transformers import Trainer

        if mode == "fsdp_resume":  # the fsdp run's output again, from its step-2 checkpoint (its step-4 one dropped)
            out = common["output_dir"] = os.path.join(os.path.dirname(out), "fsdp")
            if trainer_is_main():
                shutil.rmtree(os.path.join(out, "checkpoint-4"), ignore_errors=True)
        args = TrainingArguments(**dict(common, save_steps=2), fsdp="full_shard",
                                 fsdp_config={"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
        trainer = Trainer(model=_model(), args=args, train_dataset=data, callbacks=[record])
        if mode == "fsdp_resume":
            trainer.accelerator.wait_for_everyone()
            trainer.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2"))
            if trainer.is_world_process_zero():
                with open(os.path.join(out, "resumed.json"), "w") as fh:
                    json.dump({"losses": record.losses}, fh)
            return
    else:
        sys.exit(f"unknown mode {mode!r}")
    trainer.train()
    if trainer.is_world_process_zero():
        ckpt = os.path.join(out, "checkpoint-4")
        files = sorted(os.listdir(ckpt)) if os.path.isdir(ckpt) else []
        keys = []
        if "model.safetensors" in files:
            from safetensors import safe_open

            with safe_open(os.path.join(ckpt, "model.safetensors"), "pt") as fh:
                keys = sorted(fh.keys())
        compiled = int(torch._dynamo.utils.counters["stats"]["unique_graphs"]) if mode == "compile" else 0
        with open(os.path.join(out, "losses.json"), "w") as fh:
            json.dump({"losses": record.losses, "files": files, "keys": keys, "graphs": compiled}, fh)


def main() -> None:
    """`MODE[,MODE...] OUT`: the modes one after the other in these processes, each into OUT/<mode>."""
    launched = dict(os.environ)
    for mode in sys.argv[1].split(","):
        # each mode from the launch's environment: both libraries leave variables behind (a Trainer with fsdp sets
        # ACCELERATE_USE_FSDP, torch_compile=True sets ACCELERATE_DYNAMO_*) that would change the next mode's run
        os.environ.clear()
        os.environ.update(launched)
        run(mode, os.path.join(sys.argv[2], mode))
    # the process group torn down before the interpreter: gloo's threads destroyed at exit aborted a rank of HF's run
    # once ("terminate called without an active exception", SIGABRT after every mode had finished)
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
