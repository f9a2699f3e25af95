# tests/scripts/pippy_infer.py: prepare_pippy (accelerate_c.inference, HF's accelerate.inference) on N CPU processes
# under our launcher, with the models of HF's own test_pippy built from small configs (GPT2LMHeadModel,
# BertForMaskedLM): automatic split points, then given ones, gather_output, a batch that needs padding to the chunk
# count. Each output is compared with the unsplit model's on the same inputs (every rank builds the same model from
# the same seed). Writes --out/ok<RANK>.txt when every check passed.
from __future__ import annotations

import argparse
import os

import torch
from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel

from accelerate_c import PartialState
from accelerate_c.inference import prepare_pippy
from accelerate_c.utils import set_seed

SEQ = 16


def _gpt2() -> torch.nn.Module:
    return GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=128,
                                                    n_positions=SEQ, pad_token_id=0, bos_token_id=1,
                                                    eos_token_id=1, use_cache=False)).eval()


def _bert() -> torch.nn.Module:
    return BertForMaskedLM(BertConfig(num_hidden_layers=4, hidden_size=64, num_attention_heads=4,
                                      intermediate_size=128, vocab_size=128, max_position_embeddings=SEQ)).eval()


def _logits(out: object) -> torch.Tensor:
    return out["logits"] if isinstance(out, dict) else (out[0] if isinstance(out, (tuple, list)) else out)


def _check(build: callable, batch: int, state: PartialState, **kw: object) -> str:
    set_seed(42)
    model = build()
    inputs = torch.randint(1, 128, (batch, SEQ))
    with torch.no_grad():
        want = _logits(model(inputs))
    chunks = kw.get("num_chunks") or state.num_processes
    trace = torch.randint(1, 128, (max(1, -(-batch // chunks)), SEQ))
    piped = prepare_pippy(model, example_args=(trace,), no_split_module_classes=model._no_split_modules, **kw)
    with torch.no_grad():
        got = piped(inputs)
    every = bool(kw.get("gather_output"))
    if state.is_last_process or every:
        assert got is not None, "no output where one was due"
        got = _logits(got)[:batch]
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    else:
        assert got is None, f"output on rank {state.process_index}: {type(got)}"
    return ",".join(piped.hf_split_points)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    state = PartialState()
    points = _check(_gpt2, state.num_processes, state)
    assert points.startswith("transformer.h."), points  # the cut falls between blocks
    _check(_bert, state.num_processes, state, gather_output=True)
    _check(_gpt2, 3, state, num_chunks=state.num_processes, split_points=["transformer.h.2"])  # padded batch
    state.destroy_process_group()
    with open(os.path.join(args.out, f"ok{state.process_index}.txt"), "w") as f:
        f.write(points + "\n")


if __name__ == "__main__":
    main()
