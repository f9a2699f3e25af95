# Tests of `python -m accelerate_c estimate-memory`: the estimate for a small GPT-2 (from a transformers
# config) against the bytes a real copy of it holds while training with torch's Adam, the sizes against
# HF Accelerate's own size helpers, the per-rank DDP/ZeRO numbers against the ZeRO paper's worked example
# (a 7.5B-parameter model: only possible because it is built on the meta device), and bad MODEL inputs.
import json
import os
import subprocess
import sys

import pytest
import torch

from accelerate_c.commands import cli
from accelerate_c.commands.estimate import (build_model, bytes_at, count, format_bytes, largest_layer,
                                            per_rank_bytes, training_bytes)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ZOO = '''
import torch

def paper_model():  # the ZeRO paper's example: 7.5B parameters (75 x 10000 x 10000)
    return torch.nn.Sequential(*[torch.nn.Linear(10_000, 10_000, bias=False) for _ in range(75)])

def small():
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    net[2].bias.requires_grad_(False)  # frozen: parameters only, no gradient or optimizer state
    net.register_buffer("steps", torch.zeros(3, dtype=torch.int64))
    return net

def raises():
    raise RuntimeError("no such architecture")

def not_a_module():
    return 42

NOT_CALLABLE = 3
'''


def run_cli(args, cwd):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "accelerate_c", "estimate-memory", *args], capture_output=True,
                          text=True, env=env, cwd=str(cwd), timeout=120)


@pytest.fixture
def gpt2_config(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=64, bos_token_id=0, eos_token_id=0,
               architectures=["GPT2LMHeadModel"]).save_pretrained(str(tmp_path / "gpt2"))
    return tmp_path / "gpt2"


@pytest.fixture
def zoo(tmp_path):
    (tmp_path / "zoo_models.py").write_text(ZOO)
    return tmp_path


def tensor_bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def test_gpt2_estimate_equals_measured_training_bytes(gpt2_config):
    import transformers

    meta_model = build_model(str(gpt2_config / "config.json"))
    assert all(p.device.type == "meta" for p in meta_model.parameters())
    estimate = training_bytes(count(meta_model), "float32")

    torch.manual_seed(0)
    config = transformers.AutoConfig.from_pretrained(str(gpt2_config))
    model = transformers.GPT2LMHeadModel(config)  # the same class, real tensors
    ids = torch.randint(0, 512, (2, 16))
    model(ids, labels=ids).loss.backward()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    opt.step()
    measured = {"params": tensor_bytes(model.parameters()),
                "grads": tensor_bytes(p.grad for p in model.parameters()),
                "optimizer": tensor_bytes(t for state in opt.state.values() for t in state.values())}
    assert estimate == measured
    # The folder names the same model as its config.json, and the CLI prints those numbers.
    assert training_bytes(count(build_model(str(gpt2_config))), "float32") == measured
    res = run_cli([str(gpt2_config), "--dtypes", "float32", "bfloat16"], gpt2_config)
    assert res.returncode == 0, res.stderr
    row = next(line for line in res.stdout.splitlines() if line.count("│") == 6 and "float32" in line)
    assert [c.strip() for c in row.split("│")[2:5]] == [format_bytes(v) for v in measured.values()], row


def test_sizes_match_hf_helpers(gpt2_config, zoo):
    from accelerate.utils import calculate_maximum_sizes

    small = build_model(str(zoo / "zoo_models.py") + ":small")
    for model, int_bytes in ((build_model(str(gpt2_config)), 0), (small, 24)):
        counts = count(model)
        total, (largest, names) = calculate_maximum_sizes(model)
        assert bytes_at(counts.tensors, "float32") == total
        assert largest_layer(counts, "float32") == (largest, names)
        # Loaded in half precision floating-point tensors halve; the int64 buffer of `small` keeps its bytes.
        assert bytes_at(counts.tensors, "float16") == (total - int_bytes) / 2 + int_bytes


def test_frozen_parameters_and_buffers(zoo):
    counts = count(build_model(str(zoo / "zoo_models.py") + ":small"))
    assert (counts.trainable, counts.trainable_tensors) == (8 * 16 + 16 + 16 * 4, 3)
    est = training_bytes(counts, "float32")
    assert est == {"params": 4 * (8 * 16 + 16 + 16 * 4 + 4), "grads": 4 * 208, "optimizer": 8 * 208 + 4 * 3}
    assert training_bytes(counts, "int8") is None  # int8/int4 rows: loading only, like HF ("N/A")


def test_zero_paper_example_per_rank(zoo):
    """ZeRO paper, figure 1: Psi = 7.5B, N = 64, K = 12 (mixed precision Adam): 120 GB per rank with DDP,
    31.4 GB with stage 1, 16.6 GB with stage 2, 1.9 GB with stage 3 (GB = 1e9 bytes)."""
    model = build_model(str(zoo / "zoo_models.py") + ":paper_model")
    assert all(p.device.type == "meta" for p in model.parameters())  # 30 GB if it were real
    counts = count(model)
    psi = 7.5e9
    assert counts.trainable == psi
    per_rank = per_rank_bytes(counts, "bfloat16", 64)
    assert {k: round(v / 1e9, 1) for k, v in per_rank.items()} == \
           {"DDP": 120.0, "ZeRO-1": 31.4, "ZeRO-2": 16.6, "ZeRO-3": 1.9}
    fp32 = per_rank_bytes(counts, "float32", 64)  # the brief's fp32 forms: 16, 4+4+8/N, 4+12/N, 16/N
    assert fp32 == {"DDP": 16 * psi + 4 * 75, "ZeRO-1": 8 * psi + 8 * psi / 64, "ZeRO-2": 4 * psi + 12 * psi / 64,
                    "ZeRO-3": 16 * psi / 64}
    res = run_cli(["zoo_models:paper_model", "--num-processes", "64", "--dtypes", "bfloat16"], zoo)
    assert res.returncode == 0, res.stderr
    for strategy, value in per_rank.items():
        row = next(line for line in res.stdout.splitlines() if f" {strategy} " in line)
        assert format_bytes(value) in row, row


@pytest.mark.parametrize("spec, message", [
    ("missing_dir/config.json", "no such config file or model folder"),
    ("missing_dir", "no such config file or model folder"),
    ("empty", "no such config file or model folder"),
    ("notconfig.json", "not a transformers config"),
    ("zoo_models:absent", "has no attribute 'absent'"),
    ("zoo_models:NOT_CALLABLE", "non-callable 'NOT_CALLABLE'"),
    ("zoo_models:raises", "the factory raised RuntimeError: no such architecture"),
    ("zoo_models:not_a_module", "returned int, not a torch.nn.Module"),
    ("no_such_module_xyz:build", "cannot import 'no_such_module_xyz'"),
    ("missing.py:build", "no file 'missing.py'"),
])
def test_bad_model_inputs(zoo, monkeypatch, capsys, spec, message):
    (zoo / "empty").mkdir()
    (zoo / "notconfig.json").write_text(json.dumps({"hello": 1}))
    monkeypatch.chdir(zoo)
    monkeypatch.syspath_prepend(str(zoo))
    assert cli.main(["estimate-memory", spec]) == 2
    err = capsys.readouterr().err
    assert err.startswith("accelerate_c estimate-memory: error:") and message in err, err


def test_bad_input_exits_nonzero_in_a_process(zoo, capsys):
    res = run_cli(["zoo_models:not_a_module"], zoo)
    assert res.returncode == 2 and "not a torch.nn.Module" in res.stderr and not res.stdout, res
    assert cli.main(["estimate-memory", str(zoo / "zoo_models.py") + ":small", "--num_processes", "0"]) == 2
    assert "--num_processes 0" in capsys.readouterr().err


def test_tensor_parallel_columns(tmp_path, capsys):
    """--tp_size: the model's own TP plan applied to the meta model; per rank, every sliced tensor is 1/tp (the norms
    stay whole), data parallelism over num_processes / tp; a degree the heads do not divide is an error naming it."""
    from transformers import LlamaConfig
    from accelerate_c.commands.estimate import tp_counts
    cfg = LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)
    cfg.architectures = ["LlamaForCausalLM"]
    path = tmp_path / "config.json"
    cfg.to_json_file(str(path))
    full = count(build_model(str(path)))
    half = tp_counts(build_model(str(path)), 2)
    norms = 128 * (2 * 2 + 1)  # two per layer and the final one, held whole by every rank
    assert half.trainable == (full.trainable - norms) // 2 + norms
    ddp = per_rank_bytes(half, "float32", 2)["DDP"]
    assert cli.main(["estimate-memory", str(path), "--num_processes", "4", "--tp_size", "2", "--dtypes",
                     "float32"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "tp=2 x DDP" in line)
    assert format_bytes(ddp) in row and "tensor parallel tp=2 x data parallel 2" in out, out
    cfg.num_attention_heads = cfg.num_key_value_heads = 2
    cfg.to_json_file(str(path))
    assert cli.main(["estimate-memory", str(path), "--tp_size", "4"]) == 2
    assert "--tp_size 4" in capsys.readouterr().err
