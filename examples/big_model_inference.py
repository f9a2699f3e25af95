# examples/big_model_inference.py: big-model inference with HF Accelerate's API, unchanged under accelerate_c. A Llama
# built from a config is saved as sharded safetensors, then rebuilt without memory (init_empty_weights) and loaded with
# load_checkpoint_and_dispatch under a CPU budget that puts about half of it on disk; the logits must equal the fully
# loaded model's. Run with HF: `python examples/big_model_inference.py`; with accelerate_c:
# `ACCELERATE_C_AS_ACCELERATE=1 python examples/big_model_inference.py` (docs/hf_stack.md).
# Not for: timing (benchmarks/bigmodel_offload.py).
import argparse
import os
import tempfile
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from accelerate import init_empty_weights, load_checkpoint_and_dispatch
from accelerate.utils import compute_module_sizes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    config = LlamaConfig(vocab_size=4096, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
                         num_key_value_heads=max(1, args.hidden // 128))
    torch.manual_seed(0)
    full = LlamaForCausalLM(config).eval()
    tokens = torch.randint(0, config.vocab_size, (2, 64))
    with torch.no_grad():
        want = full(tokens).logits
    with tempfile.TemporaryDirectory() as folder:
        full.save_pretrained(folder, max_shard_size="20MB")
        budget = compute_module_sizes(full)[""] // 2
        del full
        with init_empty_weights():
            model = LlamaForCausalLM(config)
        model = load_checkpoint_and_dispatch(model, folder, device_map="auto", max_memory={"cpu": budget},
                                             no_split_module_classes=["LlamaDecoderLayer"],
                                             offload_folder=os.path.join(folder, "offload"))
        with torch.no_grad():
            for i in range(2):
                start = time.perf_counter()
                got = model(tokens).logits
                print(f"forward {i}: {time.perf_counter() - start:.3f} s")
    on_disk = sorted(k for k, v in model.hf_device_map.items() if v == "disk")
    import accelerate

    print(f"{accelerate.__name__} {accelerate.__version__} from {os.path.dirname(accelerate.__file__)}: "
          f"{len(on_disk)} blocks on disk; logits equal the full model's: {torch.equal(got, want)}")
    assert torch.equal(got, want)


if __name__ == "__main__":
    main()
