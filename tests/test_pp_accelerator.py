# tests/test_pp_accelerator.py: pipeline parallelism through the Accelerator with the DDP loop unchanged (model(**batch)
# runs the schedule, accelerator.backward is a no-op, clip_grad_norm_ / step / get_state_dict as usual) under
# ParallelismConfig and MegatronLMPlugin, against the one-process loop (tests/scripts/pp_accel.py: losses 1e-5
# relative over 8 steps (bf16: 2e-2 against the loop under autocast), the clipped norm, the final logical weights,
# the optimizer holding the stage only); a checkpoint saved under dp=2 x tp=2 x pp=2 (8 processes) loads bitwise on
# one process, under pp=2 and under DDP (tests/scripts/tp_load.py); ZeRO-1/2 over the stages of dp_shard=2 x pp=2
# (tests/scripts/pp_zero.py) and its checkpoint loaded on one process and under pp=2.
# Not for: the engine's own checks (test_pipeline_*.py), timing (benchmarks/pp_step.py).
import json
import os

import pytest

CHECKS = ["losses", "first_step", "weights"]


def _check(path, n):
    failures = []
    for r in range(n):
        with open(os.path.join(path, f"rank{r}.json")) as f:
            res = json.load(f)
        assert sorted(res) == sorted(CHECKS), (r, sorted(res))
        failures += [f"rank {r}, {k}:\n{v}" for k, v in res.items() if v != "ok"]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("mode,n", [("pp", 2), ("pp_bf16", 2), ("pp_fp8", 2), ("pp_zb", 2), ("megatron", 4)])
def test_pipeline_training_matches_one_process(run, tmp_path, mode, n):
    """pp=2 1F1B with 4 micro-batches, in fp32, in bf16 (against the loop under autocast) and in fp8 with delayed
    scaling (against the FP8Linear loop, micro-batch by micro-batch); ZB-H1 with gradient
    accumulation and tied embeddings; MegatronLMPlugin (tp_degree=2 with sequence parallelism, pp_degree=2,
    num_micro_batches: a later stage receives its slice of the sequence; tp x pp through ParallelismConfig: the
    dp x tp x pp test)."""
    run("pp_accel.py", ["--mode", mode, "--out", str(tmp_path)], nproc=n, launcher="accelerate_c", timeout=600)
    _check(tmp_path, n)


def test_dp_tp_pp_on_8_processes_and_its_checkpoint(run, tmp_path):
    ck, full = tmp_path / "ck", tmp_path / "full.safetensors"
    run("pp_accel.py", ["--mode", "dp_tp_pp", "--out", str(tmp_path), "--save", str(ck)], nproc=8,
        launcher="accelerate_c", timeout=900)
    _check(tmp_path, 8)
    for mode, n in [("single", 1), ("pp", 2)]:  # (loads under DDP: test_tp_accelerator's dp_tp checkpoint)
        run("tp_load.py", ["--mode", mode, "--ckpt", str(ck), "--full", str(full), "--out", str(tmp_path),
                           "--layers", "4"], nproc=n, launcher="accelerate_c", timeout=600)
        got = []
        for r in range(n):
            with open(os.path.join(tmp_path, f"load_rank{r}.json")) as f:
                got.append(json.load(f))
        assert got == ["ok"] * n, f"{mode}:\n" + "\n".join(g for g in got if g != "ok")


def test_zero_over_pipeline_stages_and_its_checkpoint(run, tmp_path):
    """dp_shard=2 x pp=2 on 4 processes, one launch (tests/scripts/pp_zero.py): FSDP FULL_SHARD over stages refused
    naming what works; DeepSpeed ZeRO-1 (its gradient_clipping over every stage; fp16 overflow on one rank skips the
    step everywhere) and FSDP SHARD_GRAD_OP (ZeRO-2, ZB-H1, accumulation, tied embeddings, one unit per layer) against
    the one-process loop; the ZeRO-2 checkpoint (the tied weight stored once) loads bitwise on one process and under
    pp=2 (DDP over the stages)."""
    ck, full = tmp_path / "ck", tmp_path / "full.safetensors"
    run("pp_zero.py", ["--out", str(tmp_path), "--save", str(ck)], nproc=4, launcher="accelerate_c", timeout=600)
    failures = []
    for r in range(4):
        with open(os.path.join(tmp_path, f"rank{r}.json")) as f:
            res = json.load(f)
        assert len(res) == 9, (r, sorted(res))
        failures += [f"rank {r}, {k}:\n{v}" for k, v in res.items() if v != "ok"]
    assert not failures, "\n".join(failures)
    for mode, n in [("single", 1), ("pp", 2)]:
        run("tp_load.py", ["--mode", mode, "--ckpt", str(ck), "--full", str(full), "--out", str(tmp_path),
                           "--layers", "4", "--tied"], nproc=n, launcher="accelerate_c", timeout=600)
        got = [json.load(open(os.path.join(tmp_path, f"load_rank{r}.json"))) for r in range(n)]
        assert got == ["ok"] * n, f"{mode}:\n" + "\n".join(g for g in got if g != "ok")
