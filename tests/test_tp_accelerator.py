# tests/test_tp_accelerator.py: tensor parallelism through the Accelerator as a user runs it (prepare, backward,
# clip_grad_norm_, step, get_state_dict, save_state / load_state) under ParallelismConfig and MegatronLMPlugin, against
# the one-process loop (tests/scripts/tp_accel.py: losses 1e-5 relative over 8 steps, first-step logical gradients
# rtol 1e-5 and clipped norm, final weights); checkpoints saved under dp=2 x tp=2 load bitwise on one process, under
# DDP on 2 and under tp=2 x dp_shard=2 (tests/scripts/tp_load.py), whose own save loads bitwise on one process.
# Not for: the engine's own checks (test_tensor_parallel*.py), timing (benchmarks/tp_step.py).
import json
import os

import pytest

CHECKS = {"tp": ["losses", "first_step", "weights", "fp16_agreed_skip"], "tp_sp": ["losses", "first_step", "weights"],
          "shard_tp": ["losses", "first_step", "weights"], "dp_tp": ["losses", "first_step", "weights"],
          "tp_fp8": ["losses", "first_step", "weights"]}


def _results(path, n, prefix="rank"):
    out = []
    for r in range(n):
        with open(os.path.join(path, f"{prefix}{r}.json")) as f:
            out.append(json.load(f))
    return out


def _assert_all_ok(path, mode, n):
    failures = []
    for r, res in enumerate(_results(path, n)):
        assert sorted(res) == sorted(CHECKS[mode]), (r, sorted(res))
        failures += [f"rank {r}, {k}:\n{v}" for k, v in res.items() if v != "ok"]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("mode", ["tp", "tp_sp", "tp_fp8", "shard_tp"])
def test_tensor_parallel_training_matches_one_process(run, tmp_path, mode):
    """tp=2 (ParallelismConfig; also: an fp16 overflow on one TP rank skips the step on every rank), tp=2 with
    sequence parallelism (MegatronLMPlugin), tp=2 with fp8 linears and gradient accumulation (against FP8Linear on
    one process: the amax of every sliced tensor agreed over the TP group), tp=2 x dp_shard=2 under FSDP (4
    processes)."""
    n = 4 if mode == "shard_tp" else 2
    run("tp_accel.py", ["--mode", mode, "--out", str(tmp_path)], nproc=n, launcher="accelerate_c", timeout=600)
    _assert_all_ok(tmp_path, mode, n)


def test_dp_tp_training_and_its_checkpoint_in_other_layouts(run, tmp_path):
    """dp_replicate=2 x tp=2 (our DDP over the TP slices, 4 processes) trains as one process; its save_state loads
    bitwise (weights and Adam moments) on one process, under DDP on 2 processes and under tp=2 x dp_shard=2, and
    what the last one saves again loads bitwise on one process."""
    ck, ck2, full = tmp_path / "ck", tmp_path / "ck2", tmp_path / "full.safetensors"
    run("tp_accel.py", ["--mode", "dp_tp", "--out", str(tmp_path), "--save", str(ck)], nproc=4,
        launcher="accelerate_c", timeout=600)
    _assert_all_ok(tmp_path, "dp_tp", 4)
    common = ["--full", str(full), "--out", str(tmp_path)]
    for mode, n, ckpt, extra in [("single", 1, ck, []), ("dp", 2, ck, []), ("shard_tp", 4, ck, ["--resave", str(ck2)]),
                                 ("single", 1, ck2, [])]:
        run("tp_load.py", ["--mode", mode, "--ckpt", str(ckpt), *common, *extra], nproc=n, launcher="accelerate_c",
            timeout=600)
        got = _results(tmp_path, n, "load_rank")
        assert got == ["ok"] * n, f"{mode} from {os.path.basename(ckpt)}:\n" + "\n".join(g for g in got if g != "ok")
