# tests/test_tensor_parallel.py: the tensor-parallel engine at tp=2 (2 real gloo processes over the shared-memory
# group) against the unsplit model on the same batch, without and with sequence parallelism: one run of
# tests/scripts/tp_parity.py per configuration (its header lists the checks); every check must pass on every rank.
# Not for: bad input and the in-process pieces (test_tensor_parallel_unit.py), timing (benchmarks/tp_step.py).
import json
import os

import pytest

CHECKS = ["llama_fp32", "llama_eval", "qwen2", "mistral", "qwen3", "styles", "bf16", "counts", "clip", "state", "meta"]


@pytest.mark.parametrize("sp", [0, 1], ids=["tp2", "tp2_sp"])
def test_tp_matches_one_process(run, tmp_path, sp):
    """fp32 losses (1e-5 relative) and gradients (rtol 1e-5) of Llama, Qwen2 and Mistral, 8 AdamW steps, bf16,
    the collective counts and bytes per layer, clipping, the checkpoint layout, a meta-device model materialised
    from its slices, and (without SP) a GPT-2-style model through a user plan."""
    run("tp_parity.py", ["--sp", str(sp), "--out", str(tmp_path)], nproc=2, timeout=600)
    expected = CHECKS + ([] if sp else ["gpt"])
    failures = []
    for rank in range(2):
        with open(os.path.join(tmp_path, f"rank{rank}.json")) as f:
            res = json.load(f)
        assert sorted(res) == sorted(expected), (rank, sorted(res))
        failures += [f"rank {rank}, {name}:\n{text}" for name, text in res.items() if text != "ok"]
    assert not failures, "\n".join(failures)
